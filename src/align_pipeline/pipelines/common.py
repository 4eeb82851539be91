"""Helpers shared by the training-stage nodes: typed params, run directories, lineage, launching."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from align_pipeline.config import (
    LaunchConfig,
    ModelConfig,
    ParallelConfig,
    StageParams,
    config_hash,
    from_dict,
    to_dict,
)
from align_pipeline.data.formats import Artifact
from align_pipeline.launch import run_torchrun


def typed_params(model: dict, parallel: dict, launch: dict, stage: dict, stage_name: str, stage_cls=StageParams):
    """Validate the parameter sections a training node receives; errors name the offending key."""
    return (
        from_dict(ModelConfig, model, "params:model"),
        from_dict(ParallelConfig, parallel, "params:parallel"),
        from_dict(LaunchConfig, launch, "params:launch"),
        from_dict(stage_cls, stage, f"params:{stage_name}"),
    )


@dataclasses.dataclass
class JobPaths:
    run_dir: str
    train: str
    val: str
    tokenizer: str
    lineage: dict[str, Any]


def stage_job_paths(stage: StageParams, stage_name: str, *, tokenizer: Artifact, train: Artifact, val: Artifact,
                    parent: str | None, config: dict[str, Any]) -> JobPaths:
    """Absolute paths for the job and its lineage; the run directory is keyed by everything that determines the
    result (data fingerprints, parent checkpoint, config), so the same inputs -> the same directory -> an interrupted
    run resumes, and any change starts fresh."""
    lineage = {"data": {"train": train.fingerprint, "val": val.fingerprint, "tokenizer": tokenizer.fingerprint},
               "parent_checkpoint": parent}
    key = {"stage": stage_name, **lineage, **config, "init_from": stage.init_from}
    run_dir = Path(stage.runs_dir) / stage_name / config_hash(key)
    return JobPaths(str(run_dir.resolve()), str(Path(train.path).resolve()), str(Path(val.path).resolve()),
                    str(Path(tokenizer.path).resolve()), lineage)


def run_stage(module: str, job: Any, launch: LaunchConfig, stage: StageParams, stage_name: str,
              metric_keys: tuple[str, ...]) -> tuple[str, dict[str, float]]:
    """Launch the stage's torchrun job; return (model dir for the catalog, metrics for MLflow)."""
    run_dir = Path(job.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    result = run_torchrun(module, to_dict(job), launch, run_dir, name=stage_name)
    metrics = {k: float(result[k]) for k in metric_keys if result.get(k) is not None}
    metrics["steps"] = float(result["step"])
    if result["history"]:
        metrics["first_train_loss"] = float(result["history"][0]["loss"])
    model_dir = Path(result["model_dir"])
    if not stage.keep_run_dir:
        # Move the model out of the run dir before dropping the rest (the catalog then moves it into its version).
        keep = run_dir.parent / f".{run_dir.name}-model"
        if keep.exists():
            shutil.rmtree(keep)
        model_dir.rename(keep)
        model_dir = keep
        shutil.rmtree(run_dir, ignore_errors=True)
    return str(model_dir), metrics
