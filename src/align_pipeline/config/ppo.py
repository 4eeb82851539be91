"""``params:ppo`` and the PPO job (``python -m align_pipeline.train.ppo``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from align_pipeline.config.base import ConfigError, require_range
from align_pipeline.config.common import KLConfig, LoRAConfig, OptimizerConfig, RLPaths, StageJob
from align_pipeline.config.rl import RLConfig, check_rl_job


@dataclass
class PPOLossConfig:
    """PPO's clipped objective, GAE and whitening."""

    clip_eps: float = 0.2
    """Ratio clip epsilon of the policy loss."""
    value_clip_eps: float | None = 0.2
    """How far (in reward units) the value may move from its rollout estimate before clipping; None = the plain
    squared error."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (0 = off; entropy is reported either way)."""
    whiten_advantages: bool = True
    """Whiten advantages over the whole rollout (all DP ranks)."""

    def validate(self, where: str = "loss") -> None:
        require_range(self, where, "clip_eps", 0, 1, low_open=True, high_open=True)
        require_range(self, where, "value_clip_eps", 0, low_open=True)
        for name in ("gamma", "lam"):
            require_range(self, where, name, 0, 1)
        require_range(self, where, "entropy_coef", 0)


@dataclass
class PPOConfig(RLConfig):
    """``params:ppo``: actor + critic trained with PPO against a frozen reference and reward model."""

    loss: PPOLossConfig = field(default_factory=PPOLossConfig)
    """Clipping, GAE, entropy bonus, whitening."""
    kl: KLConfig = field(default_factory=lambda: KLConfig(estimator="k1"))
    """The KL-to-reference penalty, subtracted from the per-token rewards (``beta`` x KL, Ouyang et al. 2022,
    eq. 2). Its estimator defaults to k1 here (InstructGPT's log pi - log pi_ref per token, which a reward penalty
    may use: its sum over the response estimates the sequence's KL); k2 and k3 work too."""
    critic_optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The critic's optimizer and schedule."""
    critic_lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters for the critic (rank 0 = the critic trains fully); its value head always trains. The
    stored critic is merged, like the actor (``lora``)."""
    critic_warmup_iterations: int = 0
    """First iterations in which only the critic trains and the actor is left as it is. A critic started from the
    reward model predicts reward-model scores, not this reward's returns, so its first advantages are noise that
    pushes the actor away from the SFT policy (NeMo-Aligner's ``critic_warmup_steps``, OpenRLHF's
    ``freezing_actor_steps``). The actor's schedule covers the remaining iterations."""

    def validate(self, where: str = "ppo") -> None:
        super().validate(where)
        if not 0 <= self.critic_warmup_iterations < self.rl.iterations:
            raise ConfigError(f"{where}.critic_warmup_iterations must be in [0, rl.iterations = {self.rl.iterations}), "
                              f"got {self.critic_warmup_iterations}")


@dataclass(kw_only=True)
class PPOPaths(RLPaths):
    """A PPO job's files: the RL inputs plus the critic's start."""

    critic: str | None = None
    """The critic's starting checkpoint: a value-head checkpoint (normally the reward model) or an LM checkpoint
    (a fresh value head); None = ``reward_model``."""


@dataclass(kw_only=True)
class PPOJob(StageJob):
    """What the PPO entry point runs: ``params:ppo`` + model/parallel + paths + lineage."""

    ppo: PPOConfig = field(default_factory=PPOConfig)
    """The stage's section, as in ``parameters_ppo.yml``."""
    paths: PPOPaths
    """Prompts, tokenizer, policy, reference, reward model, critic, run directory."""

    def validate(self, where: str = "PPOJob") -> None:
        check_rl_job("ppo", self.ppo, self.parallel, self.paths, where)
        if (self.paths.critic or self.paths.reward_model) is None:
            raise ConfigError(f"{where}: the critic needs paths.critic or paths.reward_model")
