"""What the launcher puts in a job's environment besides its settings: the third-party warnings every rank would print
and no user can act on, filtered out through ``PYTHONWARNINGS``."""

from __future__ import annotations

import os
from typing import Any

KNOWN_WARNINGS = (
    # Megatron-core 0.16 on import without Transformer Engine / Apex (their fallbacks are what we run on)
    "Transformer Engine and Apex are not installed",
    # Megatron-core's own config defaults (cuda_graph_scope) and its use of torch.distributed.checkpoint
    "full scope is deprecated",
    "`load_state_dict` is deprecated",
    "Please use DTensor instead and we are deprecating ShardedTensor",
    # With data parallelism and the distributed optimizer, at every step: torch 2.11+ deprecates the collectives
    # megatron-core 0.16 calls (renamed *_single) ...
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    # ... and its zero_grad reads .grad of the optimizer's fp32 shard *views* of the parameters, non-leaf by
    # construction (megatron marks the line "throws grad-access warning"; it trains with the grad buffers): only
    # from that module, so a .grad read of a non-leaf anywhere else still shows
    ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed:UserWarning:"
     "megatron.core.optimizer.optimizer"),
)
"""Starts of third-party warning messages a user cannot act on, printed by every rank of every job (``message``, or
``message:category:module`` where the filter must be narrower): the launcher puts them in the jobs'
``PYTHONWARNINGS`` (:func:`job_warning_filters`) so they never reach the console."""


def parallel_env(config: Any) -> dict[str, str]:
    """Settings a job's parallel layout asks for: with tensor parallelism, ``CUDA_DEVICE_MAX_CONNECTIONS=1`` as
    Megatron advises (one CUDA work queue keeps its TP communication and compute in issue order so they overlap; its
    TP layers warn on every rank without it), unless the user's environment sets it."""
    parallel = config.get("parallel") if isinstance(config, dict) else None
    tp = int((parallel if isinstance(parallel, dict) else {}).get("tensor_model_parallel_size") or 1)
    if tp > 1 and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def job_warning_filters(existing: str | None = None) -> str:
    """``PYTHONWARNINGS`` for a job: ignore :data:`KNOWN_WARNINGS`, after the user's own ``existing`` filters (which
    come first and so win)."""
    ours = [f"ignore:{message}" for message in KNOWN_WARNINGS]
    return ",".join([*([existing] if existing else []), *ours])
