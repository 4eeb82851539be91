"""A one-rank CPU `Dist` for the train unit tests (the one-process gloo group is a fixture in conftest.py)."""

from __future__ import annotations

import types

import torch

from align_pipeline.train.core.distributed import Dist


def dist(dp_rank: int = 0, dp_size: int = 1) -> Dist:
    return Dist(rank=dp_rank, world_size=dp_size, local_rank=0, device=torch.device("cpu"), backend="gloo",
                pgs=types.SimpleNamespace(dp=None, tp=None), tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                dp_rank=dp_rank, dp_size=dp_size)
