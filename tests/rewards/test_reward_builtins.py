"""The built-in text rewards: the demo task (same numbers as demo_task.check) and exact match."""

from __future__ import annotations

import json

import pytest
from jobs import RAW

from align_pipeline.data import demo_task as d
from align_pipeline.rewards import demo_task, exact_match


def test_demo_task_gives_the_numbers_of_the_demo_checker_on_the_shipped_prompts():
    records = [json.loads(line) for line in (RAW / "prompts.jsonl").read_text().splitlines()]
    responses = ["", "dcba", "<eos>", "22", " 98 <eos>junk", "lns\n", "lsn", "99"]
    checked = 0
    for rec in records[:40]:
        for resp in [*responses, d.answer_for(rec["prompt"]), d.answer_for(rec["prompt"]) + "<|im_end|>"]:
            want = d.check(rec["prompt"], resp, rec.get("answer"))
            got = demo_task(rec["prompt"], resp, {**rec, "prompt_ids": [1, 2]})
            assert got == float(want) and isinstance(got, float), (rec, resp)
            checked += want
    assert checked >= 80  # every prompt's own answer (plain and with an EOS marker) is accepted


def test_demo_task_by_hand():
    assert demo_task("add: 23+45\n", "68<eos>", {"answer": "68"}) == 1.0
    assert demo_task("add: 23+45\n", "67", {"answer": "68"}) == 0.0
    assert demo_task("reverse: abcd\n", " dcba \n<pad><pad>", {"answer": None}) == 1.0  # answer from the prompt
    assert demo_task("reverse: abcd\n", "dcba", {}) == 1.0
    assert demo_task.required_fields == ("answer",)  # data_prep refuses prompts without one (a job never sees them)
    with pytest.raises(ValueError, match="not a demo-task prompt"):
        demo_task("What is 2+2?", "4", {"answer": None})


@pytest.mark.parametrize(("response", "answer", "want"), [
    ("Paris", "Paris", 1.0),
    ("  Paris \n", "Paris", 1.0),             # surrounding whitespace
    ("Paris<|eot_id|>more text", "Paris", 1.0),  # cut at the first end-of-sequence marker
    ("Paris</s>", " Paris\n", 1.0),           # the answer is stripped too
    ("paris", "Paris", 0.0),                  # case matters
    ("Paris.", "Paris", 0.0),                 # exact means exact
    ("The answer is Paris", "Paris", 0.0),
    ("72", 72, 1.0),                          # a number answer: its JSON text
    ("0.5", 0.5, 1.0),
    ("72.0", 72, 0.0),
])
def test_exact_match(response, answer, want):
    assert exact_match("q", response, {"prompt": "q", "answer": answer}) == want


def test_exact_match_needs_an_answer():
    assert exact_match.required_fields == ("answer",)
    with pytest.raises(ValueError, match='no "answer"'):
        exact_match("q", "x", {"prompt": "q", "answer": None})
