"""Hyper-parameter guards shared by the pure loss and RL modules (no torch, no Megatron)."""

from __future__ import annotations

import math


def check_positive(name: str, value: float) -> None:
    """Hyper-parameter guard shared by the loss and RL modules: finite and > 0."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


def check_nonnegative(name: str, value: float) -> None:
    """Hyper-parameter guard: finite and >= 0."""
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
