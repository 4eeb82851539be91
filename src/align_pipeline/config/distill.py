"""``params:distill`` and the on-policy distillation job (``python -m align_pipeline.train.distill``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from align_pipeline.config.base import ConfigError, require_range
from align_pipeline.config.common import KLConfig, RLPaths, StageJob
from align_pipeline.config.rl import RLConfig, check_rl_job


@dataclass
class DistillLossConfig:
    """The distillation loss (:func:`align_pipeline.losses.distill.distill_loss`): per-token reverse KL to the
    teacher on the student's samples, optionally mixed with the ``reward`` section's task reward."""

    kl_coef: float = 1.0
    """Weight of the per-token reverse KL to the teacher (the k2 form ½ (log π_student − log π_teacher)², whose
    gradient is the reverse KL's per-token policy gradient)."""
    reward_weight: float = 0.0
    """Weight of the task reward's policy-gradient term (RLOO advantages of the ``reward`` section's scores over a
    prompt's ``generation.samples_per_prompt`` >= 2 samples); 0 = pure distillation, the reward only measured."""

    def validate(self, where: str = "loss") -> None:
        require_range(self, where, "kl_coef", 0, low_open=True)
        require_range(self, where, "reward_weight", 0)


@dataclass
class DistillConfig(RLConfig):
    """``params:distill``: the student (``init_from``, else sft_policy) samples responses to the prompts, and learns
    the teacher's (``teacher``, else the pipeline's teacher input) log-probabilities of its own tokens."""

    teacher: str | None = None
    """The teacher: a policy checkpoint or an HF model directory (any TP/PP it was saved with; frozen, and offloaded
    with ``offload.frozen_models`` like a KL reference). It must use the student's tokenizer. None = the pipeline's
    catalog input (``distill``: ``reinforce_policy``); the ``distill_from_path`` pipeline needs it set."""
    loss: DistillLossConfig = field(default_factory=DistillLossConfig)
    """The reverse-KL weight and the optional task reward's."""
    kl: KLConfig = field(default_factory=lambda: KLConfig(beta=0.0))
    """Unused: the teacher's reverse KL is the loss (``loss.kl_coef``); ``kl.beta`` must stay 0."""

    def validate(self, where: str = "distill") -> None:
        if self.kl.beta:
            raise ConfigError(f"{where}.kl.beta={self.kl.beta}: distillation has no KL reference besides the teacher, "
                              f"whose reverse KL is the loss: set {where}.loss.kl_coef instead (and kl.beta 0)")
        if self.env.name is not None:
            raise ConfigError(f"{where}.env.name={self.env.name!r}: distillation samples single responses; "
                              "environments are for the reinforce and ppo stages")
        if self.loss.reward_weight:
            super().validate(where)  # a task reward needs a reward
            if self.generation.samples_per_prompt < 2:
                raise ConfigError(
                    f"{where}.loss.reward_weight={self.loss.reward_weight} needs "
                    f"{where}.generation.samples_per_prompt >= 2 (its advantages are leave-one-out within a prompt's "
                    f"samples), got {self.generation.samples_per_prompt}")


@dataclass(kw_only=True)
class DistillPaths(RLPaths):
    """An RL job's paths with the teacher (``reference`` is unused: the teacher takes its place)."""

    teacher: str
    """The frozen teacher: a checkpoint or an HF model directory."""


@dataclass(kw_only=True)
class DistillJob(StageJob):
    """What the distillation entry point runs: ``params:distill`` + model/parallel + paths + lineage."""

    distill: DistillConfig = field(default_factory=DistillConfig)
    """The stage's section, as in ``parameters_distill.yml``."""
    paths: DistillPaths
    """Prompts, tokenizer, the student's start (``policy``), the teacher, run directory."""

    def validate(self, where: str = "DistillJob") -> None:
        check_rl_job("distill", self.distill, self.parallel, self.paths, where)
        if self.paths.reference not in (None, self.paths.teacher):
            raise ConfigError(f"{where}.paths.reference: distillation has no KL reference besides the teacher")
