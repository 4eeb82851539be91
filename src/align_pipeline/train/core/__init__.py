"""The toolbox the stage recipes (``align_pipeline.train.<stage>``) call; nothing here calls back into a stage.

* :mod:`.distributed` – process groups (the one place that reads Megatron's ``parallel_state``), seeding, and
  :mod:`.megatron_cpu`, the shim that lets megatron-core run on CPU with gloo;
* :mod:`.batches` – resumable global batches, the RL prompt stream, rollout rows;
* :mod:`.schedule` – Megatron's pipeline schedule: train/eval passes over micro-batches, per-row forward passes;
* :mod:`.optimizer` – trained models (DDP + AdamW + schedule), frozen models, one optimizer step;
* :mod:`.checkpointing` – resume, periodic save + prune, stop-after, export;
* :mod:`.rollout` – generation, scoring, DP statistics, offload, validation accuracy for the RL stages;
* :mod:`.progress` – progress lines and result.json; :mod:`.cli` – the ``--config`` command line.
"""
