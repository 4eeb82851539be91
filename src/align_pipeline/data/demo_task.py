"""The embedded demo task: short, verifiable string/arithmetic problems a ~0.5M-parameter GPT learns on a CPU.

Two kinds of prompt, one answer each, checked by a function (the verifiable reward of REINFORCE/PPO/evaluation):

    reverse: abcd\\n   ->  dcba        (3-6 lowercase letters, reversed)
    add: 23+45\\n      ->  68          (two 2-digit numbers, 10..99, no carry in any column, summed)

With the character-level tokenizer a sample is at most 24 tokens (``<bos>`` + 16 prompt chars + 6 answer chars +
``<eos>``), well under ``model.seq_length`` = 48.

:func:`make_demo_datasets` builds the shipped ``data/01_raw`` files (``scripts/make_demo_data.py`` writes them):
SFT data in which ~30 % of the responses are *plausibly* wrong (an off-by-one digit, a swapped letter pair, the
letters left unreversed, a dropped letter), preference pairs (correct vs plausibly wrong) and held-out prompts whose
strings appear in neither the SFT nor the preference file. Nothing here imports Kedro or torch.

Why no carries by default: in small experiments (2-layer, hidden-128 GPT, 300 steps of 32 samples, 30 % noisy
labels) no-carry addition reached 10-70 % greedy accuracy on held-out prompts while carrying 2-digit addition stayed
at 3-9 %; an RL stage needs a policy that is right some of the time. ``carries=True`` (``--carries``) gives the harder
task; :func:`answer_for` / :func:`check` handle any sum.
"""

from __future__ import annotations

import random
import re
import string
from typing import Any

REVERSE_PREFIX = "reverse: "
ADD_PREFIX = "add: "
MIN_LETTERS, MAX_LETTERS = 3, 6
MIN_OPERAND, MAX_OPERAND = 10, 99

_REVERSE_RE = re.compile(r"^reverse: ([a-z]+)\s*$")
_ADD_RE = re.compile(r"^add: (\d+)\+(\d+)\s*$")
# Text a decoder may leave at the end of a generation: special tokens of our tokenizer and of common HF ones.
_EOS_MARKERS = ("<eos>", "<pad>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>")


# ---------------------------------------------------------------------------------------------------------------
# Prompts, answers, checking
# ---------------------------------------------------------------------------------------------------------------


def reverse_prompt(letters: str) -> str:
    return f"{REVERSE_PREFIX}{letters}\n"


def add_prompt(a: int, b: int) -> str:
    return f"{ADD_PREFIX}{a}+{b}\n"


def task_kind(prompt: str) -> str:
    """``"reverse"`` or ``"add"``; raises ``ValueError`` for a prompt that is not a demo-task prompt."""
    if _REVERSE_RE.match(prompt):
        return "reverse"
    if _ADD_RE.match(prompt):
        return "add"
    raise ValueError(f"not a demo-task prompt: {prompt!r}")


def answer_for(prompt: str) -> str:
    """The correct response to a demo-task prompt."""
    m = _REVERSE_RE.match(prompt)
    if m:
        return m.group(1)[::-1]
    m = _ADD_RE.match(prompt)
    if m:
        return str(int(m.group(1)) + int(m.group(2)))
    raise ValueError(f"not a demo-task prompt: {prompt!r}")


def normalize_response(response: str) -> str:
    """Cut a generated response at the first end-of-sequence marker and strip surrounding whitespace."""
    cut = len(response)
    for marker in _EOS_MARKERS:
        i = response.find(marker)
        if i != -1:
            cut = min(cut, i)
    return response[:cut].strip()


def check(prompt: str, response: str, answer: str | None = None) -> bool:
    """True when ``response`` (as generated: trailing whitespace / EOS text allowed) is the correct answer.

    ``answer`` (e.g. from ``prompts.jsonl``) is used when given; otherwise it is computed from the prompt.
    """
    expected = answer if answer is not None else answer_for(prompt)
    return normalize_response(response) == expected.strip()


def _wrong_add(a: int, b: int, rng: random.Random) -> str:
    total = a + b
    candidates = []
    if (a % 10) + (b % 10) >= 10:
        candidates += [total - 10] * 2  # forgot the carry (the classic mistake; weighted up)
    candidates += [total + 1, total - 1]  # off by one in the last digit
    candidates += [total + 10, total - 10]  # off by one in the tens digit
    candidates = [c for c in candidates if c != total and c >= 0]
    return str(rng.choice(candidates))


def _wrong_reverse(letters: str, rng: random.Random) -> str:
    right = letters[::-1]
    candidates = []
    for i in range(len(right) - 1):  # one adjacent pair swapped
        swapped = right[:i] + right[i + 1] + right[i] + right[i + 2 :]
        if swapped != right:
            candidates += [swapped] * 2
    if letters != right:
        candidates.append(letters)  # not reversed at all
    candidates.append(right[:-1])  # last letter dropped
    return rng.choice(candidates)


