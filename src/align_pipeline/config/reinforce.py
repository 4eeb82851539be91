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
    """GRPO: divide by the group std. False = no division: Dr. GRPO's advantage (Liu et al. 2025); Dr. GRPO also
    normalises the loss by a constant token budget: ``aggregation: dr_grpo``."""
    clip_eps: float = 0.2
    """Ratio clip when a rollout is used for more than one optimizer step (epochs or minibatches > 1): [1 - ε,
    1 + ε]."""
    clip_eps_high: float | None = None
    """The upper clip 1 + ``clip_eps_high`` apart from the lower one (DAPO's "clip-higher", Yu et al. 2025, e.g.
    0.28 with clip_eps 0.2); None = ``clip_eps``."""
    objective: Literal["clip", "cispo"] = "clip"
    """Multi-step form: ``clip`` = PPO's clipped surrogate; ``cispo`` = MiniMax-M1's CISPO, the importance weight
    clipped to [1 - clip_eps, 1 + clip_eps_high] and detached, every token keeping its gradient."""
    ratio_level: Literal["token", "sequence"] = "token"
    """``sequence`` = GSPO (Zheng et al. 2025): one length-normalised ratio per response, clipped as a whole."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"] = "token_mean"
    """How per-token losses become the step's loss (:func:`align_pipeline.losses.reinforce.reinforce_loss`):
    ``token_mean`` over every response token (DAPO; TRL ``dapo``), ``seq_mean_token_mean`` (per-response mean, then
    over responses: GRPO's paper; TRL ``grpo``), ``seq_mean_token_sum``, ``dr_grpo`` (sum over tokens divided by
    responses x ``generation.max_new_tokens``: Dr. GRPO's constant normaliser; TRL ``dr_grpo``)."""
    std_eps: float = 1e-6
    """GRPO with ``grpo_scale``: added to the group's std before dividing, A_i = (r_i - mean) / (std + std_eps). It
    bounds the advantages of a group whose scores barely differ (a group of equal scores gets exactly 0 anyway).
    TRL's ``GRPOTrainer`` uses 1e-4; must be > 0."""
    rollout_correction: Literal["none", "tis", "mis"] = "none"
    """The rollout engine's log-probs differ from the training forward's (other kernels): ``tis`` reweights each
    token's policy gradient by min(π_train / π_rollout, ``tis_cap``) (truncated IS), ``mis`` by that ratio inside
    [``mis_low``, ``mis_high``] and drops the tokens outside it (masked IS); ``none`` ignores the mismatch (it is
    reported either way: ``train/logprob_diff``, ``rollout/logprob_diff/*``).
    (:func:`align_pipeline.losses.reinforce.rollout_correction_weights`)"""
    tis_cap: float = 2.0
    """C of ``tis`` (TRL's vllm_importance_sampling_cap: 2)."""
    mis_low: float = 0.5
    """Lowest per-token ratio ``mis`` keeps."""
    mis_high: float = 2.0
    """Highest per-token ratio ``mis`` keeps."""

    def validate(self, where: str = "loss") -> None:
        require_range(self, where, "clip_eps", 0, 1, low_open=True, high_open=True)
        require_range(self, where, "std_eps", 0, low_open=True)
        require_range(self, where, "clip_eps_high", 0, low_open=True)
        require_range(self, where, "tis_cap", 0, low_open=True)
        require_range(self, where, "mis_low", 0, 1, low_open=True)
        require_range(self, where, "mis_high", 1)


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (Yu et al. 2025, "DAPO: an open-source LLM reinforcement learning system at scale",
    section 3.2): a group whose scores are all equal has zero advantages and so no policy gradient; it is dropped
    and more prompts are sampled until the iteration has ``rl.prompts_per_iteration`` groups with signal."""

    enabled: bool = False
    """Off by default: every group is trained on, with or without signal."""
    max_rounds: int = 4
    """Generation rounds per iteration at most, the first included. Each later round samples as many prompts as the
    first, drawn from the whole prompt set by a seeded draw of (seed, iteration, round), so a resumed run samples
    the same. When the rounds are spent with too few groups with signal, dropped groups (zero advantage) fill the
    batch: every DP rank trains on the same number of rows (``rollout/dynamic_sampling/padded_groups``)."""

    def validate(self, where: str = "dynamic_sampling") -> None:
        require_range(self, where, "max_rounds", 1)


@dataclass
class ReinforceConfig(RLConfig):
    """``params:reinforce``: RLOO / GRPO with ``generation.samples_per_prompt`` >= 2, no critic."""

    loss: ReinforceLossConfig = field(default_factory=ReinforceLossConfig)
    """Which group baseline, and the clip of the multi-step form."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO's dynamic sampling: groups without signal dropped, the batch refilled (off by default)."""

    def validate(self, where: str = "reinforce") -> None:
        super().validate(where)
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
