"""Pure loss functions: ``(loss_sum, count, metric sums)``, see :mod:`align_pipeline.losses.base`."""

from align_pipeline import lazy_exports

_EXPORTS = {
    "LossOutput": "base",
    "PREFERENCE_LOSSES": "preference",
    "PreferenceLogps": "preference",
    "PreferenceLoss": "preference",
    "REFERENCE_FREE_LOSSES": "preference",
    "bradley_terry_loss": "reward",
    "combine": "preference",
    "distill_loss": "distill",
    "dpo_loss": "preference",
    "entropy_bonus": "ppo",
    "entropy_from_logits": "ppo",
    "get_preference_loss": "preference",
    "hinge_loss": "preference",
    "ipo_loss": "preference",
    "masked_token_loss": "sft",
    "ppo_policy_loss": "ppo",
    "ppo_value_loss": "ppo",
    "regression_reward_loss": "reward",
    "reinforce_loss": "reinforce",
    "rpo_loss": "preference",
    "simpo_loss": "preference",
}
"""Re-exported name -> the submodule that defines it (imported when the name is first read; sorted)."""

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
