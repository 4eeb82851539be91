"""HF round trip of a 1B-class model: import -> one bf16 SFT step -> export -> transformers on the GPU.

    python benchmarks/hf_roundtrip.py --preset llama32_1b --out /tmp/roundtrip      # one GPU
    python benchmarks/hf_roundtrip.py --preset tiny --out /tmp/roundtrip            # CPU smoke run

1. A random-init HF model of the preset's shape is written with ``transformers`` (bf16 safetensors, tied embeddings,
   Llama 3.1 RoPE scaling for the 1B preset: Llama-3.2-1B's configuration).
2. ``align-pipeline import HF CKPT --check``: the time, and ``max |Δlogit|`` Megatron (fp32) vs transformers (fp32).
3. One SFT step in bf16 from the imported checkpoint (a torchrun job of ``align_pipeline.train.sft``).
4. ``align-pipeline export CKPT HF --dtype bfloat16`` in its own process: wall time and that process's own peak
   resident memory (``VmHWM``, reported in its summary).
5. The export is loaded by ``transformers`` on the GPU and compared with the Megatron checkpoint on the same tokens:
   the HF model upcast to fp32 vs Megatron in fp32 (the conversion itself), and HF in bf16 (what a user serves);
   then it generates a few tokens.

Writes ``<out>/roundtrip.json`` and ``<out>/roundtrip.md`` (the section for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sft_scaling import device_name, make_copy_data, versions

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
PRESETS: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B's configuration (1.24B parameters), random weights.
    "llama32_1b": {"num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 131072,
                   "rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True, "seq_length": 512},
    "tiny": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 1024,
             "rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 64},
             "tie_word_embeddings": True, "seq_length": 64},
}


def make_hf_model(out: Path, preset: dict[str, Any], seed: int) -> int:
    """Random-init Llama in bf16 safetensors; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {k: v for k, v in preset.items() if k != "seq_length"}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2))
    model.to(torch.bfloat16).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def run_cli(args: list[str]) -> tuple[dict[str, Any], float]:
    """Run ``python -m align_pipeline <args>``; returns (its JSON summary line, wall seconds). The export's summary
    carries its own peak resident memory (``VmHWM``: ``ru_maxrss`` of a child forked from this large process would
    start at this process's peak)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "align_pipeline", *args, "--json"], capture_output=True, text=True,
                          check=False)
    wall = time.perf_counter() - t0
    lines = done.stdout.strip().splitlines()
    if done.returncode not in (0, 1) or not lines:  # 1 = a parity check above its tolerance (summary printed)
        raise SystemExit(f"align-pipeline {shlex.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1]), wall


def sft_one_step(ckpt: str, data: dict[str, str], seq_length: int, run_dir: Path, bf16: bool) -> dict[str, Any]:
    from align_pipeline.config import (
        LaunchConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelConfig,
        SFTConfig,
        SFTJob,
        TrainingConfig,
        TrainPaths,
        to_dict,
    )
    from align_pipeline.launch import run_torchrun

    training = TrainingConfig(seed=0, train_steps=1, global_batch_size=8, micro_batch_size=4, log_interval=1,
                              eval_interval=0, eval_samples=8, save_interval=0,
                              optimizer=OptimizerConfig(lr=1e-5, min_lr=1e-6, warmup_steps=0))
    job = SFTJob(sft=SFTConfig(training=training), model=ModelConfig(seq_length=seq_length),
                 parallel=ParallelConfig(bf16=bf16),
                 paths=TrainPaths(run_dir=str(run_dir), train_data=data["train"], val_data=data["val"],
                                  tokenizer=data["tokenizer"], init_from=ckpt))
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_torchrun("align_pipeline.train.sft", to_dict(job), LaunchConfig(nproc_per_node=1), run_dir)


def parity_on_device(ckpt: str, hf_dir: Path, vocab: int, run_dir: Path) -> dict[str, Any]:
    """Megatron logits (fp32, one rank) vs the export in transformers on the GPU (fp32 upcast and bf16)."""
    import torch
    from transformers import AutoModelForCausalLM

    from align_pipeline.config import LaunchConfig
    from align_pipeline.launch import run_torchrun

    tokens = np.random.default_rng(0).integers(0, vocab, size=(2, 32)).tolist()
    run_dir.mkdir(parents=True, exist_ok=True)
    ours = torch.tensor(run_torchrun("align_pipeline.train.jobs.logits", {"checkpoint": ckpt, "tokens": tokens},
                                     LaunchConfig(nproc_per_node=1), run_dir, name="megatron logits")["logits"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.tensor(tokens, device=device)
    out: dict[str, Any] = {"device": device}
    for dtype in (torch.float32, torch.bfloat16):
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).to(device).eval()
        load_s = time.perf_counter() - t0
        with torch.no_grad():
            theirs = model(ids).logits.float().cpu()
        name = "fp32" if dtype == torch.float32 else "bf16"
        out[f"max_abs_logit_diff_{name}"] = float((theirs - ours).abs().max())
        out[f"argmax_agreement_{name}"] = float((theirs.argmax(-1) == ours.argmax(-1)).float().mean())
        out[f"hf_load_s_{name}"] = round(load_s, 2)
        if dtype == torch.bfloat16:
            with torch.no_grad():
                new = model.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)[0, 8:]
            out["generated_tokens"] = len(new)
        del model
    out["logit_scale"] = float(ours.abs().max())
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    preset = PRESETS[args.preset]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hf_src, ckpt, exported = out / "hf_source", out / "imported", out / "exported_bf16"
    for d in (ckpt, exported):
        if d.exists():
            raise SystemExit(f"{d} exists; use a new --out")
    t0 = time.perf_counter()
    params = make_hf_model(hf_src, preset, args.seed)
    report: dict[str, Any] = {"preset": args.preset, "parameters": params, "make_hf_s": round(time.perf_counter() - t0, 1)}

    imported, wall = run_cli(["import", str(hf_src), str(ckpt), "--seq-length", str(preset["seq_length"]), "--check"])
    report["import"] = {"wall_s": round(wall, 1), "max_abs_logit_diff_fp32": imported["max_abs_logit_diff"]}

    data = make_copy_data(out / "data", min(preset["vocab_size"], 32000), preset["seq_length"], 64, args.seed)
    bf16 = not args.fp32
    sft = sft_one_step(str(ckpt), data, preset["seq_length"], out / "sft", bf16)
    report["sft"] = {"bf16": bf16, "loss": sft["history"][0]["loss"], "model_dir": sft["model_dir"]}

    summary, wall = run_cli(["export", sft["model_dir"], str(exported), "--dtype", "bfloat16"])
    report["export"] = {"wall_s": round(wall, 1), "export_s": summary["seconds"], "peak_rss_gib": summary["peak_rss_gib"],
                        "files": summary["files"], "gib": round(summary["bytes"] / 1024**3, 2),
                        "architecture": summary["architecture"]}
    report["transformers_on_device"] = parity_on_device(sft["model_dir"], exported, preset["vocab_size"],
                                                        out / "parity")
    report.update(command=" ".join(["python", "benchmarks/hf_roundtrip.py", *sys.argv[1:]]),
                  date=datetime.date.today().isoformat(), device=device_name(), versions=versions())
    (out / "roundtrip.json").write_text(json.dumps(report, indent=2))
    (out / "roundtrip.md").write_text(markdown(report))
    return report


def markdown(r: dict[str, Any]) -> str:
    t = r["transformers_on_device"]
    return "\n".join([
        f"## HF round trip of a {r['parameters'] / 1e9:.2f}B Llama-3.2-style model ({r['date']})", "",
        f"Command: `{r['command']}`  ", f"Device: {r['device']}; versions: {r['versions']}", "",
        "| step | figure |", "|---|---|",
        f"| import (`align-pipeline import --check`), wall | {r['import']['wall_s']} s |",
        (f"| import parity, Megatron fp32 vs transformers fp32 (CPU) | max \\|Δlogit\\| = "
        f"{r['import']['max_abs_logit_diff_fp32']:.2e} |"),
        f"| one SFT step ({'bf16' if r['sft']['bf16'] else 'fp32'}) | loss {r['sft']['loss']:.3f} |",
        (f"| export (`align-pipeline export --dtype bfloat16`), wall / in export_hf | {r['export']['wall_s']} s / "
        f"{r['export']['export_s']} s |"),
        f"| export peak host memory (the export process's VmHWM) | {r['export']['peak_rss_gib']} GiB |",
        f"| export size | {r['export']['gib']} GiB in {r['export']['files']} file(s), {r['export']['architecture']} |",
        (f"| transformers on {t['device']}, export upcast to fp32 vs Megatron fp32 | max \\|Δlogit\\| = "
        f"{t['max_abs_logit_diff_fp32']:.2e} (argmax agreement {t['argmax_agreement_fp32']:.3f}) |"),
        (f"| transformers on {t['device']} in bf16 vs Megatron fp32 | max \\|Δlogit\\| = {t['max_abs_logit_diff_bf16']:.2e} "
        f"(argmax agreement {t['argmax_agreement_bf16']:.3f}; logits up to {t['logit_scale']:.1f}) |"),
        f"| generate with the export (bf16, greedy) | {t['generated_tokens']} new tokens |",
        "",
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama32_1b")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp32", action="store_true", help="train the SFT step in fp32 (CPU smoke runs)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(run(parse_args()), indent=2))
