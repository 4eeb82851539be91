"""SFT speed of a mixture-of-experts model: our SFT job (Megatron-core's MoE layer) against HF transformers' own
Qwen3-MoE implementation on the same GPU, same random weights, same data and batch shape, in one run.

    python benchmarks/moe_sft.py --preset moe_2b --steps 12 --warmup 4 --out /tmp/moe

* The model: a random Qwen3-MoE HF directory of the preset's shape (``moe_2b``: 24 layers, hidden 1024, 64 experts
  of width 384, top 8, GQA 16/4: ~1.9B parameters, ~0.35B active per token).
* Ours: real torchrun jobs of ``align_pipeline.train.sft`` (bf16 with fp32 main weights, fused kernels, SDPA), one
  per ``--ours`` variant ``kernels:recompute:micro_batch`` (as ``benchmarks/train_kernels.py``) and ``--grouped``
  setting (``parallel.moe_grouped_gemm``: grouped expert GEMMs on or off).
* HF: ``Qwen3MoeForCausalLM`` from the same directory, pure bf16, SDPA, fused AdamW, the same masked token loss
  (``train_kernels.hf_worker``); transformers picks its own experts kernel. A second HF row with Liger-Kernel's
  Qwen3-MoE patches (RoPE, RMSNorm, experts' SwiGLU, fused linear cross-entropy) when ``liger_kernel`` imports.
* MFU counts 6 x *active* parameters + 12 L H S FLOPs per token against ``--peak-tflops``.

Writes ``<out>/moe.json`` and ``<out>/moe.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sft_scaling  # benchmarks/ is on the path (above)
from train_kernels import Variant, add_run_args, run_hf, run_ours

MOE_PRESETS: dict[str, dict[str, int]] = {
    "moe_tiny": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "intermediate_size": 128, "vocab_size": 512, "seq_length": 64},
    "moe_2b": {"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
               "head_dim": 64, "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 384,
               "intermediate_size": 3072, "vocab_size": 32000, "seq_length": 2048},
}
sft_scaling.PRESETS.update(MOE_PRESETS)  # the SFT job builder reads the preset's seq_length there


def make_moe_init(out: Path, preset: dict[str, int], seed: int) -> tuple[str, int, int]:
    """A random Qwen3-MoE HF directory of the preset's shape: (dir, parameters, active parameters per token)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = {k: v for k, v in preset.items() if k != "seq_length"}
    config = Qwen3MoeConfig(**shape, max_position_embeddings=preset["seq_length"], norm_topk_prob=True,
                            tie_word_embeddings=False, initializer_range=0.02, mlp_only_layers=[],
                            decoder_sparse_step=1)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    expert = 3 * preset["hidden_size"] * preset["moe_intermediate_size"]
    inactive = preset["num_hidden_layers"] * (preset["num_experts"] - preset["num_experts_per_tok"]) * expert
    if not (out / "config.json").is_file():
        model.save_pretrained(out, safe_serialization=True)
    return str(out), params, params - inactive


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    out, on_gpu = Path(args.out).resolve(), torch.cuda.is_available()
    preset = MOE_PRESETS[args.preset]
    rows = min(args.global_batch * args.steps, 4096)
    data = sft_scaling.make_copy_data(out / "data", preset["vocab_size"], preset["seq_length"], n=rows, seed=args.seed)
    hf_dir, params, active = make_moe_init(out / "hf_init", preset, args.seed)
    fpt = 6 * active + 12 * preset["num_hidden_layers"] * preset["hidden_size"] * preset["seq_length"]
    print(f"[moe] preset {args.preset}: {params / 1e6:.1f}M parameters, {active / 1e6:.1f}M active, "
          f"{fpt / 1e9:.2f} GFLOP per token", flush=True)
    rows_out = [run_ours(Variant.parse(v), args, data, hf_dir, out, on_gpu and not args.fp32,
                         {"moe_grouped_gemm": grouped}, f" grouped-{grouped}")
                for v in args.ours for grouped in args.grouped]
    if on_gpu and args.hf:
        rows_out.append(run_hf(False, False, args.micro_batch, args, data, hf_dir, out))
        rows_out.append(run_hf(False, False, args.micro_batch, args, data, hf_dir, out, liger=True))
    for r in rows_out:
        if "tokens_per_s" in r:
            r["mfu"] = r["tokens_per_s"] * fpt / (args.peak_tflops * 1e12)
    report = {**sft_scaling.run_header(), "preset": args.preset, "parameters": params, "active_parameters": active,
              "flops_per_token": fpt, "settings": vars(args), "rows": rows_out}
    return sft_scaling.write_report(out, "moe", report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [*sft_scaling.header_lines(report),
             (f"Model: a random Qwen3-MoE, preset `{report['preset']}` ({report['parameters'] / 1e6:.0f}M parameters, "
              f"{report['active_parameters'] / 1e6:.0f}M active), seq {MOE_PRESETS[report['preset']]['seq_length']}, "
              f"global batch {s['global_batch']}, {s['steps']} steps (tokens/s over steps {s['warmup'] + 1}-"
              f"{s['steps']}); MFU over active parameters at {s['peak_tflops']:.0f} TFLOP/s"),
             "", "| trainer | variant | tokens/s | MFU | peak GiB | loss first -> last |", "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['trainer']} | {r['variant']} | {r['error'][:120]} | | | |")
            continue
        lines.append(f"| {r['trainer']} | {r['variant']} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f} % | "
                     f"{r['peak_memory_gib'] or 0:.1f} | {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(MOE_PRESETS), default="moe_2b")
    p.add_argument("--ours", nargs="+", default=["fused:none:4"], help="kernels:recompute:micro_batch variants")
    p.add_argument("--grouped", nargs="+", choices=["on", "off"], default=["on", "off"],
                   help="parallel.moe_grouped_gemm settings of our runs (on: torch's grouped matmul; off: a GEMM "
                   "pair per expert)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="leave out the HF transformers peer")
    add_run_args(p, steps=12, warmup=4, global_batch=16, eval_samples=16)
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
    run(parse_args())
