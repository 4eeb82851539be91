"""PPO and REINFORCE (RLOO / GRPO) entry points as real torchrun jobs on CPU (gloo): one iteration's effects, TP=2
against TP=1, and resume equality. Models: a tiny SFT policy and a reward model trained here on the demo data."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path

import pytest
from rl_jobs import (
    DEMO,
    DETERMINISTIC,
    deterministic,
    max_diff,
    outputs_of,
    ppo_job,
    reinforce_job,
    run,
    tree_hash,
)

from align_pipeline.config import (
    DynamicSamplingConfig,
    KLConfig,
    ParallelConfig,
    ReinforceLossConfig,
    RewardConfig,
    RewardFunctionConfig,
    RLLoopConfig,
)

pytestmark = pytest.mark.slow  # launches torchrun jobs or a KedroSession

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def models(tiny_models):
    return tiny_models


def test_one_ppo_iteration_trains_actor_and_critic_and_leaves_reference_and_rm_alone(models, tmp_path):
    before = {k: tree_hash(models[k]) for k in ("sft", "rm")}
    result = run("ppo", ppo_job(models, tmp_path / "ppo", iterations=1))
    (it,) = result["history"]
    assert all(math.isfinite(v) for v in it.values()), it
    for key in ("rollout/rewards_mean", "rollout/rewards_std", "rollout/rewards_with_kl", "rollout/init_policy_kl",
                "rollout/response_lengths", "rollout/fraction_of_samples_properly_ended", "rollout/advantages_mean",
                "rollout/returns_std", "rollout/values_mean", "train/policy_loss", "train/clip_fraction",
                "train/approx_kl", "train/entropy", "train/grad_norm", "train/lr", "critic/value_loss",
                "critic/grad_norm", "timing/generate_s", "timing/train_s", "throughput/generated_tokens_per_s",
                "rollout/kl_beta"):
        assert key in it, key
    assert it["rollout/init_policy_kl"] == pytest.approx(0.0, abs=1e-5)  # the actor starts as the reference
    # the rollout engine (KV-cached decode) vs the training forward over the same tokens: measured, tiny on CPU fp32
    assert 0 <= it["rollout/logprob_diff/mean"] <= it["rollout/logprob_diff/max"] < 1e-3, it
    assert it["rollout/seq_ratio/mean"] == pytest.approx(1.0, abs=1e-3) and it["rollout/seq_ratio/max"] >= 1.0 - 1e-3
    lengths = [it[f"rollout/response_length/{k}"] for k in ("p50", "p90", "max")]
    assert 1 <= lengths[0] <= lengths[1] <= lengths[2] and it["rollout/response_length/mean"] <= lengths[2]
    assert it["rollout/response_length/clip_fraction"] == pytest.approx(
        1 - it["rollout/fraction_of_samples_properly_ended"])
    assert it["train/entropy"] > 0 and it["train/grad_norm"] > 0 and it["critic/grad_norm"] > 0
    # the frozen inputs are untouched; the exported actor and critic moved away from them
    assert {k: tree_hash(models[k]) for k in ("sft", "rm")} == before
    actor = outputs_of(result["actor_dir"], tmp_path / "o1")
    sft = outputs_of(models["sft"], tmp_path / "o2")
    critic = outputs_of(result["critic_dir"], tmp_path / "o3")
    rm = outputs_of(models["rm"], tmp_path / "o4")
    assert max_diff(actor, sft) > 1e-3 and max_diff(critic, rm) > 1e-3
    meta = json.loads((Path(result["critic_dir"]) / "meta.json").read_text())
    assert meta["head"] == "value" and meta["stage"] == "ppo" and meta["lineage"]["reward_model"] == models["rm"]


def test_lora_ppo_reference_is_the_actor_with_adapters_off(models, tmp_path):
    """Actor and critic with adapters: the KL reference is the actor with its adapters off (no reference model), so
    the KL is 0 at iteration 1 (zero adapters) and not after the actor moved; a frozen copy of the same reference
    (loaded from another directory) gives the same iterations."""
    import shutil

    lora = {"rank": 4, "alpha": 8.0}
    off = run("ppo", ppo_job(models, tmp_path / "off", iterations=2, lora=lora))
    copy = tmp_path / "sft_copy"
    shutil.copytree(models["sft"], copy)
    frozen = run("ppo", ppo_job(models, tmp_path / "frozen", iterations=2, lora=lora, reference=str(copy)))
    assert "adapters off" in (tmp_path / "off" / "logs" / "rank0.log").read_text()
    first, second = off["history"]
    assert first["rollout/init_policy_kl"] == 0.0 and second["rollout/init_policy_kl"] > 1e-6
    for a, b in zip(deterministic(off["history"]), deterministic(frozen["history"])):
        assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) < 1e-5
    storage = {name: json.loads((Path(off[name]) / "meta.json").read_text())["lora"]["storage"]
               for name in ("actor_dir", "critic_dir")}
    assert storage == {"actor_dir": "adapters", "critic_dir": "merged"}  # a value head is stored merged
    actor = outputs_of(off["actor_dir"], tmp_path / "o_actor")  # merged into the SFT policy on load
    assert max_diff(actor, outputs_of(frozen["actor_dir"], tmp_path / "o_frozen")) < 1e-5
    assert max_diff(actor, outputs_of(models["sft"], tmp_path / "o_sft")) > 1e-4


def test_ppo_tensor_parallel_matches_one_rank(models, tmp_path):
    one = run("ppo", ppo_job(models, tmp_path / "tp1", iterations=2))
    two = run("ppo", ppo_job(models, tmp_path / "tp2", iterations=2,
                             parallel=ParallelConfig(tensor_model_parallel_size=2)), nproc=2)
    for a, b in zip(deterministic(one["history"]), deterministic(two["history"])):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-4), (k, a[k], b[k])
    assert max_diff(outputs_of(one["actor_dir"], tmp_path / "l1"), outputs_of(two["actor_dir"], tmp_path / "l2")) < 1e-3


@pytest.mark.parametrize("module", ["ppo", "reinforce"])
def test_resume_after_interruption_continues_with_identical_metrics(models, tmp_path, module):
    """PPO with one critic warm-up iteration (unclipped value loss): the stop falls where the actor starts training."""
    make = functools.partial(ppo_job, critic_warmup=1) if module == "ppo" else reinforce_job
    full = run(module, make(models, tmp_path / "full", iterations=3))
    if module == "ppo":  # warm-up: the critic trains, the actor does not; then both
        assert "train/policy_loss" not in full["history"][0] and "critic/value_loss" in full["history"][0]
        assert "train/policy_loss" in full["history"][1]
        assert full["history"][1]["rollout/init_policy_kl"] == pytest.approx(0.0, abs=1e-5)  # the actor is unchanged
        assert full["history"][2]["rollout/init_policy_kl"] > 0
    stopped = run(module, make(models, tmp_path / "resumed", iterations=3, stop_after=1))
    assert stopped["stopped_at_iteration"] == 1
    resumed = run(module, make(models, tmp_path / "resumed", iterations=3))
    assert [h["iteration"] for h in resumed["history"]] == [2, 3]
    assert deterministic(resumed["history"]) == deterministic(full["history"][1:])  # exact, not approximate
    assert deterministic(stopped["history"]) == deterministic(full["history"][:1])
    assert outputs_of(resumed["actor_dir"], tmp_path / "a") == outputs_of(full["actor_dir"], tmp_path / "b")


def test_reinforce_rloo_single_step_and_data_parallel(models, tmp_path):
    """On-policy RLOO (one step per rollout: no ratio) on two DP ranks; groups stay whole on a rank."""
    job = reinforce_job(models, tmp_path / "rloo", iterations=2,
                        loss=ReinforceLossConfig(estimator="rloo"), kl=KLConfig(estimator="k3", beta=0.0),
                        rl=RLLoopConfig(seed=3, iterations=2, prompts_per_iteration=8, epochs=1, minibatches=1,
                                        micro_batch_size=8, eval_interval=1, eval_prompts=8, save_interval=0))
    result = run("reinforce", job, nproc=2)
    first = result["history"][0]
    assert "train/clip_fraction" not in first and "train/pg_loss" in first
    # kl.beta 0: no reference model and no reference forward, so no KL metrics and no reference in the lineage
    assert "no KL reference" in (tmp_path / "rloo" / "logs" / "rank0.log").read_text()
    assert "train/kl" not in first and "rollout/init_policy_kl" not in first
    assert json.loads((Path(result["actor_dir"]) / "meta.json").read_text())["lineage"]["reference"] is None
    # on-policy: no forward over the rollout besides the training step's own, which measures the engine's mismatch
    assert "rollout/logprob_diff/mean" not in first and 0 <= first["train/logprob_diff"] < 1e-3, first
    assert first["train/is_weight"] == pytest.approx(1.0) and first["train/is_dropped"] == 0  # correction: none
    # the length distribution over both DP ranks' samples (gathered)
    assert 1 <= first["rollout/response_length/p50"] <= first["rollout/response_length/p90"] \
        <= first["rollout/response_length/max"]
    assert first["rollout/advantages_mean"] == pytest.approx(0.0, abs=1e-6)  # RLOO advantages sum to 0 per group
    assert 0.0 <= result["val/greedy_accuracy"] <= 1.0 and "val/accuracy" in result["history"][0]


@pytest.mark.parametrize("loss", [
    {"rollout_correction": "tis", "tis_cap": 2.0},  # truncated IS of the rollout-training mismatch
    {"ratio_level": "sequence", "clip_eps_high": 0.28, "rollout_correction": "mis"},  # GSPO + DAPO's clip-higher
    {"objective": "cispo", "clip_eps_high": 0.28},  # CISPO
], ids=["tis", "gspo_clip_higher_mis", "cispo"])
def test_reinforce_multi_step_objectives_and_rollout_corrections_run(models, tmp_path, loss):
    """Several steps per rollout (epochs 2 x minibatches 2): the training forward over the rollout measures the
    engine's mismatch, and the importance weights (1 where the two log-probs agree) stay at 1 within it."""
    job = reinforce_job(models, tmp_path / "r", iterations=1, loss=ReinforceLossConfig(estimator="grpo", **loss))
    (it,) = run("reinforce", job)["history"]
    assert all(math.isfinite(v) for v in it.values()), it
    assert "train/clip_fraction" in it and 0 <= it["rollout/logprob_diff/mean"] < 1e-3, it
    assert it["train/is_weight"] == pytest.approx(1.0, abs=1e-3) and it["train/is_dropped"] == 0


