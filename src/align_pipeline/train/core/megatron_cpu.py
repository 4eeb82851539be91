"""Run megatron-core on a machine without CUDA (CPU tensors, gloo process groups).

megatron-core is written for GPUs. On its CPU path (``use_cpu_initialization=True``, gloo) a handful of *kinds* of
CUDA-only call remain; this module redirects each kind to its CPU equivalent. It is the only place in the project
that does so. :func:`activate` is a no-op when CUDA is available, so GPU runs execute megatron-core unmodified.

Kinds of call redirected (call sites seen on megatron-core 0.16.1 / 0.19.2, see ``shared/notes/megatron-cpu.md``):

1. CUDA RNG: ``torch.cuda.manual_seed`` / ``get_rng_state`` / ``set_rng_state`` and megatron's own
   ``tensor_parallel.random._{get,set}_cuda_rng_state``. Without CUDA, ``torch.cuda.manual_seed`` is a *silent* no-op,
   so every tensor-parallel rank would draw from one stream. They are mapped onto the CPU default generator, which is
   the generator CPU tensors actually draw from, so ``CudaRNGStatesTracker.fork()`` really switches streams.
2. Device/stream bookkeeping: ``torch.cuda.current_device`` (-> ``"cpu"``), ``current_stream``, ``default_stream``,
   ``Stream``, ``stream``, ``Event``, ``synchronize``, ``empty_cache`` (-> inert CPU stand-ins).
3. Literal ``device="cuda"`` tensor factories (pipeline schedules, optimizer, clip_grads, grad scaler,
   dist_checkpointing): ``torch.{zeros,ones,empty,full,tensor,arange}`` get ``device="cpu"`` (and no
   ``pin_memory``) when asked for a CUDA device; ``Tensor.cuda()`` returns the tensor itself.
4. Type-name checks: ``Tensor.type()`` (no argument) reports ``torch.cuda.<T>Tensor`` for CPU tensors, so the
   optimizer's dtype dispatch and ``clip_grad_by_total_norm_fp32``'s assert accept CPU parameters.

5. Host copies of MoE token counts: the all-to-all token dispatcher hands split sizes to ``all_to_all_single`` as
   the NumPy arrays ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)`` makes of CUDA tensors; a CPU tensor
   came back as a tensor, which ``all_to_all_single`` refuses. It now becomes the same NumPy array.

6. Uneven first-dimension collectives (the MoE dispatcher with expert TP > 1): Megatron gathers and reduce-scatters
   rows of different counts per rank with ``all_gather`` / ``reduce_scatter`` over tensor lists, which gloo refuses
   (it needs equal sizes, and has no reduce-scatter). On gloo they run as an all-gather of rows padded to the longest
   then cut, and an all-reduce of the whole tensor then this rank's rows: the same values.

Not redirected: ``import triton``. megatron-core 0.19 imports it unconditionally (via the pipeline schedules), but the
pinned 0.16.x guards it with ``try/except``; a placeholder module would mislead torch's own ``has_triton()`` checks.

Set ``ALIGN_MEGATRON_CPU_TRACE=1`` to count the call sites that hit a redirection (see :func:`call_sites`).

Traps this module does not hide (handled where they occur, in ``model.checkpoint``): the torch_dist checkpoint saver
starts its results queue's manager with *spawn*, which re-imports the entry point (slow, and a deadlock without an
``if __name__ == "__main__":`` guard) — the queue is started by fork instead; and the distributed optimizer's restored
AdamW state shares one ``step`` tensor across parameters (un-shared after every restore).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
import traceback

import torch

_ACTIVE = False
_TRACE = os.environ.get("ALIGN_MEGATRON_CPU_TRACE") == "1"
_CALL_SITES: collections.Counter[str] = collections.Counter()

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int16: "torch.cuda.ShortTensor",
    torch.int8: "torch.cuda.CharTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def is_active() -> bool:
    """True when the redirections are installed (CUDA absent and :func:`activate` called)."""
    return _ACTIVE


def call_sites() -> dict[str, int]:
    """Counts of ``"<kind> from <file>:<line>"`` seen since activation (only with ALIGN_MEGATRON_CPU_TRACE=1)."""
    return dict(_CALL_SITES)


def _record(kind: str) -> None:
    if not _TRACE:
        return
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "megatron" in frame.filename:
            where = frame.filename.split("site-packages/")[-1]
            _CALL_SITES[f"{kind} from {where}:{frame.lineno}"] += 1
            return
    _CALL_SITES[f"{kind} from <non-megatron>"] += 1


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA ordinal
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _cpu_factory(fn, name: str):
    def factory(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            _record(f"torch.{name}(device='cuda')")
            kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    factory.__wrapped__ = fn
    factory.__name__ = name
    return factory


class _CpuStream:
    """Inert stand-in for ``torch.cuda.Stream``: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event or _CpuEvent()

    def query(self) -> bool:
        return True


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event`` that measures wall time."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, stream=None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _CpuEvent) -> float:
        return (end._t - self._t) * 1000.0


