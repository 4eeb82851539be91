"""Distillation and an environment on one GPU (skipped without CUDA), each starting from HF directories (exported
here from tiny SFT policies, as `-e hf_example` starts from one), bf16 on NCCL with conf/gpu's settings:

* on-policy distillation: an HF student learns an HF teacher of another architecture (its reverse KL falls);
* REINFORCE in the built-in calculator environment (plain calls, the calculator demo's data): the HF policy's
  held-out accuracy in the environment rises over its start (validated before the first iteration).

The figures are printed (``-s``) for the record."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from jobs import TINY_MODEL, make_prompts, make_sft_data, run_sft, sft_job

from align_pipeline.config import (
    DistillConfig,
    DistillJob,
    DistillPaths,
    EnvConfig,
    GenerationConfig,
    KLConfig,
    LaunchConfig,
    OptimizerConfig,
    ParallelConfig,
    ReinforceConfig,
    ReinforceJob,
    ReinforceLossConfig,
    RewardConfig,
    RewardFunctionConfig,
    RLLoopConfig,
    RLPaths,
    to_dict,
)
from align_pipeline.launch import run_torchrun

pytestmark = pytest.mark.gpu

GPU = ParallelConfig(bf16=True, use_distributed_optimizer=True, kernels="auto")
TEACHER_MODEL = {"num_layers": 3, "hidden_size": 48, "num_attention_heads": 4, "num_query_groups": 4,
                 "ffn_hidden_size": 96}


def _cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _hf(data: dict, run_dir: Path, **overrides) -> str:
    """A tiny SFT policy trained here, exported as an HF directory."""
    from align_pipeline.model.hf_export import export_hf

    trained = run_sft(sft_job(data, run_dir, **overrides))
    export_hf(trained["model_dir"], run_dir / "hf")
    return str(run_dir / "hf")


def _run(module: str, job) -> dict:
    Path(job.paths.run_dir).mkdir(parents=True, exist_ok=True)
    return run_torchrun(f"align_pipeline.train.{module}", to_dict(job), LaunchConfig(nproc_per_node=1),
                        job.paths.run_dir)


def _loop(iterations: int, prompts: int, **rl) -> RLLoopConfig:
    return RLLoopConfig(seed=11, iterations=iterations, prompts_per_iteration=prompts, epochs=1, minibatches=1,
                        micro_batch_size=prompts, eval_interval=0, eval_prompts=64, save_interval=0, **rl)


def test_distillation_on_one_gpu_from_an_hf_teacher_into_an_hf_student(tmp_path):
    _cuda()
    data = make_sft_data(tmp_path / "data")
    prompts = make_prompts(tmp_path / "data", data["tokenizer"])
    student = _hf(data, tmp_path / "student", training={"train_steps": 20})
    teacher = _hf(data, tmp_path / "teacher", model=TEACHER_MODEL, training={"train_steps": 80,
                                                                                "global_batch_size": 16})
    section = DistillConfig(rl=_loop(10, 32), generation=GenerationConfig(max_new_tokens=8, samples_per_prompt=2,
                                                                          seed=5),
                            optimizer=OptimizerConfig(lr=2e-3, min_lr=2e-3, warmup_steps=0, weight_decay=0.0),
                            reward=RewardConfig(reward_model_weight=0.0, functions=[
                                RewardFunctionConfig(name="align_pipeline.rewards:demo_task", weight=1.0)]))
    paths = DistillPaths(run_dir=str(tmp_path / "distill"), prompts=prompts["train"], val_prompts=prompts["val"],
                         tokenizer=data["tokenizer"], policy=student, teacher=teacher)
    result = _run("distill", DistillJob(distill=section, model=TINY_MODEL, parallel=GPU, paths=paths))
    kls = [it["rollout/teacher_kl"] for it in result["history"]]
    print("distill on one GPU: rollout/teacher_kl per iteration", [round(k, 3) for k in kls],
          "val", {k: result[k] for k in ("val/accuracy", "val/greedy_accuracy")})
    assert all(math.isfinite(v) for it in result["history"] for v in it.values())
    assert sum(kls[-3:]) / 3 < 0.7 * kls[0], kls


def test_reinforce_in_the_calculator_environment_on_one_gpu_from_an_hf_policy(tmp_path):
    _cuda()
    data = make_sft_data(tmp_path / "data", raw_file="calculator_demo_sft.jsonl")
    prompts = make_prompts(tmp_path / "data", data["tokenizer"], raw_file="calculator_demo_prompts.jsonl")
    policy = _hf(data, tmp_path / "sft", training={"train_steps": 300, "global_batch_size": 32,
                                                   "micro_batch_size": 8})
    section = ReinforceConfig(
        rl=_loop(20, 64, eval_before_training=True),
        generation=GenerationConfig(max_new_tokens=12, samples_per_prompt=4, seed=5),
        optimizer=OptimizerConfig(lr=3e-4, min_lr=3e-5, warmup_steps=5),
        reward=RewardConfig(reward_model_weight=0.0, functions=[]), kl=KLConfig(beta=0.0),
        loss=ReinforceLossConfig(estimator="rloo"),
        env=EnvConfig(name="align_pipeline.envs.builtin:Calculator", max_turns=3, workers=2,
                      config={"call_format": "plain", "tool_name": "calc", "max_calls": 2}),
    )
    paths = RLPaths(run_dir=str(tmp_path / "reinforce"), prompts=prompts["train"], val_prompts=prompts["val"],
                    tokenizer=data["tokenizer"], policy=policy)
    result = _run("reinforce", ReinforceJob(reinforce=section, model=TINY_MODEL, parallel=GPU, paths=paths))
    before, after = result["initial"], result["final"]
    print("calculator env on one GPU: val before", before, "after",
          {k: after[k] for k in ("val/accuracy", "val/greedy_accuracy", "env/turns", "env/timeouts")})
    assert after["env/timeouts"] == 0 and after["env/turns"] >= 1.5
    assert after["val/accuracy"] >= before["val/accuracy"] + 0.1, (before, after)