def test_loss_aggregation_changes_the_gradient_not_the_per_token_metrics(models, tmp_path):
    """One on-policy step per rollout from the same start: the per-token metrics (pg_loss, kl) are the same whatever
    the aggregation; the gradient (its norm) is not."""
    firsts = {}
    for aggregation in ("token_mean", "seq_mean_token_mean", "dr_grpo"):
        job = reinforce_job(models, tmp_path / aggregation, iterations=1,
                            loss=ReinforceLossConfig(estimator="grpo", aggregation=aggregation),
                            rl=RLLoopConfig(seed=3, iterations=1, prompts_per_iteration=8, epochs=1, minibatches=1,
                                            micro_batch_size=4, eval_interval=0, eval_prompts=8, save_interval=0))
        (firsts[aggregation],) = run("reinforce", job)["history"]
    base = firsts["token_mean"]
    for aggregation, it in firsts.items():
        assert it["train/pg_loss"] == pytest.approx(base["train/pg_loss"], rel=1e-5, abs=1e-7), aggregation
        assert it["train/kl"] == pytest.approx(base["train/kl"], rel=1e-5, abs=1e-9), aggregation
    assert firsts["seq_mean_token_mean"]["train/grad_norm"] != pytest.approx(base["train/grad_norm"], rel=1e-3)
    assert firsts["dr_grpo"]["train/grad_norm"] != pytest.approx(base["train/grad_norm"], rel=1e-3)


