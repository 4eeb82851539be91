"""Reasoning-length rollouts on one GPU: static batches against continuous batching, uniform and variable lengths.

    python benchmarks/rollout_lengths.py --out /tmp/rollout_lengths               # GPU: the shape of issue 33
    python benchmarks/rollout_lengths.py --out /tmp/rollout_lengths --shape tiny  # CPU smoke run

A random-init Llama (the Llama-3.2-1B shape: 1.24B parameters, GQA 32/8, vocab 128256) is written as an HF directory
with ``transformers`` and imported into our Megatron-core GPT (bf16, SDPA). The rollout of issue 33: 32 prompts of
random ids, lengths drawn uniformly from 64-512 tokens, 8 samples each (256 rows), up to 2,048 new tokens, T=1, the
prompts padded to multiples of 64 (``prefill_bucket``).

* **uniform**: no stop id, every response 2,048 tokens: decode tokens/s, ms per step, and the step against the HBM
  floor (the bytes a step must read - the weights, and the keys and values of every row's real columns - at the
  GPU's peak bandwidth, ``--hbm-tb-s``).
* **variable**: a set of stop ids sized so that a random-init model emits one with probability ~1/``--mean``
  per token (geometric lengths, long-tailed, capped at 2,048). Same seed, so the same samples, generated four ways:
  ``naive static``: one batch of 256 rows that all run until the longest has ended (``eos_id=None`` and
  ``max_new_tokens`` = the longest response, then cut at the first stop id: what a static batch without early exit
  per row computes); ``static batch of 256``: our engine with every row in the cache (ended rows dropped from the
  step once half have ended); ``static batches of 64``: four calls of 64 rows (a KV cache of 64 rows, as before
  continuous batching); ``continuous, 64 rows``: one call, ``kv_cache_gib`` sized to 64 rows, ended rows refilled.
  Tokens/s counts generated tokens up to and including each response's stop id; ``same`` is the share of samples
  identical to the reference generation of the same seeds (static batch of 256, resp. static batches of 64).

Each figure is the median of ``--repeats`` warm calls (after ``prepare_generation`` and one untimed call). Writes
``<out>/rollout_lengths.json`` and ``<out>/rollout_lengths.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from generation import make_hf_model, model_shape
from generation import timed as generation_timed
from sft_scaling import device_name, hbm_tb_s, versions

RUNS = {
    "1b": {"model": "1b_b64", "prompts": 32, "samples": 8, "prompt_range": (64, 512), "new": 2048, "bucket": 64,
           "slots": 64},
    "tiny": {"model": "tiny", "prompts": 4, "samples": 4, "prompt_range": (4, 12), "new": 32, "bucket": 8,
             "slots": 4},
}


def same(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of samples identical in two generations of the same seeds (bf16 GEMMs of other batch widths may round
    differently and flip a sampled token; on the CPU they are all identical)."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def timed(fn, repeats: int) -> tuple[float, Any]:
    """(median wall time of ``repeats`` calls, the last call's output): :func:`generation.timed`'s median."""
    walls, out = generation_timed(fn, repeats)
    return statistics.median(walls), out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, help="where the HF model directory is written (default: OUT)")
    parser.add_argument("--shape", default="1b", choices=list(RUNS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mean", type=float, default=400.0, help="mean response length wanted (variable lengths)")
    parser.add_argument("--hbm-tb-s", type=float, default=None,
                        help="peak HBM bandwidth in TB/s (default: H200 4.8, H100 3.35, by the device's name)")
    parser.add_argument("--uniform-only", action="store_true", help="only the uniform-length generation")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    import dataclasses
    import random

    import torch

    from align_pipeline.config import ModelConfig, ParallelConfig
    from align_pipeline.model import init
    from align_pipeline.model.decode import kv_bytes_per_row
    from align_pipeline.model.generate import generate, prepare_generation
    from align_pipeline.train.core.distributed import init_distributed

    if args.hbm_tb_s is None:
        args.hbm_tb_s = hbm_tb_s(device_name())
    run = RUNS[args.shape]
    dist = init_distributed(ParallelConfig(bf16=True), seed=0)
    shape = model_shape(run["model"])
    vocab = shape["vocab_size"]
    work = args.work or args.out
    params = make_hf_model(work / "hf", shape, seed=0)
    new, bucket, slots = run["new"], run["bucket"], run["slots"]
    rng = random.Random(1)
    lo, hi = run["prompt_range"]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(run["prompts"])]
    rows = [p for p in prompts for _ in range(run["samples"])]
    longest = -(-max(len(p) for p in rows) // bucket) * bucket
    source = init.resolve(str(work / "hf"), ModelConfig(attention_backend="sdpa"), tokenizer_vocab_size=0)
    source = dataclasses.replace(source, model=dataclasses.replace(source.model, seq_length=longest + new))
    gpt = init.build_model(source, ParallelConfig(bf16=True), dist)
    gpt.eval()
    stops = list(range(3, 3 + max(1, round(vocab / args.mean))))  # ~1/mean of a near-uniform distribution
    common = {"pad_id": 0, "vocab_size": vocab, "temperature": 1.0, "seed": 7, "prefill_bucket": bucket}

    def call(batch: list[list[int]], **kw):
        return generate(gpt, batch, **{**common, "max_new_tokens": new, "eos_id": stops, **kw})

    row_bytes = kv_bytes_per_row(gpt, longest + new)
    budget_64 = slots * row_bytes / 2**30
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "device": device_name(), "versions": versions(),
        "command": "python benchmarks/rollout_lengths.py " + " ".join(argv or sys.argv[1:]),
        "parameters": params, "rows": len(rows), "prompt_lengths": [len(p) for p in prompts], "max_new_tokens": new,
        "stop_ids": len(stops), "kv_mib_per_row": row_bytes / 2**20, "hbm_tb_s": args.hbm_tb_s, "results": {},
    }
    results = report["results"]

    def save() -> None:  # after every section: a run stopped by a time limit keeps what it measured
        (args.out / "rollout_lengths.json").write_text(json.dumps(report, indent=1))

    t = prepare_generation(gpt, batch=len(rows), length=longest + new, prompt_len=longest, vocab_size=vocab,
                           pad_id=0)
    report["setup_s"] = t["setup_s"]

    # ---- uniform lengths: every row 2,048 tokens
    call(rows[:8], eos_id=None, max_new_tokens=16)
    wall, g = timed(lambda: call(rows, eos_id=None), args.repeats)
    tokens = sum(len(x) for x in g.tokens)
    weights = sum(p.numel() * p.element_size() for p in gpt.parameters())
    real_columns = sum(len(p) for p in rows) * new + len(rows) * new * (new - 1) / 2  # summed over steps
    floor_s = (new * weights + real_columns * row_bytes / (longest + new)) / (args.hbm_tb_s * 1e12)
    results["uniform"] = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                          "ms_per_step": 1000 * wall / new, "hbm_floor_s": floor_s, "of_floor": floor_s / wall}
    save()
    if args.uniform_only:
        print(json.dumps(results["uniform"]))
        return

    # ---- variable lengths: the same samples four ways
    call(rows)  # warm
    wall, ours = timed(lambda: call(rows), args.repeats)
    lengths = [len(x) for x in ours.tokens]
    tokens = sum(lengths)
    results["static_256"] = {"wall_s": wall, "tokens_per_s": tokens / wall}
    report["lengths"] = {"mean": statistics.mean(lengths), "p50": statistics.median(lengths),
                         "p90": sorted(lengths)[int(0.9 * (len(lengths) - 1))], "max": max(lengths),
                         "clipped": sum(not e for e in ours.ended_with_eos)}
    save()

    def naive():
        g = call(rows, eos_id=None, max_new_tokens=max(lengths))
        return [t[: t.index(next(x for x in t if x in set(stops))) + 1] if set(t) & set(stops) else t
                for t in g.tokens]

    wall, cut = timed(naive, max(1, args.repeats - 2))
    results["naive_static"] = {"wall_s": wall, "tokens_per_s": sum(len(x) for x in cut) / wall,
                               "same_samples": same(cut, ours.tokens)}
    save()

    def chunks():
        out = []
        for start in range(0, len(rows), slots):
            out += call(rows[start : start + slots], seed=common["seed"] + start).tokens
        return out

    wall, chunked = timed(chunks, args.repeats)
    results["static_batches_64"] = {"wall_s": wall, "tokens_per_s": sum(len(x) for x in chunked) / wall}
    save()
    wall, cont = timed(lambda: call(rows, max_rows=slots, kv_cache_gib=budget_64 * 1.0001), args.repeats)
    results["continuous_64"] = {"wall_s": wall, "tokens_per_s": sum(len(x) for x in cont.tokens) / wall,
                                "slots": cont.slots, "refills": cont.admissions,
                                "same_samples": same(cont.tokens, chunked)}
    report["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    save()
    (args.out / "rollout_lengths.md").write_text(markdown(report))
    print(markdown(report))


def markdown(r: dict[str, Any]) -> str:
    res, lengths = r["results"], r["lengths"]
    u = res["uniform"]
    lines = [
        (f"{r['date']}, {r['device']}; `{r['command']}`; {r['parameters'] / 1e9:.2f}B parameters, {r['rows']} rows, "
         f"prompts {min(r['prompt_lengths'])}-{max(r['prompt_lengths'])} tokens, up to {r['max_new_tokens']} new; "
         f"KV cache {r['kv_mib_per_row']:.1f} MiB per row; peak {r['peak_gib'] or 0:.1f} GiB."),
        "",
        (f"Uniform lengths: {u['tokens_per_s']:,.0f} generated tokens/s, {u['ms_per_step']:.2f} ms per step; HBM "
         f"floor {1000 * u['hbm_floor_s'] / r['max_new_tokens']:.2f} ms per step (weights + real KV columns at peak "
         f"bandwidth): {100 * u['of_floor']:.0f} % of the floor."),
        "",
        (f"Variable lengths ({r['stop_ids']} stop ids): mean {lengths['mean']:.0f}, p50 {lengths['p50']:.0f}, "
         f"p90 {lengths['p90']}, max {lengths['max']}, {lengths['clipped']} clipped at the cap."),
        "",
        "| generation | wall s | generated tokens/s | vs naive static | same samples |",
        "|---|---|---|---|---|",
    ]
    n, k = r["rows"], r["results"]["continuous_64"]["slots"]
    for key, label in (("naive_static", f"naive static batch of {n} (all rows to the longest)"),
                       ("static_256", f"static batch of {n}, ended rows dropped"),
                       ("static_batches_64", f"static batches of {k} ({-(-n // k)} calls)"),
                       ("continuous_64", f"continuous batching, {k} rows, refilled")):
        row = res[key]
        same_share = f"{100 * row['same_samples']:.0f} %" if "same_samples" in row else ""
        speedup = row["tokens_per_s"] / res["naive_static"]["tokens_per_s"]
        lines.append(f"| {label} | {row['wall_s']:.2f} | {row['tokens_per_s']:,.0f} | {speedup:.2f}x | {same_share} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
