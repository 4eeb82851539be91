"""What rank 0 shows and keeps of a run: progress lines, log lines, and ``result.json`` at the end."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from align_pipeline.model import memory
from align_pipeline.train.core.distributed import Dist, shutdown

# (metric key, label, format) shown in a progress line when present, in this order.
STEP_FIELDS = (("loss", "loss", "{:.4f}"), ("val_loss", "val_loss", "{:.4f}"), ("lr", "lr", "{:.1e}"),
               ("grad_norm", "gnorm", "{:.2f}"))
ITERATION_FIELDS = (("rollout/rewards_mean", "reward", "{:.3f}"), ("rollout/accuracy", "acc", "{:.3f}"),
                    ("rollout/init_policy_kl", "kl", "{:.4f}"), ("train/policy_loss", "pg", "{:.4f}"),
                    ("train/pg_loss", "pg", "{:.4f}"), ("critic/value_loss", "vf", "{:.4f}"),
                    ("val/greedy_accuracy", "val_greedy_acc", "{:.3f}"), ("timing/generate_s", "gen", "{:.2f}s"),
                    ("timing/train_s", "train", "{:.2f}s"))


def log(dist: Dist, msg: str) -> None:
    """Print on rank 0 only."""
    if dist.is_logging_rank:
        print(msg, file=sys.stdout, flush=True)


class Progress:
    """Rank-0 progress line: ``step 20/300 | loss 1.2340 | lr 1.0e-03 | gnorm 0.52 | 5321 tok/s | eta 0:01:02`` for
    the supervised stages (``unit="step"``), ``[ppo] iter 10/200 | reward 0.412 | ... | eta 0:02:10`` for RL."""

    def __init__(self, total: int, start: int, dist: Dist, unit: str = "step", prefix: str = ""):
        self.total, self.start, self.dist, self.unit, self.prefix = total, start, dist, unit, prefix
        self.t0 = time.perf_counter()
        self.tokens = 0

    def add_tokens(self, n: int) -> None:
        self.tokens += n

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self.t0, 1e-9)

    def eta_s(self, done_until: int) -> float:
        elapsed = time.perf_counter() - self.t0
        return elapsed / max(done_until - self.start, 1) * (self.total - done_until)

    def line(self, at: int, metrics: dict[str, float]) -> str:
        label = "step" if self.unit == "step" else "iter"
        parts = [f"{self.prefix}{label} {at}/{self.total}"]
        for key, name, fmt in (STEP_FIELDS if self.unit == "step" else ITERATION_FIELDS):
            if key in metrics:
                parts.append(f"{name} {fmt.format(metrics[key])}")
        if self.unit == "step":
            parts.append(f"{self.tokens_per_s():.0f} tok/s")
        eta = int(self.eta_s(at))
        parts.append(f"eta {eta // 3600}:{eta % 3600 // 60:02d}:{eta % 60:02d}")
        return " | ".join(parts)

    def print(self, at: int, metrics: dict[str, float]) -> None:
        log(self.dist, self.line(at, metrics))


POINTS_PER_CURVE = 50
"""MLflow points a curve gets by default (``metrics_interval: null``)."""


def metrics_every(total: int, interval: int | None) -> int:
    """The configured ``metrics_interval``, or the one giving :data:`POINTS_PER_CURVE` points over ``total``."""
    return interval if interval else max(1, total // POINTS_PER_CURVE)


class RunLog:
    """Rank 0's record of one run: the progress line every ``interval`` steps or iterations, MLflow metrics (+ system
    metrics) every ``metrics_interval`` (both at the last one too, and whenever ``force``), the history kept in
    result.json, and the end of the run (result.json, tracking and process groups closed)."""

    def __init__(self, stage: str, dist: Dist, logger, total: int, start: int, interval: int, unit: str = "step",
                 metrics_interval: int | None = None):
        self.stage, self.dist, self.logger, self.interval = stage, dist, logger, interval
        self.metrics_interval = metrics_every(total, metrics_interval)
        self.progress = Progress(total, start, dist, unit=unit, prefix="" if unit == "step" else f"[{stage}] ")
        self.history: list[dict[str, float]] = []

    def record(self, at: int, metrics: dict[str, float], kept: dict[str, float], force: bool = False) -> None:
        """``kept`` goes to the history; ``metrics`` to the progress line and MLflow when due."""
        self.history.append(kept)
        last = at == self.progress.total
        if force or last or at % self.interval == 0:
            self.progress.print(at, metrics)
        if force or last or at % self.metrics_interval == 0:
            self.logger.log_metrics(metrics, at)
            self.logger.log_system_metrics(at)

    def stopped(self, at: int, run_dir: str | Path, started_at: int) -> dict[str, Any]:
        """End an invocation that stops early (``stop_after``): a rerun resumes at ``at``."""
        unit = "steps" if self.progress.unit == "step" else "iterations"
        log(self.dist, f"[{self.stage}] stopping after {at - started_at} {unit} (stop_after); a rerun resumes at {at}")
        key = "stopped_at_step" if self.progress.unit == "step" else "stopped_at_iteration"
        return self.finish(run_dir, {key: at, "history": self.history})

    def finish(self, run_dir: str | Path, result: dict[str, Any]) -> dict[str, Any]:
        """Report the job's peak accelerator memory per phase (training step, validation, checkpoint save; a log line
        and ``memory/peak_<phase>_gib`` metrics at the last step), then rank 0 writes ``run_dir/result.json``; every
        rank closes its tracking and process groups."""
        peaks = memory.peaks_gib()
        if peaks:
            log(self.dist, f"[{self.stage}] peak accelerator memory (rank 0): "
                + ", ".join(f"{phase} {gib:.1f} GiB" for phase, gib in peaks.items()))
            self.logger.log_metrics({f"memory/peak_{phase}_gib": gib for phase, gib in peaks.items()},
                                    self.progress.total)
            result = {**result, "peak_memory_by_phase_gib": peaks}
        return finish(self.dist, self.logger, run_dir, result)


def finish(dist: Dist, logger, run_dir: str | Path, result: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 copies its ``metrics.jsonl`` into every model checkpoint named in ``result`` (``*_dir`` keys: the copy
    outlives the run directory and travels with the catalog version), then writes ``run_dir/result.json``; every rank
    closes its tracking and process groups."""
    if dist.is_logging_rank:
        for key, value in result.items():
            if key.endswith("_dir") and isinstance(value, str) and (Path(value) / "meta.json").is_file():
                logger.copy_metrics_to(value)
        (Path(run_dir) / "result.json").write_text(json.dumps(result, indent=2))
    logger.close()
    shutdown()
    return result


def log_job_params(logger, job, dist: Dist, **extra: Any) -> None:
    """The job's MLflow params: ``world_size`` and ``extra`` (e.g. ``resumed_from_step``); and, only when no Kedro
    node's run is attached (a job run by hand, whose ``metrics.jsonl`` may be re-logged later), its config sections
    under the Kedro parameter names (``dpo.loss.beta``, ``model.num_layers``): in a ``kedro run`` the hook logs those
    on the node's child run, and logging them twice would give every param two names."""
    params: dict[str, Any] = {"world_size": dist.world_size, **extra}
    if not logger.run_id:
        from align_pipeline.config.base import to_dict

        params.update({k: v for k, v in to_dict(job).items() if k not in ("paths", "lineage")})
    logger.log_params(params)

