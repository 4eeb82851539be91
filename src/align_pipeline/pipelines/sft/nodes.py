"""SFT node: typed params + artifact paths in, checkpoint path + metrics out. The work runs in a torchrun job."""

from __future__ import annotations

from align_pipeline.config import SFTJobConfig, to_dict
from align_pipeline.data.formats import Artifact
from align_pipeline.pipelines.common import run_stage, stage_job_paths, typed_params


def train_sft(
    tokenizer: Artifact,
    sft_train: Artifact,
    sft_val: Artifact,
    model: dict,
    parallel: dict,
    launch: dict,
    sft: dict,
) -> tuple[str, dict[str, float]]:
    """Fine-tune the base model (random init, ``sft.init_from`` checkpoint or HF dir) on the tokenized SFT data."""
    model_cfg, parallel_cfg, launch_cfg, stage = typed_params(model, parallel, launch, sft, "sft")
    paths = stage_job_paths(stage, "sft", tokenizer=tokenizer, train=sft_train, val=sft_val, parent=stage.init_from,
                            config={"model": to_dict(model_cfg), "parallel": to_dict(parallel_cfg),
                                    "training": to_dict(stage.training)})
    job = SFTJobConfig(
        run_dir=paths.run_dir, train_data=paths.train, val_data=paths.val, tokenizer=paths.tokenizer,
        model=model_cfg, parallel=parallel_cfg, training=stage.training, init_from=stage.init_from,
        lineage=paths.lineage,
    )
    return run_stage("align_pipeline.train.sft", job, launch_cfg, stage, "sft",
                     metric_keys=("val_loss", "train_loss"))
