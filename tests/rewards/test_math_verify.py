"""rewards:math_verify - Hugging Face's math-verify behind the reward-function contract (hand-made cases where
today's math_answer, which compares numbers or strings, says no and an equivalence check says yes, and back)."""

from __future__ import annotations

import threading

import pytest

from align_pipeline.rewards import math_answer, math_verify


@pytest.mark.parametrize(("response", "answer", "want"), [
    (r"The result is \boxed{\frac{1}{2}}.", "0.5", 1.0),                  # a fraction is the decimal
    (r"so \boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"Expanding: \boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),                 # the same polynomial
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0),
    (r"\boxed{2\pi}", r"\boxed{2 \pi}", 1.0),
    ("Janet has 5 eggs left.\n#### 72", "She sells ... #### 72", 1.0),    # a GSM8K reference's final answer
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}", 1.0),                              # sets, in any order
    (r"\boxed{x^2 + 2x}", "(x+1)^2", 0.0),
    (r"\boxed{4}", "3", 0.0),
    ("I don't know.", "3", 0.0),                                          # no answer at all
])
def test_equivalent_answers_score_one(response, answer, want):
    assert math_verify("", response, {"answer": answer}) == want


def test_where_it_differs_from_the_string_and_number_checker():
    record = {"answer": "(x+1)^2"}
    response = r"\boxed{x^2 + 2x + 1}"
    assert math_answer("", response, record) == 0.0 and math_verify("", response, record) == 1.0


def test_it_is_a_reward_function_by_name_and_runs_off_the_main_thread():
    from align_pipeline.rewards.base import load_reward_function

    fn = load_reward_function("align_pipeline.rewards:math_verify", "reward.functions[0].name")
    assert fn is math_verify and math_verify.required_fields == ("answer",)
    out = []
    worker = threading.Thread(target=lambda: out.append(math_verify("", r"\boxed{\frac{2}{4}}", {"answer": "0.5"})))
    worker.start()
    worker.join(60)
    assert out == [1.0]  # math-verify's SIGALRM timer is main-thread only: off it, no timeout, same answer
