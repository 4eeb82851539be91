"""What the RL sections share: ``params:ppo`` and ``params:reinforce`` both start with these fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from align_pipeline.config.base import ConfigError, require_range
from align_pipeline.config.checks import check_reward_model, check_stage_parallel
from align_pipeline.config.common import (
    EnvConfig,
    GenerationConfig,
    KLConfig,
    OffloadConfig,
    OptimizerConfig,
    ParallelConfig,
    RewardConfig,
    RLLoopConfig,
    RLPaths,
    StageRunConfig,
)


@dataclass
class RLGateConfig:
    """``<stage>.gate``: what the stage's inputs must reach before it starts (a miss stops the node and its
    dependants with one message; :mod:`align_pipeline.evaluation.gates`)."""

    min_reward_model_accuracy: float | None = None
    """The reward model's held-out pair accuracy (its training's final ``val_accuracy``, read from its checkpoint)
    must be at least this; None = no gate. Checked only when the stage uses a reward model."""

    def validate(self, where: str = "gate") -> None:
        require_range(self, where, "min_reward_model_accuracy", 0, 1)


@dataclass
class RLConfig(StageRunConfig):
    """The fields of every RL section: the loop, sampling, the reward, the KL term, the policy's optimizer."""

    rl: RLLoopConfig = field(default_factory=RLLoopConfig)
    """Iterations, rollout size, epochs x minibatches per rollout, intervals."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Rollout sampling (temperature, max new tokens, samples per prompt)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The sequence score: the reward model and/or weighted reward functions; the accuracy function."""
    kl: KLConfig = field(default_factory=KLConfig)
    """The KL-to-reference term and its coefficient ``beta``."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The policy's optimizer and schedule (over iterations x epochs x minibatches steps)."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """CPU offload of frozen models / optimizer states between phases (GPU memory)."""
    gate: RLGateConfig = field(default_factory=RLGateConfig)
    """Thresholds the inputs must meet before the stage starts (the reward model's accuracy)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """A multi-turn environment the policy acts in (``env.name``); none by default (one response per prompt)."""

    def validate(self, where: str = "rl") -> None:
        if not self.reward.has_reward() and not (self.env.name and self.env.reward_weight):
            raise ConfigError(f"{where}.reward: no reward: reward_model_weight is 0 and no entry of {where}.reward."
                              "functions has a non-zero weight" + (" (nor an env with a reward_weight)"
                                                                   if self.env.name else ""))


def check_rl_job(stage: str, section: RLConfig, parallel: ParallelConfig, paths: RLPaths, where: str) -> None:
    """The checks every RL job makes before any process starts (the layout rules: :mod:`align_pipeline.config.checks`,
    which the Kedro hook also applies before any node runs)."""
    if section.reward.reward_model_weight and paths.reward_model is None:
        raise ConfigError(f"{where}: reward.reward_model_weight is {section.reward.reward_model_weight} but no "
                          "reward model is given (paths.reward_model)")
    if section.reward.reward_model_weight:
        check_reward_model(section.reward, paths.reward_model, f"{where}.{stage}.reward")
    check_stage_parallel(stage, parallel, f"{where}.parallel")
