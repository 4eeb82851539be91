"""check_prompts (data_prep) and check_records (the jobs): a prompt lacking a field a configured reward function
needs is refused, naming file, line, field and the stage's function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from jobs import RAW, REPO

from align_pipeline.config import ConfigError, ScoringConfig, from_dict
from align_pipeline.data.schemas import DataValidationError
from align_pipeline.rewards import RewardFunctions, check_prompts, check_records

MATH = {"name": "align_pipeline.rewards:math_answer", "weight": 1.0}
DEMO = {"name": "align_pipeline.rewards:demo_task", "weight": 1.0}
LENGTH = {"name": "sample_rewards:length_bonus", "weight": 1.0}  # declares no fields


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # sample_rewards


def _params(*functions, rm: float = 0.0) -> dict:
    return {"reward": {"reward_model_weight": rm, "functions": list(functions)}}


RECORDS = [
    {"prompt": "a", "answer": "1", "category": "x"},
    {"prompt": "b", "answer": "2"},
    {"prompt": "c", "category": "math"},
    {"prompt": "d", "answer": None, "category": "math"},
]
LINES = [1, 2, 4, 7]  # physical lines (blank lines skipped)


def test_the_first_record_without_a_needed_field_is_named_with_file_line_field_and_stage():
    with pytest.raises(DataValidationError) as e:
        check_prompts(RECORDS, LINES, "data/01_raw/prompts.jsonl", {"ppo": _params(LENGTH), "reinforce": _params(MATH)})
    assert str(e.value) == ('data/01_raw/prompts.jsonl line 4: field "answer": missing, but the reward function '
                            "align_pipeline.rewards:math_answer (params:reinforce.reward.functions[0]) needs it")


def test_every_stage_whose_function_needs_the_field_is_named_and_null_counts_as_missing():
    records = [r for r in RECORDS if r["prompt"] != "c"]
    params = {"ppo": _params(LENGTH, MATH, rm=1.0), "evaluation": {"reward": {"functions": [MATH]}}}
    with pytest.raises(DataValidationError, match=(
            r'^p.jsonl line 7: field "answer": null, but the reward functions align_pipeline.rewards:math_answer '
            r"\(params:ppo.reward.functions\[1\]\) and align_pipeline.rewards:math_answer "
            r"\(params:evaluation.reward.functions\[0\]\) need it$")):
        check_prompts(records, [1, 2, 7], "p.jsonl", params)


def test_fields_other_than_answer_and_their_order():
    fn = {"name": "sample_rewards:category_is_math"}  # required_fields = ("category", "answer")
    with pytest.raises(DataValidationError, match=r'^p.jsonl line 2: field "category": missing, but the reward '
                                                  r"function sample_rewards:category_is_math \(params:ppo.reward"):
        check_prompts(RECORDS, LINES, "p.jsonl", {"ppo": _params(fn)})


def test_prompts_without_answers_pass_when_no_function_needs_one():
    check_prompts(RECORDS, LINES, "p.jsonl", {"ppo": _params(rm=1.0), "reinforce": _params(LENGTH),
                                             "evaluation": {"reward": {"functions": []}}})
    check_prompts(RECORDS, LINES, "p.jsonl", {"ppo": {}, "evaluation": None})  # sections left at their defaults
    check_prompts([], [], "p.jsonl", {"ppo": _params(MATH)})


def test_a_bad_function_spec_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"^params:evaluation.reward.functions\[0\].name='nope:f': cannot import"):
        check_prompts(RECORDS, LINES, "p.jsonl", {"evaluation": {"reward": {"functions": [{"name": "nope:f"}]}}})
    with pytest.raises(ValueError, match="stage 'sft' does not score with reward functions"):
        check_prompts(RECORDS, LINES, "p.jsonl", {"sft": {}})


def test_the_shipped_demo_prompts_pass_the_shipped_parameters():
    lines = (RAW / "prompts.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    params = {stage: yaml.safe_load((REPO / "conf" / "base" / f"parameters_{stage}.yml").read_text())[stage]
              for stage in ("ppo", "reinforce", "evaluation")}
    check_prompts(records, list(range(1, len(records) + 1)), str(RAW / "prompts.jsonl"), params)
    with pytest.raises(DataValidationError, match=r'prompts.jsonl line 3: field "answer": missing, but the reward '
                                                  r"functions align_pipeline.rewards:demo_task \(params:ppo.reward."
                                                  r"functions\[0\]\) and .* \(params:reinforce.*\(params:evaluation"):
        check_prompts([r if i != 2 else {"prompt": r["prompt"]} for i, r in enumerate(records)],
                      list(range(1, len(records) + 1)), "prompts.jsonl", params)


def test_the_demo_task_reward_needs_an_answer():
    """The shipped reward: a prompt without an answer (here not even a demo-task prompt) is refused with its line,
    not scored mid-rollout ("not a demo-task prompt")."""
    records = [{"prompt": "add: 1+2\n", "answer": "3"}, {"prompt": "What is 2+2?"}]
    with pytest.raises(DataValidationError, match=r'^data/01_raw/prompts.jsonl line 2: field "answer": missing, but '
                                                  r"the reward function align_pipeline.rewards:demo_task "
                                                  r"\(params:reinforce.reward.functions\[0\]\) needs it$"):
        check_prompts(records, [1, 2], "data/01_raw/prompts.jsonl", {"reinforce": _params(DEMO)})
    check_prompts(records[:1], [1], "data/01_raw/prompts.jsonl", {"reinforce": _params(DEMO)})


def test_check_records_numbers_the_lines_of_a_tokenized_file():
    fns = RewardFunctions.load(from_dict(ScoringConfig, {"functions": [MATH]}, "evaluation.reward"),
                               "evaluation.reward")
    tokenized = [{"prompt": "a", "answer": "1", "prompt_ids": [1]}, {"prompt": "b", "answer": None, "prompt_ids": [1]}]
    with pytest.raises(DataValidationError, match=r'^/x/prompts_val.jsonl line 2: field "answer": null, but the '
                                                  r"reward function align_pipeline.rewards:math_answer "
                                                  r"\(evaluation.reward.functions\[0\]\) needs it$"):
        check_records(tokenized, "/x/prompts_val.jsonl", fns)
    check_records(tokenized[:1], "/x/prompts_val.jsonl", fns)
