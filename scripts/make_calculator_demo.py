"""Write the embedded demo's tool-use data (``conf/calculator_demo``): additions with carries, which the tiny demo model
gets wrong on its own, solved with the calculator in its plain call format (``calc(57+68)`` answered ``=125``).

    python scripts/make_calculator_demo.py        # data/01_raw/calculator_demo_{sft,prompts}.jsonl (seed 0)

* ``calculator_demo_sft.jsonl``: conversations in the demo's plain layout (no chat template): the prompt, the
  policy's call, the calculator's answer as the next user turn, the policy's final answer. Like the demo's own SFT
  data, a share of them is plausibly wrong (``--noise``): the call's operands copied with a digit off, the result
  copied with a digit off, or no call at all and a guessed sum - so SFT leaves room for RL.
* ``calculator_demo_prompts.jsonl``: ``{"prompt", "answer", "category"}`` for REINFORCE in the calculator
  environment; their operand pairs appear in no SFT conversation.

Deterministic: the same flags give byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def carrying_pair(rng: random.Random) -> tuple[int, int]:
    """Two 2-digit numbers whose sum carries in at least one column (the demo's own add task has none)."""
    while True:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if a % 10 + b % 10 >= 10 or a // 10 + b // 10 >= 10:
            return a, b


def off_by_one_digit(rng: random.Random, text: str) -> str:
    """``text`` with one of its digits moved by one (never the same text)."""
    positions = [i for i, c in enumerate(text) if c.isdigit()]
    i = rng.choice(positions)
    digit = int(text[i])
    new = digit + rng.choice([d for d in (-1, 1) if 0 <= digit + d <= 9])
    return text[:i] + str(new) + text[i + 1:]


def conversation(rng: random.Random, a: int, b: int, noise: float) -> list[dict[str, str]]:
    prompt, expression, total = f"add: {a}+{b}\n", f"{a}+{b}", a + b
    turns = [{"from": "User", "value": prompt}]
    kind = rng.choice(("operand", "result", "guess")) if rng.random() < noise else "right"
    if kind == "guess":  # no call: a guess one digit off the sum
        return turns + [{"from": "Assistant", "value": off_by_one_digit(rng, str(total))}]
    called = off_by_one_digit(rng, expression) if kind == "operand" else expression
    value = eval_sum(called)
    answer = off_by_one_digit(rng, str(value)) if kind == "result" else str(value)
    return turns + [{"from": "Assistant", "value": f"calc({called})"}, {"from": "User", "value": f"={value}\n"},
                    {"from": "Assistant", "value": answer}]


def eval_sum(expression: str) -> int:
    a, b = expression.split("+")
    return int(a) + int(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default="data/01_raw")
    ap.add_argument("--sft", type=int, default=2000, help="SFT conversations")
    ap.add_argument("--prompts", type=int, default=600, help="prompts for RL (and its validation)")
    ap.add_argument("--noise", type=float, default=0.4, help="share of plausibly wrong SFT conversations")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(pairs) < args.sft + args.prompts:
        pair = carrying_pair(rng)
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    sft, prompts = pairs[:args.sft], pairs[args.sft:]
    out = Path(args.out_dir)
    (out / "calculator_demo_sft.jsonl").write_text(
        "".join(json.dumps({"conversations": conversation(rng, a, b, args.noise)}) + "\n" for a, b in sft))
    (out / "calculator_demo_prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"add: {a}+{b}\n", "answer": str(a + b), "category": "add"}) + "\n"
                for a, b in prompts))


if __name__ == "__main__":
    main()
