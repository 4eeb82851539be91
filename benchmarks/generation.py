"""Rollout generation on one GPU, side by side: ours vs Hugging Face ``generate`` on the same weights, in one process.

    python benchmarks/generation.py --out /tmp/gen                       # H200: the shapes of issue 15
    python benchmarks/generation.py --out /tmp/gen --shapes tiny         # CPU smoke run (no HF compile)

For each shape a random-init Llama is written as an HF directory with ``transformers`` (bf16 safetensors) and loaded
twice: by ``transformers`` (``attn_implementation="sdpa"``) and by our importer into a Megatron-core GPT (bf16, SDPA
core attention, NCCL world of 1). Every generator continues the same ``batch x prompt`` random prompt ids by exactly
``new`` tokens (no EOS), sampling at T=1 (and greedy where noted); generated tokens/s and ms per decode step
((wall - prefill) / steps) are the median of ``--repeats`` warm calls. Generators:

* ``megatron_kv``: the generator before issue 15 (Megatron's ``StaticInferenceContext`` KV cache, eager), kept here
  verbatim in :func:`megatron_kv_generate` as the baseline;
* ``ours_eager``: :func:`~align_pipeline.model.generate.generate` with ``cuda_graphs=False`` (static cache, eager);
* ``ours``: :func:`generate` as rollouts run it (static cache, CUDA-graph decode step);
* ``ours_compiled``: the same with ``compile_step=True`` (``generation.compile_step``: the step through
  ``torch.compile``, then captured);
* ``hf_dynamic``: ``model.generate`` with its default dynamic cache;
* ``hf_static_compile``: ``model.generate(cache_implementation="static")``, which compiles the forward with
  ``torch.compile`` (transformers' automatic compile of the static-cache decode step).

Also measured: the first call of ``ours`` in the process (cold: graph capture and kernel selection) against a warm one;
the capture time on its own; a weight update in place followed by a call (no re-capture, no copy); and agreement with
``transformers``: the log-probs ``ours`` reports for its sampled tokens against HF's teacher-forced log-probs of the
same sequences (bf16 both; the mean and max |difference| over all generated tokens).

Writes ``<out>/generation.json`` and ``<out>/generation.md`` (the section for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sft_scaling import device_name, versions

SHAPES: dict[str, dict[str, Any]] = {
    # 368M parameters: Llama layout at hidden 1024, 24 layers, 16 heads (MHA), SwiGLU 2816, vocab 32000.
    "350m_b64": {"model": {"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
                           "num_key_value_heads": 16, "intermediate_size": 2816, "vocab_size": 32000},
                 "batch": 64, "prompt": 128, "new": 256},
    "350m_b256": {"model": "350m_b64", "batch": 256, "prompt": 128, "new": 256},
    # Llama-3.2-1B's shape (1.24B parameters, GQA 32/8, vocab 128256, tied embeddings).
    "1b_b64": {"model": {"num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
                         "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256,
                         "tie_word_embeddings": True, "rope_theta": 500000.0},
               "batch": 64, "prompt": 128, "new": 256},
    # The rollout shape late in a long generation: every row ~1,600 columns deep (decode spans of 2,048).
    "1b_b256_long": {"model": "1b_b64", "batch": 256, "prompt": 1536, "new": 64},
    "tiny": {"model": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "intermediate_size": 128, "vocab_size": 512},
             "batch": 4, "prompt": 8, "new": 8},
}


def model_shape(name: str) -> dict[str, Any]:
    shape = SHAPES[name]["model"]
    return SHAPES[shape]["model"] if isinstance(shape, str) else shape


def make_hf_model(out: Path, shape: dict[str, Any], seed: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def megatron_kv_generate(gpt, prompts, max_new_tokens: int, vocab_size: int, greedy: bool, seed: int):
    """The generator before issue 15 (commit e48561b), for equal-length prompts and no EOS: Megatron's
    ``StaticInferenceContext`` KV cache, one eager forward per token."""
    import torch
    import torch.nn.functional as F
    from megatron.core.inference.contexts import StaticInferenceContext

    from align_pipeline.model.generate import _inference_mode, _mask_honouring_attention, sample_next_token

    b, p = prompts.shape
    tokens = torch.zeros((b, p + max_new_tokens), dtype=torch.long, device=prompts.device)
    tokens[:, :p] = prompts
    positions = torch.arange(p + max_new_tokens, device=prompts.device).expand(b, -1)
    logprobs = torch.zeros((b, max_new_tokens), device=prompts.device)
    context = StaticInferenceContext(max_batch_size=b, max_sequence_length=p + max_new_tokens)
    generator = torch.Generator(device=prompts.device).manual_seed(seed)
    with _inference_mode(gpt, gpt), _mask_honouring_attention(gpt):
        for step in range(max_new_tokens):
            end = p + step
            start = 0 if step == 0 else end - 1
            logits = gpt(tokens[:, start:end].contiguous(), positions[:, start:end].contiguous(), None,
                         inference_context=context, runtime_gather_output=True)
            logits = logits[:, -1, :vocab_size].float()
            context.sequence_len_offset += end - start
            context.enable_decode_mode()
            token = sample_next_token(logits, greedy=greedy, generator=generator)
            logprobs[:, step] = F.log_softmax(logits, dim=-1).gather(1, token.unsqueeze(1)).squeeze(1)
            tokens[:, end] = token
    return tokens[:, p:], logprobs


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> tuple[list[float], Any]:
    walls, out = [], None
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        walls.append(time.perf_counter() - t0)
    return walls, out


def prefill_seconds(fn, repeats: int) -> float:
    """Wall of a 1-new-token call: the prefill (and the first sample)."""
    walls, _ = timed(fn, repeats)
    return statistics.median(walls)


def rate(name: str, walls: list[float], prefill: float, batch: int, new: int) -> dict[str, Any]:
    wall = statistics.median(walls)
    return {"generator": name, "wall_s": wall, "walls_s": walls, "tokens_per_s": batch * new / wall,
            "ms_per_step": 1000 * max(wall - prefill, 0.0) / max(new - 1, 1)}


def decode_profile(call, steps: int = 32, top: int = 12) -> dict[str, Any]:
    """The GPU kernels of one decode step of ``call(n)`` (a generation of ``n`` new tokens): a call of ``steps + 1``
    tokens minus one of 1 token (the prefill and first sample), divided by ``steps``. Kernels replayed from a CUDA
    graph are recorded by CUPTI like launched ones. Without a GPU: the CPU operators (self time; a smoke test)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()

    def kernels(n: int) -> dict[str, tuple[int, float]]:
        call(n)
        sync()
        with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
            call(n)
            sync()
        out = {}
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", 0.0) if gpu else e.self_cpu_time_total
            if us > 0:
                out[e.key] = (e.count, us)
        return out

    short, long = kernels(1), kernels(steps + 1)
    per_step = {}
    for key, (count, us) in long.items():
        c0, us0 = short.get(key, (0, 0.0))
        if count > c0:
            per_step[key] = ((count - c0) / steps, max(us - us0, 0.0) / steps)
    ranked = sorted(per_step.items(), key=lambda kv: -kv[1][1])
    return {"kernels_per_step": sum(c for c, _ in per_step.values()),
            "kernel_ms_per_step": sum(us for _, us in per_step.values()) / 1000,
            "top": [{"kernel": k[:90], "per_step": c, "us_per_step": us} for k, (c, us) in ranked[:top]]}


