"""Pure RL math: KL estimators and controllers, per-token rewards, GAE, whitening, group baselines.

Tensors in, tensors out; no Megatron, no ``torch.distributed``. The token-level losses built on these (PPO policy and
value losses, REINFORCE/GRPO) live with the other losses in :mod:`align_pipeline.losses.ppo`.
"""

from align_pipeline import lazy_exports

_EXPORTS = {
    "AdaptiveKLController": "kl",
    "FixedKLController": "kl",
    "KLEstimator": "kl",
    "KL_ESTIMATORS": "kl",
    "gae": "advantages",
    "gae_over_turns": "advantages",
    "groups_without_signal": "advantages",
    "grpo_advantages": "advantages",
    "kl_k1": "kl",
    "kl_k2": "kl",
    "kl_k3": "kl",
    "kl_penalty": "kl",
    "masked_moments": "advantages",
    "moments_to_mean_var": "advantages",
    "overlong_shaping": "advantages",
    "rloo_advantages": "advantages",
    "token_rewards": "advantages",
    "whiten_with": "advantages",
}
"""Re-exported name -> the submodule that defines it (imported when the name is first read; sorted)."""

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
