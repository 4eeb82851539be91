"""CPU, memory and GPU samples for MLflow, named like MLflow's own system metrics (``system/...``).

GPUs are found at run time through NVML (``pynvml`` from the ``nvidia-ml-py`` package); without a GPU, without the
driver or without the package only the CPU/memory metrics are returned. Sampling never raises.

Why not MLflow's own monitor (``mlflow.system_metrics``, checked in 3.17)? It samples on a wall-clock thread with its
own step counter, so its points do not line up with training steps; it logs straight to the server, so nothing of
it reaches ``metrics.jsonl`` (the record kept when the store is down, re-logged later); it reads every GPU of the
host, not the job's ``CUDA_VISIBLE_DEVICES``; and it has no process CPU / RSS. These samples are taken by rank 0 at
its logging steps and go through :class:`~align_pipeline.tracking.RunLogger` like every other metric.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import psutil

logger = logging.getLogger(__name__)

_MB = 1024 * 1024


def _visible_gpu_handles(pynvml: Any) -> list[tuple[int, Any]]:
    """(visible index, NVML handle) for the GPUs this process may use (honours CUDA_VISIBLE_DEVICES)."""
    count = pynvml.nvmlDeviceGetCount()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    handles = []
    for i, item in enumerate(x.strip() for x in visible.split(",") if x.strip()):
        if item.isdigit():
            if int(item) >= count:
                break
            handles.append((i, pynvml.nvmlDeviceGetHandleByIndex(int(item))))
        else:  # GPU-/MIG- UUID
            handles.append((i, pynvml.nvmlDeviceGetHandleByUUID(item)))
    return handles


class SystemMetrics:
    """Samples host and GPU utilisation. Create once per process (CPU percentages are measured between samples)."""

    def __init__(self, gpu: bool = True) -> None:
        self._proc = psutil.Process()
        psutil.cpu_percent(interval=None)  # prime: the first reading of a percentage is meaningless
        self._proc.cpu_percent(interval=None)
        self._nvml: Any = None
        self._gpus: list[tuple[int, Any]] = []
        if gpu:
            self._init_nvml()

    def _init_nvml(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._gpus = _visible_gpu_handles(pynvml)
            self._nvml = pynvml
        except Exception as exc:  # noqa: BLE001 — no package, no driver, no GPU: CPU metrics only
            logger.debug("NVML unavailable, no GPU metrics: %s", exc)
            self._nvml, self._gpus = None, []

    @property
    def gpu_count(self) -> int:
        """GPUs being sampled (0 without NVML)."""
        return len(self._gpus)

    def sample(self) -> dict[str, float]:
        """One reading: ``system/cpu_utilization_percentage``, ``system/process_rss_megabytes``, ... and per GPU
        ``system/gpu_<i>_{utilization_percentage,memory_usage_megabytes,memory_usage_percentage,power_usage_watts}``.
        """
        out: dict[str, float] = {}
        try:
            out["system/cpu_utilization_percentage"] = float(psutil.cpu_percent(interval=None))
            vm = psutil.virtual_memory()
            out["system/system_memory_usage_megabytes"] = (vm.total - vm.available) / _MB
            out["system/system_memory_usage_percentage"] = float(vm.percent)
            with self._proc.oneshot():
                out["system/process_cpu_percentage"] = float(self._proc.cpu_percent(interval=None))
                out["system/process_rss_megabytes"] = self._proc.memory_info().rss / _MB
        except (psutil.Error, OSError) as exc:
            logger.debug("psutil sample failed: %s", exc)
        nvml = self._nvml
        for i, handle in self._gpus:
            prefix = f"system/gpu_{i}_"
            for name, read in (
                ("utilization_percentage", lambda h: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)),
                ("memory_usage_megabytes", lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used / _MB),
                ("memory_usage_percentage", lambda h: _mem_percent(nvml.nvmlDeviceGetMemoryInfo(h))),
                ("power_usage_watts", lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ):
                try:
                    out[prefix + name] = read(handle)
                except Exception as exc:  # noqa: BLE001 — e.g. power not supported on this board / MIG slice
                    logger.debug("NVML %s unavailable for GPU %d: %s", name, i, exc)
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:  # noqa: BLE001
                logger.debug("nvmlShutdown failed: %s", exc)
            self._nvml, self._gpus = None, []


def _mem_percent(info: Any) -> float:
    return 100.0 * info.used / info.total if info.total else 0.0


__all__ = ["SystemMetrics"]
