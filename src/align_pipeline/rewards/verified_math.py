"""Math answers checked by Hugging Face's ``math-verify`` (the optional extra ``math``: ``pip install -e ".[math]"``).

:func:`math_verify` scores 1.0 when the response's answer is *mathematically equivalent* to the record's reference
answer, as ``math_verify.verify`` decides it: LaTeX (``\\boxed{}`` / ``\\frac`` / ``\\sqrt`` / sets, intervals,
matrices), plain expressions and numbers are parsed into SymPy, and the two compared numerically and symbolically
(``\\frac{1}{2}`` = ``0.5``; ``(x+1)^2`` = ``x^2+2x+1``; units and ``\\text{}`` ignored). Where today's
:func:`align_pipeline.rewards.math_answer` compares numbers or strings, this compares expressions.

The reference is read as :func:`align_pipeline.rewards.math_answers.reference_answer` reads it (a number, a
``\\boxed{}`` string, a GSM8K solution's ``#### n``, or a bare answer) and handed to ``math_verify.parse`` as
LaTeX. The response is parsed by ``math_verify.parse`` itself (its last ``\\boxed{}``, else its last expression).
``math-verify`` bounds its own parse and compare with a SIGALRM timer (seconds: :data:`PARSE_TIMEOUT_S`,
:data:`VERIFY_TIMEOUT_S`), which only the main thread has: called from another thread it runs without them.
"""

from __future__ import annotations

import threading
from typing import Any

from align_pipeline.errors import UserError
from align_pipeline.rewards.math_answers import reference_answer

PARSE_TIMEOUT_S = 5
"""Per parse (math-verify's ``parsing_timeout``); a parse that runs over gives no answer (score 0)."""
VERIFY_TIMEOUT_S = 5
"""Per comparison (math-verify's ``timeout_seconds``); one that runs over scores 0."""


def _library():
    try:
        from math_verify import parse, verify
    except ImportError as exc:  # the optional extra is not installed
        raise UserError('align_pipeline.rewards:math_verify needs the math-verify package: pip install -e ".[math]" '
                        f"({exc})") from exc
    return parse, verify


def math_verify(prompt: str, response: str, record: dict[str, Any]) -> float:
    """1.0 when ``math_verify.verify(gold, answer)`` holds for the record's answer (gold) and the response."""
    parse, verify = _library()
    main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (PARSE_TIMEOUT_S, VERIFY_TIMEOUT_S) if main else (None, None)
    gold = parse(f"${reference_answer(record['answer'])}$", parsing_timeout=parse_timeout)
    answer = parse(response, parsing_timeout=parse_timeout)
    if not gold or not answer:
        return 0.0
    return float(verify(gold, answer, timeout_seconds=verify_timeout))


math_verify.required_fields = ("answer",)

__all__ = ["PARSE_TIMEOUT_S", "VERIFY_TIMEOUT_S", "math_verify"]
