"""Shared test set-up: no telemetry, GPU tests skipped without CUDA, helpers to run torchrun jobs."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
