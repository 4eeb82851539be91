"""Write the reasoning demo's prompts (``data/01_raw/reasoning_prompts.jsonl``): short multi-step math problems whose
answer the response gives as ``\\boxed{...}``, checked by ``align_pipeline.rewards:math_verify`` (or ``math_answer``).

    python scripts/make_reasoning_prompts.py --out data/01_raw/reasoning_prompts.jsonl    # the shipped file (seed 0)

Deterministic: the same flags give a byte-identical file. Each line: ``{"prompt", "answer", "category"}``; answers are
integers or reduced fractions in LaTeX (``\\frac{p}{q}``), so that a model must work out the value (not copy it).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from pathlib import Path

INSTRUCTION = "Solve the problem. Reason step by step, then give the final answer in the form \\boxed{{answer}}.\n\n"


def change(rng: random.Random) -> tuple[str, str]:
    price, count = rng.randint(15, 95), rng.randint(2, 9)
    bill = math.ceil(price * count / 500) * 5 + rng.choice((0, 5))
    item = rng.choice(("pencils", "stickers", "apples", "stamps", "notebooks"))
    name = rng.choice(("Maya", "Omar", "Lena", "Ravi", "Sofia", "Jun"))
    return ((f"{name} buys {count} {item} at {price} cents each and pays with a {bill}-dollar bill. "
            f"How many cents of change does {name} get back?"), str(bill * 100 - price * count))


def linear(rng: random.Random) -> tuple[str, str]:
    x, a = rng.randint(-12, 12), rng.choice([k for k in range(-9, 10) if k not in (0, 1)])
    b = rng.randint(-30, 30)
    return f"Solve for $x$: ${a}x {'+' if b >= 0 else '-'} {abs(b)} = {a * x + b}$.", str(x)


def series(rng: random.Random) -> tuple[str, str]:
    m = rng.randint(1, 40)
    n = m + rng.randint(5, 60)
    return f"What is the sum of all integers from {m} to {n}, inclusive?", str((m + n) * (n - m + 1) // 2)


def fraction(rng: random.Random) -> tuple[str, str]:
    b, d = rng.randint(2, 12), rng.randint(2, 12)
    a, c = rng.randint(1, 2 * b), rng.randint(1, 2 * d)
    op = rng.choice("+-")
    num = a * d + c * b if op == "+" else a * d - c * b
    g = math.gcd(num, b * d)
    p, q = num // g, b * d // g
    answer = str(p) if q == 1 else f"-\\frac{{{-p}}}{{{q}}}" if p < 0 else f"\\frac{{{p}}}{{{q}}}"
    return f"Compute $\\frac{{{a}}}{{{b}}} {op} \\frac{{{c}}}{{{d}}}$ and write it as a reduced fraction.", answer


def percent(rng: random.Random) -> tuple[str, str]:
    p = rng.choice((5, 10, 12, 15, 20, 25, 30, 40, 45, 60, 75))
    whole = rng.randint(2, 40) * 100 // math.gcd(p, 100)
    up = rng.choice((True, False))
    value = whole + whole * p // 100 if up else whole - whole * p // 100
    return ((f"A price of {whole} dollars is {'raised' if up else 'lowered'} by {p}%. "
            "What is the new price in dollars?"), str(value))


def lcm(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(4, 40), rng.randint(4, 40)
    return f"What is the least common multiple of {a} and {b}?", str(a * b // math.gcd(a, b))


def remainder(rng: random.Random) -> tuple[str, str]:
    base, exp, mod = rng.randint(2, 9), rng.randint(5, 40), rng.choice((7, 9, 11, 13))
    return f"What is the remainder when ${base}^{{{exp}}}$ is divided by {mod}?", str(pow(base, exp, mod))


KINDS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "change": change, "linear": linear, "series": series, "fraction": fraction, "percent": percent, "lcm": lcm,
    "remainder": remainder,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data/01_raw/reasoning_prompts.jsonl")
    ap.add_argument("--n", type=int, default=700, help="problems (distinct prompts)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng, seen, lines = random.Random(args.seed), set(), []
    names = sorted(KINDS)
    while len(lines) < args.n:
        kind = names[len(lines) % len(names)]
        problem, answer = KINDS[kind](rng)
        if problem in seen:
            continue
        seen.add(problem)
        lines.append(json.dumps({"prompt": INSTRUCTION.format() + problem, "answer": answer, "category": kind}))
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"{args.out}: {len(lines)} problems")


if __name__ == "__main__":
    main()
