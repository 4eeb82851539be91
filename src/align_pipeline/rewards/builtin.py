"""Built-in reward functions over plain text: the demo task and exact match.

Both cut a generated response at its first end-of-sequence marker and strip surrounding whitespace first
(:func:`align_pipeline.data.demo_task.normalize_response`).
"""

from __future__ import annotations

import json
from typing import Any

from align_pipeline.data import demo_task as _demo
from align_pipeline.data.demo_task import normalize_response


def demo_task(prompt: str, response: str, record: dict[str, Any]) -> float:
    """1.0 when ``response`` equals the record's ``answer`` (the demo task: ``reverse: abc`` / ``add: 12+34``), else
    0.0. Same numbers as :func:`align_pipeline.data.demo_task.check`.

    Declares ``answer`` required: data_prep refuses a prompt without one, naming its line, instead of a job failing
    mid-rollout on a prompt that is not a demo-task prompt. Called directly on a record without one, the answer is
    computed from the prompt (``ValueError`` for a prompt that is not a demo-task prompt).
    """
    return float(_demo.check(prompt, response, record.get("answer")))


demo_task.required_fields = ("answer",)


def answer_text(answer: Any) -> str:
    """The record's ``answer`` as the text a response must equal: a string stripped, anything else (a number) as
    its JSON text (``72``, ``0.5``). A missing answer (None) is a ``ValueError``."""
    if answer is None:
        raise ValueError('the prompt record has no "answer" (data_prep refuses such prompts for this reward function)')
    return answer.strip() if isinstance(answer, str) else json.dumps(answer)


def exact_match(prompt: str, response: str, record: dict[str, Any]) -> float:
    """1.0 when the normalised response equals the record's ``answer`` (stripped) exactly, else 0.0."""
    return float(normalize_response(response) == answer_text(record["answer"]))


exact_match.required_fields = ("answer",)
