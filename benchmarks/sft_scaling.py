"""SFT scaling benchmark: tokens/s per GPU for tensor / pipeline / data-parallel layouts, loss curves against one GPU,
and a reshard check (a checkpoint written at TP x PP loads at TP=1 PP=1).

    python benchmarks/sft_scaling.py --preset 1b --layouts 1x1x1,2x1x1,1x2x1,1x1x2,2x1x2 --modes strong weak \\
        --steps 30 --out /tmp/scaling

A layout is ``TPxPPxDP`` (GPUs = TP * PP * DP). Every run is a real torchrun job of the SFT entry point
(``align_pipeline.train.sft``) through the project's launcher, NCCL + bf16 on GPUs, gloo + fp32 on CPU.

* Same start: every run initialises from one random HF Llama checkpoint written here with ``transformers`` (seeded),
  so PP > 1 starts from the same weights as one GPU (Megatron's own random init differs between PP layouts).
* Data: a synthetic copy task (Zipf-distributed first half, repeated second half; loss on the second half): the loss falls
  within a few dozen steps and every layout sees exactly the same global batches.
* strong: the global batch is ``--global-batch`` for every layout. Losses must match the 1x1x1 run step by step to
  ``--loss-tol`` (bf16 tolerance on GPUs). weak: the global batch is ``--global-batch`` x GPUs (tokens per GPU fixed).
* tokens/s: steady state, over the steps after ``--warmup``, from the trainer's per-step wall times (rank 0).
  efficiency = (tokens/s per GPU) / (tokens/s per GPU of 1x1x1 in the same mode).
* reshard: for every strong layout with TP or PP > 1, its final checkpoint is loaded at TP=1 PP=1 on one process and
  its validation loss must equal the run's own final validation loss to ``--loss-tol``.

Writes ``<out>/scaling.json`` (everything, with loss curves) and ``<out>/scaling.md`` (the section for
docs/benchmarks.md: command, date, device, versions, table). Exit status 1 if a loss or reshard check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent

# Llama-style shapes (GQA, SwiGLU, RoPE, RMSNorm). Head counts divide by 4 and layer counts by 4 (TP, PP up to 4).
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
             "intermediate_size": 128, "vocab_size": 512, "seq_length": 64},
    "350m": {"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
             "intermediate_size": 2816, "vocab_size": 32000, "seq_length": 2048},
    "1b": {"num_hidden_layers": 24, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
           "intermediate_size": 5632, "vocab_size": 32000, "seq_length": 2048},
}


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int

    @classmethod
    def parse(cls, text: str) -> Layout:
        try:
            tp, pp, dp = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise SystemExit(f"layout {text!r}: expected TPxPPxDP, e.g. 2x1x2") from None
        if min(tp, pp, dp) < 1:
            raise SystemExit(f"layout {text!r}: sizes must be >= 1")
        return cls(tp, pp, dp)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return f"{self.tp}x{self.pp}x{self.dp}"


def make_copy_data(out: Path, vocab: int, seq_length: int, n: int, seed: int) -> dict[str, str]:
    """Tokenizer dir + train/val npz of the copy task: t[0:h] drawn from a Zipf-like unigram, t[h:2h] = t[0:h]; loss
    on the copied half."""
    from align_pipeline.data.formats import save_npz
    from align_pipeline.data.tokenizer import TokenizerConfig, build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(TokenizerConfig(), ["copy task"]).save(out / "tokenizer")  # only its directory is needed
    rng = np.random.default_rng(seed)
    half = seq_length // 2 + 1  # 2 * half >= seq_length + 1 tokens
    paths = {"tokenizer": str(out / "tokenizer")}
    zipf = 1.0 / np.arange(1, vocab - 3) ** 1.1  # skewed unigram: the loss falls within a few steps, then the copy
    zipf /= zipf.sum()
    for split, rows in (("train", n), ("val", max(n // 8, 16))):
        first = 4 + rng.choice(vocab - 4, size=(rows, half), p=zipf)
        seq = np.concatenate([first, first], axis=1)[:, : seq_length + 1]  # [rows, S+1]
        mask = np.zeros((rows, seq_length), dtype=np.float32)
        mask[:, half - 1:] = 1.0  # labels[t] = seq[t+1]: predictable from position half on
        save_npz(out / f"{split}.npz", {"input_ids": seq[:, :-1].astype(np.int64),
                                        "labels": seq[:, 1:].astype(np.int64), "loss_mask": mask})
        paths[split] = str(out / f"{split}.npz")
    return paths


def make_hf_init(out: Path, preset: dict[str, int], seed: int) -> tuple[str, int]:
    """A random HF Llama checkpoint of the preset's shape (the common start of every layout); returns (dir, params)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {k: v for k, v in preset.items() if k != "seq_length"}
    config = LlamaConfig(**shape, max_position_embeddings=preset["seq_length"], rms_norm_eps=1e-5,
                         tie_word_embeddings=False, initializer_range=0.02)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    if not (out / "config.json").is_file():
        model.save_pretrained(out, safe_serialization=True)
    return str(out), params


