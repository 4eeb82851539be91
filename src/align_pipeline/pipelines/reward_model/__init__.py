"""Reward-model stage."""

from .pipeline import create_pipeline  # noqa: F401
