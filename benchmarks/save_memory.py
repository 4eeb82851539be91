"""Accelerator memory of a training step vs. of saving a checkpoint, and where the save's extra memory goes.

    python benchmarks/save_memory.py --preset 1b --out /tmp/save_memory [--distributed-optimizer]

One process (NCCL on a GPU, gloo + fp32 on CPU): a Llama-style model of ``--preset`` (the shapes of
``benchmarks/sft_scaling.py``) in Megatron DDP with its bf16 AdamW, ``--steps`` SFT steps on random tokens through the
project's own ``train_step``, then the project's resumable training checkpoint (``model.checkpoint.save_training``)
and model export (``save_model``). For each phase: peak allocated memory (``torch.cuda.max_memory_allocated``, reset
between phases) and the extra over what was allocated when the phase began. With ``--trace``, CUDA's allocator
history is recorded during the first save and the allocations live at its peak are grouped by the innermost frame of
the code that made them (``<out>/save_trace.txt``). Writes ``<out>/save_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sft_scaling import PRESETS


def _gib(n: float) -> float:
    return round(n / 2**30, 3)


def _top_allocations(snapshot: dict, start_index: int, limit: int = 15) -> list[str]:
    """Allocations made after event ``start_index`` and live at the peak, summed by their first frame of interest."""
    events = snapshot["device_traces"][0][start_index:]
    live: dict[int, tuple[int, list]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, list]] = {}
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] in ("free_requested",) and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    groups: dict[str, int] = defaultdict(int)
    for size, frames in at_peak.values():
        where = next((f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in frames
                      if f["filename"].endswith(".py") and "torch/cuda/memory" not in f["filename"]
                      and "torch/utils/_contextlib" not in f["filename"]), "?")  # fmt: skip
        groups[where] += size
    lines = [f"peak of allocations made during the save: {_gib(peak)} GiB"]
    lines += [f"{_gib(size):8.3f} GiB  {where}" for where, size in sorted(groups.items(), key=lambda kv: -kv[1])]
    return lines[: limit + 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    from align_pipeline.config import ModelConfig, OptimizerConfig, ParallelConfig
    from align_pipeline.model import checkpoint, init
    from align_pipeline.train.core.distributed import init_distributed
    from align_pipeline.train.core.optimizer import build_trainable, train_step
    from align_pipeline.train.sft import METRICS, sft_loss

    cuda = torch.cuda.is_available()
    shape = PRESETS[args.preset]
    model = ModelConfig(num_layers=shape["num_hidden_layers"], hidden_size=shape["hidden_size"],
                        num_attention_heads=shape["num_attention_heads"],
                        num_query_groups=shape["num_key_value_heads"], ffn_hidden_size=shape["intermediate_size"],
                        seq_length=shape["seq_length"], vocab_size=shape["vocab_size"])  # fmt: skip
    parallel = ParallelConfig(bf16=cuda, use_distributed_optimizer=args.distributed_optimizer)
    dist = init_distributed(parallel, seed=0)
    t = build_trainable(init.resolve(None, model, shape["vocab_size"]), parallel, OptimizerConfig(), 10, dist)
    loss = sft_loss(shape["vocab_size"], dist.tp_rank)
    g = torch.Generator().manual_seed(0)
    shape_bs = (args.micro_batch, shape["seq_length"])
    batch = {"input_ids": torch.randint(0, shape["vocab_size"], shape_bs, generator=g),
             "labels": torch.randint(0, shape["vocab_size"], shape_bs, generator=g),
             "loss_mask": torch.ones(shape_bs)}  # fmt: skip
    batch = {k: v.to(dist.device) for k, v in batch.items()}

    def peak() -> float:
        return torch.cuda.max_memory_allocated() if cuda else 0.0

    def allocated() -> float:
        return torch.cuda.memory_allocated() if cuda else 0.0

    def reset() -> None:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    phases: dict[str, dict] = {}

    def phase(name: str, fn) -> None:
        reset()
        before, start = allocated(), time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        phases[name] = {"seconds": round(time.perf_counter() - start, 2), "allocated_before_gib": _gib(before),
                        "peak_gib": _gib(peak()), "extra_gib": _gib(peak() - before),
                        "allocated_after_gib": _gib(allocated())}  # fmt: skip
        print(name, phases[name], flush=True)

    for _ in range(args.steps):
        phase("train_step", lambda: train_step(t, [batch], loss, METRICS, dist, shape["seq_length"]))

    trace_index = 0
    if args.trace and cuda:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        trace_index = len(torch.cuda.memory._snapshot()["device_traces"][0])
    run_dir = args.out / "run"
    phase("save_training", lambda: checkpoint.save_training(run_dir, 1, t.model, t.optimizer, t.scheduler, {}, {}))
    if args.trace and cuda:
        lines = _top_allocations(torch.cuda.memory._snapshot(), trace_index)
        torch.cuda.memory._record_memory_history(enabled=None)
        (args.out / "save_trace.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    phase("save_training_again", lambda: checkpoint.save_training(run_dir, 2, t.model, t.optimizer, t.scheduler,
                                                                  {}, {}))  # fmt: skip
    phase("save_model", lambda: checkpoint.save_model(args.out / "model", t.model, {"stage": "bench"}))
    phase("train_step_after_save", lambda: train_step(t, [batch], loss, METRICS, dist, shape["seq_length"]))
    report = {"preset": args.preset, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "distributed_optimizer": args.distributed_optimizer, "phases": phases}  # fmt: skip
    (args.out / "save_memory.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
