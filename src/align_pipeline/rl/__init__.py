"""Pure RL math: KL estimators and controllers, per-token rewards, GAE, whitening, group baselines.

Tensors in, tensors out; no Megatron, no ``torch.distributed``. The token-level losses built on these (PPO policy and
value losses, REINFORCE/GRPO) live with the other losses in :mod:`align_pipeline.losses.ppo`.
"""

from align_pipeline.rl.advantages import (
    gae,
    groups_without_signal,
    grpo_advantages,
    masked_moments,
    moments_to_mean_var,
    rloo_advantages,
    token_rewards,
    whiten_with,
)
from align_pipeline.rl.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
)

__all__ = [
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLEstimator",
    "gae",
    "groups_without_signal",
    "grpo_advantages",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "masked_moments",
    "moments_to_mean_var",
    "rloo_advantages",
    "token_rewards",
    "whiten_with",
]