class _RngWarningFilter(logging.Filter):
    # With the CUDA RNG mapped onto the CPU generator, fork() sees "the CPU state" change whenever a random op runs
    # inside it; that is the intended effect here, not a bug.
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def activate() -> bool:
    """Install the CPU redirections if CUDA is absent. Idempotent. Returns whether they are active.

    Call before building any megatron-core object (import order does not matter: megatron looks these up at call time).
    """
    global _ACTIVE
    if _ACTIVE:
        return True
    if torch.cuda.is_available():
        return False

    # 1. RNG -> CPU default generator.
    def cuda_manual_seed(seed: int) -> None:
        _record("torch.cuda.manual_seed")
        torch.default_generator.manual_seed(int(seed))

    def cuda_get_rng_state(device="cuda") -> torch.Tensor:
        _record("torch.cuda.get_rng_state")
        return torch.get_rng_state()

    def cuda_set_rng_state(new_state: torch.Tensor, device="cuda") -> None:
        _record("torch.cuda.set_rng_state")
        torch.set_rng_state(new_state)

    torch.cuda.manual_seed = cuda_manual_seed
    torch.cuda.manual_seed_all = cuda_manual_seed
    torch.cuda.get_rng_state = cuda_get_rng_state
    torch.cuda.set_rng_state = cuda_set_rng_state
    torch.cuda.random.get_rng_state = cuda_get_rng_state
    torch.cuda.random.set_rng_state = cuda_set_rng_state

    from megatron.core.tensor_parallel import random as mcore_random

    def get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        _record("megatron _get_cuda_rng_state")
        return torch.get_rng_state()

    def set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        _record("megatron _set_cuda_rng_state")
        torch.set_rng_state(new_state)

    mcore_random._get_cuda_rng_state = get_cuda_rng_state
    mcore_random._set_cuda_rng_state = set_cuda_rng_state
    logging.getLogger(mcore_random.__name__).addFilter(_RngWarningFilter())

    # 2. Devices, streams, events.
    def current_device() -> str:
        _record("torch.cuda.current_device")
        return "cpu"

    torch.cuda.current_device = current_device
    torch.cuda.current_stream = lambda device=None: _CpuStream()
    torch.cuda.default_stream = lambda device=None: _CpuStream()
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = _CpuEvent
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None

    # 3. Literal device="cuda" factories and Tensor.cuda(). torch's default-device mode (``with torch.device(...)``,
    # which transformers builds models under) recognises a factory by identity in a set it caches on first use: fill
    # the cache with the real functions first, which our wrappers call, or that mode would no longer see them
    # (transformers would then leave a model's rotary buffers uninitialised).
    from torch.utils import _device

    _device._device_constructors()
    for name in ("zeros", "ones", "empty", "full", "tensor", "arange"):
        setattr(torch, name, _cpu_factory(getattr(torch, name), name))

    def tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        _record("Tensor.cuda()")
        return self

    torch.Tensor.cuda = tensor_cuda

    # 4. Type-name checks.
    original_type = torch.Tensor.type

    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            _record("Tensor.type() cuda-name")
            return _CUDA_TYPE_NAMES[self.dtype]
        return original_type(self, dtype, non_blocking, **kwargs) if dtype is not None else original_type(self)

    torch.Tensor.type = tensor_type

    # 5. MoE split sizes as NumPy arrays.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original_to_cpu = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            _record("moe maybe_move_tensor_to_cpu as_numpy")
            return tensor.numpy()
        return original_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    # 6. Uneven gathers and reduce-scatters on gloo.
    from megatron.core.tensor_parallel import mappings

    original_gather, original_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group is None or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        _record("uneven all_gather")
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group is None or group.size() == 1:
            return original_scatter(input_, group, input_split_sizes, use_global_buffer)
        _record("uneven reduce_scatter")
        total = input_.clone()
        torch.distributed.all_reduce(total, group=group)
        return list(torch.split(total, [int(n) for n in input_split_sizes], dim=0))[group.rank()].contiguous()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim

    _ACTIVE = True
    return True
