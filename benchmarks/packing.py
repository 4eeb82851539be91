"""Packing benchmark: non-padding tokens/s of the SFT stage, packed vs padded vs dense rows, same model and steps.

    python benchmarks/packing.py --preset 1b_4k --steps 16 --warmup 4 --layouts dense packed packed_varlen --out /tmp/pk

Both runs are real torchrun jobs of the SFT entry point (``align_pipeline.train.sft``) through the project's launcher
(NCCL + bf16 on a GPU, gloo + fp32 on CPU), from one random HF Llama checkpoint written here with ``transformers``, on
one tokenized SFT file in the project's ragged format. They differ in ``sft.packing`` only: padded rows hold one
sample each, packed rows as many as fit (attention restricted to each sample: FlexAttention on the GPU without
Transformer Engine). Each step trains on ``--global-batch`` rows of ``seq_length`` tokens.

* Sample lengths (prompt + response): log-normal with median ``--median`` tokens and sigma ``--sigma``, clipped to
  [16, seq_length]; the first 30 % of each sample is the prompt (no loss). With the defaults (median 512, sigma 1.0:
  mean ~ 840 tokens, 10 % of samples over 1,850 tokens) the shape follows the heavy-tailed lengths of multi-turn chat
  SFT sets such as ShareGPT / UltraChat in Llama-3 tokens. Tokens are drawn from a Zipf-like unigram.
* Non-padding tokens/s: the trainer's per-step ``step_tokens`` (real tokens of the global batch) over its per-step
  wall times, for the steps after ``--warmup`` (the first steps include compilation).
* ``--layouts``: ``padded`` (the chat lengths, one sample a row), ``packed`` (the chat lengths packed; on a GPU the
  packed attention is FlexAttention with a block mask), ``packed_varlen`` (the same with
  ``ALIGN_PACKED_ATTENTION=varlen``: PyTorch's variable-length FlashAttention), ``dense`` (every sample exactly
  ``seq_length`` tokens: the dense path's tokens/s per real token, what packing is measured against).

Writes ``<out>/packing.json`` and ``<out>/packing.md`` (the docs/benchmarks.md section).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sft_scaling import PRESETS, header_lines, make_hf_init, run_header

PRESETS = {**PRESETS, "1b_4k": {**PRESETS["1b"], "seq_length": 4096}, "tiny_256": {**PRESETS["tiny"], "seq_length": 256}}


def chat_lengths(n: int, median: float, sigma: float, seq_length: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, size=n)), 16, seq_length).astype(np.int64)


def make_chat_data(out: Path, preset: dict[str, int], n: int, args: argparse.Namespace,
                   dense: bool = False) -> dict[str, Any]:
    """Tokenizer dir + train/val npz (ragged, with sidecars) of synthetic samples of chat-like lengths (``dense``:
    every sample ``seq_length`` tokens)."""
    from align_pipeline.data.formats import save_npz
    from align_pipeline.data.store import ragged
    from align_pipeline.data.tokenizer import TokenizerConfig, build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(TokenizerConfig(), ["chat"]).save(out / "tokenizer")  # only its directory is needed
    vocab, S = preset["vocab_size"], preset["seq_length"]
    zipf = 1.0 / np.arange(1, vocab - 3) ** 1.1
    zipf /= zipf.sum()
    rng = np.random.default_rng(args.seed)
    paths: dict[str, Any] = {"tokenizer": str(out / "tokenizer")}
    for split, rows in (("train", n), ("val", 64)):
        lengths = chat_lengths(rows, args.median, args.sigma, S, args.seed + (split == "val"))
        if dense:
            lengths = np.full(rows, S, dtype=np.int64)
        samples = []
        for L in lengths:
            ids = [1] + (4 + rng.choice(vocab - 4, size=int(L) - 1, p=zipf)).tolist()
            prompt = max(1, int(0.3 * L))
            samples.append((ids, [False] * prompt + [True] * (int(L) - prompt)))
        meta = {"kind": "sft", "split": split, "num_samples": rows, "seq_length": S, "pad_id": 0,
                "tokenizer_fingerprint": "synthetic"}
        save_npz(out / f"{split}.npz", ragged(samples), meta)
        paths[split] = str(out / f"{split}.npz")
        if split == "train":
            paths["lengths"] = {"mean": float(lengths.mean()), "median": float(np.median(lengths)),
                                "p90": float(np.percentile(lengths, 90)), "max": int(lengths.max()),
                                "padding_share": float(1 - lengths.mean() / S)}
    return paths


def sft_job(packing: bool, args: argparse.Namespace, data: dict[str, Any], hf_dir: str, run_dir: Path, bf16: bool):
    from align_pipeline.config import (
        ModelConfig,
        OptimizerConfig,
        ParallelConfig,
        SFTConfig,
        SFTJob,
        TrainingConfig,
        TrainPaths,
    )

    training = TrainingConfig(
        seed=args.seed, train_steps=args.steps, global_batch_size=args.global_batch,
        micro_batch_size=args.micro_batch, log_interval=max(args.steps // 4, 1), eval_interval=0, eval_samples=16,
        save_interval=0, keep_checkpoints=1,
        optimizer=OptimizerConfig(lr=args.lr, min_lr=args.lr / 10, warmup_steps=max(args.steps // 5, 1)))
    model = ModelConfig(seq_length=PRESETS[args.preset]["seq_length"], attention_backend="sdpa")
    paths = TrainPaths(run_dir=str(run_dir), train_data=data["train"], val_data=data["val"],
                       tokenizer=data["tokenizer"], init_from=hf_dir)
    return SFTJob(sft=SFTConfig(training=training, packing=packing), model=model,
                  parallel=ParallelConfig(bf16=bf16), paths=paths)


def steady(result: dict[str, Any], warmup: int) -> dict[str, float]:
    steps = result["history"][warmup:]
    if not steps:
        raise SystemExit(f"--warmup {warmup} leaves no steps to time; raise --steps")
    seconds = sum(h["step_time_s"] for h in steps)
    return {"tokens_per_s": sum(h["step_tokens"] for h in steps) / seconds, "step_time_s": seconds / len(steps),
            "tokens_per_step": sum(h["step_tokens"] for h in steps) / len(steps)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from align_pipeline.config import LaunchConfig, to_dict
    from align_pipeline.launch import run_torchrun

    out = Path(args.out).resolve()
    on_gpu = torch.cuda.is_available()
    bf16 = on_gpu and not args.fp32
    preset = PRESETS[args.preset]
    n = max(args.global_batch * args.steps * 8, 512)  # packed rows hold several samples: enough for every step
    data = make_chat_data(out / "data", preset, n, args)
    dense = (make_chat_data(out / "data_dense", preset, args.global_batch * (args.steps + 1), args, dense=True)
             if "dense" in args.layouts else None)
    hf_dir, params = make_hf_init(out / "hf_init", preset, args.seed)
    print(f"[packing] preset {args.preset}: {params / 1e6:.1f}M parameters, seq {preset['seq_length']}, "
          f"lengths {data['lengths']}", flush=True)
    rows = []
    for name in args.layouts:
        run_dir = out / "runs" / name
        run_dir.mkdir(parents=True, exist_ok=True)
        job = sft_job(name.startswith("packed"), args, dense if name == "dense" else data, hf_dir, run_dir, bf16)
        env = {"ALIGN_PACKED_ATTENTION": "varlen" if name == "packed_varlen" else "flex"}
        result = run_torchrun("align_pipeline.train.sft", to_dict(job), LaunchConfig(nproc_per_node=1), run_dir,
                              name=f"sft {name}", env=env)
        row = {"layout": name, **steady(result, args.warmup), "peak_memory_gib": result.get("peak_memory_gib"),
               "losses": [h["loss"] for h in result["history"]], "val_loss": result["val_loss"]}
        rows.append(row)
        print(f"[packing] {name}: {row['tokens_per_s']:,.0f} non-padding tokens/s, {row['step_time_s']:.3f} s/step, "
              f"{row['tokens_per_step']:,.0f} tokens/step, val loss {row['val_loss']:.4f}", flush=True)
    by = {r["layout"]: r["tokens_per_s"] for r in rows}
    ratios = {f"{a}/{b}": by[a] / by[b] for a in ("packed", "packed_varlen") for b in ("dense", "padded", "packed")
              if a in by and b in by and a != b}
    report = {**run_header(), "preset": args.preset, "parameters": params,
              "precision": "bf16" if bf16 else "fp32", "settings": vars(args), "lengths": data["lengths"],
              "rows": rows, "ratios": ratios}
    (out / "packing.json").write_text(json.dumps(report, indent=2))
    (out / "packing.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    return report


def markdown(report: dict[str, Any]) -> str:
    s, L = report["settings"], report["lengths"]
    lines = [
        *header_lines(report),
        (f"Model: preset `{report['preset']}`, {report['parameters'] / 1e6:.1f}M parameters, seq "
         f"{PRESETS[report['preset']]['seq_length']}, {report['precision']}, SDPA attention (no Transformer Engine), "
         f"global batch {s['global_batch']} rows, micro-batch {s['micro_batch']} rows, {s['steps']} steps (timed: "
         f"steps {s['warmup'] + 1}-{s['steps']})  "),
        (f"Sample lengths: log-normal, median {s['median']}, sigma {s['sigma']}, clipped to [16, seq]: mean "
         f"{L['mean']:.0f}, median {L['median']:.0f}, p90 {L['p90']:.0f}, max {L['max']} tokens; padded rows are "
         f"{100 * L['padding_share']:.0f} % padding (dense rows: every sample {PRESETS[report['preset']]['seq_length']} "
         "tokens)"),
        "",
        "| rows | non-padding tokens/s | s/step | non-padding tokens/step | peak GiB | loss first -> last | val loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        mem = f"{r['peak_memory_gib']:.1f}" if r.get("peak_memory_gib") is not None else "-"
        lines.append(f"| {r['layout']} | {r['tokens_per_s']:,.0f} | {r['step_time_s']:.3f} | "
                     f"{r['tokens_per_step']:,.0f} | {mem} | {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} | "
                     f"{r['val_loss']:.4f} |")
    lines.append("")
    for name, ratio in report["ratios"].items():
        lines.append(f"- {name} non-padding tokens/s: **{ratio:.2f}x**")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b_4k")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of tokens/s")
    p.add_argument("--global-batch", type=int, default=16, help="rows of seq_length tokens per step")
    p.add_argument("--micro-batch", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--median", type=float, default=512.0, help="median sample length (tokens)")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the sample lengths")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fp32", action="store_true", help="fp32 on GPUs too (bf16 is the GPU default)")
    p.add_argument("--layouts", nargs="+", choices=["padded", "packed", "packed_varlen", "dense"],
                   default=["padded", "packed"], help="the runs, in this order (see the module docstring)")
    p.add_argument("--out", required=True, help="working directory: data, HF init, runs, packing.json/.md")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
    run(parse_args())
