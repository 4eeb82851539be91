"""What the launcher puts in a job's environment besides its settings: the third-party warnings every rank would print
and no user can act on, filtered out through ``PYTHONWARNINGS``."""

from __future__ import annotations

KNOWN_WARNINGS = (
    # Megatron-core 0.16 on import without Transformer Engine / Apex (their fallbacks are what we run on)
    "Transformer Engine and Apex are not installed",
    # Megatron-core's own config defaults (cuda_graph_scope) and its use of torch.distributed.checkpoint
    "full scope is deprecated",
    "`load_state_dict` is deprecated",
    "Please use DTensor instead and we are deprecating ShardedTensor",
)
"""Starts of third-party warning messages a user cannot act on, printed by every rank of every job: the launcher
puts them in the jobs' ``PYTHONWARNINGS`` (:func:`job_warning_filters`) so they never reach the console."""


def job_warning_filters(existing: str | None = None) -> str:
    """``PYTHONWARNINGS`` for a job: ignore :data:`KNOWN_WARNINGS`, after the user's own ``existing`` filters (which
    come first and so win)."""
    ours = [f"ignore:{message}" for message in KNOWN_WARNINGS]
    return ",".join([*([existing] if existing else []), *ours])
