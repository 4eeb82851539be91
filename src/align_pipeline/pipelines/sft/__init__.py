"""Supervised fine-tuning stage."""

from .pipeline import create_pipeline  # noqa: F401
