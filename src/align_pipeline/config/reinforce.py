"""``params:reinforce`` and the REINFORCE job (``python -m align_pipeline.train.reinforce``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from align_pipeline.config.base import ConfigError, require_range
from align_pipeline.config.common import RLPaths, StageJob
from align_pipeline.config.rl import RLConfig, check_rl_job


@dataclass
class ReinforceLossConfig:
    """The REINFORCE-family estimator (the KL term is the section's ``kl``)."""

    estimator: Literal["rloo", "grpo"] = "rloo"
    """rloo: leave-one-out baseline (Ahmadian et al. 2024); grpo: group mean/std normalisation (Shao et al. 2024)."""
    grpo_scale: bool = True
    """GRPO: divide by the group std (False = Dr. GRPO)."""
    clip_eps: float = 0.2
    """Ratio clip when a rollout is used for more than one optimizer step (epochs or minibatches > 1)."""
    std_eps: float = 1e-6
    """GRPO with ``grpo_scale``: added to the group's std before dividing, A_i = (r_i - mean) / (std + std_eps). It
    bounds the advantages of a group whose scores barely differ (a group of equal scores gets exactly 0 anyway).
    TRL's ``GRPOTrainer`` uses 1e-4; must be > 0."""

    def validate(self, where: str = "loss") -> None:
        require_range(self, where, "clip_eps", 0, 1, low_open=True, high_open=True)
        require_range(self, where, "std_eps", 0, low_open=True)


@dataclass
class ReinforceConfig(RLConfig):
    """``params:reinforce``: RLOO / GRPO with ``generation.samples_per_prompt`` >= 2, no critic."""

    loss: ReinforceLossConfig = field(default_factory=ReinforceLossConfig)
    """Which group baseline, and the clip of the multi-step form."""

    def validate(self, where: str = "reinforce") -> None:
        if self.generation.samples_per_prompt < 2:
            raise ConfigError(
                f"{where}.generation.samples_per_prompt={self.generation.samples_per_prompt}: group "
                "baselines need generation.samples_per_prompt >= 2"
            )
        if self.kl.adaptive:
            raise ConfigError(f"{where}.kl.adaptive is a PPO controller; REINFORCE uses a constant kl.beta")
        if self.kl.estimator == "k1" and self.kl.beta > 0:
            raise ConfigError(f"{where}.kl.estimator=k1: REINFORCE adds beta x KL to the loss, and k1's gradient is "
                              "zero in expectation as a loss term; use k3 (or k2)")


@dataclass(kw_only=True)
class ReinforceJob(StageJob):
    """What the REINFORCE entry point runs: ``params:reinforce`` + model/parallel + paths + lineage."""

    reinforce: ReinforceConfig = field(default_factory=ReinforceConfig)
    """The stage's section, as in ``parameters_reinforce.yml``."""
    paths: RLPaths
    """Prompts, tokenizer, policy, reference, optional reward model, run directory."""

    def validate(self, where: str = "ReinforceJob") -> None:
        check_rl_job("reinforce", self.reinforce, self.parallel, self.paths, where)
