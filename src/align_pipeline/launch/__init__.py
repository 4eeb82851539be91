"""Launching training entry points: torchrun jobs with per-rank logs, live progress and failure reports."""

from align_pipeline import lazy_exports

_EXPORTS = {
    "LaunchError": "torchrun",
    "LaunchInterrupted": "torchrun",
    "RunDirBusy": "torchrun",
    "build_command": "torchrun",
    "build_env": "torchrun",
    "free_port": "torchrun",
    "run_torchrun": "torchrun",
    "terminate_tree": "torchrun",
}
"""Re-exported name -> the submodule that defines it (imported when the name is first read; sorted)."""

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
