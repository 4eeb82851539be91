"""Fixtures of the train unit tests."""

from __future__ import annotations

import pytest
import torch.distributed as tdist


@pytest.fixture(scope="module")
def single_process_group():
    if not tdist.is_initialized():
        tdist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    tdist.destroy_process_group()
