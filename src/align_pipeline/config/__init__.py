"""One config family: a dataclass per YAML section, and per stage a job = that section + model/parallel + the paths
the node resolved + lineage.

* :mod:`.base` – :func:`from_dict` (unknown keys and wrong types fail, naming the key), :func:`to_dict`,
  :func:`config_hash`, :class:`ConfigError`;
* :mod:`.common` – sections several stages use (``model``, ``parallel``, ``launch``, ``training``, ``generation``,
  ``reward`` and its ``functions``, ``kl``, ``rl``, ``offload``) and the path groups of the jobs;
* one module per stage: the stage's section (``params:<stage>``) and its job;
* :mod:`.checks` – the rules that span sections (world size vs TP x PP, heads / layers / sequence vs TP and PP,
  PP = 1 for generating stages, batches over data-parallel ranks), applied by the Kedro hook before any node runs
  and by each entry point at its start (the world size itself: :mod:`align_pipeline.launch.world`). A section's own
  ranges are its ``validate(where)``;
* :mod:`.guards` – the hyper-parameter guards of the pure loss and RL functions; :mod:`.reward_spec` – a
  ``module:function`` reward spec, imported and checked; :mod:`.sections` – ``params:<section>`` -> its dataclass.

Every field has a docstring; nothing here imports Kedro, Megatron, torch or any other part of the project but
:mod:`align_pipeline.errors`.
"""

from align_pipeline import lazy_exports

_EXPORTS = {
    "ConfigError": "base",
    "DPOConfig": "dpo",
    "DPOJob": "dpo",
    "DPOPaths": "dpo",
    "DistillConfig": "distill",
    "DistillJob": "distill",
    "DistillLossConfig": "distill",
    "DistillPaths": "distill",
    "DynamicSamplingConfig": "reinforce",
    "EvaluationConfig": "evaluation",
    "EvaluationJob": "evaluation",
    "EvaluationPaths": "evaluation",
    "ExportConfig": "common",
    "EnvConfig": "common",
    "GenerationConfig": "common",
    "KLConfig": "common",
    "LaunchConfig": "common",
    "LoRAConfig": "common",
    "ModelConfig": "common",
    "OffloadConfig": "common",
    "OptimizerConfig": "common",
    "PPOConfig": "ppo",
    "PPOJob": "ppo",
    "PPOLossConfig": "ppo",
    "PPOPaths": "ppo",
    "ParallelConfig": "common",
    "PreferenceLossConfig": "dpo",
    "REFERENCE_FREE_LOSSES": "dpo",
    "RLConfig": "rl",
    "RLLoopConfig": "common",
    "RLPaths": "common",
    "ReferenceLogpsJob": "dpo",
    "ReinforceConfig": "reinforce",
    "ReinforceJob": "reinforce",
    "ReinforceLossConfig": "reinforce",
    "RewardConfig": "common",
    "RewardFunctionConfig": "common",
    "RewardModelConfig": "reward_model",
    "RewardModelJob": "reward_model",
    "SFTConfig": "sft",
    "SECTIONS": "sections",
    "SFTJob": "sft",
    "ScoringConfig": "common",
    "SlurmConfig": "common",
    "StageRunConfig": "common",
    "TrainPaths": "common",
    "TrainingConfig": "common",
    "config_hash": "base",
    "from_dict": "base",
    "to_dict": "base",
}
"""Re-exported name -> the submodule that defines it (imported when the name is first read; sorted)."""

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
