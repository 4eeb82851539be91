"""A math answer checker: the final answer of a response against the record's reference answer.

The response's final answer is, in this order of preference:

1. the content of its last ``\\boxed{...}`` (nested braces allowed; ``\\fbox{...}`` too),
2. else the rest of the line after its last GSM8K marker ``#### ``,
3. else the last number in the text.

The reference (``record["answer"]``) may be a number, a GSM8K solution ending in ``#### 72``, a string holding a
``\\boxed{}``, or a bare answer string. Both sides are compared numerically when both read as numbers
(thousands commas, ``$`` and ``\\$``, ``%``, a trailing ``.``, ``\\text{...}`` units, fractions ``3/4`` and
``\\frac{3}{4}`` are understood; equal within 1e-6 absolute, 1e-9 relative), else as strings with whitespace
removed.
"""

from __future__ import annotations

import math
import re
from typing import Any

from align_pipeline.data.demo_task import normalize_response

ABS_TOL = 1e-6
"""Two numbers match when they differ by at most this much (or by a relative 1e-9, for large values)."""
REL_TOL = 1e-9

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|[-−]?\.\d+")
_LEADING_NUMBER = re.compile(r"\s*\\?\$?\s*(" + _NUMBER.pattern + r")(?![\w/])")
_PLAIN = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC = re.compile(r"^([-+]?)\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}$")
_TEXT = re.compile(r"\\(?:text|textrm|mbox|mathrm)\s*\{[^{}]*\}")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces close; None if there is none."""
    found = None
    for m in _BOX.finditer(text):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    found = text[start:i]
                    break
    return found


def _gsm8k(rest: str) -> str:
    """What follows ``#### ``: its leading number when it starts with one (``72 dollars`` -> ``72``), else all."""
    m = _LEADING_NUMBER.match(rest)
    return m.group(1) if m else rest.strip()


def final_answer(response: str) -> str | None:
    """The final answer of a response: last ``\\boxed{}``, else the GSM8K ``#### `` line, else the last number;
    None when the response has none of them."""
    text = normalize_response(response)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    marks = _GSM8K.findall(text)
    if marks:
        return _gsm8k(marks[-1])
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def reference_answer(answer: Any) -> str:
    """The reference answer of a record as text: a number as is, a string's last ``\\boxed{}`` content, else what
    follows its last ``####`` (a GSM8K solution), else the whole string. None is a ``ValueError``, another type a
    ``TypeError``."""
    if answer is None:
        raise ValueError('the prompt record has no "answer" (data_prep refuses such prompts for this reward function)')
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TypeError(f"a math answer must be a string or a number, got {type(answer).__name__}")
    if not isinstance(answer, str):
        return repr(answer)
    boxed = last_boxed(answer)
    if boxed is not None:
        return boxed.strip()
    marks = _GSM8K.findall(answer)
    return _gsm8k(marks[-1]) if marks else answer.strip()


def _plain_number(text: str) -> float | None:
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    return float(text) if _PLAIN.fullmatch(text) else None


def parse_number(text: str) -> float | None:
    """``text`` as a number, or None. Read as numbers: ``1,234.5``, ``$72``, ``\\$72``, ``72.``, ``50%``,
    ``72 \\text{ dollars}``, ``1e3``, ``-3/4``, ``\\frac{3}{4}``, ``\\dfrac{-3}{4}`` (``\\frac34`` is not)."""
    s = _TEXT.sub("", text).replace("−", "-").replace("\\!", "").replace("\\,", "").strip()
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").strip()
    s = s.removesuffix(".").strip()
    m = _FRAC.match(s)
    if m:
        num, den = _plain_number(m.group(2).strip()), _plain_number(m.group(3).strip())
        if num is None or den is None or den == 0:
            return None
        return (-1 if m.group(1) == "-" else 1) * num / den
    if "/" in s:
        num_text, _, den_text = s.partition("/")
        num, den = _plain_number(num_text.strip()), _plain_number(den_text.strip())
        return num / den if num is not None and den is not None and den != 0 else None
    return _plain_number(s.replace(" ", ""))


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text).strip("$").removesuffix(".")


def answers_match(predicted: str | None, reference: str) -> bool:
    """Numerically equal (within :data:`ABS_TOL` / :data:`REL_TOL`) when both read as numbers; else equal as
    strings with whitespace, surrounding ``$`` and a trailing ``.`` removed."""
    if predicted is None:
        return False
    p, r = parse_number(predicted), parse_number(reference)
    if p is not None and r is not None:
        return math.isclose(p, r, rel_tol=REL_TOL, abs_tol=ABS_TOL)
    if p is not None or r is not None:
        return False
    return _squash(predicted) == _squash(reference) != ""


def math_answer(prompt: str, response: str, record: dict[str, Any]) -> float:
    """1.0 when the response's final answer (:func:`final_answer`) matches the record's answer
    (:func:`reference_answer`, :func:`answers_match`), else 0.0."""
    return float(answers_match(final_answer(response), reference_answer(record["answer"])))


math_answer.required_fields = ("answer",)
