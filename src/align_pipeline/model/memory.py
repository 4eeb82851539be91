"""Peak accelerator memory per phase of a job (train step, validation, checkpoint save), so a report can say which
phase needs the memory: CUDA keeps one peak counter, which is reset when a phase starts and read when it ends.

    with memory.phase("save"):
        checkpoint.save_training(...)
    memory.peaks_gib()  # {"train": 38.8, "eval": 21.0, "save": 20.0} (GiB; {} on CPU)

Phases must not nest (the inner one would reset the outer one's counter).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_PEAKS: dict[str, int] = {}


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Track the peak allocated memory of the enclosed code under ``name`` (max over every time it runs)."""
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        _PEAKS[name] = max(_PEAKS.get(name, 0), torch.cuda.max_memory_allocated())


def peaks_gib() -> dict[str, float]:
    """Each phase's peak in GiB (empty without CUDA)."""
    return {name: round(peak / 2**30, 3) for name, peak in _PEAKS.items()}


def overall_peak_gib() -> float | None:
    """The job's peak: the largest phase peak or the peak since the last phase began (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    return round(max([torch.cuda.max_memory_allocated(), *_PEAKS.values()]) / 2**30, 3)


__all__ = ["overall_peak_gib", "peaks_gib", "phase"]
