"""What a reward function is, how a ``module:function`` spec is loaded, and the configured functions as one scorer.

A reward function is ``fn(prompt: str, response: str, record: dict) -> float`` (a bool counts as 0.0 / 1.0): pure,
no model calls. ``record`` is the prompt's record in the tokenized prompts ``.jsonl``: every field of the raw prompt
line (extra fields included), ``answer`` (None when the line had none) and ``prompt_ids``. A function declares the
record fields it reads in an attribute ``required_fields`` (a tuple of names; none declared = none needed):
``data_prep`` (:func:`align_pipeline.rewards.check_prompts`) and every job that scores
(:func:`check_records`) refuse a record that lacks one (absent or null), naming file, line and field.

Nothing here imports torch, Megatron or Kedro; a reward module is imported by the Kedro process too (the parameters
are validated before any node runs), so it should not import them either.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from align_pipeline.config.reward_spec import load_reward_function

if TYPE_CHECKING:
    from align_pipeline.config.common import ScoringConfig


class RewardFunction(Protocol):
    """``fn(prompt, response, record) -> float``; optional attribute ``required_fields: tuple[str, ...]``."""

    def __call__(self, prompt: str, response: str, record: dict[str, Any]) -> float | bool: ...


def required_fields(fn: RewardFunction) -> tuple[str, ...]:
    """The record fields ``fn`` declares it needs (``fn.required_fields``; none declared = none)."""
    return tuple(getattr(fn, "required_fields", ()))


def call(fn: RewardFunction, spec: str, prompt: str, response: str, record: dict[str, Any]) -> float:
    """``fn(prompt, response, record)`` as a float (a bool is 0.0 / 1.0); any other return type is a TypeError."""
    value = fn(prompt, response, record)
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "item") and callable(value.item):  # a 0-d numpy / torch value
        return float(value.item())
    raise TypeError(f"reward function {spec} returned {type(value).__name__}, expected a float or bool")


_KEY_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")


def metric_key(text: str) -> str:
    """``text`` as a piece of a metric name (and of a plot file name): runs of other characters than letters,
    digits, ``_``, ``.``, ``-`` become one ``_``."""
    return _KEY_CHARS.sub("_", text).strip("_") or "_"


@dataclass(frozen=True)
class Term:
    """One configured reward function."""

    spec: str
    """``module:function`` as configured."""
    fn: RewardFunction
    """The loaded function."""
    weight: float
    """Its weight in the sequence score."""
    key: str
    """Its short name in metric names: the function's name, made unique among the terms."""
    where: str
    """The parameter that configures it, e.g. ``params:ppo.reward.functions[0]``."""


@dataclass(frozen=True)
class RewardFunctions:
    """The reward functions of one stage, loaded: each response gets one value per function; their weighted sum is
    the functions' part of the sequence score, and the accuracy function's value (>= 1 = correct) is the accuracy."""

    terms: tuple[Term, ...]
    """In configured order."""
    accuracy: int | None
    """Index of the accuracy function in ``terms``; None = no accuracy metrics (no functions)."""

    @classmethod
    def load(cls, scoring: ScoringConfig, where: str) -> RewardFunctions:
        """Load ``scoring.functions`` (``where`` = the scoring section's key, e.g. ``params:ppo.reward``)."""
        terms: list[Term] = []
        for i, f in enumerate(scoring.functions):
            fn = load_reward_function(f.name, f"{where}.functions[{i}].name")
            base = metric_key(f.name.split(":")[1].split(".")[-1])
            key, n = base, 1
            while key in {t.key for t in terms}:
                n += 1
                key = f"{base}_{n}"
            terms.append(Term(f.name, fn, f.weight, key, f"{where}.functions[{i}]"))
        accuracy = None
        if terms:
            name = scoring.accuracy_function or terms[0].spec
            accuracy = next(i for i, t in enumerate(terms) if t.spec == name)
        return cls(tuple(terms), accuracy)

    def values(self, prompt: str, response: str, record: dict[str, Any]) -> list[float]:
        """Each function's value for one response, in ``terms`` order."""
        return [call(t.fn, t.spec, prompt, response, record) for t in self.terms]

    def weighted(self, values: Sequence[float]) -> float:
        """Σ_i weight_i x value_i (0.0 without functions)."""
        return float(sum(t.weight * v for t, v in zip(self.terms, values)))

    def correct(self, values: Sequence[float]) -> bool:
        """The accuracy function's value is >= 1 (needs an accuracy function)."""
        if self.accuracy is None:
            raise ValueError("no accuracy function: no reward functions are configured")
        return values[self.accuracy] >= 1.0

    def requirements(self) -> dict[str, list[Term]]:
        """Record field -> the terms whose function needs it, fields in order of first appearance."""
        needs: dict[str, list[Term]] = {}
        for t in self.terms:
            for name in required_fields(t.fn):
                needs.setdefault(name, []).append(t)
        return needs
