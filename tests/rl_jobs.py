"""RL test helpers: PPO / REINFORCE jobs on the shared tiny models (conftest's ``tiny_models``) run as real torchrun
jobs, a model's outputs on fixed tokens, and the per-iteration metrics that are not timings."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from jobs import TINY_MODEL

from align_pipeline.config import (
    GenerationConfig,
    KLConfig,
    LaunchConfig,
    LoRAConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PPOConfig,
    PPOJob,
    PPOLossConfig,
    PPOPaths,
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

# Per-iteration numbers that are not timings (those differ run to run).
DETERMINISTIC = ("rollout/", "train/", "critic/", "val/")
DEMO = RewardFunctionConfig(name="align_pipeline.rewards:demo_task", weight=1.0)


def rl_section(iterations: int) -> dict:
    return {
        "rl": RLLoopConfig(seed=11, iterations=iterations, prompts_per_iteration=8, epochs=2, minibatches=2,
                           micro_batch_size=2, eval_interval=0, eval_prompts=8, save_interval=0),
        "generation": GenerationConfig(max_new_tokens=8, samples_per_prompt=1, seed=5),
        "optimizer": OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=0),
    }


def rl_paths(models, run_dir: Path, **extra) -> dict:
    return {"run_dir": str(run_dir), "prompts": models["prompts"]["train"], "val_prompts": models["prompts"]["val"],
            "tokenizer": models["tokenizer"], "policy": models["sft"], **extra}


def ppo_job(models, run_dir: Path, iterations: int = 2, parallel: ParallelConfig | None = None,
            stop_after: int | None = None, critic_warmup: int = 0, lora: dict | None = None,
            reference: str | None = None, model: ModelConfig = TINY_MODEL) -> PPOJob:
    """A PPO job from ``models`` (tiny_models' keys: policy ``sft``, reward model ``rm``, ``prompts``,
    ``tokenizer``): the demo reward function plus the reward model, adaptive KL."""
    adapters = {"lora": LoRAConfig(**lora), "critic_lora": LoRAConfig(**lora)} if lora else {}
    section = PPOConfig(
        **adapters,
        **rl_section(iterations),
        reward=RewardConfig(reward_model_weight=1.0, functions=[DEMO], missing_eos_penalty=0.5),
        kl=KLConfig(beta=0.1, adaptive=True, target=0.5, horizon=100.0),
        loss=PPOLossConfig(entropy_coef=0.01, value_clip_eps=None if critic_warmup else 0.2),
        critic_optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0), critic_warmup_iterations=critic_warmup,
    )
    return PPOJob(ppo=section, model=model, parallel=parallel or ParallelConfig(),
                  paths=PPOPaths(**rl_paths(models, run_dir, reward_model=models["rm"], reference=reference)),
                  stop_after=stop_after)


def reinforce_job(models, run_dir: Path, iterations: int = 2, stop_after: int | None = None,
                  model: ModelConfig = TINY_MODEL, **section) -> ReinforceJob:
    fields = {**rl_section(iterations), "reward": RewardConfig(reward_model_weight=0.0, functions=[DEMO]),
              "loss": ReinforceLossConfig(estimator="grpo"), "kl": KLConfig(estimator="k3", beta=0.05), **section}
    fields["generation"] = dataclasses.replace(fields["generation"], samples_per_prompt=4)
    return ReinforceJob(reinforce=ReinforceConfig(**fields), model=model, paths=RLPaths(**rl_paths(models, run_dir)),
                        stop_after=stop_after)


def run(module: str, job, nproc: int = 1, env: dict[str, str] | None = None) -> dict:
    Path(job.paths.run_dir).mkdir(parents=True, exist_ok=True)
    return run_torchrun(f"align_pipeline.train.{module}", to_dict(job), LaunchConfig(nproc_per_node=nproc),
                        job.paths.run_dir, env=env)


def outputs_of(model_dir: str, run_dir: Path, nproc: int = 1, parallel: dict | None = None):
    """The model's outputs (logits, or values for a value-head checkpoint) on fixed tokens (model.logits_job)."""
    cfg = {"run_dir": str(run_dir), "checkpoint": model_dir, "parallel": parallel or {},
           "tokens": [[1, 18, 21, 21, 17, 5, 9, 9, 6, 15, 16, 4, 12, 2]]}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg))
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                    "-m", "align_pipeline.train.jobs.logits", "--config", str(run_dir / "config.json")],
                   check=True, capture_output=True)
    return json.loads((run_dir / "result.json").read_text())["logits"]


def tree_hash(path: str) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(path).rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def max_diff(a, b) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def deterministic(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k.startswith(DETERMINISTIC)} for h in history]
