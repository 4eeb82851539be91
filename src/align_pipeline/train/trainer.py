"""The optimisation loop every training stage runs (SFT, reward model, DPO): resume, step, log, evaluate, checkpoint,
export. A stage script provides the data, the model and a ``forward_loss``; it stays a short, readable file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from align_pipeline.config import TrainJobConfig, config_hash, to_dict
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.model import checkpoint, init
from align_pipeline.model.init import ModelSource
from align_pipeline.tracking import RunLogger
from align_pipeline.train import loop
from align_pipeline.train.distributed import Dist, init_distributed, shutdown


@dataclasses.dataclass
class StageSpec:
    """What differs between stages."""

    name: str
    """Stage name (meta.json, log prefix)."""
    forward_loss: loop.ForwardLoss
    """(module, micro-batch) -> (output, loss_fn) with loss_fn from align_pipeline.losses."""
    metrics: list[str]
    """Metric names the loss reports (sums over its count)."""
    loss_metric: str
    """The metric that is *the* loss (logged as ``loss`` / ``val_loss``)."""
    head: str = "lm"
    """Model head stored in meta.json ("lm" or "value")."""
    extra_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Stage-specific fields for meta.json (e.g. the reward head's pooling)."""


@dataclasses.dataclass
class Prepared:
    """Everything a stage has set up before its loop."""

    dist: Dist
    tokenizer: Any
    source: ModelSource
    model: Any
    optimizer: Any
    scheduler: Any
    train: loop.ArrayBatches
    val: loop.ArrayBatches


def prepare(job: TrainJobConfig, stage: str, head: str = "lm", num_outputs: int = 1,
            with_arrays: Callable[[dict[str, np.ndarray], str], dict[str, np.ndarray]] | None = None) -> Prepared:
    """Process groups, tokenizer, the model (from ``job.init_from`` or random) with its optimizer and schedule, and
    the train/val batches (``with_arrays(arrays, split)`` may add per-sample arrays, e.g. reference log-probs)."""
    tcfg = job.training
    dist = init_distributed(job.parallel, tcfg.seed)
    tokenizer = load_tokenizer(job.tokenizer)
    source = init.resolve(job.init_from, job.model, tokenizer.vocab_size)
    loop.log(dist, f"[{stage}] world={dist.world_size} tp={dist.tp_size} pp={dist.pp_size} dp={dist.dp_size} "
                   f"backend={dist.backend} init={source.parent['kind']}:{job.init_from}")
    model, optimizer, scheduler = loop.build_model_and_optimizer(source, job.parallel, tcfg, dist, head=head,
                                                                 num_outputs=num_outputs)
    batches = {}
    for split, path in (("train", job.train_data), ("val", job.val_data)):
        arrays = dict(np.load(path))
        if with_arrays is not None:
            arrays = with_arrays(arrays, split)
        batches[split] = loop.ArrayBatches(arrays, tcfg.global_batch_size, tcfg.micro_batch_size, dist,
                                           seed=tcfg.seed, shuffle=split == "train")
    return Prepared(dist, tokenizer, source, model, optimizer, scheduler, batches["train"], batches["val"])


