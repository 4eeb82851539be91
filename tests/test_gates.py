"""Gates (align_pipeline.evaluation.gates): the reward-model gate before an RL stage, promotion by gain over SFT and KL, with
hand-computed values."""

from __future__ import annotations

import pytest

from align_pipeline.errors import UserError
from align_pipeline.evaluation.gates import GateFailed, check_reward_model_gate, gates_markdown, promotion

POLICIES = {
    "sft": {"accuracy": 0.40, "kl_to_reference": 0.0},
    "dpo": {"accuracy": 0.55, "kl_to_reference": 3.0},  # gain +0.15, KL 3
    "ppo": {"accuracy": 0.50, "kl_to_reference": 0.5},  # gain +0.10, KL 0.5
    "reinforce": {"accuracy": 0.38, "kl_to_reference": 0.2},  # gain -0.02
}
RANKING = ["dpo", "ppo", "sft", "reinforce"]


def test_reward_model_gate_passes_fails_and_names_gate_threshold_and_value():
    check_reward_model_gate("ppo.gate.min_reward_model_accuracy", 0.6, {"metrics": {"val_accuracy": 0.6}}, "v1")
    check_reward_model_gate("ppo.gate.min_reward_model_accuracy", None, {}, "v1")  # no gate
    with pytest.raises(GateFailed) as info:
        check_reward_model_gate("ppo.gate.min_reward_model_accuracy", 0.7, {"metrics": {"val_accuracy": 0.645}}, "v1")
    error = info.value
    assert isinstance(error, UserError)  # printed without a traceback, exit 2
    assert (error.gate, error.threshold, error.value) == ("ppo.gate.min_reward_model_accuracy", 0.7, 0.645)
    assert str(error) == ("gate ppo.gate.min_reward_model_accuracy failed: the held-out accuracy of reward model v1 "
                          "is 0.645, the gate needs 0.7; the dependent nodes were not run")
    with pytest.raises(GateFailed, match="is missing"):  # a checkpoint that recorded no accuracy fails the gate
        check_reward_model_gate("ppo.gate.min_reward_model_accuracy", 0.5, {"metrics": {}}, "v1")


def test_promotion_picks_the_best_ranked_policy_passing_every_gate():
    results, promoted = promotion(POLICIES, RANKING, "sft", min_gain_over_sft=0.0, max_kl_to_reference=1.0)
    assert promoted == "ppo"  # dpo ranks first but its KL 3.0 > 1.0
    assert set(results) == {"dpo", "ppo", "reinforce"}  # the reference is not gated
    dpo = {r.gate.rsplit(".", 1)[-1]: (r.value, r.passed) for r in results["dpo"]}
    assert dpo["min_gain_over_sft"][0] == pytest.approx(0.15) and dpo["min_gain_over_sft"][1]
    assert dpo["max_kl_to_reference"] == (3.0, False)
    gain = results["reinforce"][0]
    assert gain.value == pytest.approx(-0.02) and not gain.passed


def test_promotion_without_gates_promotes_the_best_non_reference_and_none_when_all_fail():
    assert promotion(POLICIES, RANKING, "sft", None, None)[1] == "dpo"
    assert promotion(POLICIES, RANKING, "sft", 0.5, None)[1] is None
    results, promoted = promotion(POLICIES, RANKING, None, 0.0, None)  # no reference: the gain is unmeasurable
    assert promoted is None and all(r.value is None and not r.passed for c in results.values() for r in c)


def test_gates_markdown_lists_each_gate_and_the_promoted_policy():
    results, promoted = promotion(POLICIES, RANKING, "sft", 0.0, 1.0)
    text = gates_markdown(results, promoted)
    assert "| dpo | evaluation.gate.max_kl_to_reference | 1 | 3 | FAIL |" in text
    assert "| ppo | evaluation.gate.min_gain_over_sft | 0 | 0.1 | pass |" in text
    assert "Promoted: **ppo**" in text
    assert "Promoted: none" in gates_markdown(*promotion(POLICIES, RANKING, "sft", 0.5, None))
