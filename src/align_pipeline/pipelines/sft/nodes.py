"""SFT node: typed params + artifact paths in, checkpoint path + metrics out. The work runs in a torchrun job."""

from __future__ import annotations

from pathlib import Path

from align_pipeline.config import SFTJobConfig, to_dict
from align_pipeline.data.formats import Artifact
from align_pipeline.pipelines.common import data_lineage, finish_run_dir, launch_stage, run_dir_for, typed_params


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
    lineage = data_lineage(sft_train=sft_train, sft_val=sft_val, tokenizer=tokenizer)
    key = {"stage": "sft", **lineage, "model": to_dict(model_cfg), "parallel": to_dict(parallel_cfg),
           "training": to_dict(stage.training), "init_from": stage.init_from}
    run_dir = run_dir_for(stage, "sft", key)
    job = SFTJobConfig(
        run_dir=str(run_dir.resolve()),
        train_data=str(Path(sft_train.path).resolve()),
        val_data=str(Path(sft_val.path).resolve()),
        tokenizer=str(Path(tokenizer.path).resolve()),
        model=model_cfg,
        parallel=parallel_cfg,
        training=stage.training,
        init_from=stage.init_from,
        lineage=lineage,
    )
    result = launch_stage("align_pipeline.train.sft", to_dict(job), launch_cfg, run_dir, "sft")
    metrics = {"val_loss": result["val_loss"], "train_loss": result["train_loss"], "steps": float(result["step"])}
    first = result["history"][0]["loss"] if result["history"] else float("nan")
    metrics["first_train_loss"] = first
    model_dir = result["model_dir"]
    if not stage.keep_run_dir:
        # Move the model out of the run dir before dropping the rest (the catalog then moves it into its version).
        keep = run_dir.parent / f".{run_dir.name}-model"
        Path(model_dir).rename(keep)
        model_dir = str(keep)
        finish_run_dir(run_dir, stage)
    return model_dir, metrics
