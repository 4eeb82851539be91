"""Process-group set-up for the torchrun entry points: the one place that reads Megatron's ``parallel_state``.

Everything downstream receives a :class:`Dist` and passes its process groups explicitly.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as tdist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection

from align_pipeline.config.checks import Names, check_world
from align_pipeline.config.common import ParallelConfig
from align_pipeline.train.core import megatron_cpu


@dataclass
class Dist:
    """Ranks, sizes and process groups of this process."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    pgs: ProcessGroupCollection
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_logging_rank(self) -> bool:
        """Rank 0 alone logs."""
        return self.rank == 0

    def describe(self) -> str:
        """``world=4 tp=2 pp=1 dp=2 backend=gloo`` for a job's first log line."""
        ep = f" ep={self.ep_size}" if self.ep_size > 1 else ""
        return (f"world={self.world_size} tp={self.tp_size} pp={self.pp_size} dp={self.dp_size}{ep} "
                f"backend={self.backend}")


def init_distributed(parallel: ParallelConfig, seed: int) -> Dist:
    """Initialise torch.distributed from torchrun's environment (or as a single process) and Megatron's groups.

    Backend: ``ALIGN_BACKEND`` (set by the launcher) or nccl with CUDA, gloo without. Seeds Python, NumPy, torch and
    Megatron's model-parallel RNG tracker (TP ranks get distinct streams for dropout in TP regions).
    """
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = None
    if "MASTER_PORT" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1":  # one process, no launcher
        store = tdist.TCPStore(os.environ["MASTER_ADDR"], 0, 1, True, wait_for_workers=False)  # kernel-picked port
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = os.environ.get("ALIGN_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        megatron_cpu.activate()
    if not tdist.is_initialized():  # NCCL bound to this rank's GPU (without, every barrier warns that it guesses)
        tdist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30),
                                 device_id=device if backend == "nccl" else None,
                                 **({"store": store, "rank": 0, "world_size": 1} if store is not None else {}))
    world = tdist.get_world_size()
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    check_world(parallel, world, Names(parallel="parallel", world=f"the job's world size {world}"))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, create_gloo_process_groups=True,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        )
    seed_everything(seed)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    return Dist(
        rank=tdist.get_rank(),
        world_size=world,
        local_rank=local_rank,
        device=device,
        backend=backend,
        pgs=pgs,
        tp_rank=pgs.tp.rank(),
        tp_size=pgs.tp.size(),
        pp_rank=pgs.pp.rank(),
        pp_size=pgs.pp.size(),
        dp_rank=pgs.dp.rank(),
        dp_size=pgs.dp.size(),
        ep_rank=pgs.ep.rank(),
        ep_size=pgs.ep.size(),
    )


def seed_everything(seed: int) -> None:
    """Same seed on every rank for Python/NumPy/torch; Megatron's tracker derives the per-TP-rank streams."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if tdist.is_initialized():
        tdist.destroy_process_group()

