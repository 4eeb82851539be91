"""PPO stage: actor from sft_policy, critic from reward_model, frozen reference and reward model."""

from .pipeline import create_pipeline  # noqa: F401
