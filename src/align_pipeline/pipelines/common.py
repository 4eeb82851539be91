"""Helpers shared by the training-stage nodes: typed params, run directories, lineage, launching.

Imports only config, launch, data formats, the stored-versions index and reuse keys: the Kedro process never loads
torch or Megatron.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from align_pipeline.config.base import config_hash, from_dict, to_dict
from align_pipeline.config.common import (
    ExportConfig,
    LaunchConfig,
    ModelConfig,
    ParallelConfig,
    RLPaths,
    StageRunConfig,
    TrainPaths,
)
from align_pipeline.data.formats import Artifact, check_checkpoint_tokenizers, check_tokenized_with
from align_pipeline.datasets.stored import StoredVersions
from align_pipeline.kedro.run_dirs import RUN_DIR_CLEANUP
from align_pipeline.launch import model_jobs
from align_pipeline.launch.torchrun import run_torchrun
from align_pipeline.pipelines.reuse import StageReuse, content_key

logger = logging.getLogger(__name__)


def typed_params(model: dict, parallel: dict, launch: dict, section: dict, section_cls: type, stage_name: str):
    """Validate the parameter sections a training node receives; errors name the offending key."""
    return (
        from_dict(ModelConfig, model, "params:model"),
        from_dict(ParallelConfig, parallel, "params:parallel"),
        from_dict(LaunchConfig, launch, "params:launch"),
        from_dict(section_cls, section, f"params:{stage_name}"),
    )


def run_dir_for(section: StageRunConfig, stage_name: str, key: dict[str, Any]) -> str:
    """The run directory of a job, keyed by everything that determines its result (data fingerprints, parent
    checkpoints, every config section): the same inputs -> the same directory -> an interrupted run resumes; any
    change starts fresh."""
    plain = {k: to_dict(v) if dataclasses.is_dataclass(v) else v for k, v in key.items()}
    return str((Path(section.runs_dir) / stage_name / config_hash({"stage": stage_name, **plain})).resolve())


def data_lineage(tokenizer: Artifact, train: Artifact, val: Artifact) -> dict[str, Any]:
    """Fingerprints of the data a job reads (recorded in its checkpoint's meta.json and in MLflow tags), after checking
    that both splits were tokenized with ``tokenizer`` (``DataValidationError`` otherwise: data_prep outputs from
    different runs)."""
    check_tokenized_with(tokenizer, **{Path(a.path).name: a for a in (train, val)})
    return {"train": train.fingerprint, "val": val.fingerprint, "tokenizer": tokenizer.fingerprint}


def train_paths(section: StageRunConfig, stage_name: str, *, tokenizer: Artifact, train: Artifact, val: Artifact,
                init_from: str | None, key: dict[str, Any]) -> tuple[TrainPaths, dict[str, Any]]:
    """The paths and lineage of a supervised stage's job; ``key`` holds the job's config sections. The lineage
    carries the job's reuse key (``reuse_key``, :func:`align_pipeline.pipelines.reuse.content_key`)."""
    lineage = {"data": data_lineage(tokenizer, train, val), "parent_checkpoint": init_from}
    check_checkpoint_tokenizers(tokenizer, **{f"{stage_name}'s starting checkpoint": init_from})
    run_dir = run_dir_for(section, stage_name, {"lineage": lineage, **key})
    lineage["reuse_key"] = content_key(stage_name, lineage, key)
    paths = TrainPaths(run_dir=run_dir, train_data=str(Path(train.path).resolve()),
                       val_data=str(Path(val.path).resolve()), tokenizer=str(Path(tokenizer.path).resolve()),
                       init_from=init_from)
    return paths, lineage


def rl_paths(section: StageRunConfig, stage_name: str, *, tokenizer: Artifact, prompts_train: Artifact,
             prompts_val: Artifact, sft_policy: str | None, reward_model: str | None, key: dict[str, Any],
             teacher: str | None = None) -> tuple[RLPaths, dict[str, Any]]:
    """The paths and lineage of an RL stage's job: the policy starts from ``section.init_from`` or sft_policy, the
    KL reference is sft_policy, or without one (RL from a model) the policy's start; with a ``teacher``
    (distillation) there is no KL reference and the lineage names the teacher; ``key`` holds the job's config
    sections."""
    policy = section.init_from or sft_policy
    reference = None if teacher else sft_policy or policy
    lineage = {"data": data_lineage(tokenizer, prompts_train, prompts_val), "parent_checkpoint": policy,
               "reference": reference, "reward_model": reward_model, **({"teacher": teacher} if teacher else {})}
    check_checkpoint_tokenizers(tokenizer, **{f"{stage_name}'s starting policy": policy, "sft_policy": sft_policy,
                                              "reward_model": reward_model, "the teacher": teacher})
    run_dir = run_dir_for(section, stage_name, {"lineage": lineage, **key})
    lineage["reuse_key"] = content_key(stage_name, lineage, key)
    paths = RLPaths(run_dir=run_dir, prompts=str(Path(prompts_train.path).resolve()),
                    val_prompts=str(Path(prompts_val.path).resolve()), tokenizer=str(Path(tokenizer.path).resolve()),
                    policy=policy, reference=reference, reward_model=reward_model)
    return paths, lineage


def launch_stage(module: str, job: Any, launch: LaunchConfig, section: StageRunConfig, stage_name: str,
                 output_keys: tuple[str, ...]) -> tuple[list[str], dict[str, Any]]:
    """Launch the stage's torchrun job; return (the model dirs named by ``output_keys`` in result.json, result).

    Unless ``section.keep_run_dir``, the models are moved out of the run directory (the catalog then moves each into
    its version) and the rest of the run directory (training checkpoints, logs, metrics.jsonl) is deleted — in a
    ``kedro run`` only after the catalog has stored every output of the node (:class:`RunDirCleanup`): if a save
    fails, the directory stays and a rerun resumes from its last training checkpoint. Called outside a Kedro session
    the directory is deleted here, before returning. With ``section.export_hf`` each model is also written as an HF
    directory ``<model>/hf`` (see :func:`align_pipeline.launch.model_jobs.export`).
    """
    run_dir = Path(job.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    result = run_torchrun(module, to_dict(job), launch, run_dir, name=stage_name)
    dirs = [Path(result[key]) for key in output_keys]
    if section.export_hf:
        for model_dir in dirs:
            model_jobs.export(str(model_dir), str(model_dir / "hf"), ExportConfig(), run_dir / "export" / model_dir.name)
    if not section.keep_run_dir:
        kept = []
        for key, model_dir in zip(output_keys, dirs):
            keep = run_dir.parent / f".{run_dir.name}-{key.removesuffix('_dir')}"
            if keep.exists():
                shutil.rmtree(keep)
            model_dir.rename(keep)
            kept.append(keep)
        dirs = kept
        if not RUN_DIR_CLEANUP.defer(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
    return [str(d) for d in dirs], result


def reuse_or_launch(module: str, job: Any, launch: LaunchConfig, section: StageRunConfig, stage_name: str,
                    output_keys: tuple[str, ...], stored: Sequence[StoredVersions | None],
                    metrics_of: Callable[[dict[str, Any]], dict[str, float]]) -> tuple[list[str], dict[str, float]]:
    """The stage's outputs (model dirs for the catalog) and final metrics: a stored version's (cloned) when one was
    made with the job's reuse key (``job.lineage["reuse_key"]``) and ``section.reuse``; else the job's
    (:func:`launch_stage`), with the key and metrics recorded in each output for the next run. ``stored``: the
    outputs' ``<artifact>_stored`` inputs, in ``output_keys`` order."""
    reuse = StageReuse(stage_name, job.lineage["reuse_key"], section.reuse, stored,
                       Path(section.runs_dir).resolve() / stage_name)
    found = reuse.find()
    if found is not None:
        dirs, record = found
        return dirs, {k: float(v) for k, v in (record.get("metrics") or {}).items()}
    dirs, result = launch_stage(module, job, launch, section, stage_name, output_keys)
    metrics = metrics_of(result)
    reuse.record(dirs, metrics)
    return dirs, metrics


def supervised_metrics(result: dict[str, Any], metric_keys: tuple[str, ...]) -> dict[str, float]:
    """Final metrics of an SFT / reward-model / DPO job for MLflow."""
    metrics = {k: float(result[k]) for k in metric_keys if result.get(k) is not None}
    metrics["steps"] = float(result["step"])
    if result["history"]:
        metrics["first_train_loss"] = float(result["history"][0]["loss"])
    return metrics


def run_supervised_stage(module: str, job: Any, launch: LaunchConfig, section: StageRunConfig, stage_name: str,
                         metric_keys: tuple[str, ...], stored: StoredVersions | None = None
                         ) -> tuple[str, dict[str, float]]:
    """Reuse or launch an SFT / reward-model / DPO job; return (model dir for the catalog, final metrics for
    MLflow). ``stored``: the output's stored versions (None: always train)."""
    (model_dir,), metrics = reuse_or_launch(module, job, launch, section, stage_name, ("model_dir",), [stored],
                                            lambda result: supervised_metrics(result, metric_keys))
    return model_dir, metrics


def check_rl_gate(cfg, stage_name: str, reward_model: str | None) -> None:
    """The stage's gate on its reward model (``<stage>.gate.min_reward_model_accuracy``), before any process starts:
    :class:`~align_pipeline.evaluation.gates.GateFailed` when the model's recorded held-out accuracy is below it."""
    if reward_model:
        from align_pipeline.data.formats import checkpoint_meta
        from align_pipeline.evaluation.gates import check_reward_model_gate

        check_reward_model_gate(f"{stage_name}.gate.min_reward_model_accuracy", cfg.gate.min_reward_model_accuracy,
                                checkpoint_meta(reward_model), Path(reward_model).parent.name)


def rl_metrics(result: dict[str, Any]) -> dict[str, float]:
    """Final RL metrics of the node (the job's own names, ``rollout/rewards_mean``: it logs every iteration itself, so
    the hook adds only what the job did not log)."""
    metrics = {k: float(v) for k, v in result["final"].items() if isinstance(v, (int, float))}
    metrics["iterations"] = float(result["iteration"])
    return metrics