def test_reward_workers_score_as_the_rank_does(models, tmp_path):
    """``reward.workers: 2``: the reward functions run in spawned worker processes of the rank; the same rollout
    scores the same (same seed: the same rewards and accuracy), with no timeout counted."""
    results = {}
    for workers in (0, 2):
        job = reinforce_job(models, tmp_path / f"w{workers}", iterations=1,
                            reward=RewardConfig(reward_model_weight=0.0, functions=[DEMO], workers=workers,
                                                timeout_s=60.0))
        (results[workers],) = run("reinforce", job)["history"]
    for key in ("rollout/rewards_mean", "rollout/accuracy"):
        assert results[2][key] == results[0][key], key
    assert results[2]["rollout/reward_timeouts"] == 0 == results[0]["rollout/reward_timeouts"]


def test_dynamic_sampling_drops_groups_without_signal_and_refills(models, tmp_path):
    """DAPO's dynamic sampling. A reward with signal in every group: nothing is dropped, and the run is the run
    without dynamic sampling. A reward that scores every response of half the prompts 0: those groups are dropped,
    later rounds refill the batch (no trained group without signal), and a run resumed after iteration 1 samples
    and trains exactly as the uninterrupted one."""
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}

    def job(name: str, reward: str, enabled: bool = True, **kw):
        return reinforce_job(models, tmp_path / name, reward=RewardConfig(
            reward_model_weight=0.0, functions=[RewardFunctionConfig(name=f"group_reward:{reward}")]),
            dynamic_sampling=DynamicSamplingConfig(enabled=enabled, max_rounds=6), **kw)

    (off,) = run("reinforce", job("off", "every_group_with_signal", enabled=False, iterations=1), env=env)["history"]
    (on,) = run("reinforce", job("on", "every_group_with_signal", iterations=1), env=env)["history"]
    assert on["rollout/dynamic_sampling/rounds"] == 1 and on["rollout/dynamic_sampling/dropped_groups"] == 0
    assert {k: v for k, v in on.items() if "dynamic_sampling" not in k and k.startswith(DETERMINISTIC)} == {
        k: v for k, v in off.items() if k.startswith(DETERMINISTIC)}

    full = run("reinforce", job("full", "half_without_signal", iterations=2), env=env)
    for it in full["history"]:
        assert it["rollout/dynamic_sampling/dropped_groups"] > 0 and it["rollout/dynamic_sampling/rounds"] > 1, it
        assert it["rollout/dynamic_sampling/padded_groups"] == 0, it
        assert it["rollout/fraction_of_groups_without_signal"] == 0, it
    assert run("reinforce", job("resumed", "half_without_signal", iterations=2, stop_after=1),
               env=env)["stopped_at_iteration"] == 1
    resumed = run("reinforce", job("resumed", "half_without_signal", iterations=2), env=env)
    assert deterministic(resumed["history"]) == deterministic(full["history"][1:])

    # no group ever has signal: every round runs, dropped groups fill the batch (zero advantages)
    (none,) = run("reinforce", job("none", "no_signal", iterations=1), env=env)["history"]
    assert none["rollout/dynamic_sampling/rounds"] == 6 and none["rollout/dynamic_sampling/padded_groups"] == 8
    assert none["rollout/dynamic_sampling/dropped_groups"] == 6 * 8 and none["rollout/advantages_mean"] == 0