def wrong_answer_for(prompt: str, rng: random.Random) -> str:
    """A plausible but wrong response to ``prompt`` (never equal to the right one)."""
    kind = task_kind(prompt)
    if kind == "add":
        m = _ADD_RE.match(prompt)
        assert m is not None
        wrong = _wrong_add(int(m.group(1)), int(m.group(2)), rng)
    else:
        m = _REVERSE_RE.match(prompt)
        assert m is not None
        wrong = _wrong_reverse(m.group(1), rng)
    assert wrong != answer_for(prompt)
    return wrong


# ---------------------------------------------------------------------------------------------------------------
# Dataset generation
# ---------------------------------------------------------------------------------------------------------------


def has_carry(a: int, b: int) -> bool:
    """True when the column-wise sum of ``a + b`` carries anywhere (e.g. 27+45, 73+52)."""
    while a or b:
        if a % 10 + b % 10 >= 10:
            return True
        a, b = a // 10, b // 10
    return False


def addition_pairs(carries: bool = False) -> list[tuple[int, int]]:
    """All operand pairs of the addition task, in order; without ``carries`` only sums with no carry in any column
    (1980 pairs, sums 20..99 - learnable in a few hundred steps, where carrying addition is not)."""
    span = range(MIN_OPERAND, MAX_OPERAND + 1)
    return [(a, b) for a in span for b in span if carries or not has_carry(a, b)]


class _PromptSource:
    """Random prompts: reversal prompts drawn fresh (a huge space), addition prompts dealt from a shuffled pool.

    :meth:`draw` never returns an excluded prompt and avoids repeats within one draw while the space allows.
    """

    def __init__(self, rng: random.Random, add_fraction: float, carries: bool):
        self.rng = rng
        self.add_fraction = add_fraction
        self.pairs = addition_pairs(carries)

    def _reverse(self) -> str:
        n = self.rng.randint(MIN_LETTERS, MAX_LETTERS)
        return reverse_prompt("".join(self.rng.choice(string.ascii_lowercase) for _ in range(n)))

    def draw(self, n: int, exclude: set[str]) -> list[str]:
        n_add = sum(self.rng.random() < self.add_fraction for _ in range(n))
        pool = [add_prompt(a, b) for a, b in self.pairs if add_prompt(a, b) not in exclude]
        adds: list[str] = []
        while len(adds) < n_add and pool:  # each pass deals the whole pool once (repeats only after exhausting it)
            batch = pool[:]
            self.rng.shuffle(batch)
            adds += batch[: n_add - len(adds)]
        reverses: list[str] = []
        seen = set(exclude)
        while len(reverses) < n - len(adds):
            p = self._reverse()
            if p not in seen:
                seen.add(p)
                reverses.append(p)
        out = adds + reverses
        self.rng.shuffle(out)
        return out


def make_demo_datasets(
    n_sft: int = 4000,
    n_preference: int = 2000,
    n_prompts: int = 800,
    wrong_fraction: float = 0.3,
    reward_fraction: float = 0.5,
    add_fraction: float = 0.5,
    carries: bool = False,
    seed: int = 0,
) -> dict[str, list[dict[str, Any]]]:
    """The three raw demo files as lists of records: ``{"sft": [...], "preference": [...], "prompts": [...]}``.

    Deterministic for a given seed. Held-out prompts (``prompts``) are drawn first and never occur in the SFT or
    preference data. Reversal prompts are distinct across all three files; addition prompts are distinct within a
    file until the (small) no-carry space runs out, after which SFT repeats some (with another answer: a record that
    would repeat an earlier one exactly is left out, so ``sft`` may hold fewer than ``n_sft`` records and data_prep's
    duplicate check finds nothing), and SFT and preference share some.
    A held-out prompt carries its task as ``category`` (``reverse`` / ``add``: evaluation's ``group_by``).
    """
    rng = random.Random(seed)
    source = _PromptSource(rng, add_fraction, carries)
    held_out = source.draw(n_prompts, set())
    sft_prompts = source.draw(n_sft, set(held_out))
    pref_prompts = source.draw(n_preference, set(held_out) | {p for p in sft_prompts if p.startswith(REVERSE_PREFIX)})

    sft, written = [], set()
    for p in sft_prompts:
        out = wrong_answer_for(p, rng) if rng.random() < wrong_fraction else answer_for(p)
        if (p, out) not in written:  # an exact repeat teaches nothing new and reads as a data error
            written.add((p, out))
            sft.append({"input": p, "output": out})

    preference = []
    for p in pref_prompts:
        rec: dict[str, Any] = {
            "prompt": p,
            "chosen_response": answer_for(p),
            "rejected_response": wrong_answer_for(p, rng),
        }
        if rng.random() < reward_fraction:
            rec["chosen_reward"] = 1.0
            rec["rejected_reward"] = 0.0
        preference.append(rec)

    prompts = [{"prompt": p, "answer": answer_for(p), "category": task_kind(p)} for p in held_out]
    return {"sft": sft, "preference": preference, "prompts": prompts}


__all__ = [
    "ADD_PREFIX",
    "REVERSE_PREFIX",
    "add_prompt",
    "addition_pairs",
    "answer_for",
    "check",
    "has_carry",
    "make_demo_datasets",
    "normalize_response",
    "reverse_prompt",
    "task_kind",
    "wrong_answer_for",
]
