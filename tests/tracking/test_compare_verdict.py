"""The comparison report's verdict: a metric's direction, and a winner named only beyond the binomial noise
(hand-computed values)."""

from __future__ import annotations

import math

from align_pipeline.tracking.compare import direction, verdict


def test_directions():
    assert [direction(m) for m in ("dpo/accuracy", "sft/greedy_accuracy", "reward_model/accuracy",
                                   "ppo/reward_model_score", "dpo/kl_to_reference", "sft/sft_val_perplexity",
                                   "dpo/rank", "dpo/response_length", "dpo/samples")] == [
        "↑", "↑", "↑", "↑", "↓", "↓", "↓", "", ""]


def test_a_gap_beyond_twice_the_standard_error_names_the_better_run():
    # 0.21 vs 0.30 over 800 samples each: 2 * sqrt(.21*.79/800 + .30*.70/800) = 2 * sqrt(.3759/800) = 0.04335
    evaluation = {"dpo/accuracy": [0.21, 0.30], "dpo/samples": [800.0, 800.0]}
    assert math.isclose(2 * math.sqrt((0.21 * 0.79 + 0.30 * 0.70) / 800), 0.043354, abs_tol=1e-6)
    assert verdict("dpo/accuracy", [0.21, 0.30], evaluation, ["beta=0.1", "beta=0.3"]) == \
        "beta=0.3 (gap 0.09 > 2σ 0.0434)"


def test_a_gap_within_the_noise_names_no_winner():
    # the case: -0.019 on 800 samples; 2 * sqrt((.30*.70 + .281*.719)/800) = 0.04539
    evaluation = {"dpo/accuracy": [0.300, 0.281], "dpo/samples": [800.0, 800.0]}
    assert verdict("dpo/accuracy", [0.300, 0.281], evaluation, ["a", "b"]) == "within noise (gap 0.019 ≤ 2σ 0.0454)"


def test_counts_per_metric_and_no_estimate_without_one():
    evaluation = {"reward_model/accuracy": [0.60, 0.70], "reward_model/pairs": [200.0, 200.0],
                  "sft/greedy_accuracy": [0.5, 0.6], "sft/prompts": [50.0, 50.0],
                  "dpo/kl_to_reference": [0.07, 0.02]}
    # 2 * sqrt((.6*.4 + .7*.3)/200) = 2 * sqrt(.45/200) = 0.09487 < 0.1: a winner
    assert verdict("reward_model/accuracy", [0.60, 0.70], evaluation, ["a", "b"]) == "b (gap 0.1 > 2σ 0.0949)"
    # 2 * sqrt((.5*.5 + .6*.4)/50) = 2 * sqrt(.49/50) = 0.198 > 0.1: within noise (greedy: one answer per prompt)
    assert verdict("sft/greedy_accuracy", [0.5, 0.6], evaluation, ["a", "b"]) == "within noise (gap 0.1 ≤ 2σ 0.198)"
    assert verdict("dpo/kl_to_reference", [0.07, 0.02], evaluation, ["a", "b"]) == "no noise estimate"
    assert verdict("dpo/response_length", [4.1, 4.2], evaluation, ["a", "b"]) == ""
    assert verdict("dpo/kl_to_reference", [0.07, 0.07], evaluation, ["a", "b"]) == "same"
    assert verdict("dpo/accuracy", [0.3, None], {"dpo/samples": [800.0, None]}, ["a", "b"]) == ""


def test_params_only_some_runs_have_are_not_differences():
    """A run of the whole DAG vs a DPO-only rerun: the sections the rerun never ran are absent there, not different;
    only dpo.loss.beta differs."""
    from types import SimpleNamespace

    from align_pipeline.tracking.compare import Experiment, params_diff

    def parent(params):
        return SimpleNamespace(info=SimpleNamespace(run_id="r"), data=SimpleNamespace(params=params, tags={}))

    full = Experiment(parent({"dpo.loss.beta": "0.1", "sft.training.train_steps": "600", "kedro.env": "local"}))
    rerun = Experiment(parent({"dpo.loss.beta": "0.3", "kedro.env": "local"}))
    differing = params_diff([full, rerun])
    assert differing == {"dpo.loss.beta": ["0.1", "0.3"], "sft.training.train_steps": ["600", "—"]}
    assert [k for k, v in differing.items() if "—" not in v] == ["dpo.loss.beta"]  # what the report compares
