"""SFT node: typed params + artifact paths in, checkpoint path + metrics out. The work runs in a torchrun job."""

from __future__ import annotations

from align_pipeline.config.sft import SFTConfig, SFTJob
from align_pipeline.data.formats import Artifact
from align_pipeline.datasets.stored import StoredVersions
from align_pipeline.pipelines.common import run_supervised_stage, train_paths, typed_params


def train_sft(tokenizer: Artifact, sft_train: Artifact, sft_val: Artifact, model: dict, parallel: dict, launch: dict,
              sft: dict, stored: StoredVersions | None = None) -> tuple[str, dict[str, float]]:
    """Fine-tune the base model (random init, ``sft.init_from`` checkpoint or HF dir) on the tokenized SFT data; a
    stored version (``stored``: sft_policy_stored) made from the same inputs, config and code is reused instead."""
    model_cfg, parallel_cfg, launch_cfg, cfg = typed_params(model, parallel, launch, sft, SFTConfig, "sft")
    paths, lineage = train_paths(cfg, "sft", tokenizer=tokenizer, train=sft_train, val=sft_val,
                                 init_from=cfg.init_from, key={"model": model_cfg, "parallel": parallel_cfg, "sft": cfg})
    job = SFTJob(sft=cfg, model=model_cfg, parallel=parallel_cfg, paths=paths, lineage=lineage)
    return run_supervised_stage("align_pipeline.train.sft", job, launch_cfg, cfg, "sft",
                                metric_keys=("val_loss", "train_loss"), stored=stored)