def fit(job: TrainJobConfig, spec: StageSpec, p: Prepared) -> dict[str, Any]:
    """Train for ``job.training.train_steps`` steps; returns the result dict (also run_dir/result.json)."""
    dist, source, model, optimizer, scheduler, train, val = (p.dist, p.source, p.model, p.optimizer, p.scheduler,
                                                             p.train, p.val)
    logger = RunLogger(rank=dist.rank)
    run_dir, tcfg, seq_length = Path(job.run_dir), job.training, source.model.seq_length
    step = 0
    latest = checkpoint.latest_checkpoint(run_dir) if tcfg.resume else None
    if latest is not None:
        state = checkpoint.load_training(latest, model, optimizer, scheduler)
        step = int(state["step"])
        assert state["consumed_samples"] == step * tcfg.global_batch_size, "data position does not match the step"
        loop.log(dist, f"[{spec.name}] resumed from {latest} at step {step}")
    logger.log_params({"job": to_dict(job), "world_size": dist.world_size, "resumed_from_step": step})

    def evaluate() -> dict[str, float]:
        model.eval()
        m = loop.run_microbatches(model, val.eval_microbatches(tcfg.eval_samples), spec.forward_loss, spec.metrics,
                                  dist, seq_length, forward_only=True)
        model.train()
        return {f"val_{k}": v for k, v in m.items() if k != "count"}

    def save(at_step: int) -> None:
        checkpoint.save_training(run_dir, at_step, model, optimizer, scheduler,
                                 {"step": at_step, "consumed_samples": at_step * tcfg.global_batch_size},
                                 {"stage": spec.name, "config_hash": config_hash(job)})
        if dist.is_logging_rank and tcfg.keep_checkpoints > 0:
            for old in sorted((run_dir / "checkpoints").glob("iter_*"))[: -tcfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)

    progress = loop.Progress(tcfg.train_steps, step, dist.is_logging_rank)
    tokens_per_step = tcfg.global_batch_size * seq_length * train.rows_per_sample
    history: list[dict[str, float]] = []
    last: dict[str, float] = {}
    steps_this_run = 0
    model.train()
    while step < tcfg.train_steps:
        t0 = time.perf_counter()
        loop.zero_grads(model, optimizer)
        m = loop.run_microbatches(model, train.microbatches(step), spec.forward_loss, spec.metrics, dist,
                                  seq_length, forward_only=False)
        ok, grad_norm = loop.optimizer_step(model, optimizer, scheduler)
        step += 1
        steps_this_run += 1
        progress.add_tokens(tokens_per_step)
        last = {"loss": m[spec.loss_metric], **{k: v for k, v in m.items() if k not in (spec.loss_metric, "count")},
                "lr": loop.current_lr(optimizer), "grad_norm": grad_norm, "step_time_s": time.perf_counter() - t0,
                "tokens_per_s": progress.tokens_per_s(), "update_skipped": float(not ok)}
        history.append({"step": step, "loss": last["loss"], "step_time_s": last["step_time_s"]})
        logged = dict(last)
        if tcfg.eval_interval and step % tcfg.eval_interval == 0 and step < tcfg.train_steps:
            logged.update(_with_val_loss(evaluate(), spec))
        if step % tcfg.log_interval == 0 or step == tcfg.train_steps or "val_loss" in logged:
            progress.print(step, logged)
            logger.log_metrics(logged, step)
            logger.log_system_metrics(step)
        if tcfg.save_interval and step % tcfg.save_interval == 0 and step < tcfg.train_steps:
            save(step)
        if job.stop_after_steps is not None and steps_this_run >= job.stop_after_steps and step < tcfg.train_steps:
            save(step)
            loop.log(dist, f"[{spec.name}] stopping after {steps_this_run} steps (stop_after_steps); "
                           f"a rerun resumes at step {step}")
            return finish(dist, logger, run_dir, {"stopped_at_step": step})

    final_val = _with_val_loss(evaluate(), spec)
    progress.print(step, {**last, **final_val})
    logger.log_metrics(final_val, step)
    save(step)
    meta = {
        "stage": spec.name,
        "step": step,
        "model": to_dict(source.model),
        "head": spec.head,
        "vocab_size": source.vocab_size,
        "tokenizer": {"path": str(job.tokenizer), "fingerprint": p.tokenizer.fingerprint},
        "saved_with_parallel": to_dict(job.parallel),
        "metrics": {**final_val, "train_loss": last.get("loss")},
        "lineage": {**job.lineage, "parent": source.parent, "config_hash": config_hash(job),
                    "mlflow_run_id": os.environ.get("MLFLOW_RUN_ID")},
        **spec.extra_meta,
    }
    model_dir = checkpoint.save_model(run_dir / "model", model, meta)
    result = {"model_dir": str(model_dir), "step": step, **final_val, "train_loss": last.get("loss"),
              "train_metrics": last, "tokens_per_s": last.get("tokens_per_s"), "tokens_per_step": tokens_per_step,
              "peak_memory_gib": loop.peak_memory_gib(), "history": history}
    return finish(dist, logger, run_dir, result)


def _with_val_loss(val: dict[str, float], spec: StageSpec) -> dict[str, float]:
    return {"val_loss": val[f"val_{spec.loss_metric}"], **{k: v for k, v in val.items()
                                                            if k != f"val_{spec.loss_metric}"}}


def finish(dist: Dist, logger, run_dir: Path, result: dict) -> dict:
    """Rank 0 writes result.json; everyone closes tracking and process groups."""
    if dist.is_logging_rank:
        (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    logger.close()
    shutdown()
    return result
