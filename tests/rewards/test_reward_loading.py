"""Loading reward-function specs and the reward config: every mistake is a ConfigError naming the parameter key."""

from __future__ import annotations

import re

import pytest

from align_pipeline.config import (
    ConfigError,
    EvaluationConfig,
    PPOConfig,
    ReinforceConfig,
    RewardConfig,
    ScoringConfig,
    from_dict,
)
from align_pipeline.rewards import RewardFunctions, load_reward_function, math_answer

SAMPLE = "sample_rewards"  # tests/rewards/sample_rewards.py
DEMO = "align_pipeline.rewards:demo_task"


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def test_a_spec_loads_the_function():
    assert load_reward_function("align_pipeline.rewards:math_answer", "k") is math_answer
    assert load_reward_function(f"{SAMPLE}:Namespace.nested", "k")("p", "r", {}) == 0.5


@pytest.mark.parametrize(("spec", "message"), [
    ("align_pipeline.rewards.math_answer", r"expected 'module:function'"),
    ("a:b:c", r"expected 'module:function'"),
    (":math_answer", r"expected 'module:function'"),
    ("no_such_module_xyz:f", r"cannot import module 'no_such_module_xyz' \(ModuleNotFoundError"),
    ("align_pipeline.rewards:no_such", r"align_pipeline.rewards has no attribute 'no_such'"),
    (f"{SAMPLE}:NOT_A_FUNCTION", r"is a int, not a function"),
    (f"{SAMPLE}:two_args", r"cannot be called as fn\(prompt, response, record\)"),
    (f"{SAMPLE}:bad_fields", r"its required_fields must be a tuple of field names, got 'answer'"),
])
def test_a_bad_spec_names_the_key(spec, message):
    key = re.escape(f"params:ppo.reward.functions[0].name={spec!r}")
    with pytest.raises(ConfigError, match=rf"^{key}.*{message}"):
        load_reward_function(spec, "params:ppo.reward.functions[0].name")


def test_the_config_validates_specs_when_the_parameters_are_loaded():
    with pytest.raises(ConfigError, match=r"^params:ppo.reward.functions\[1\].name='nope:f': cannot import module"):
        from_dict(PPOConfig, {"reward": {"functions": [{"name": DEMO}, {"name": "nope:f", "weight": 0.5}]}},
                  "params:ppo")
    with pytest.raises(ConfigError, match=r"^params:evaluation.reward.functions\[0\].name='x': expected"):
        from_dict(EvaluationConfig, {"reward": {"functions": [{"name": "x"}]}}, "params:evaluation")
    with pytest.raises(ConfigError, match=r"params:ppo.reward.functions\[0\].name: required key is missing"):
        from_dict(PPOConfig, {"reward": {"functions": [{"weight": 1.0}]}}, "params:ppo")
    with pytest.raises(ConfigError, match=r"params:ppo.reward: unknown key\(s\) \['checker'\]"):
        from_dict(PPOConfig, {"reward": {"checker": "align_pipeline.data.demo_task:check"}}, "params:ppo")


