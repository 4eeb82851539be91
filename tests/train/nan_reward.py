"""A reward function that fails on some samples (returns NaN), for the non-finite-reward tests: the demo task's
reward, except NaN for every response of odd length."""

from __future__ import annotations

from align_pipeline.rewards import demo_task


def demo_or_nan(prompt: str, response: str, record: dict) -> float:
    return float("nan") if len(response) % 2 else demo_task(prompt, response, record)


demo_or_nan.required_fields = ("answer",)
