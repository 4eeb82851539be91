"""Evaluation stage: every policy vs sft_policy on held-out prompts."""

from .pipeline import create_pipeline  # noqa: F401
