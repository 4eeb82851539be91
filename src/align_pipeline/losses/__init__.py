"""Pure loss functions: ``(loss_sum, count, metric sums)``, see :mod:`align_pipeline.losses.base`."""

from align_pipeline.losses.base import LossOutput
from align_pipeline.losses.ppo import (
    entropy_bonus,
    entropy_from_logits,
    ppo_policy_loss,
    ppo_value_loss,
)
from align_pipeline.losses.preference import (
    PREFERENCE_LOSSES,
    REFERENCE_FREE_LOSSES,
    PreferenceLogps,
    PreferenceLoss,
    combine,
    dpo_loss,
    get_preference_loss,
    hinge_loss,
    ipo_loss,
    rpo_loss,
    simpo_loss,
)
from align_pipeline.losses.reinforce import reinforce_loss
from align_pipeline.losses.reward import bradley_terry_loss, regression_reward_loss
from align_pipeline.losses.sft import masked_token_loss

__all__ = [
    "PREFERENCE_LOSSES",
    "REFERENCE_FREE_LOSSES",
    "LossOutput",
    "PreferenceLogps",
    "PreferenceLoss",
    "bradley_terry_loss",
    "combine",
    "dpo_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "get_preference_loss",
    "hinge_loss",
    "ipo_loss",
    "masked_token_loss",
    "ppo_policy_loss",
    "ppo_value_loss",
    "regression_reward_loss",
    "reinforce_loss",
    "rpo_loss",
    "simpo_loss",
]
