"""REINFORCE and PPO in a multi-turn environment as real torchrun jobs on CPU (gloo), the tiny demo policy acting in
the test environments of toy_envs.py: episodes of several turns with their rewards summed, the turn limit, a hung
step ending its episode while the job goes on, an environment's exception naming the episode and turn, and PPO with
per-turn rewards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from jobs import TINY_MODEL

from align_pipeline.config import (
    EnvConfig,
    GenerationConfig,
    KLConfig,
    LaunchConfig,
    OptimizerConfig,
    PPOConfig,
    PPOJob,
    PPOPaths,
    ReinforceConfig,
    ReinforceJob,
    ReinforceLossConfig,
    RewardConfig,
    RLLoopConfig,
    RLPaths,
    to_dict,
)
from align_pipeline.launch import LaunchError, run_torchrun

pytestmark = pytest.mark.slow  # launches torchrun jobs

HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


def _job(models, run_dir: Path, env: dict, prompts: int = 4, iterations: int = 1) -> ReinforceJob:
    section = ReinforceConfig(
        rl=RLLoopConfig(seed=3, iterations=iterations, prompts_per_iteration=prompts, epochs=1, minibatches=1,
                        micro_batch_size=4, eval_interval=0, eval_prompts=4, save_interval=0),
        generation=GenerationConfig(max_new_tokens=12, samples_per_prompt=2, seed=5),
        optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=0),
        reward=RewardConfig(reward_model_weight=0.0, functions=[]), kl=KLConfig(estimator="k3", beta=0.0),
        loss=ReinforceLossConfig(estimator="grpo"),
        env=EnvConfig(**{"name": "toy_envs:Nudge", "workers": 2, "step_timeout_s": 20.0, **env}),
    )
    paths = RLPaths(run_dir=str(run_dir), prompts=models["prompts"]["train"], val_prompts=models["prompts"]["val"],
                    tokenizer=models["tokenizer"], policy=models["sft"])
    return ReinforceJob(reinforce=section, model=TINY_MODEL, paths=paths)


def _run(job: ReinforceJob | PPOJob) -> dict:
    Path(job.paths.run_dir).mkdir(parents=True, exist_ok=True)
    module = "ppo" if isinstance(job, PPOJob) else "reinforce"
    return run_torchrun(f"align_pipeline.train.{module}", to_dict(job), LaunchConfig(nproc_per_node=1),
                        job.paths.run_dir, env=ENV)


def test_episodes_of_several_turns_train_and_report_their_returns(tiny_models, tmp_path):
    result = _run(_job(tiny_models, tmp_path / "nudge", {"config": {"turns": 2}, "max_turns": 3}))
    m = result["history"][-1]
    # every episode: turn 1 -> " more:" (0.25), turn 2 -> done (1.0 when the answer is in it); or cut short when a
    # policy turn ends without a stop token (12 new tokens)
    assert 1.0 <= m["env/turns"] <= 2.0 and m["env/timeouts"] == 0
    assert m["env/env_tokens"] > 0 and m["env/policy_tokens"] > 0
    full = 1.0 - m["env/truncated"]  # share of episodes the environment ended
    assert m["env/return_mean"] == pytest.approx(0.25 * (m["env/turns"] - 1) + m["rollout/accuracy"], abs=1e-9)
    assert full > 0 and "val/accuracy" in result and "val/greedy_accuracy" in result

    limited = _run(_job(tiny_models, tmp_path / "limit", {"config": {"turns": 5}, "max_turns": 2}))["history"][-1]
    assert limited["env/turns"] <= 2.0 and limited["env/truncated"] == 1.0  # the turn limit ends every episode
    assert "rollout/accuracy" not in limited  # no episode reached the step that says whether it was correct


def test_a_hung_step_ends_its_episode_and_the_job_goes_on(tiny_models, tmp_path):
    job = _job(tiny_models, tmp_path / "hang", {"config": {"turns": 1, "hang_on": 1, "hang_one_in": 4},
                                                "step_timeout_s": 3.0})
    m = _run(job)["history"][-1]
    assert m["env/timeouts"] >= 1 and m["env/truncated"] > 0


def test_an_exception_in_the_environment_names_the_episode_and_turn(tiny_models, tmp_path):
    with pytest.raises(LaunchError, match=r"toy_envs:Nudge: step\(\) of episode \d+ \(prompt .*sample \d\), turn 2 "
                                          r"failed: ValueError: boom on turn 2"):
        _run(_job(tiny_models, tmp_path / "boom", {"config": {"turns": 3, "raise_on": 2}, "max_turns": 3}))


def test_ppo_learns_from_per_turn_rewards(tiny_models, tmp_path):
    """PPO with an environment: each turn's reward at its last policy token, GAE over the policy's tokens; the
    critic starts from the reward model (which does not score: reward_model_weight 0)."""
    base = _job(tiny_models, tmp_path / "unused", {"config": {"turns": 2}, "max_turns": 3}).reinforce
    section = PPOConfig(rl=base.rl, generation=base.generation, optimizer=base.optimizer, reward=base.reward,
                        env=base.env, critic_optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0))
    paths = PPOPaths(run_dir=str(tmp_path / "ppo"), prompts=tiny_models["prompts"]["train"],
                     val_prompts=tiny_models["prompts"]["val"], tokenizer=tiny_models["tokenizer"],
                     policy=tiny_models["sft"], reward_model=tiny_models["rm"])
    m = _run(PPOJob(ppo=section, model=TINY_MODEL, paths=paths))["history"][-1]
    assert 1.0 <= m["env/turns"] <= 2.0 and m["env/env_tokens"] > 0
    # the rollout's score is the episode's return: 0.25 per " more:" turn and 1.0 for a right last turn
    assert m["rollout/rewards_mean"] == pytest.approx(m["env/return_mean"], abs=1e-9)
    assert "critic/value_loss" in m and "train/policy_loss" in m
