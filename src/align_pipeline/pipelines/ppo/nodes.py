"""PPO node: launches the colocated actor/critic job and hands both models to the catalog."""

from __future__ import annotations

from align_pipeline.config.base import to_dict
from align_pipeline.config.checks import check_reward_model
from align_pipeline.config.ppo import PPOConfig, PPOJob, PPOPaths
from align_pipeline.data.formats import Artifact
from align_pipeline.datasets.stored import StoredVersions
from align_pipeline.pipelines.common import check_rl_gate, reuse_or_launch, rl_metrics, rl_paths, typed_params


def train_ppo(tokenizer: Artifact, prompts_train: Artifact, prompts_val: Artifact, sft_policy: str,
              reward_model: str, model: dict, parallel: dict, launch: dict,
              ppo: dict, policy_stored: StoredVersions | None = None,
              critic_stored: StoredVersions | None = None) -> tuple[str, str, dict[str, float]]:
    """Returns (ppo_policy dir, ppo_critic dir, final metrics). The critic starts from the reward model. A policy and
    critic stored by one earlier run with the same inputs, config and code are reused instead."""
    model_cfg, parallel_cfg, launch_cfg, cfg = typed_params(model, parallel, launch, ppo, PPOConfig, "ppo")
    if cfg.reward.reward_model_weight:
        check_reward_model(cfg.reward, reward_model, "params:ppo.reward")
    check_rl_gate(cfg, "ppo", reward_model)  # the critic starts from the reward model: gated even at weight 0
    paths, lineage = rl_paths(cfg, "ppo", tokenizer=tokenizer, prompts_train=prompts_train, prompts_val=prompts_val,
                              sft_policy=sft_policy, reward_model=reward_model,
                              key={"model": model_cfg, "parallel": parallel_cfg, "ppo": cfg})
    job = PPOJob(ppo=cfg, model=model_cfg, parallel=parallel_cfg,
                 paths=PPOPaths(**to_dict(paths), critic=reward_model), lineage=lineage)
    (policy, critic), metrics = reuse_or_launch("align_pipeline.train.ppo", job, launch_cfg, cfg, "ppo",
                                                ("actor_dir", "critic_dir"), [policy_stored, critic_stored],
                                                rl_metrics)
    return policy, critic, metrics
