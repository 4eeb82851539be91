"""Reward functions and reward models in real jobs (torchrun, CPU): evaluation grouped by a record field, reward-model
only scoring without answers, a multi-attribute reward model's outputs combined by the configured weights."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from jobs import RAW, TINY_MODEL

from align_pipeline.config import (
    ConfigError,
    EvaluationConfig,
    EvaluationJob,
    EvaluationPaths,
    GenerationConfig,
    KLConfig,
    LaunchConfig,
    OptimizerConfig,
    ReinforceConfig,
    ReinforceJob,
    RewardConfig,
    RewardFunctionConfig,
    RewardModelConfig,
    RewardModelJob,
    RLLoopConfig,
    RLPaths,
    ScoringConfig,
    TrainingConfig,
    TrainPaths,
    from_dict,
    to_dict,
)
from align_pipeline.data import demo_task
from align_pipeline.data.formats import load_jsonl, save_jsonl, save_npz
from align_pipeline.data.schemas import read_raw_jsonl
from align_pipeline.data.tokenize import DataPrepConfig, encode, split_encoded
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.launch import run_torchrun
from align_pipeline.launch.torchrun import LaunchError

pytestmark = pytest.mark.slow

DEMO = RewardFunctionConfig(name="align_pipeline.rewards:demo_task", weight=1.0)
EXACT = RewardFunctionConfig(name="align_pipeline.rewards:exact_match", weight=0.5)


@pytest.fixture(scope="module")
def prompts(tiny_models, tmp_path_factory):
    """The held-out demo prompts with a ``category`` field, and the same without answers (reward-model-only data)."""
    root = tmp_path_factory.mktemp("prompts")
    records = load_jsonl(tiny_models["prompts"]["val"])[:24]
    with_category = [{**r, "category": demo_task.task_kind(r["prompt"])} for r in records]
    no_answer = [{**r, "answer": None} for r in records]
    save_jsonl(root / "categories.jsonl", with_category)
    save_jsonl(root / "no_answer.jsonl", no_answer)
    return {"categories": str(root / "categories.jsonl"), "no_answer": str(root / "no_answer.jsonl")}


@pytest.fixture(scope="module")
def two_attribute_rm(tiny_models, tmp_path_factory):
    """A (barely trained) SteerLM-style regression reward model with two outputs: correctness, length."""
    root = tmp_path_factory.mktemp("rm2")
    rng = random.Random(0)
    rows = []
    for line in (RAW / "sft.jsonl").read_text().splitlines()[:200]:
        rec = json.loads(line)
        labels = {"correctness": float(demo_task.check(rec["input"], rec["output"])), "length": len(rec["output"]) / 6}
        rows.append({"prompt": rec["input"], "response": rec["output"],
                     "labels": labels if rng.random() < 0.8 else {**labels, "length": None}})
    (root / "regression.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = read_raw_jsonl(root / "regression.jsonl", "regression")
    tok = load_tokenizer(tiny_models["tokenizer"])
    paths = {}
    for split, bundle in split_encoded(encode(raw, tok, TINY_MODEL.seq_length), raw, tok, DataPrepConfig(),
                                       TINY_MODEL.seq_length).items():
        paths[split] = str(root / f"{split}.npz")
        save_npz(paths[split], bundle.arrays, bundle.meta)
    job = RewardModelJob(
        reward_model=RewardModelConfig(loss="regression", training=TrainingConfig(
            train_steps=3, global_batch_size=8, micro_batch_size=8, eval_interval=0, eval_samples=8, save_interval=0,
            optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0))),
        model=TINY_MODEL, paths=TrainPaths(run_dir=str(root / "run"), train_data=paths["train"],
                                           val_data=paths["val"], tokenizer=tiny_models["tokenizer"],
                                           init_from=tiny_models["sft"]))
    (root / "run").mkdir()
    return run_torchrun("align_pipeline.train.reward_model", to_dict(job), LaunchConfig(), root / "run")["model_dir"]


def evaluate(tiny_models, run_dir: Path, prompts: str, reward: ScoringConfig, rm: str | None,
             group_by: str | None = None, greedy: bool = True) -> dict:
    job = EvaluationJob(
        evaluation=EvaluationConfig(generation=GenerationConfig(max_new_tokens=8, samples_per_prompt=2, seed=3),
                                    reward=reward, group_by=group_by, greedy=greedy, micro_batch_size=16),
        paths=EvaluationPaths(run_dir=str(run_dir), output_dir=str(run_dir / "out"), tokenizer=tiny_models["tokenizer"],
                              prompts=prompts, policies={"sft": tiny_models["sft"]}, reward_model=rm,
                              preference_data=tiny_models["pref"]["val"] if rm else None))
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_torchrun("align_pipeline.train.evaluate", to_dict(job), LaunchConfig(), run_dir)["report"]


def test_evaluation_groups_by_a_record_field_and_reports_each_function(tiny_models, prompts, tmp_path):
    report = evaluate(tiny_models, tmp_path / "ev", prompts["categories"], ScoringConfig(functions=[DEMO, EXACT]),
                      tiny_models["rm"], group_by="category")
    m = report["policies"]["sft"]
    records = load_jsonl(prompts["categories"])
    kinds = [demo_task.task_kind(r["prompt"]) for r in records for _ in range(2)]  # 2 samples per prompt
    correct = [e["correct"] for e in m["examples"]]
    assert len(correct) == 8 and all(isinstance(c, bool) for c in correct)
    for key in ("accuracy", "greedy_accuracy", "function_reward", "reward_demo_task", "reward_exact_match",
                "accuracy_add", "accuracy_reverse", "reward_model_score", "reward_model_score_add",
                "reward_model_score_reverse", "kl_to_reference"):
        assert isinstance(m[key], float), key
    # the demo answers are exact answers: both functions agree, the weighted mean is 1.5 x accuracy
    assert m["reward_demo_task"] == m["reward_exact_match"] == m["accuracy"]
    assert m["function_reward"] == pytest.approx(1.5 * m["accuracy"])
    n_add = kinds.count("add")
    assert m["accuracy"] == pytest.approx((m["accuracy_add"] * n_add + m["accuracy_reverse"] * (len(kinds) - n_add))
                                          / len(kinds))
    assert "reward_model" in report and report["ranking"] == ["sft"]
    table = (Path(tmp_path / "ev" / "out" / "report.md")).read_text()
    assert "accuracy add" in table and "accuracy reverse" in table


def test_reward_model_only_evaluation_needs_no_answers(tiny_models, prompts, tmp_path):
    report = evaluate(tiny_models, tmp_path / "ev", prompts["no_answer"], ScoringConfig(), tiny_models["rm"],
                      group_by="category")  # no record has it: no breakdown
    m = report["policies"]["sft"]
    assert not [k for k in m if "accuracy" in k or "function_reward" in k], m
    assert isinstance(m["reward_model_score"], float) and "correct" not in m["examples"][0]
    assert report["ranking"] == ["sft"]
    assert (tmp_path / "ev" / "out" / "reward_model_score.png").is_file()


def test_evaluation_refuses_prompts_without_the_answer_a_function_needs(tiny_models, prompts, tmp_path):
    with pytest.raises(LaunchError, match=r'no_answer.jsonl line 1: field "answer": null, but the reward function '
                                        r"align_pipeline.rewards:exact_match \(evaluation.reward.functions\[0\]\)"):
        evaluate(tiny_models, tmp_path / "ev", prompts["no_answer"], ScoringConfig(functions=[EXACT]), None)


def test_multi_attribute_reward_model_scores_with_the_attribute_weights(tiny_models, prompts, two_attribute_rm,
                                                                        tmp_path):
    scores = {}
    for name, weights in {"a": [1.0, 0.0], "b": [0.0, 2.0], "ab": [1.0, 2.0]}.items():
        report = evaluate(tiny_models, tmp_path / name, prompts["no_answer"],
                          ScoringConfig(reward_model_attribute_weights=weights), two_attribute_rm, greedy=False)
        scores[name] = report["policies"]["sft"]["reward_model_score"]
    assert scores["a"] != pytest.approx(scores["b"])
    assert scores["ab"] == pytest.approx(scores["a"] + scores["b"], rel=1e-4, abs=1e-5)  # the same samples, linear
    # no weights for a two-output model: refused before the job builds anything, naming the key
    job = EvaluationJob(paths=EvaluationPaths(run_dir="r", output_dir="o", tokenizer="t", prompts="p",
                                              policies={"sft": tiny_models["sft"]}, reward_model=two_attribute_rm))
    with pytest.raises(ConfigError, match=r"EvaluationJob.evaluation.reward.reward_model_attribute_weights is not set, "
                                          r"but the reward model .* has 2 outputs"):
        from_dict(EvaluationJob, to_dict(job))


def test_reinforce_with_a_multi_attribute_reward_model_and_no_functions(tiny_models, prompts, two_attribute_rm,
                                                                        tmp_path):
    """Reward-model-only REINFORCE on prompts without answers: it trains, and reports no accuracy."""
    run_dir = tmp_path / "rf"
    section = ReinforceConfig(
        rl=RLLoopConfig(seed=1, iterations=1, prompts_per_iteration=4, micro_batch_size=8, eval_interval=0,
                        eval_prompts=4, save_interval=0),
        generation=GenerationConfig(max_new_tokens=6, samples_per_prompt=2, seed=1),
        reward=RewardConfig(reward_model_weight=1.0, reward_model_attribute_weights=[1.0, 0.5]),
        kl=KLConfig(estimator="k3", beta=0.0), optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=0))
    job = ReinforceJob(reinforce=section, model=TINY_MODEL, paths=RLPaths(
        run_dir=str(run_dir), prompts=prompts["no_answer"], val_prompts=prompts["no_answer"],
        tokenizer=tiny_models["tokenizer"], policy=tiny_models["sft"], reward_model=two_attribute_rm))
    run_dir.mkdir()
    result = run_torchrun("align_pipeline.train.reinforce", to_dict(job), LaunchConfig(), run_dir)
    (it,) = result["history"]
    assert "rollout/accuracy" not in it and np.isfinite(it["rollout/reward_model_score"])
    assert it["rollout/rewards_mean"] == pytest.approx(it["rollout/reward_model_score"], abs=1e-5)
    assert not [k for k in result if k.startswith("val/")]
    bad = to_dict(job)
    bad["reinforce"]["reward"]["reward_model_attribute_weights"] = None
    with pytest.raises(ConfigError, match=r"ReinforceJob.reinforce.reward.reward_model_attribute_weights is not set"):
        from_dict(ReinforceJob, bad)
