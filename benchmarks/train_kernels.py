"""Training speed of the SFT step with and without the fused kernels, against HF Llama + SDPA (eager and
``torch.compile``) on the same GPU, same weights, same data, same batch shape, in one run.

    python benchmarks/train_kernels.py --preset 1b --steps 30 --micro --out /tmp/kernels

* Ours: real torchrun jobs of the SFT entry point (``align_pipeline.train.sft``), bf16 with fp32 main weights and
  fp32 gradient accumulation (Megatron's DDP), SDPA attention, one per ``--ours`` variant ``kernels:recompute:mb``
  (kernels eager | fused, recompute none | selective | full, micro-batch; optional fourth and fifth fields:
  ``parallel.logits_chunk_tokens`` and ``parallel.optimizer_precision``, fp32 | bf16, e.g. ``fused:none:8:0:bf16``:
  bf16 weights, gradients and moments with stochastic rounding, HF's 8 bytes per parameter). The first variant is the reference of the
  loss check: every other variant's loss curve must equal it to ``--loss-tol`` (bf16 tolerance; same micro-batch).
* HF: ``LlamaForCausalLM`` from the same random HF directory, pure bf16 weights (less state per parameter than ours),
  SDPA, torch's fused AdamW, the same masked token loss over the same global batch (gradient accumulation), with and
  without ``torch.compile`` of model + loss; each variant in its own process.
* tokens/s: steady state over the steps after ``--warmup``, from per-step wall times. MFU counts
  (6 N + 12 L H S) FLOPs per token (N parameters, L layers, H hidden, S sequence) against ``--peak-tflops`` (989, an
  H200's dense bf16).
* Peak memory: ours per phase (the training step, validation, the checkpoint save) from the job; HF's is training only.
* ``--micro``: forward + backward time of each fused operation against its eager form at the preset's shapes
  (RoPE, RMSNorm, SwiGLU, GQA attention), plus Liger-Kernel's Triton kernels when ``liger_kernel`` is importable.
* Larger micro-batches are variants too (``fused:none:16``); one that does not fit is reported as out of memory.

Writes ``<out>/kernels.json`` and ``<out>/kernels.md`` (the section for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sft_scaling import (  # benchmarks/ is on the path (above)
    PRESETS,
    Layout,
    bench_setup,
    copy_task_and_init,
    header_lines,
    run_header,
    sft_job,
    steady_tokens_per_s,
    write_report,
)


@dataclasses.dataclass(frozen=True)
class Variant:
    kernels: str
    recompute: str
    micro_batch: int
    logits_chunk: int = 0
    optimizer: str = "fp32"

    @classmethod
    def parse(cls, text: str) -> Variant:
        parts = text.split(":")
        if (len(parts) not in (3, 4, 5) or parts[0] not in ("eager", "fused")
                or parts[1] not in ("none", "selective", "full") or parts[4:5] not in ([], ["fp32"], ["bf16"])):
            raise SystemExit(f"variant {text!r}: expected kernels:recompute:micro_batch[:logits_chunk_tokens"
                             "[:optimizer_precision]], e.g. fused:none:4, fused:none:8:4096 or fused:none:8:0:bf16")
        return cls(parts[0], parts[1], int(parts[2]), int(parts[3]) if len(parts) > 3 else 0,
                   parts[4] if len(parts) > 4 else "fp32")

    def __str__(self) -> str:
        chunk = f":{self.logits_chunk}" if self.logits_chunk or self.optimizer != "fp32" else ""
        opt = f":{self.optimizer}" if self.optimizer != "fp32" else ""
        return f"{self.kernels}:{self.recompute}:{self.micro_batch}{chunk}{opt}"


def flops_per_token(preset: dict[str, int], params: int) -> float:
    layers, hidden, seq = preset["num_hidden_layers"], preset["hidden_size"], preset["seq_length"]
    return 6 * params + 12 * layers * hidden * seq


# ----------------------------------------------------------------------------------------------------------------- ours
def run_ours(variant: Variant, args, data, hf_dir: str, out: Path, bf16: bool,
             parallel_overrides: dict[str, Any] | None = None, label: str = "") -> dict[str, Any]:
    from align_pipeline.config import LaunchConfig, to_dict
    from align_pipeline.launch import run_torchrun

    scaling_args = argparse.Namespace(preset=args.preset, seed=args.seed, steps=args.steps,
                                      micro_batch=variant.micro_batch,
                                      eval_samples=args.eval_samples, lr=args.lr, sequence_parallel=False,
                                      distributed_optimizer=False)
    run_dir = out / "runs" / (str(variant).replace(":", "_") + label)
    job = sft_job(Layout(1, 1, 1), args.global_batch, scaling_args, data, hf_dir, run_dir, bf16)
    parallel = dataclasses.replace(job.parallel, kernels=variant.kernels, recompute_granularity=variant.recompute,
                                   recompute_num_layers=1, logits_chunk_tokens=variant.logits_chunk,
                                   optimizer_precision=variant.optimizer if bf16 else "fp32",
                                   **(parallel_overrides or {}))
    job = dataclasses.replace(job, parallel=parallel)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resumed one
    run_dir.mkdir(parents=True)
    print(f"[kernels] ours {variant} ...", flush=True)
    try:
        env = {"ALIGN_PROFILE_DIR": str(run_dir / "profile"), "ALIGN_PROFILE_STEP": "8"} if args.profile else None
        result = run_torchrun("align_pipeline.train.sft", to_dict(job), LaunchConfig(nproc_per_node=1), run_dir,
                              name=f"sft {variant}", env=env)
    except Exception as exc:  # noqa: BLE001 -- an OOM of a large micro-batch is a result, not a crash
        text = str(exc)
        return {"trainer": "ours", "variant": str(variant), "error": "out of memory" if "out of memory" in text.lower()
                else text[-400:]}
    finally:
        free_run_disk(run_dir)
    history = result["history"]
    if args.profile:  # the profiled step (8) runs under the profiler: not a timing
        result = {**result, "history": [h for h in history if h["step"] != 8]}
    tps = steady_tokens_per_s(result, args.warmup)
    row = {"trainer": "ours", "variant": str(variant) + label, "kernels": variant.kernels,
           "recompute": variant.recompute,
           "micro_batch": variant.micro_batch, "tokens_per_s": tps,
           "peak_memory_gib": result.get("peak_memory_gib"),
           "peak_memory_by_phase_gib": result.get("peak_memory_by_phase_gib") or {},
           "losses": [h["loss"] for h in history], "step_times": [h["step_time_s"] for h in history]}
    profile = run_dir / "profile" / "rank0_kernels.json"
    if profile.is_file():
        row["profile"] = json.loads(profile.read_text())
    print(f"[kernels] ours {variant}: {tps:,.0f} tokens/s, loss {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}",
          flush=True)
    return row


def free_run_disk(run_dir: Path) -> None:
    """Delete a finished run's training checkpoints and model artifact (its logs and metrics stay): a 2B model's
    checkpoint with fp32 main weights and moments is ~30 GB, and a device's 64 GiB disk filled after two runs."""
    for name in ("checkpoints", "model"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------------------- HF
def run_hf(compiled: bool, recompute: bool, micro_batch: int, args, data, hf_dir: str, out: Path,
           liger: bool = False) -> dict[str, Any]:
    name = f"hf{'-liger' if liger else ''}{'-compile' if compiled else ''}{'-recompute' if recompute else ''}:{micro_batch}"
    cfg = {"hf_dir": hf_dir, "train": data["train"], "compile": compiled, "recompute": recompute, "liger": liger,
           "micro_batch": micro_batch, "global_batch": args.global_batch, "steps": args.steps, "lr": args.lr,
           "seed": args.seed, "result": str(out / "runs" / f"{name.replace(':', '_')}.json"), "profile": args.profile}
    Path(cfg["result"]).parent.mkdir(parents=True, exist_ok=True)
    print(f"[kernels] {name} ...", flush=True)
    proc = subprocess.run([sys.executable, __file__, "--worker-hf", json.dumps(cfg)], text=True,
                          capture_output=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-600:]
        return {"trainer": name, "variant": name, "error": "out of memory" if "out of memory" in tail.lower()
                else tail}
    res = json.loads(Path(cfg["result"]).read_text())
    times = [t for i, t in enumerate(res["step_times"]) if i >= args.warmup and not (args.profile and i == 7)]
    tps = res["tokens_per_step"] * len(times) / sum(times)
    print(f"[kernels] {name}: {tps:,.0f} tokens/s, loss {res['losses'][0]:.4f} -> {res['losses'][-1]:.4f}", flush=True)
    return {"trainer": name, "variant": name, "micro_batch": micro_batch, "tokens_per_s": tps,
            "peak_memory_gib": res["peak_memory_gib"], "peak_memory_by_phase_gib": {"train": res["peak_memory_gib"]},
            "losses": res["losses"], "step_times": res["step_times"], "compile_s": res.get("first_step_s"), **({"profile": res["profile"]}
                                                                             if "profile" in res else {})}


def hf_worker(cfg: dict[str, Any]) -> None:
    """One HF training run (own process): pure bf16 weights, fused AdamW, the SFT job's masked token loss. With
    ``liger``: Liger-Kernel's patches for the model's family (RoPE, RMSNorm, SwiGLU / experts, and the fused linear
    cross-entropy that never materialises the logits), the loss through the model's own ``forward`` as a TRL user
    gets it (``shift_labels``: our labels are already shifted; summed over the step's loss tokens)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg["seed"])
    device = torch.device("cuda")
    model = AutoModelForCausalLM.from_pretrained(cfg["hf_dir"], dtype=torch.bfloat16, attn_implementation="sdpa")
    if cfg.get("liger"):
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    model.to(device).train()
    model.config.use_cache = False
    if cfg["recompute"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    data = np.load(cfg["train"])
    ids, labels, mask = (torch.from_numpy(data[k]) for k in ("input_ids", "labels", "loss_mask"))

    def masked_nll(x, y, m):
        logits = model(input_ids=x).logits
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        return (nll * m.flatten()).sum()

    def liger_nll(x, y, m):  # the fused linear cross-entropy: a sum over the loss tokens (ignore_index -100)
        return model(input_ids=x, shift_labels=torch.where(m > 0, y, -100), num_items_in_batch=1).loss

    loss_fn = liger_nll if cfg.get("liger") else masked_nll
    loss_fn = torch.compile(loss_fn) if cfg["compile"] else loss_fn
    mb, gb = cfg["micro_batch"], cfg["global_batch"]
    times, losses, profile = [], [], None
    for step in range(cfg["steps"]):
        prof = None
        if cfg["profile"] and step == 7:  # the same step as ours (ALIGN_PROFILE_STEP=8, 1-based)
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            prof = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        rows = (np.arange(gb) + step * gb) % ids.shape[0]
        x, y, m = (t[rows].to(device, non_blocking=True) for t in (ids, labels, mask))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = m.sum()
        loss_sum = torch.zeros((), device=device)
        for i in range(0, gb, mb):
            part = loss_fn(x[i:i + mb], y[i:i + mb], m[i:i + mb]) / total
            part.backward()
            loss_sum += part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss_sum))
        if prof is not None:
            from align_pipeline.train.core.profiling import summarize

            prof.__exit__(None, None, None)
            profile = summarize(prof.events())
    result = {"step_times": times, "losses": losses, "tokens_per_step": gb * ids.shape[1],
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "first_step_s": times[0]}
    if profile is not None:
        result["profile"] = profile
    Path(cfg["result"]).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------- micro
def micro_benchmarks(preset: dict[str, int], micro_batch: int, repeats: int = 20) -> list[dict[str, Any]]:
    """Forward + backward ms of each operation, eager vs fused (and Liger's Triton kernels when importable)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from megatron.core.models.common.embeddings import rope_utils

    from align_pipeline.model import kernels

    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:  # noqa: BLE001 -- optional
        LigerRMSNormFunction = LigerRopeFunction = LigerSiLUMulFunction = None

    dev, dt = torch.device("cuda"), torch.bfloat16
    S, b, H = preset["seq_length"], micro_batch, preset["hidden_size"]
    heads, groups, ffn = preset["num_attention_heads"], preset["num_key_value_heads"], preset["intermediate_size"]
    d = H // heads

    def timed(fn, *inputs):
        inputs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]

        def once():
            outs = fn(*inputs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        for _ in range(5):
            once()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            once()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats

    rows: list[dict[str, Any]] = []

    def add(op: str, impl: str, fn, *inputs):
        try:
            rows.append({"op": op, "impl": impl, "ms": timed(fn, *inputs)})
        except Exception as exc:  # noqa: BLE001 -- report, go on
            rows.append({"op": op, "impl": impl, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})

    # RoPE on a layer's query and key, Megatron layout [s, b, h, d]
    q, k = torch.randn(S, b, heads, d, device=dev, dtype=dt), torch.randn(S, b, groups, d, device=dev, dtype=dt)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device=dev).float() / d)
    f = torch.outer(torch.arange(S, device=dev).float(), inv)
    freqs = torch.cat((f, f), -1)[:, None, None, :]
    add("rope (q and k)", "megatron eager",
        lambda q, k: (rope_utils._apply_rotary_pos_emb_bshd(q, freqs), rope_utils._apply_rotary_pos_emb_bshd(k, freqs)),
        q, k)
    add("rope (q and k)", "fused (compiled)", lambda q, k: (kernels.rope_bshd(q, freqs), kernels.rope_bshd(k, freqs)),
        q, k)
    if LigerRopeFunction is not None:
        cos, sin = torch.cos(freqs[:, 0, 0])[None].to(dt), torch.sin(freqs[:, 0, 0])[None].to(dt)  # [1, s, d]
        add("rope (q and k)", "liger (incl. layout copies)",
            lambda q, k: LigerRopeFunction.apply(q.permute(1, 2, 0, 3).contiguous(), k.permute(1, 2, 0, 3).contiguous(),
                                                 cos, sin), q, k)
    # RMSNorm over [s, b, H]
    x, w = torch.randn(S, b, H, device=dev, dtype=dt), torch.ones(H, device=dev, dtype=dt)
    add("rmsnorm", "torch eager", lambda x, w: F.rms_norm(x, (H,), w, 1e-5), x, w)
    add("rmsnorm", "fused (compiled)", lambda x, w: kernels._compiled(kernels._rms_norm)(x, w, 1e-5), x, w)
    if LigerRMSNormFunction is not None:
        add("rmsnorm", "liger", lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-5, 0.0, "llama", False), x, w)
    # SwiGLU over [s, b, 2 ffn]
    y = torch.randn(S, b, 2 * ffn, device=dev, dtype=dt)

    def eager_swiglu(y):
        a, g = torch.chunk(y, 2, -1)
        return F.silu(a) * g

    add("swiglu", "torch eager", eager_swiglu, y)
    add("swiglu", "megatron fused (compiled)", lambda y: bias_swiglu_impl(y, None), y)
    if LigerSiLUMulFunction is not None:
        add("swiglu", "liger", lambda y: LigerSiLUMulFunction.apply(*torch.chunk(y, 2, -1)), y)
    # attention with grouped key/value heads, [b, h, s, d]
    qa = torch.randn(b, heads, S, d, device=dev, dtype=dt)
    ka, va = (torch.randn(b, groups, S, d, device=dev, dtype=dt) for _ in range(2))
    rep = heads // groups
    add("attention (GQA)", "repeat_interleave + SDPA",
        lambda q, k, v: F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                       is_causal=True), qa, ka, va)
    add("attention (GQA)", "SDPA enable_gqa",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), qa, ka, va)
    for r in rows:
        print(f"[kernels] micro {r['op']:<16} {r['impl']:<28} " + (f"{r['ms']:.3f} ms" if "ms" in r else r["error"]),
              flush=True)
    return rows


