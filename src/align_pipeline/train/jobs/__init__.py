"""One-off torchrun jobs on a model (not training stages): import from HF, export to HF (with its check), merge
adapters, outputs on fixed tokens. Launched by :mod:`align_pipeline.launch.model_jobs`; as a package, never postable
to the multi-node job board (which runs ``align_pipeline.train.<stage>`` modules only)."""
