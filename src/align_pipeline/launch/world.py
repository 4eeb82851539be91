"""How many processes a launch makes and which process-group backend they use: the one place that resolves
``launch.nproc_per_node: gpus`` and ``launch.dist_backend: auto``. The parameters hook (before any node runs) and the
launcher (before each job) both call it, so both apply the same rule and raise the same :class:`ConfigError`.

Nothing here imports torch: the Kedro process stays free of it (``auto`` is decided by each rank on its own node,
``train/core/distributed.py``: nccl where it sees CUDA, else gloo).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Callable

from align_pipeline.config.base import ConfigError
from align_pipeline.config.common import LaunchConfig


def visible_gpus() -> int:
    """GPUs this process may use, without importing torch: ``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi -L``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


def processes_per_node(launch: LaunchConfig, gpus: Callable[[], int] | None = None,
                       key: str = "params:launch") -> tuple[int, str]:
    """(processes per node, how it is made) of ``launch``. ``nproc_per_node: gpus`` is the job's nodes' GPUs: under
    Slurm ``slurm.gpus_per_node`` (the login machine's GPUs say nothing), else ``gpus()`` (default
    :func:`visible_gpus`) of this machine; none is a :class:`ConfigError` naming ``key``."""
    nproc = launch.nproc_per_node
    if nproc != "gpus":
        return nproc, f"{key}.nproc_per_node={nproc}"
    if launch.backend == "slurm":
        if not launch.slurm.gpus_per_node:
            raise ConfigError(f"{key}.nproc_per_node=gpus with backend slurm needs {key}.slurm.gpus_per_node")
        nproc = launch.slurm.gpus_per_node
        return nproc, f"{key}.nproc_per_node=gpus ({key}.slurm.gpus_per_node={nproc})"
    nproc = (gpus or visible_gpus)()
    if nproc < 1:
        raise ConfigError(f"{key}.nproc_per_node=gpus but no GPU is visible (CUDA_VISIBLE_DEVICES / nvidia-smi)")
    return nproc, f"{key}.nproc_per_node=gpus ({nproc} visible)"


def world_size(launch: LaunchConfig, gpus: Callable[[], int] | None = None,
               key: str = "params:launch") -> tuple[int, str]:
    """(world size, how it is made): processes per node (:func:`processes_per_node`) x ``nnodes``."""
    nproc, per_node = processes_per_node(launch, gpus, key)
    world = nproc * launch.nnodes
    return world, f"{per_node} x {key}.nnodes={launch.nnodes} (world size {world})"


def resolved(launch: LaunchConfig, gpus: Callable[[], int] | None = None) -> LaunchConfig:
    """``launch`` with ``nproc_per_node`` a number (:func:`processes_per_node`)."""
    nproc, _ = processes_per_node(launch, gpus, "launch")
    return dataclasses.replace(launch, nproc_per_node=nproc)


def job_backend(dist_backend: str) -> str | None:
    """The process-group backend the launcher sets for its ranks (``ALIGN_BACKEND``): ``nccl`` / ``gloo`` as asked;
    None for ``auto``, which each rank decides on its node."""
    if dist_backend in ("nccl", "gloo"):
        return dist_backend
    if dist_backend != "auto":
        raise ConfigError(f"launch.dist_backend must be auto, nccl or gloo, got {dist_backend!r}")
    return None
