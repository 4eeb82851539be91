"""PPO and REINFORCE iterations on one GPU with NCCL and bf16 (skipped without CUDA), with a ~180M-parameter
Llama-style model so the timings (generation vs training) mean something. Run with ``-s`` to see them:

    pytest tests/train/test_gpu_rl.py -m gpu -s
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from jobs import make_pref_data, make_prompts, make_sft_data, run_rm, run_sft, sft_job

from align_pipeline.config import (
    GenerationConfig,
    LaunchConfig,
    ModelConfig,
    OffloadConfig,
    OptimizerConfig,
    ParallelConfig,
    PPOConfig,
    PPOJob,
    PPOPaths,
    ReinforceConfig,
    ReinforceJob,
    RewardConfig,
    RewardFunctionConfig,
    RLLoopConfig,
    RLPaths,
    TrainingConfig,
    to_dict,
)
from align_pipeline.launch import run_torchrun

pytestmark = pytest.mark.gpu

MODEL = ModelConfig(num_layers=16, hidden_size=1024, num_attention_heads=16, num_query_groups=4, ffn_hidden_size=2816,
                    seq_length=160)
BF16 = ParallelConfig(bf16=True)
DEMO = RewardFunctionConfig(name="align_pipeline.rewards:demo_task", weight=1.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_rl")
    data = make_sft_data(root / "data")
    pref = make_pref_data(root / "data", data["tokenizer"])
    prompts = make_prompts(root / "data", data["tokenizer"])
    # One step at a negligible learning rate: a near-random policy rarely samples EOS, so rollouts run to (or near)
    # max_new_tokens and the timings measure long generations rather than the demo task's 4-token answers.
    sft = run_sft(sft_job(data, root / "sft", model=MODEL, parallel={"bf16": True}, training={
        "train_steps": 1, "global_batch_size": 64, "micro_batch_size": 32, "log_interval": 1,
        "optimizer": OptimizerConfig(lr=1e-9, min_lr=0.0, warmup_steps=0)}))
    rm = run_rm(pref, data["tokenizer"], sft["model_dir"], root / "rm", model=MODEL, parallel=BF16,
                training=TrainingConfig(train_steps=5, global_batch_size=32, micro_batch_size=16, eval_interval=0,
                                        eval_samples=64, save_interval=0))
    return {"tokenizer": data["tokenizer"], "prompts": prompts, "sft": sft["model_dir"], "rm": rm["model_dir"]}


def _section(samples: int, prompts: int) -> dict:
    return {
        "rl": RLLoopConfig(iterations=2, prompts_per_iteration=prompts, epochs=1, minibatches=4, micro_batch_size=32,
                           eval_interval=0, eval_prompts=64, save_interval=0),
        "generation": GenerationConfig(max_new_tokens=128, samples_per_prompt=samples, batch_size=256),
        "reward": RewardConfig(reward_model_weight=1.0, functions=[DEMO]),
        "optimizer": OptimizerConfig(lr=1e-6, min_lr=1e-7, warmup_steps=0),
    }


def _paths(models, run_dir: Path) -> dict:
    return {"run_dir": str(run_dir), "prompts": models["prompts"]["train"], "val_prompts": models["prompts"]["val"],
            "tokenizer": models["tokenizer"], "policy": models["sft"], "reward_model": models["rm"]}


def _run(module: str, job, run_dir: Path) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_torchrun(f"align_pipeline.train.{module}", to_dict(job), LaunchConfig(), run_dir)


def _report(name: str, result: dict) -> None:
    for h in result["history"]:
        assert all(math.isfinite(v) for v in h.values()), h
        keys = ("timing/generate_s", "timing/score_s", "timing/train_s", "timing/iteration_s",
                "throughput/generated_tokens_per_s", "throughput/train_tokens_per_s", "rollout/response_lengths",
                "timing/decode_capture_s", "timing/decode_setup_s",  # these two: iteration 1 only
                # the rollout engine (bf16, KV cache, CUDA graphs) vs the training forward on the same tokens
                "rollout/logprob_diff/mean", "rollout/logprob_diff/max", "rollout/seq_ratio/mean",
                "rollout/seq_ratio/max", "train/logprob_diff", "rollout/response_length/p50",
                "rollout/response_length/p90", "rollout/response_length/max", "rollout/response_length/clip_fraction")
        print(f"\n[{name}] iteration {h['iteration']}: " + json.dumps({k: round(h[k], 3) for k in keys if k in h}),
              flush=True)


@pytest.mark.parametrize("offload", [False, True])
def test_ppo_iteration_on_one_gpu(models, tmp_path, offload):
    section = PPOConfig(**_section(samples=1, prompts=256),
                        critic_optimizer=OptimizerConfig(lr=1e-6, min_lr=1e-7, warmup_steps=0),
                        offload=OffloadConfig(frozen_models=offload, optimizer_states=offload))
    job = PPOJob(ppo=section, model=ModelConfig(attention_backend="sdpa"), parallel=BF16,
                 paths=PPOPaths(**_paths(models, tmp_path / "ppo")))
    result = _run("ppo", job, tmp_path / "ppo")
    _report(f"ppo offload={offload}", result)
    assert Path(result["actor_dir"], "meta.json").is_file() and Path(result["critic_dir"], "meta.json").is_file()


def test_reinforce_iteration_on_one_gpu(models, tmp_path):
    section = _section(samples=4, prompts=64)
    section["reward"] = RewardConfig(reward_model_weight=0.0, functions=[DEMO])
    job = ReinforceJob(reinforce=ReinforceConfig(**section), model=ModelConfig(attention_backend="sdpa"),
                       parallel=BF16, paths=RLPaths(**_paths(models, tmp_path / "rf")))
    result = _run("reinforce", job, tmp_path / "rf")
    _report("reinforce", result)