def test_reward_config_cross_field_rules():
    with pytest.raises(ConfigError, match=r"params:reinforce.reward: no reward: reward_model_weight is 0 and no entry"):
        from_dict(ReinforceConfig, {"generation": {"samples_per_prompt": 4},
                                    "reward": {"reward_model_weight": 0.0, "functions": [{"name": DEMO, "weight": 0}]}},
                  "params:reinforce")
    with pytest.raises(ConfigError, match=r"params:ppo.reward: no reward"):
        from_dict(PPOConfig, {"reward": {"reward_model_weight": 0.0}}, "params:ppo")
    with pytest.raises(ConfigError, match=r"params:ppo.reward.accuracy_function='align_pipeline.rewards:exact_match' "
                                          r"is not one of the names in params:ppo.reward.functions"):
        from_dict(PPOConfig, {"reward": {"functions": [{"name": DEMO}],
                                         "accuracy_function": "align_pipeline.rewards:exact_match"}}, "params:ppo")
    with pytest.raises(ConfigError, match=r"params:ppo.reward.functions\[1\].name='align_pipeline.rewards:demo_task' "
                                          r"is listed twice"):
        from_dict(PPOConfig, {"reward": {"functions": [{"name": DEMO}, {"name": DEMO, "weight": 2.0}]}}, "params:ppo")
    with pytest.raises(ConfigError, match=r"params:ppo.reward.reward_model_attribute_weights is empty"):
        from_dict(PPOConfig, {"reward": {"reward_model_attribute_weights": []}}, "params:ppo")
    # reward-model only: no functions at all is a valid reward
    cfg = from_dict(PPOConfig, {"reward": {"reward_model_weight": 1.0, "functions": []}}, "params:ppo")
    assert cfg.reward.functions == [] and cfg.reward.accuracy_function is None


def _load(functions, accuracy=None) -> RewardFunctions:
    scoring = from_dict(ScoringConfig, {"functions": functions, "accuracy_function": accuracy}, "params:x.reward")
    return RewardFunctions.load(scoring, "params:x.reward")


def test_values_weighted_sum_and_accuracy_function():
    fns = _load([{"name": DEMO, "weight": 2.0}, {"name": f"{SAMPLE}:length_bonus", "weight": 0.5}])
    assert [t.key for t in fns.terms] == ["demo_task", "length_bonus"] and fns.accuracy == 0  # the first function
    assert fns.terms[1].where == "params:x.reward.functions[1]"
    v = fns.values("add: 12+34\n", "46<eos>", {"prompt": "add: 12+34\n", "answer": "46", "prompt_ids": [1]})
    assert v == [1.0, 0.7]  # "46<eos>": 7 characters / 10
    assert fns.weighted(v) == pytest.approx(2.0 * 1.0 + 0.5 * 0.7) and fns.correct(v)
    assert not fns.correct([0.0, 1.0])
    # accuracy from the second function: correct when its value is >= 1
    fns = _load([{"name": DEMO}, {"name": f"{SAMPLE}:length_bonus", "weight": 0.0}], f"{SAMPLE}:length_bonus")
    assert fns.accuracy == 1 and not fns.correct([1.0, 0.7]) and fns.correct([0.0, 1.0])


def test_no_functions_means_no_accuracy():
    fns = _load([])
    assert fns.terms == () and fns.accuracy is None and fns.values("p", "r", {}) == [] and fns.weighted([]) == 0.0
    with pytest.raises(ValueError, match="no accuracy function"):
        fns.correct([])


def test_metric_keys_are_unique_and_clean():
    fns = _load([{"name": DEMO}, {"name": f"{SAMPLE}:Namespace.nested"}, {"name": "align_pipeline.rewards.builtin:demo_task"}])
    assert [t.key for t in fns.terms] == ["demo_task", "nested", "demo_task_2"]


def test_a_function_must_return_a_number():
    fns = _load([{"name": f"{SAMPLE}:returns_text"}])
    with pytest.raises(TypeError, match=r"sample_rewards:returns_text returned str, expected a float or bool"):
        fns.values("p", "r", {})
    assert _load([{"name": f"{SAMPLE}:category_is_math"}]).values("p", "r", {"category": "math"}) == [1.0]


def test_shipped_parameters_use_the_demo_reward():
    import yaml
    from jobs import REPO

    for stage, cls in (("ppo", PPOConfig), ("reinforce", ReinforceConfig), ("evaluation", EvaluationConfig)):
        params = yaml.safe_load((REPO / "conf" / "base" / f"parameters_{stage}.yml").read_text())[stage]
        cfg = from_dict(cls, params, f"params:{stage}")
        assert [(f.name, f.weight) for f in cfg.reward.functions] == [(DEMO, 1.0)], stage
        assert isinstance(cfg.reward, RewardConfig) == (stage != "evaluation")
