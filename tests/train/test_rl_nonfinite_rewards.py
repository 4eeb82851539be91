"""A NaN reward in the RL stages: PPO gives the sample advantage 0 and leaves it out of the whitening; the rollout
metrics count it (``rollout/nonfinite_rewards``) and keep it out of the reward means; and a real REINFORCE job whose
reward function returns NaN for some samples trains through every step (no skipped update, finite metrics)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from jobs import TINY_MODEL
from one_process import dist

from align_pipeline.config import (
    GenerationConfig,
    KLConfig,
    LaunchConfig,
    OptimizerConfig,
    PPOConfig,
    PPOLossConfig,
    ReinforceConfig,
    ReinforceJob,
    ReinforceLossConfig,
    RewardConfig,
    RewardFunctionConfig,
    RLLoopConfig,
    RLPaths,
    to_dict,
)
from align_pipeline.train.core.rollout import Rollout, Scores, rollout_stats

HERE = Path(__file__).resolve().parent
NAN = math.nan






def test_ppo_gives_a_nan_scored_sample_zero_advantage_and_whitens_without_it(single_process_group):
    from align_pipeline.train.ppo import advantages_and_returns

    cfg = PPOConfig(loss=PPOLossConfig(gamma=1.0, lam=1.0, whiten_advantages=True), kl=KLConfig(beta=0.0))
    scores = torch.tensor([1.0, NAN])
    values = torch.tensor([[0.5, 0.0], [0.3, 0.2]])
    logp = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    kl, adv, returns, raw = advantages_and_returns(cfg, scores, logp, logp, values, mask, 0.0, dist())
    # row 0: rewards [0, 1]; A_1 = 1 - 0 = 1, A_0 = (0 + 0 - 0.5) + 1 = 0.5; returns A + V = [1, 1]
    assert raw.tolist() == [[0.5, 1.0], [0.0, 0.0]]
    assert returns.tolist() == [[1.0, 1.0], [pytest.approx(0.3), pytest.approx(0.2)]]  # row 1: its own values
    # whitened over row 0 only: mean 0.75, std 0.25
    assert adv[0].tolist() == [pytest.approx(-1.0, abs=1e-6), pytest.approx(1.0, abs=1e-6)]
    assert adv[1].tolist() == [0.0, 0.0]
    assert torch.isfinite(kl).all()


def test_rollout_stats_count_nonfinite_rewards_and_keep_them_out_of_the_means(single_process_group):
    r = Rollout([{}] * 4, [[5]] * 4, [True] * 4, {"loss_mask": torch.ones(4, 3)}, ["a"] * 4)
    s = Scores(total=torch.tensor([1.0, NAN, 3.0, math.inf]), correct=torch.tensor([1.0, 0.0, 1.0, 0.0]),
               rm=torch.tensor([0.5, NAN, 1.5, 2.0]), functions=None)
    out = rollout_stats(r, s, None, dist()).reduce()
    assert out["rollout/nonfinite_rewards"] == 2.0
    assert out["rollout/rewards_mean"] == 2.0 and out["rollout/rewards_std"] == 1.0
    assert out["rollout/reward_model_score"] == pytest.approx(4 / 3)
    finite = Scores(total=torch.tensor([1.0, 2.0, 3.0, 4.0]), correct=None, rm=None, functions=None)
    assert rollout_stats(r, finite, None, dist()).reduce()["rollout/nonfinite_rewards"] == 0.0  # logged every step


@pytest.mark.slow  # a real torchrun job (and the tiny models)
@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_a_reinforce_job_with_nan_rewards_trains_every_step(tiny_models, tmp_path, estimator):
    from align_pipeline.launch import run_torchrun

    run_dir = tmp_path / estimator
    run_dir.mkdir()
    section = ReinforceConfig(
        rl=RLLoopConfig(seed=3, iterations=2, prompts_per_iteration=8, epochs=1, minibatches=1, micro_batch_size=8,
                        eval_interval=0, eval_prompts=8, save_interval=0),
        generation=GenerationConfig(max_new_tokens=8, samples_per_prompt=4, seed=5),
        optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=0),
        reward=RewardConfig(reward_model_weight=0.0, functions=[RewardFunctionConfig(name="nan_reward:demo_or_nan")]),
        loss=ReinforceLossConfig(estimator=estimator), kl=KLConfig(estimator="k3", beta=0.05))
    job = ReinforceJob(reinforce=section, model=TINY_MODEL, paths=RLPaths(
        run_dir=str(run_dir), prompts=tiny_models["prompts"]["train"], val_prompts=tiny_models["prompts"]["val"],
        tokenizer=tiny_models["tokenizer"], policy=tiny_models["sft"]))
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    result = run_torchrun("align_pipeline.train.reinforce", to_dict(job), LaunchConfig(nproc_per_node=1), run_dir,
                          env=env)
    history = result["history"]
    assert len(history) == 2
    for h in history:
        assert h["train/update_skipped"] == 0.0, h  # the step was taken
        for key in ("train/pg_loss", "train/grad_norm", "rollout/advantages_mean", "rollout/rewards_mean"):
            assert math.isfinite(h[key]), (key, h)
        assert 0 <= h["rollout/nonfinite_rewards"] < 32
    assert sum(h["rollout/nonfinite_rewards"] for h in history) > 0  # some responses had odd lengths
