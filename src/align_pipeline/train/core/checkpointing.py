"""Checkpointing of a training run, written once for every stage: resume, periodic save + prune, stop-after, export.

Each trained model has its own training checkpoints under its directory (``<dir>/checkpoints/iter_<k>``: weights,
optimizer, schedule, per-rank RNG, and the stage's ``train_state`` — the step or iteration, the data/prompt cursor, a
KL controller). SFT, the reward model and DPO keep their one model in the run directory; PPO keeps ``actor/`` and
``critic/``. A resume starts from the newest step that *every* model has completely written. The final model of each
is exported to ``<dir>/model`` (weights + meta.json with lineage).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from align_pipeline.config.base import config_hash, to_dict
from align_pipeline.config.common import RLLoopConfig, TrainingConfig
from align_pipeline.model import checkpoint
from align_pipeline.train.core.distributed import Dist
from align_pipeline.train.core.optimizer import Trainable


class Checkpoints:
    """The training checkpoints of one run.

    ``models``: name -> (trainable, directory). ``interval``: steps between saves (0 = only at the end);
    ``keep``: checkpoints kept per model (0 = all); ``stop_after``: stop (saving first) after this many steps of this
    invocation; ``meta``: recorded in every checkpoint's meta.json (stage, config hash).
    """

    def __init__(self, models: dict[str, tuple[Trainable, str | Path]], dist: Dist, *, total: int, interval: int,
                 keep: int, resume: bool, stop_after: int | None, meta: dict[str, Any]):
        self.models = {name: (t, Path(d)) for name, (t, d) in models.items()}
        self.dist, self.total, self.interval, self.keep = dist, total, interval, keep
        self.resume_enabled, self.stop_after, self.meta = resume, stop_after, meta
        self.started_at = 0

    @classmethod
    def for_training(cls, models: dict[str, tuple[Trainable, str | Path]], cfg: TrainingConfig, job, stage: str,
                     dist: Dist) -> Checkpoints:
        """The checkpoints of a supervised run: interval, retention and resume from ``cfg``, ``job.stop_after``."""
        return cls(models, dist, total=cfg.train_steps, interval=cfg.save_interval, keep=cfg.keep_checkpoints,
                   resume=cfg.resume, stop_after=job.stop_after, meta={"stage": stage, "config_hash": config_hash(job)})

    @classmethod
    def for_rl(cls, models: dict[str, tuple[Trainable, str | Path]], rl: RLLoopConfig, job, stage: str,
               dist: Dist) -> Checkpoints:
        """The checkpoints of an RL run: interval, retention and resume from ``rl``, ``job.stop_after``."""
        return cls(models, dist, total=rl.iterations, interval=rl.save_interval, keep=rl.keep_checkpoints,
                   resume=rl.resume, stop_after=job.stop_after, meta={"stage": stage, "config_hash": config_hash(job)})

    def resume(self) -> tuple[int, dict[str, Any] | None]:
        """Restore every model (weights, optimizer, schedule, RNG) from the newest step all of them have; returns
        (that step, its train_state), or (0, None) for a fresh start."""
        common: set[int] | None = None
        for _, d in self.models.values():
            steps = set(checkpoint.complete_checkpoints(d))
            common = steps if common is None else common & steps
        if not self.resume_enabled or not common:
            return 0, None
        step = max(common)
        for t, d in self.models.values():
            state = checkpoint.load_training(checkpoint.iteration_dir(d, step), t.model, t.optimizer, t.scheduler)
        self.started_at = step
        return step, state

    def save(self, step: int, train_state: dict[str, Any]) -> None:
        """A resumable checkpoint of every model at ``step``; older ones beyond ``keep`` are deleted."""
        for name, (t, d) in self.models.items():
            checkpoint.save_training(d, step, t.model, t.optimizer, t.scheduler, train_state, {**self.meta, "trained_model": name})
            if self.dist.is_logging_rank and self.keep > 0:
                found = checkpoint.complete_checkpoints(d)
                for old in sorted(found)[: -self.keep]:
                    shutil.rmtree(found[old], ignore_errors=True)

    def after_step(self, step: int, train_state: dict[str, Any]) -> bool:
        """Save when ``step`` is on the interval; True (after saving) when this invocation must stop here."""
        if step >= self.total:
            return False
        stop = self.stop_after is not None and step - self.started_at >= self.stop_after
        if stop or (self.interval and step % self.interval == 0):
            self.save(step, train_state)
        return stop

    def export(self, step: int, meta: dict[str, Any], per_model: dict[str, dict[str, Any]] | None = None
               ) -> dict[str, str]:
        """Write each model's final weights to ``<dir>/model`` with meta.json; returns {"<name>_dir": path}.

        ``meta`` (stage, tokenizer, metrics, lineage, ...) is completed per model with its architecture, head,
        vocabulary, parent and the MLflow run id; ``per_model[name]`` adds model-specific fields."""
        out = {}
        for name, (t, d) in self.models.items():
            model_meta = {
                **meta,
                "step": step,
                "model": to_dict(t.source.model),
                "head": t.head,
                "num_outputs": t.num_outputs,
                "vocab_size": t.source.vocab_size,
                "lineage": {**meta.get("lineage", {}), "parent": t.source.parent,
                            "mlflow_run_id": os.environ.get("MLFLOW_RUN_ID")},
                **(per_model or {}).get(name, {}),
            }
            adapters_only = bool(t.lora is not None and t.lora.rank and t.lora.store == "adapters")
            out[f"{name}_dir"] = str(checkpoint.save_model(d / "model", t.model, model_meta, adapters_only))
        return out