def test_micro_batches_cut_to_their_rows_train_as_rows_without_the_padding(models, tmp_path):
    """A policy (a tiny random HF Llama) run at seq_length 300 gets rollout rows of 300 columns, most of them right
    padding: the rows are grouped by length and every micro-batch is cut to 128 columns (its rows' length rounded
    up) for the reference forward and the training step. The run equals one at seq_length 64, whose rows are
    neither regrouped nor cut: same rollouts, same per-row reference log-probs (KL), losses and updates over the
    iteration's four optimizer steps (up to the order in which the micro-batches' gradients add up). One iteration:
    the next one's samples come from weights that differ by that float noise, and one flipped token changes a
    response (it did, once the venv's packages changed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from align_pipeline.data.tokenizer import load_tokenizer

    tok = load_tokenizer(models["tokenizer"])
    torch.manual_seed(0)
    hf = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 tie_word_embeddings=True)).save_pretrained(str(hf))
    runs = {}
    for seq in (64, 300):
        job = reinforce_job(models, tmp_path / f"s{seq}", iterations=1)
        job = dataclasses.replace(job, model=dataclasses.replace(job.model, seq_length=seq),
                                  paths=dataclasses.replace(job.paths, policy=str(hf)))
        result = run("reinforce", job)
        meta = json.loads((Path(result["actor_dir"]) / "meta.json").read_text())
        assert meta["model"]["seq_length"] == seq
        runs[seq] = deterministic(result["history"])
    for a, b in zip(runs[64], runs[300]):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (k, a[k], b[k])  # other shapes: float noise
