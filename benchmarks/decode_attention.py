"""The decode step's attention alone: one query token per row against a per-row masked KV cache, GQA, bf16, timed
per layer for several ways of calling it and reported against the bandwidth floor (bytes of K and V read / HBM
bandwidth). This is what ``model/decode.py`` runs once per layer per decode step.

    python benchmarks/decode_attention.py --out /tmp/decode_attention          # GPU
    python benchmarks/decode_attention.py --out /tmp/decode_attention --rows 4 --spans 64 --repeats 2   # CPU smoke

Ways (all take q [b, heads, 1, d], the cache k, v [b, groups, span, d] and keep [b, 1, 1, span]):

* ``sdpa_gqa``: ``scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)``, the backend torch picks
  (what ``model/decode.py`` runs);
* ``sdpa_fold``: the query heads of one key/value group folded into the query-length axis, q [b, groups, heads /
  groups, d], so that the kernel reads each cached head once for its whole group with no GQA support needed; the same
  call with each SDPA backend forced (``fold_cudnn``, ``fold_efficient``, ``fold_math``; ``gqa_*`` likewise) where
  it accepts the call;
* ``bmm_fold``: the folded form as two batched GEMMs and a float32 softmax.

Each way is checked against ``fold_math`` in float32 (max abs difference printed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def fold(q: torch.Tensor, groups: int) -> torch.Tensor:
    b, heads, _, d = q.shape
    return q.view(b, groups, heads // groups, d)


def unfold(context: torch.Tensor, heads: int) -> torch.Tensor:
    b, _, _, d = context.shape
    return context.reshape(b, heads, 1, d)


def ways(scale: float) -> dict[str, Callable]:
    def sdpa_gqa(q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=True)

    def sdpa_fold(q, k, v, keep):
        return unfold(F.scaled_dot_product_attention(fold(q, k.shape[1]), k, v, attn_mask=keep, scale=scale),
                      q.shape[1])

    def forced(way, backend):
        def run(q, k, v, keep):
            with sdpa_kernel([backend]):
                return way(q, k, v, keep)
        return run

    def bmm_fold(q, k, v, keep):
        scores = torch.matmul(fold(q, k.shape[1]), k.transpose(-1, -2)) * scale  # [b, g, heads/g, span]
        scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        return unfold(torch.matmul(probs, v), q.shape[1])

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH}
    table = {"sdpa_gqa": sdpa_gqa, "sdpa_fold": sdpa_fold, "bmm_fold": bmm_fold}
    for form, way in (("gqa", sdpa_gqa), ("fold", sdpa_fold)):
        table.update({f"{form}_{name}": forced(way, backend) for name, backend in backends.items()})
    return table


def time_ms(fn: Callable, args: tuple, repeats: int, device: torch.device) -> float:
    import time

    for _ in range(3):
        fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn(*args)
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - t0) * 1000 / repeats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--spans", type=int, nargs="+", default=[512, 1024, 2048, 2560])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    from sft_scaling import device_name, hbm_tb_s

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gpu = device_name()
    bandwidth = hbm_tb_s(gpu) if device.type == "cuda" else None
    scale = args.head_dim ** -0.5
    table = ways(scale)
    generator = torch.Generator(device=device).manual_seed(0)
    report = {"date": datetime.date.today().isoformat(), "device": gpu, "torch": torch.__version__,
              "command": "python benchmarks/decode_attention.py " + " ".join(argv or sys.argv[1:]),
              "rows": args.rows, "heads": args.heads, "groups": args.groups, "head_dim": args.head_dim,
              "hbm_tb_s": bandwidth, "results": []}
    for span in args.spans:
        shape_kv = (args.rows, args.groups, span, args.head_dim)
        q = torch.randn(args.rows, args.heads, 1, args.head_dim, device=device, dtype=dtype, generator=generator)
        k = torch.randn(shape_kv, device=device, dtype=dtype, generator=generator)
        v = torch.randn(shape_kv, device=device, dtype=dtype, generator=generator)
        filled = torch.randint(1, span + 1, (args.rows,), device=device, generator=generator)
        keep = (torch.arange(span, device=device)[None, :] < filled[:, None])[:, None, None, :]
        with torch.no_grad():
            reference = table["fold_math"](q.float(), k.float(), v.float(), keep)
            kv_bytes = 2 * k.numel() * k.element_size()
            for name, fn in table.items():
                row = {"span": span, "way": name}
                try:
                    out = fn(q, k, v, keep)
                    row["max_abs_diff"] = (out.float() - reference).abs().max().item()
                    row["ms"] = time_ms(fn, (q, k, v, keep), args.repeats, device)
                    if bandwidth:
                        row["floor_fraction"] = kv_bytes / (bandwidth * 1e12) * 1000 / row["ms"]
                except RuntimeError as error:  # a forced backend that refuses the call
                    row["error"] = str(error).splitlines()[0][:160]
                report["results"].append(row)
                print(json.dumps(row), flush=True)
        (args.out / "decode_attention.json").write_text(json.dumps(report, indent=1))
    (args.out / "decode_attention.md").write_text(markdown(report))
    print(markdown(report))


def markdown(r: dict) -> str:
    spans = sorted({x["span"] for x in r["results"]})
    title = (f"{r['date']}, {r['device']}, torch {r['torch']}; `{r['command']}`; {r['rows']} rows, {r['heads']} query "
             f"heads in {r['groups']} groups, head dim {r['head_dim']}; ms per layer (fraction of the K/V bandwidth "
             "floor).")
    lines = [title, "", "| way | " + " | ".join(f"span {s}" for s in spans) + " |", "|---" * (1 + len(spans)) + "|"]
    for name in dict.fromkeys(x["way"] for x in r["results"]):
        cells = []
        for x in (y for y in r["results"] if y["way"] == name):
            if "ms" not in x:
                cells.append("refused")
            else:
                share = f" ({100 * x['floor_fraction']:.0f} %)" if "floor_fraction" in x else ""
                cells.append(f"{x['ms']:.3f}{share}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
