"""Helpers shared by the training-stage nodes: typed params, run directories, lineage, launching."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from align_pipeline.config import LaunchConfig, ModelConfig, ParallelConfig, StageParams, config_hash, from_dict
from align_pipeline.data.formats import Artifact
from align_pipeline.launch import run_torchrun


def typed_params(model: dict, parallel: dict, launch: dict, stage: dict, stage_name: str):
    """Validate the parameter sections a training node receives; errors name the offending key."""
    return (
        from_dict(ModelConfig, model, "params:model"),
        from_dict(ParallelConfig, parallel, "params:parallel"),
        from_dict(LaunchConfig, launch, "params:launch"),
        from_dict(StageParams, stage, f"params:{stage_name}"),
    )


def data_lineage(**artifacts: Artifact) -> dict[str, Any]:
    """{"data": {name: fingerprint}} for the artifacts a stage consumed."""
    return {"data": {name: a.fingerprint for name, a in artifacts.items()}}


def run_dir_for(stage: StageParams, stage_name: str, key: dict[str, Any]) -> Path:
    """Run directory keyed by everything that determines the result (inputs' fingerprints + config).

    Same key -> same directory -> an interrupted run resumes; any change -> a fresh run.
    """
    return Path(stage.runs_dir) / stage_name / config_hash(key)


def launch_stage(module: str, job: dict[str, Any], launch: LaunchConfig, run_dir: Path, stage_name: str) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_torchrun(module, job, launch, run_dir, name=stage_name)


def finish_run_dir(run_dir: Path, stage: StageParams) -> None:
    """Drop the run directory (training checkpoints) once its model has been handed to the catalog."""
    if not stage.keep_run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