# --------------------------------------------------------------------------------------------------------------- report
def run(args: argparse.Namespace) -> dict[str, Any]:
    out, on_gpu, bf16, preset = bench_setup(args)
    data, hf_dir, params = copy_task_and_init(out, preset, args, rows=args.global_batch * args.steps)
    fpt = flops_per_token(preset, params)
    print(f"[kernels] preset {args.preset}: {params / 1e6:.1f}M parameters, {fpt / 1e9:.2f} GFLOP per token", flush=True)

    micro = micro_benchmarks(preset, args.micro_batch) if args.micro and on_gpu else []
    rows = [run_ours(Variant.parse(v), args, data, hf_dir, out, bf16) for v in args.ours]
    if on_gpu:
        for spec in args.hf:
            compiled, recompute = "compile" in spec, "recompute" in spec
            rows.append(run_hf(compiled, recompute, args.micro_batch, args, data, hf_dir, out, liger="liger" in spec))

    ok = [r for r in rows if "tokens_per_s" in r]
    for r in ok:
        r["mfu"] = r["tokens_per_s"] * fpt / (args.peak_tflops * 1e12)
    failures = []
    reference = ok[0] if ok and ok[0]["trainer"] == "ours" else None
    for r in ok:
        if r is reference or r["trainer"] != "ours" or r["micro_batch"] != reference["micro_batch"]:
            continue
        r["max_loss_diff"] = float(np.max(np.abs(np.subtract(r["losses"], reference["losses"]))))
        if r["max_loss_diff"] > args.loss_tol:
            failures.append(f"{r['variant']}: loss curve differs from {reference['variant']} by {r['max_loss_diff']:.2e}")
    report = {**run_header(), "preset": args.preset, "parameters": params,
              "flops_per_token": fpt, "settings": vars(args), "micro": micro, "rows": rows, "failures": failures}
    return write_report(out, "kernels", report, markdown(report))


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        *header_lines(report),
        (f"Model: preset `{report['preset']}`, {report['parameters'] / 1e6:.1f}M parameters, seq "
         f"{PRESETS[report['preset']]['seq_length']}, global batch {s['global_batch']}, {s['steps']} steps "
         f"(tokens/s over steps {s['warmup'] + 1}-{s['steps']}); MFU = {report['flops_per_token'] / 1e9:.2f} GFLOP "
         f"per token x tokens/s / {s['peak_tflops']:.0f} TFLOP/s"),
        "",
        ("| trainer | kernels:recompute:micro-batch | tokens/s | MFU | peak GiB train / eval / save "
         "| loss first -> last | max loss diff vs first row |"),
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['trainer']} | {r['variant']} | {r['error'][:80]} | | | | |")
            continue
        ph = r.get("peak_memory_by_phase_gib") or {}
        mem = " / ".join(f"{ph[k]:.1f}" if k in ph else "-" for k in ("train", "eval", "save"))
        diff = f"{r['max_loss_diff']:.1e}" if "max_loss_diff" in r else "-"
        variant = r["variant"] if r["trainer"] == "ours" else f"micro-batch {r['micro_batch']}"
        lines.append(f"| {r['trainer']} | {variant} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f} % | {mem} "
                     f"| {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} | {diff} |")
    profiled = [r for r in report["rows"] if "profile" in r]
    if profiled:
        cats = sorted({c for r in profiled for c in r["profile"]["categories"]})
        lines += ["", "Kernel time of one profiled step (step 8), share of the GPU time:", "",
                  "| run | GPU ms | kernels | " + " | ".join(cats) + " |", "|---|---|---|" + "---|" * len(cats)]
        for r in profiled:
            p = r["profile"]
            shares = [f"{100 * p['categories'][c]['share']:.1f} %" if c in p["categories"] else "-" for c in cats]
            lines.append(f"| {r['variant']} | {p['total_us'] / 1e3:,.0f} | {p['kernels']:,} | " + " | ".join(shares)
                         + " |")
    if report["micro"]:
        lines += ["", "| operation (forward + backward) | implementation | ms |", "|---|---|---|"]
        for m in report["micro"]:
            lines.append(f"| {m['op']} | {m['impl']} | {m['ms']:.3f} |" if "ms" in m
                         else f"| {m['op']} | {m['impl']} | {m['error'][:80]} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--ours", nargs="+", default=["eager:none:4", "fused:none:4", "fused:full:4"],
                   help="kernels:recompute:micro_batch variants of our SFT job; the first is the loss reference")
    p.add_argument("--hf", nargs="*", default=["eager", "compile"],
                   help="HF variants: eager | compile | compile-recompute | liger | liger-recompute (GPU only; liger: "
                   "Liger-Kernel's patches, the peer TRL users switch on with one flag)")
    p.add_argument("--micro", action="store_true", help="per-operation micro-benchmarks (GPU only)")
    add_run_args(p, steps=30, warmup=5, global_batch=32, eval_samples=32)
    p.add_argument("--loss-tol", type=float, default=5e-2, help="max abs loss difference vs the first variant")
    return p.parse_args(argv)


def add_run_args(p: argparse.ArgumentParser, steps: int, warmup: int, global_batch: int, eval_samples: int) -> None:
    """The run flags of the SFT benchmarks that run our job beside HF's (this one and ``moe_sft.py``): steps,
    batches, optimizer, seed, the peak for MFU, precision, profiling and the output directory."""
    p.add_argument("--profile", action="store_true", help="kernel profile of step 8 of every run (GPU only)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=warmup, help="steps left out of tokens/s")
    p.add_argument("--global-batch", type=int, default=global_batch)
    p.add_argument("--micro-batch", type=int, default=4, help="HF's micro-batch (ours: per variant)")
    p.add_argument("--eval-samples", type=int, default=eval_samples)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--fp32", action="store_true", help="ours in fp32 on a GPU too (exactness checks; bf16 default)")
    p.add_argument("--out", required=True)


if __name__ == "__main__":
    os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
    if len(sys.argv) == 3 and sys.argv[1] == "--worker-hf":
        hf_worker(json.loads(sys.argv[2]))
        sys.exit(0)
    report = run(parse_args())
    sys.exit(1 if report["failures"] else 0)
