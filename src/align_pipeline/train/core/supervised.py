"""Pieces of the supervised recipes (SFT, reward model, DPO) that are the same in all three: the start of a run
(resume + parameters), the per-step record, the data position kept in checkpoints, and the final export. The loop
itself is written in each recipe."""

from __future__ import annotations

import time
from typing import Any

from align_pipeline.config.base import config_hash, to_dict
from align_pipeline.config.common import TrainingConfig
from align_pipeline.model import memory
from align_pipeline.train.core.checkpointing import Checkpoints
from align_pipeline.train.core.distributed import Dist
from align_pipeline.train.core.optimizer import peak_memory_gib
from align_pipeline.train.core.progress import RunLog, log, log_job_params


def start(stage: str, job, ckpts: Checkpoints, cfg: TrainingConfig, dist: Dist, logger
          ) -> tuple[int, RunLog, dict[str, float]]:
    """Resume from the newest complete checkpoint (checking its data position), log the job as MLflow params, and
    open the run log; returns (first step to run, run log, the metrics of the step the checkpoint was taken after:
    a run resumed at its final step reports them instead of nothing)."""
    step, state = ckpts.resume()
    last: dict[str, float] = {}
    if state is not None:
        if state["consumed_samples"] != step * cfg.global_batch_size:
            raise RuntimeError(f"checkpoint data position {state['consumed_samples']} does not match step {step}")
        last = dict(state.get("last_metrics") or {})
        log(dist, f"[{stage}] resumed at step {step} from {job.paths.run_dir}")
    log_job_params(logger, job, dist, resumed_from_step=step)
    return step, RunLog(stage, dist, logger, cfg.train_steps, step, cfg.log_interval,
                       metrics_interval=cfg.metrics_interval), last


def data_position(step: int, cfg: TrainingConfig, last: dict[str, float] | None = None) -> dict[str, Any]:
    """The train state a checkpoint keeps: the step, the samples consumed (batches are a function of the step) and
    the metrics of that step (``last``)."""
    return {"step": step, "consumed_samples": step * cfg.global_batch_size,
            "last_metrics": {k: float(v) for k, v in (last or {}).items()}}


def eval_due(step: int, cfg: TrainingConfig) -> bool:
    """A validation pass every ``eval_interval`` steps (the last step always gets the final one)."""
    return bool(cfg.eval_interval) and step % cfg.eval_interval == 0 and step < cfg.train_steps


def step_metrics(m: dict[str, float], loss_name: str, t0: float, runlog: RunLog, tokens: int) -> dict[str, float]:
    """A step's metrics as logged: ``loss`` (= ``loss_name``) first, the rest of the loss's metrics, grad norm, lr,
    the step's wall time, its tokens (``step_tokens``: non-padding tokens of the global batch) and the tokens/s so
    far."""
    runlog.progress.add_tokens(tokens)
    return {"loss": m[loss_name], **{k: v for k, v in m.items() if k != loss_name},
            "step_time_s": time.perf_counter() - t0, "step_tokens": float(tokens),
            "tokens_per_s": runlog.progress.tokens_per_s()}


def record(runlog: RunLog, step: int, metrics: dict[str, float]) -> None:
    """Log a step (validation steps always); the history keeps loss and step time."""
    runlog.record(step, metrics, {"step": step, "loss": metrics["loss"], "step_time_s": metrics["step_time_s"],
                                  "step_tokens": metrics["step_tokens"]}, force="val_loss" in metrics)


def finish(stage: str, job, ckpts: Checkpoints, runlog: RunLog, step: int, cfg: TrainingConfig, tok,
           final: dict[str, float], last: dict[str, float], tokens_per_step: int,
           meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The end of a supervised run: final checkpoint, the model exported with its meta.json (``meta`` adds
    stage-specific fields), result.json."""
    runlog.progress.print(step, {**last, **final})
    runlog.logger.log_metrics(final, step)
    ckpts.save(step, data_position(step, cfg, last))
    dirs = ckpts.export(step, {
        "stage": stage, "tokenizer": {"path": str(job.paths.tokenizer), "fingerprint": tok.fingerprint},
        "saved_with_parallel": to_dict(job.parallel), "metrics": {**final, "train_loss": last.get("loss")},
        "lineage": {**job.lineage, "config_hash": config_hash(job)}, **(meta or {})})
    return runlog.finish(job.paths.run_dir, {
        **dirs, "step": step, **final, "train_loss": last.get("loss"), "train_metrics": last,
        "tokens_per_s": last.get("tokens_per_s"), "tokens_per_step": tokens_per_step,
        "peak_memory_gib": peak_memory_gib(), "peak_memory_by_phase_gib": memory.peaks_gib(),
        "history": runlog.history})
