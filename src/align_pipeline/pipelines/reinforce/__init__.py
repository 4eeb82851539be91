"""REINFORCE-family stage (RLOO / GRPO) on the verifiable reward and/or the reward model."""

from .pipeline import create_pipeline  # noqa: F401
