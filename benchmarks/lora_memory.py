"""Peak GPU memory and speed of SFT and DPO with LoRA against full fine-tuning, on one GPU, in one run.

    python benchmarks/lora_memory.py --shapes 1b 8b --out /tmp/lora_mem

Every row is a real torchrun job of our stage entry point (``align_pipeline.train.sft`` / ``.dpo``), bf16 with fp32
main weights, random-initialised from the shape (no HF directory: the 8B shape would take minutes to write), the
fused kernels (``parallel.kernels: auto``):

* SFT: full fine-tuning vs ``sft.lora.rank`` adapters on all four linears, the copy task of
  ``benchmarks/sft_scaling.py`` (``--sft-seq`` tokens per row).
* DPO: full fine-tuning with the reference as a separate frozen model in memory (``dpo.reference: online`` without
  LoRA: what TRL does by default) vs LoRA with the reference being the policy with its adapters off (``dpo.reference:
  online`` with LoRA: no second copy), and full fine-tuning with cached reference log-probs (our default; the
  reference pass is a separate job, not counted), on the synthetic pairs of ``benchmarks/dpo_vs_trl.py``.

Peak memory is the job's training-step peak (``torch.cuda.max_memory_allocated`` per phase, reported by the job);
tokens/s over the steps after ``--warmup``. A job that runs out of memory is reported as such (the 8B shape does not
fit full fine-tuning with fp32 main weights and Adam on one H200: ~18 bytes per parameter).

Writes ``<out>/lora_memory.json`` and ``<out>/lora_memory.md`` (the section for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dpo_vs_trl import make_pref_data
from sft_scaling import header_lines, make_copy_data, run_header, write_report

SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
             "ffn_hidden_size": 128, "vocab_size": 512},
    "1b": {"num_layers": 24, "hidden_size": 2048, "num_attention_heads": 32, "num_query_groups": 4,
           "ffn_hidden_size": 5632, "vocab_size": 32000},
    "8b": {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
           "ffn_hidden_size": 14336, "vocab_size": 32000},
}
"""Llama shapes (GQA, SwiGLU, RoPE, RMSNorm): a 1.2B one (the kernels benchmark's) and Llama-3-8B's (vocab 32k)."""


def parameters(shape: dict[str, int]) -> int:
    h, f, v, n = shape["hidden_size"], shape["ffn_hidden_size"], shape["vocab_size"], shape["num_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_query_groups"]
    return n * (h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h) + 2 * v * h + h


def model_config(shape: dict[str, int], seq: int):
    from align_pipeline.config import ModelConfig

    return ModelConfig(seq_length=seq, **shape)


def training(args: argparse.Namespace, micro: int, global_batch: int):
    from align_pipeline.config import OptimizerConfig, TrainingConfig

    return TrainingConfig(seed=args.seed, train_steps=args.steps, global_batch_size=global_batch,
                          micro_batch_size=micro, log_interval=max(args.steps // 4, 1), eval_interval=0,
                          eval_samples=8, save_interval=0, keep_checkpoints=1,
                          optimizer=OptimizerConfig(lr=1e-5, min_lr=1e-5, warmup_steps=0))


def lora(rank: int):
    from align_pipeline.config import LoRAConfig

    return LoRAConfig(rank=rank, alpha=2.0 * rank) if rank else LoRAConfig()


def run_job(module: str, job, run_dir: Path) -> dict[str, Any]:
    from align_pipeline.config import LaunchConfig, to_dict
    from align_pipeline.launch import run_torchrun

    run_dir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    try:
        result = run_torchrun(module, to_dict(job), LaunchConfig(nproc_per_node=1), run_dir, name=run_dir.name)
    except Exception as exc:  # noqa: BLE001 - a row that failed (out of memory) is a result
        text = str(exc)
        oom = "out of memory" in text.lower() or "OutOfMemoryError" in text
        lines = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln] or text.splitlines()[:1]
        return {"error": "out of memory" if oom else lines[0][:200], "wall_s": time.perf_counter() - t}
    finally:
        # training checkpoints (fp32 optimizer states: 16 bytes a parameter) are not needed: keep the disk free
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {**result, "wall_s": time.perf_counter() - t}


def summarize(name: str, shape: str, stage: str, result: dict[str, Any], warmup: int) -> dict[str, Any]:
    row = {"row": name, "shape": shape, "stage": stage}
    if "error" in result:
        return {**row, "error": result["error"]}
    history = result["history"][warmup:]
    seconds = sum(h["step_time_s"] for h in history)
    tokens = sum(h["step_tokens"] for h in history)
    phases = result.get("peak_memory_by_phase_gib") or {}
    return {**row, "tokens_per_s": tokens / seconds if seconds else None, "s_per_step": seconds / len(history),
            "peak_train_gib": phases.get("train"), "peak_overall_gib": result.get("peak_memory_gib"),
            "loss_first_last": [result["history"][0]["loss"], result["history"][-1]["loss"]]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from align_pipeline.config import (
        DPOConfig,
        DPOJob,
        DPOPaths,
        ParallelConfig,
        PreferenceLossConfig,
        SFTConfig,
        SFTJob,
        TrainPaths,
    )

    out = Path(args.out).resolve()
    report = {**run_header(), "settings": vars(args), "rows": []}
    parallel = ParallelConfig(bf16=not args.fp32)
    for name in args.shapes:
        shape = SHAPES[name]
        report.setdefault("parameters", {})[name] = parameters(shape)
        sft_data = make_copy_data(out / "data" / f"sft_{shape['vocab_size']}", shape["vocab_size"], args.sft_seq,
                                  n=args.sft_global * (args.steps + 1), seed=args.seed)
        pref = make_pref_data(out / "data" / f"pref_{shape['vocab_size']}", shape["vocab_size"], args.prompt_len,
                              args.dpo_seq, args.dpo_global * (args.steps + 1), 8, args.seed)
        sft_rows = [("full", 0)] + [(f"lora r{args.rank}", args.rank)]
        for label, rank in sft_rows:
            if name in args.skip_full and not rank:
                continue
            run_dir = out / "runs" / f"{name}-sft-{rank}"
            job = SFTJob(sft=SFTConfig(training=training(args, args.sft_micro, args.sft_global), lora=lora(rank)),
                         model=model_config(shape, args.sft_seq), parallel=parallel,
                         paths=TrainPaths(run_dir=str(run_dir), train_data=sft_data["train"],
                                          val_data=sft_data["val"], tokenizer=sft_data["tokenizer"]))
            print(f"[lora_memory] {name} SFT {label} ...", flush=True)
            report["rows"].append(summarize(f"SFT {label}", name, "sft", run_job("align_pipeline.train.sft", job,
                                                                                  run_dir), args.warmup))
            print(json.dumps(report["rows"][-1]), flush=True)
        # DPO: the policy starts from a checkpoint (init_from is required); the reference is that checkpoint
        base = out / "runs" / f"{name}-sft-0" / "model"
        if not (base / "meta.json").is_file():
            base = out / "runs" / f"{name}-sft-{args.rank}" / "model"
        dpo_rows = [("full, separate frozen reference", 0, "online"), ("full, cached reference log-probs", 0, None),
                    (f"lora r{args.rank}, reference = adapters off", args.rank, "online")]
        for label, rank, reference in dpo_rows:
            if (name in args.skip_full and not rank) or (reference is None and "-sft-0" not in str(base)):
                continue  # cached log-probs only where full fine-tuning fits (its reference pass is a full model)
            run_dir = out / "runs" / f"{name}-dpo-{rank}-{reference}"
            ref_logps = None
            if reference is None:
                ref_logps = reference_logps(base, pref, out / "runs" / f"{name}-reference", parallel, args)
            job = DPOJob(dpo=DPOConfig(training=training(args, args.dpo_micro, args.dpo_global), lora=lora(rank),
                                       loss=PreferenceLossConfig(name="dpo", beta=0.1),
                                       reference=reference or "cached"),
                         model=model_config(shape, args.dpo_seq), parallel=parallel,
                         paths=DPOPaths(run_dir=str(run_dir), train_data=pref["train"], val_data=pref["val"],
                                        tokenizer=pref["tokenizer"], init_from=str(base), reference_logps=ref_logps))
            print(f"[lora_memory] {name} DPO {label} ...", flush=True)
            report["rows"].append(summarize(f"DPO {label}", name, "dpo", run_job("align_pipeline.train.dpo", job,
                                                                                  run_dir), args.warmup))
            print(json.dumps(report["rows"][-1]), flush=True)
    return write_report(out, "lora_memory", report, markdown(report))


def reference_logps(base: Path, pref: dict[str, str], run_dir: Path, parallel, args: argparse.Namespace) -> str:
    from align_pipeline.config import ReferenceLogpsJob

    job = ReferenceLogpsJob(run_dir=str(run_dir), checkpoint=str(base), data={"train": pref["train"],
                                                                              "val": pref["val"]},
                            output=str(run_dir / "reference_logps.npz"), parallel=parallel,
                            micro_batch_size=args.dpo_micro)
    result = run_job("align_pipeline.train.reference_logps", job, run_dir)
    if "error" in result:
        raise SystemExit(f"[lora_memory] reference log-probs failed: {result['error']}")
    return job.output


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = header_lines(report) + [
        (f"Shapes: {', '.join(f'{k} ({v / 1e9:.2f}B parameters)' for k, v in report['parameters'].items())}; "
         f"SFT seq {s['sft_seq']}, micro-batch {s['sft_micro']}, global {s['sft_global']}; DPO seq {s['dpo_seq']} "
         f"per sequence, micro-batch {s['dpo_micro']} pairs, global {s['dpo_global']}; {s['steps']} steps, "
         f"tokens/s over steps {s['warmup'] + 1}-{s['steps']}; LoRA rank {s['rank']} on all four linears."), "",
        "| shape | run | tokens/s | s/step | peak GiB (training step) | vs full with a separate reference |",
        "|---|---|---|---|---|---|"]
    full_ref = {r["shape"]: r.get("peak_train_gib") for r in report["rows"]
                if r["row"] == "DPO full, separate frozen reference"}
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['row']} | {r['error']} | - | - | - |")
            continue
        ratio = "-"
        if r["stage"] == "dpo" and full_ref.get(r["shape"]) and r["peak_train_gib"]:
            ratio = f"{r['peak_train_gib'] / full_ref[r['shape']]:.0%}"
        peak = f"{r['peak_train_gib']:.1f}" if r["peak_train_gib"] is not None else "- (CPU)"
        lines.append(f"| {r['shape']} | {r['row']} | {r['tokens_per_s']:,.0f} | {r['s_per_step']:.3f} | {peak} | "
                     f"{ratio} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["1b", "8b"])
    p.add_argument("--skip-full", nargs="*", default=[], help="shapes whose full fine-tuning rows are left out")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sft-seq", type=int, default=2048)
    p.add_argument("--sft-micro", type=int, default=4)
    p.add_argument("--sft-global", type=int, default=16)
    p.add_argument("--dpo-seq", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--dpo-micro", type=int, default=4)
    p.add_argument("--dpo-global", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fp32", action="store_true")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
    run(parse_args())