def run_shape(name: str, root: Path, repeats: int, dist, profile: bool = False, ours_only: bool = False
              ) -> dict[str, Any]:
    """Every generator on one shape (``ours_only``: our engine only); HF directories are written under ``root``."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from align_pipeline.config import ModelConfig, ParallelConfig
    from align_pipeline.model import init
    from align_pipeline.model.decode import _parameter_addresses
    from align_pipeline.model.generate import generate, prepare_generation

    spec = SHAPES[name]
    batch, plen, new = spec["batch"], spec["prompt"], spec["new"]
    hf_dir = root / f"hf_{name}"
    params = make_hf_model(hf_dir, model_shape(name), seed=0)
    vocab = model_shape(name)["vocab_size"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result: dict[str, Any] = {"shape": name, "parameters": params, "batch": batch, "prompt": plen, "new": new,
                              "rows": []}

    # ---- ours: import the same HF directory into Megatron-core (bf16, SDPA core attention)
    source = init.resolve(str(hf_dir), ModelConfig(attention_backend="sdpa"), tokenizer_vocab_size=0)
    source = dataclasses.replace(source, model=dataclasses.replace(source.model, seq_length=plen + new))
    gpt = init.build_model(source, ParallelConfig(bf16=True), dist)
    gpt.eval()
    g = torch.Generator().manual_seed(1)
    prompts_t = torch.randint(3, vocab, (batch, plen), generator=g).to(device)  # [b, P]
    prompts = prompts_t.tolist()

    def ours(n=new, graphs=True, greedy=False, seed=0, compiled=False):
        return generate(gpt, prompts, max_new_tokens=n, eos_id=None, pad_id=0, vocab_size=vocab, greedy=greedy,
                        seed=seed, cuda_graphs=graphs, compile_step=compiled)

    # One-off set-up as a rollout job runs it before its first rollout (cache allocation, a graph per batch width,
    # prefill and sampling kernels loaded), then the first call of the process for this model (cold).
    setup = prepare_generation(gpt, batch=batch, length=plen + new, prompt_len=plen, vocab_size=vocab, pad_id=0)
    engine = gpt._align_decode_engine
    result["setup_s"], result["capture_s"], result["captures"] = setup["setup_s"], setup["capture_s"], engine.captures
    cold, _ = timed(lambda: ours(), 1)
    result["cold_s"] = cold[0]
    pre = prefill_seconds(lambda: ours(n=1), repeats)
    walls, gen = timed(lambda: ours(), repeats)
    result["rows"].append(rate("ours", walls, pre, batch, new))
    result["warm_over_cold"] = cold[0] / statistics.median(walls)
    walls, _ = timed(lambda: ours(greedy=True), repeats)
    result["rows"].append(rate("ours_greedy", walls, pre, batch, new))
    walls, _ = timed(lambda: ours(graphs=False), repeats)
    result["rows"].append(rate("ours_eager", walls, pre, batch, new))

    if profile:
        result["profile"] = {"ours": decode_profile(lambda n: ours(n=n)),
                             "ours_eager": decode_profile(lambda n: ours(n=n, graphs=False))}

    # Weight refresh: an in-place update of every parameter (what an optimizer step does), then a call.
    t0 = time.perf_counter()
    same = _parameter_addresses(gpt) == engine._weights
    result["refresh_check_ms"] = 1000 * (time.perf_counter() - t0)
    with torch.no_grad():
        for p in gpt.parameters():
            p.mul_(1.0 + 1e-3)
    captures = engine.captures
    walls, after = timed(lambda: ours(), 1)
    result["after_update_s"] = walls[0]
    result["recaptured_after_update"] = engine.captures != captures or not same
    result["update_changed_tokens"] = after.tokens != gen.tokens
    with torch.no_grad():
        for p in gpt.parameters():
            p.div_(1.0 + 1e-3)

    # The decode step through torch.compile (generation.compile_step), captured as graphs the same way: its set-up
    # (compile + captures) and warm calls.
    setup = prepare_generation(gpt, batch=batch, length=plen + new, prompt_len=plen, vocab_size=vocab, pad_id=0,
                               compile_step=True)
    result["compiled_setup_s"] = setup["setup_s"]
    walls, compiled_gen = timed(lambda: ours(compiled=True), repeats)
    result["rows"].append(rate("ours_compiled", walls, pre, batch, new))
    walls, _ = timed(lambda: ours(greedy=True, compiled=True), repeats)
    result["rows"].append(rate("ours_compiled_greedy", walls, pre, batch, new))
    if profile:
        result["profile"]["ours_compiled"] = decode_profile(lambda n: ours(n=n, compiled=True))
    by = {r["generator"]: r for r in result["rows"]}
    result["compiled_over_ours"] = by["ours_compiled"]["tokens_per_s"] / by["ours"]["tokens_per_s"]
    if ours_only:
        return result

    # Baseline: the generator before this change.
    pre_b = prefill_seconds(lambda: megatron_kv_generate(gpt, prompts_t, 1, vocab, False, 0), max(1, repeats // 2))
    walls, _ = timed(lambda: megatron_kv_generate(gpt, prompts_t, new, vocab, False, 0), max(1, repeats // 2))
    result["rows"].append(rate("megatron_kv", walls, pre_b, batch, new))
    gpt = engine = None  # frees the GPU memory for the HF model

    # ---- transformers on the same weights
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    hf.eval()
    hf.generation_config.eos_token_id = None  # no EOS: every row generates exactly `new` tokens
    hf.generation_config.pad_token_id = 0
    mask = torch.ones_like(prompts_t)

    def hf_gen(n=new, static=False, greedy=False):
        kwargs = {"cache_implementation": "static"} if static else {}
        with torch.no_grad():
            return hf.generate(input_ids=prompts_t, attention_mask=mask, max_new_tokens=n, do_sample=not greedy,
                               temperature=1.0, top_k=0, top_p=1.0, **kwargs)

    pre_h = prefill_seconds(lambda: hf_gen(n=1), repeats)
    walls, _ = timed(lambda: hf_gen(), repeats)
    result["rows"].append(rate("hf_dynamic", walls, pre_h, batch, new))
    try:
        if device.type != "cuda":
            raise RuntimeError("skipped without a GPU")
        cold_h, _ = timed(lambda: hf_gen(static=True), 1)  # compiles
        result["hf_static_compile_cold_s"] = cold_h[0]
        pre_s = prefill_seconds(lambda: hf_gen(n=1, static=True), repeats)
        walls, _ = timed(lambda: hf_gen(static=True), repeats)
        result["rows"].append(rate("hf_static_compile", walls, pre_s, batch, new))
        walls, _ = timed(lambda: hf_gen(static=True, greedy=True), repeats)
        result["rows"].append(rate("hf_static_compile_greedy", walls, pre_s, batch, new))
        result["hf_compiled"] = hasattr(hf, "_compiled_call") or any("compile" in k for k in vars(hf))
        if profile:
            result["profile"]["hf_static_compile"] = decode_profile(lambda n: hf_gen(n=n, static=True))
    except Exception as e:  # noqa: BLE001 -- report the peer's failure instead of losing the other figures
        result["hf_static_compile_error"] = f"{type(e).__name__}: {e}"

    # Agreement: HF teacher-forced log-probs of our sampled sequences vs the log-probs ours reported (the eager-kernel
    # step and the compiled one).
    for key, ours_gen in (("logprob_vs_hf", gen), ("compiled_logprob_vs_hf", compiled_gen)):
        seqs = torch.cat([prompts_t, torch.tensor(ours_gen.tokens, device=device)], dim=1)  # [b, P + N]
        with torch.no_grad():
            logits = hf(input_ids=seqs).logits[:, plen - 1 : -1].float()  # [b, N, V]
        hf_lp = torch.log_softmax(logits, -1).gather(2, seqs[:, plen:, None]).squeeze(2)  # [b, N]
        diff = (hf_lp - torch.tensor(ours_gen.logprobs, device=device)).abs()
        result[key] = {"mean_abs": diff.mean().item(), "max_abs": diff.max().item(),
                       "mean_logprob": hf_lp.mean().item()}
    hf = None
    by = {r["generator"]: r for r in result["rows"]}
    if "hf_static_compile" in by:
        result["ours_over_hf_static_compile"] = by["ours"]["tokens_per_s"] / by["hf_static_compile"]["tokens_per_s"]
    result["ours_over_megatron_kv"] = by["ours"]["tokens_per_s"] / by["megatron_kv"]["tokens_per_s"]
    return result


def markdown(r: dict[str, Any]) -> str:
    lines = [f"### Rollout generation: ours vs HF `generate` ({r['date']}, {r['device']})", "",
             f"`{r['command']}`; {r['versions']}.", ""]
    for s in r["shapes"]:
        lines += [(f"**{s['shape']}** — {s['parameters'] / 1e6:.0f}M parameters, batch {s['batch']} x prompt "
                   f"{s['prompt']}, {s['new']} new tokens, bf16, sampling T=1 unless `greedy`"), "",
                  "| generator | generated tok/s | ms per decode step | wall s (median) |", "|---|---|---|---|"]
        for row in s["rows"]:
            lines.append(f"| {row['generator']} | {row['tokens_per_s']:,.0f} | {row['ms_per_step']:.2f} | "
                         + f"{row['wall_s']:.3f} |")
        lines.append("")
        if "ours_over_megatron_kv" in s:
            lines.append(f"- ours / HF static+compile: **{s.get('ours_over_hf_static_compile', float('nan')):.2f}x**; "
                         f"ours / before (megatron_kv): **{s['ours_over_megatron_kv']:.2f}x**")
        lines += [(f"- one-off set-up {s['setup_s']:.2f} s, of which graph capture {s['capture_s']:.2f} s "
                   f"({s['captures']} graphs); then the first call {s['cold_s']:.3f} s = {s['warm_over_cold']:.2f}x "
                   f"a warm one; HF static+compile first call {s.get('hf_static_compile_cold_s', float('nan')):.1f} s"),
                  (f"- weight update in place, then a call: {s['after_update_s']:.3f} s, re-captured: "
                   f"{s['recaptured_after_update']}, tokens changed: {s['update_changed_tokens']} (address check "
                   f"{s['refresh_check_ms']:.3f} ms)")]
        if "compiled_over_ours" in s:
            lines.append(f"- compiled step (`compile_step`): **{s['compiled_over_ours']:.2f}x** ours; its set-up "
                         f"(compile + captures) {s['compiled_setup_s']:.1f} s")
        for key, what in (("logprob_vs_hf", "ours"), ("compiled_logprob_vs_hf", "ours_compiled")):
            if key in s:
                lines.append(f"- log-probs {what} reported vs HF teacher-forced on the same sampled tokens: mean |Δ| "
                             f"{s[key]['mean_abs']:.4f}, max {s[key]['max_abs']:.3f} nats (mean log-prob "
                             f"{s[key]['mean_logprob']:.2f})")
        lines.append("")
        if "profile" in s:
            lines += [("Profile of one decode step (CUPTI, kernels inside CUDA graphs included; a 33-token call minus "
                       "a 1-token call, per step):"), "",
                      "| generator | kernels per step | kernel time per step (ms) | top kernels (us per step, calls) |",
                      "|---|---|---|---|"]
            for gen, prof in s["profile"].items():
                tops = "; ".join(f"`{t['kernel'][:48]}` {t['us_per_step']:.0f} ({t['per_step']:.0f})"
                                 for t in prof["top"][:5])
                lines.append(f"| {gen} | {prof['kernels_per_step']:.0f} | {prof['kernel_ms_per_step']:.2f} | {tops} |")
            lines.append("")
        if "hf_static_compile_error" in s:
            lines += [f"- HF static+compile failed: `{s['hf_static_compile_error']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=["350m_b64", "350m_b256", "1b_b64"], choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="also profile one decode step of ours (graphs and eager) and of HF static+compile")
    parser.add_argument("--work", type=Path, default=None, help="where the HF directories go (default: --out)")
    parser.add_argument("--ours-only", action="store_true", help="time (and profile) our engine only")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    from align_pipeline.config import ParallelConfig
    from align_pipeline.train.core.distributed import init_distributed

    dist = init_distributed(ParallelConfig(bf16=True), seed=0)
    report = {"date": datetime.date.today().isoformat(), "device": device_name(), "versions": versions(),
              "command": "python benchmarks/generation.py " + " ".join(argv or sys.argv[1:]), "shapes": []}
    for name in args.shapes:
        report["shapes"].append(run_shape(name, args.work or args.out, args.repeats, dist, args.profile, args.ours_only))
        (args.out / "generation.json").write_text(json.dumps(report, indent=1))
        print(json.dumps({k: v for k, v in report["shapes"][-1].items() if k != "rows"}), flush=True)
        for row in report["shapes"][-1]["rows"]:
            print(f"  {row['generator']:>26}: {row['tokens_per_s']:>10,.0f} tok/s  {row['ms_per_step']:.2f} ms/step",
                  flush=True)
    (args.out / "generation.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
