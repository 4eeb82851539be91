"""A kernel profile of one training step, asked for through the environment (benchmarks set it; nothing else does).

    ALIGN_PROFILE_DIR=/tmp/prof ALIGN_PROFILE_STEP=8 python -m align_pipeline.train.sft --config ...

The ``ALIGN_PROFILE_STEP``-th optimizer step (1-based, default 8: after compilation and warm-up) of every rank runs
under ``torch.profiler``; each rank writes ``rank<N>_kernels.json`` (accelerator time by kernel category - matmul,
attention, fused/generated, communication, other elementwise -, the 40 longest kernels, the step's wall time and
the share of it the GPU spent in kernels) and
``rank<N>_trace.json`` (a Chrome trace) into ``ALIGN_PROFILE_DIR``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

_CALLS = 0

# kernel-name fragments -> category (first match wins)
CATEGORIES = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "sm90_", "sm100_")),
    ("fused (generated)", ("triton",)),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, fragments in CATEGORIES:
        if any(f in low for f in fragments):
            return cat
    return "other elementwise / reductions"


def summarize(events) -> dict:
    """Accelerator-side kernel time of a profile: totals per category and the longest kernels (microseconds)."""
    per_kernel: dict[str, list[float]] = {}
    for e in events:
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        per_kernel.setdefault(e.name, []).append(e.device_time_total if hasattr(e, "device_time_total")
                                                 else e.cuda_time_total)
    total = sum(sum(v) for v in per_kernel.values())
    cats: dict[str, float] = {}
    for name, times in per_kernel.items():
        cats[category(name)] = cats.get(category(name), 0.0) + sum(times)
    top = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:40]
    return {"total_us": total, "kernels": sum(len(v) for v in per_kernel.values()),
            "categories": {k: {"us": v, "share": v / total if total else 0.0}
                           for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:160], "calls": len(t), "us": sum(t), "category": category(n)} for n, t in top]}


@contextlib.contextmanager
def maybe_profile(rank: int) -> Iterator[None]:
    """Profile this optimizer step if it is the one ``ALIGN_PROFILE_STEP`` names (see the module docstring)."""
    global _CALLS
    _CALLS += 1
    out = os.environ.get("ALIGN_PROFILE_DIR")
    if not out or _CALLS != int(os.environ.get("ALIGN_PROFILE_STEP", "8")) or not torch.cuda.is_available():
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    Path(out).mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(Path(out) / f"rank{rank}_trace.json"))
    summary = summarize(prof.events())
    # kernel time / wall time of the step (under the profiler's own overhead): well below 1 = the GPU waits on the host
    summary.update(step_wall_us=wall_us, gpu_busy_share=summary["total_us"] / wall_us if wall_us else None)
    (Path(out) / f"rank{rank}_kernels.json").write_text(json.dumps(summary, indent=1))
