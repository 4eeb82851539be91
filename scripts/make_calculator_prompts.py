"""Write the tool-calling demo's prompts (``data/01_raw/calculator_prompts.jsonl``): arithmetic too long to do in one's
head, for a policy that may call the calculator tool (``align_pipeline.envs.builtin:Calculator``).

    python scripts/make_calculator_prompts.py --out data/01_raw/calculator_prompts.jsonl    # the shipped file (seed 0)

Deterministic: the same flags give a byte-identical file. Each line: ``{"prompt", "answer", "category"}``; answers
are integers.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def problem(rng: random.Random) -> tuple[str, str, str]:
    kind = rng.choice(("product", "sum", "mixed", "difference"))
    if kind == "product":
        a, b = rng.randint(101, 999), rng.randint(11, 99)
        return kind, f"What is {a} times {b}?", str(a * b)
    if kind == "sum":
        terms = [rng.randint(1000, 9999) for _ in range(rng.randint(3, 4))]
        return kind, f"What is the sum of {', '.join(map(str, terms[:-1]))} and {terms[-1]}?", str(sum(terms))
    if kind == "difference":
        a, b = rng.randint(10_000, 99_999), rng.randint(1000, 9999)
        return kind, f"What is {a} minus {b}?", str(a - b)
    a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(100, 999)
    return kind, f"A crate holds {a} boxes of {b} items each, and {c} items are taken out. How many items are left?", \
        str(a * b - c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/01_raw/calculator_prompts.jsonl")
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    lines = []
    for _ in range(args.n):
        category, prompt, answer = problem(rng)
        lines.append(json.dumps({"prompt": prompt, "answer": answer, "category": category}))
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
