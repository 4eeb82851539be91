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
    (model_dir,), result = launch_stage(module, job, launch, stage, stage_name, ("model_dir",))
    metrics = {k: float(result[k]) for k in metric_keys if result.get(k) is not None}
    metrics["steps"] = float(result["step"])
    if result["history"]:
        metrics["first_train_loss"] = float(result["history"][0]["loss"])
    return model_dir, metrics


def launch_stage(module: str, job: Any, launch: LaunchConfig, stage: StageParams | Any, stage_name: str,
                 output_keys: tuple[str, ...]) -> tuple[list[str], dict[str, Any]]:
    """Launch the stage's torchrun job; return (the model dirs named by ``output_keys`` in result.json, result).

    Unless ``stage.keep_run_dir``, the models are moved out of the run directory (the catalog then moves each into
    its version) and the rest of the run directory (training checkpoints, logs) is deleted.
    """
    run_dir = Path(job.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    result = run_torchrun(module, to_dict(job), launch, run_dir, name=stage_name)
    dirs = [Path(result[key]) for key in output_keys]
    if not stage.keep_run_dir:
        kept = []
        for key, model_dir in zip(output_keys, dirs):
            keep = run_dir.parent / f".{run_dir.name}-{key.removesuffix('_dir')}"
            if keep.exists():
                shutil.rmtree(keep)
            model_dir.rename(keep)
            kept.append(keep)
        dirs = kept
        shutil.rmtree(run_dir, ignore_errors=True)
    return [str(d) for d in dirs], result


def rl_job_fields(params: Any, stage_name: str, *, tokenizer: Artifact, prompts_train: Artifact,
                  prompts_val: Artifact, sft_policy: str, reward_model: str | None, model: ModelConfig,
                  parallel: ParallelConfig, config: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~align_pipeline.config.RLJobConfig` fields an RL node fills from the catalog and its params.

    The run directory is keyed by the prompts, the tokenizer, the policy / reference / reward-model versions and the
    whole stage config (``config``), so an interrupted ``kedro run`` resumes and any change starts fresh.
    """
    init_from = params.init_from or sft_policy
    paths = stage_job_paths(params, stage_name, tokenizer=tokenizer, train=prompts_train, val=prompts_val,
                            parent=init_from, config={"model": to_dict(model), "parallel": to_dict(parallel),
                                                      "reward_model": reward_model, **config})
    return {
        "run_dir": paths.run_dir, "prompts": paths.train, "val_prompts": paths.val, "tokenizer": paths.tokenizer,
        "init_from": init_from, "reference": sft_policy, "reward_model": reward_model, "model": model,
        "parallel": parallel, "rl": params.rl, "generation": params.generation, "reward": params.reward,
        "optimizer": params.optimizer, "offload": params.offload,
        "lineage": {**paths.lineage, "reference": sft_policy, "reward_model": reward_model},
    }


def rl_metrics(result: dict[str, Any]) -> dict[str, float]:
    """Final RL metrics for the node's MLflow child run (the torchrun job logs every iteration itself)."""
    metrics = {k.replace("/", "."): float(v) for k, v in result["final"].items() if isinstance(v, (int, float))}
    metrics["iterations"] = float(result["iteration"])
    return metrics
