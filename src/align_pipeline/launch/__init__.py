"""Launching training entry points: torchrun jobs with per-rank logs, live progress and failure reports."""

from align_pipeline.launch.torchrun import (
    LaunchError,
    LaunchInterrupted,
    RunDirBusy,
    build_command,
    build_env,
    free_port,
    resolve_backend,
    run_torchrun,
    terminate_tree,
)

__all__ = [
    "LaunchError",
    "LaunchInterrupted",
    "RunDirBusy",
    "build_command",
    "build_env",
    "free_port",
    "resolve_backend",
    "run_torchrun",
    "terminate_tree",
]