def sft_job(layout: Layout, global_batch: int, args: argparse.Namespace, data: dict[str, str], hf_dir: str,
            run_dir: Path, bf16: bool):
    from align_pipeline.config import (
        ModelConfig,
        OptimizerConfig,
        ParallelConfig,
        SFTConfig,
        SFTJob,
        TrainingConfig,
        TrainPaths,
    )

    parallel = ParallelConfig(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                              sequence_parallel=layout.tp > 1 and args.sequence_parallel,
                              use_distributed_optimizer=layout.dp > 1 and args.distributed_optimizer, bf16=bf16)
    training = TrainingConfig(
        seed=args.seed, train_steps=args.steps, global_batch_size=global_batch, micro_batch_size=args.micro_batch,
        log_interval=max(args.steps // 5, 1), eval_interval=0, eval_samples=args.eval_samples, save_interval=0,
        keep_checkpoints=1, optimizer=OptimizerConfig(lr=args.lr, min_lr=args.lr / 10, warmup_steps=args.steps // 5),
    )
    model = ModelConfig(seq_length=PRESETS[args.preset]["seq_length"])  # the architecture comes from the HF dir
    paths = TrainPaths(run_dir=str(run_dir), train_data=data["train"], val_data=data["val"],
                       tokenizer=data["tokenizer"], init_from=hf_dir)
    return SFTJob(sft=SFTConfig(training=training), model=model, parallel=parallel, paths=paths)


def steady_tokens_per_s(result: dict[str, Any], warmup: int) -> float:
    """Tokens per second over the steps after ``warmup`` (per-step wall times measured by the trainer)."""
    times = [h["step_time_s"] for h in result["history"][warmup:]]
    if not times:
        raise SystemExit(f"--warmup {warmup} leaves no steps to time; raise --steps")
    return result["tokens_per_step"] * len(times) / sum(times)


def reshard_val_loss(model_dir: str, data: dict[str, str], args: argparse.Namespace, run_dir: Path,
                     bf16: bool) -> float:
    """Validation loss of ``model_dir`` loaded at TP=1 PP=1 on one process (same samples as the trainer's eval)."""
    from align_pipeline.config import LaunchConfig
    from align_pipeline.launch import run_torchrun

    cfg = {"run_dir": str(run_dir), "checkpoint": model_dir, "val_data": data["val"], "bf16": bf16,
           "eval_samples": args.eval_samples, "micro_batch_size": args.micro_batch}
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_torchrun("val_loss_worker", cfg, LaunchConfig(nproc_per_node=1), run_dir, name="reshard")["val_loss"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from align_pipeline.config import LaunchConfig, to_dict
    from align_pipeline.launch import run_torchrun

    out, on_gpu, bf16, preset = bench_setup(args)
    layouts = [Layout.parse(x) for x in args.layouts.split(",")]
    if str(layouts[0]) != "1x1x1":
        layouts.insert(0, Layout(1, 1, 1))  # the reference every other layout is compared with
    if on_gpu and max(lay.gpus for lay in layouts) > torch.cuda.device_count():
        raise SystemExit(f"layouts need {max(lay.gpus for lay in layouts)} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    biggest = max(lay.gpus for lay in layouts) if "weak" in args.modes else 1
    data, hf_dir, params = copy_task_and_init(out, preset, args, rows=args.global_batch * biggest * args.steps)
    print(f"[scaling] preset {args.preset}: {params / 1e6:.1f}M parameters, seq {preset['seq_length']}, "
          f"{'bf16 NCCL' if bf16 else 'fp32'} on {'GPU' if on_gpu else 'CPU'}", flush=True)

    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        for layout in layouts:
            global_batch = args.global_batch * (layout.gpus if mode == "weak" else 1)
            same = next((r for r in rows if r["layout"] == str(layout) and r["global_batch"] == global_batch), None)
            if same is not None:  # 1x1x1 is the same run in both modes
                rows.append({**same, "mode": mode})
                continue
            run_dir = out / "runs" / f"{mode}_{layout}"
            job = sft_job(layout, global_batch, args, data, hf_dir, run_dir, bf16)
            run_dir.mkdir(parents=True, exist_ok=True)
            print(f"[scaling] {mode} {layout} ({layout.gpus} GPU, global batch {global_batch}) ...", flush=True)
            result = run_torchrun("align_pipeline.train.sft", to_dict(job), LaunchConfig(nproc_per_node=layout.gpus),
                                  run_dir, name=f"sft {layout}")
            tps = steady_tokens_per_s(result, args.warmup)
            rows.append({"mode": mode, "layout": str(layout), "gpus": layout.gpus, "global_batch": global_batch,
                         "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / layout.gpus,
                         "peak_memory_gib": result.get("peak_memory_gib"),
                         "peak_memory_by_phase_gib": result.get("peak_memory_by_phase_gib") or {},
                         "losses": [h["loss"] for h in result["history"]], "val_loss": result["val_loss"],
                         "model_dir": result["model_dir"]})
            print(f"[scaling] {mode} {layout}: {tps:,.0f} tokens/s ({tps / layout.gpus:,.0f} per GPU), "
                  f"loss {rows[-1]['losses'][0]:.4f} -> {rows[-1]['losses'][-1]:.4f}", flush=True)

    failures = []
    for mode in args.modes:
        base = next(r for r in rows if r["mode"] == mode and r["layout"] == "1x1x1")
        for r in (r for r in rows if r["mode"] == mode):
            r["efficiency"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
            if mode == "strong" and r is not base:
                r["max_loss_diff"] = float(np.max(np.abs(np.subtract(r["losses"], base["losses"]))))
                if r["max_loss_diff"] > args.loss_tol:
                    failures.append(f"strong {r['layout']}: loss curve differs from 1x1x1 by {r['max_loss_diff']:.2e}")
                lay = Layout.parse(r["layout"])
                if args.reshard and (lay.tp > 1 or lay.pp > 1):
                    at_1 = reshard_val_loss(r["model_dir"], data, args, out / "runs" / f"reshard_{lay}", bf16)
                    r["reshard_val_loss_diff"] = abs(at_1 - r["val_loss"])
                    if r["reshard_val_loss_diff"] > args.loss_tol:
                        failures.append(f"{lay} checkpoint at TP=1 PP=1: val loss {at_1:.5f} vs {r['val_loss']:.5f}")
    report = {**run_header(), "preset": args.preset, "parameters": params,
              "precision": "bf16" if bf16 else "fp32", "settings": vars(args), "rows": rows, "failures": failures}
    return write_report(out, "scaling", report, markdown(report))


def bench_setup(args: argparse.Namespace) -> tuple[Path, bool, bool, dict[str, int]]:
    """(output dir, on a GPU, bf16, the preset's shape); torchrun jobs can import benchmarks/ (the val-loss worker)."""
    import torch

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    on_gpu = torch.cuda.is_available()
    return Path(args.out).resolve(), on_gpu, on_gpu and not args.fp32, PRESETS[args.preset]


def copy_task_and_init(out: Path, preset: dict[str, int], args: argparse.Namespace, rows: int
                       ) -> tuple[dict[str, str], str, int]:
    """The copy-task data (``rows`` training rows, at most 4096) and the seeded random HF init every run starts from:
    (data paths, HF dir, parameter count)."""
    data = make_copy_data(out / "data", preset["vocab_size"], preset["seq_length"], n=min(rows, 4096), seed=args.seed)
    hf_dir, params = make_hf_init(out / "hf_init", preset, args.seed)
    return data, hf_dir, params


def write_report(out: Path, stem: str, report: dict[str, Any], text: str) -> dict[str, Any]:
    """``<out>/<stem>.json`` (the report) and ``<out>/<stem>.md`` (``text``, also printed), then each of the
    report's ``failures`` on its own line; returns the report."""
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (out / f"{stem}.md").write_text(text)
    print(text, flush=True)
    for f in report.get("failures", []):
        print(f"[{stem}] FAILED: {f}", flush=True)
    return report


def run_header(extra_versions: dict[str, str] | None = None) -> dict[str, Any]:
    """What every benchmark report starts with: the command as typed, the UTC date, the device, library versions."""
    return {"command": " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device_name(), "versions": {**versions(), **(extra_versions or {})}}


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU ({os.cpu_count()} cores)"


def hbm_tb_s(device: str) -> float:
    """Peak HBM bandwidth in TB/s of a device named by :func:`device_name` (H100 SXM 3.35, else the H200's 4.8)."""
    return 3.35 if "H100" in device else 4.8


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import torch

    return {"torch": torch.__version__, "megatron-core": version("megatron-core"),
            "cuda": str(torch.version.cuda), "python": sys.version.split()[0]}


def header_lines(report: dict[str, Any]) -> list[str]:
    """The Markdown lines of :func:`run_header`'s fields: command, then date, device and versions."""
    return [f"Command: `{report['command']}`  ",
            f"Date: {report['date']}; device: {report['device']}; "
            + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + "  "]


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        *header_lines(report),
        (f"Model: preset `{report['preset']}`, {report['parameters'] / 1e6:.1f}M parameters, "
        f"seq {PRESETS[report['preset']]['seq_length']}, {report['precision']}, micro-batch {s['micro_batch']}, "
        f"{s['steps']} steps (tokens/s over steps {s['warmup'] + 1}-{s['steps']})"),
        "",
        ("| mode | TPxPPxDP | GPUs | global batch | tokens/s | tokens/s per GPU | efficiency | peak mem GiB (rank 0) "
        "| train / eval / save peak GiB | loss first -> last | max abs diff vs 1 GPU | reshard val-loss diff |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        mem = f"{r['peak_memory_gib']:.1f}" if r.get("peak_memory_gib") is not None else "-"
        phases = r.get("peak_memory_by_phase_gib") or {}
        by_phase = " / ".join(f"{phases[k]:.1f}" if k in phases else "-" for k in ("train", "eval", "save"))
        diff = f"{r['max_loss_diff']:.1e}" if "max_loss_diff" in r else "-"
        reshard = f"{r['reshard_val_loss_diff']:.1e}" if "reshard_val_loss_diff" in r else "-"
        lines.append(f"| {r['mode']} | {r['layout']} | {r['gpus']} | {r['global_batch']} | {r['tokens_per_s']:,.0f} "
                     f"| {r['tokens_per_s_per_gpu']:,.0f} | {r['efficiency']:.2f} | {mem} | {by_phase} "
                     f"| {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} | {diff} | {reshard} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--layouts", default="1x1x1", help="comma-separated TPxPPxDP; 1x1x1 is always run first")
    p.add_argument("--modes", nargs="+", choices=["strong", "weak"], default=["strong"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s")
    p.add_argument("--global-batch", type=int, default=32, help="strong: every layout; weak: per GPU")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--eval-samples", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--loss-tol", type=float, default=None,
                   help="max abs loss difference vs 1x1x1 (default 5e-2 in bf16, 1e-4 in fp32)")
    p.add_argument("--fp32", action="store_true", help="fp32 on GPUs too (bf16 is the GPU default)")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    p.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_false")
    p.add_argument("--no-reshard", dest="reshard", action="store_false")
    p.add_argument("--out", required=True, help="working directory: data, HF init, runs, scaling.json/.md")
    args = p.parse_args(argv)
    if args.loss_tol is None:
        import torch

        args.loss_tol = 5e-2 if torch.cuda.is_available() and not args.fp32 else 1e-4
    return args


if __name__ == "__main__":
    os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
    report = run(parse_args())
    sys.exit(1 if report["failures"] else 0)
