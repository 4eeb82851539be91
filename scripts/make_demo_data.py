"""Write the embedded demo data (``data/01_raw/{sft,preference,prompts}.jsonl``) for the verifiable demo task.

    python scripts/make_demo_data.py --out data/01_raw            # the shipped files (seed 0)
    python scripts/make_demo_data.py --out /tmp/raw --sft 200 --preference 100 --prompts 50

Deterministic: the same flags give byte-identical files. The task itself lives in ``align_pipeline.data.demo_task``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from align_pipeline.data.demo_task import make_demo_datasets
from align_pipeline.data.formats import atomic_write_bytes

FILES = {"sft": "sft.jsonl", "preference": "preference.jsonl", "prompts": "prompts.jsonl"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data/01_raw", help="output directory")
    ap.add_argument("--sft", type=int, default=4000, help="SFT prompts drawn (exact repeats are left out: the shipped "
                    "file has 3738 lines)")
    ap.add_argument("--preference", type=int, default=2000, help="lines of preference.jsonl")
    ap.add_argument("--prompts", type=int, default=800, help="lines of prompts.jsonl (held-out prompts)")
    ap.add_argument("--wrong-fraction", type=float, default=0.3, help="share of SFT outputs that are wrong")
    ap.add_argument("--reward-fraction", type=float, default=0.5, help="share of preference lines with rewards")
    ap.add_argument("--add-fraction", type=float, default=0.5, help="share of addition (vs reversal) prompts")
    ap.add_argument("--carries", action="store_true", help="allow carrying additions (harder to learn)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    data = make_demo_datasets(
        n_sft=args.sft,
        n_preference=args.preference,
        n_prompts=args.prompts,
        wrong_fraction=args.wrong_fraction,
        reward_fraction=args.reward_fraction,
        add_fraction=args.add_fraction,
        carries=args.carries,
        seed=args.seed,
    )
    out = Path(args.out)
    os.makedirs(out, exist_ok=True)
    for kind, name in FILES.items():
        blob = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data[kind]).encode()
        atomic_write_bytes(out / name, blob)
        print(f"{out / name}: {len(data[kind])} lines, {len(blob)} bytes")


if __name__ == "__main__":
    main()
