"""PPO node: launches the colocated actor/critic job and hands both models to the catalog."""

from __future__ import annotations

from align_pipeline.config import PPOJobConfig, PPOParams, to_dict
from align_pipeline.data.formats import Artifact
from align_pipeline.pipelines.common import launch_stage, rl_job_fields, rl_metrics, typed_params


def train_ppo(tokenizer: Artifact, prompts_train: Artifact, prompts_val: Artifact, sft_policy: str,
              reward_model: str, model: dict, parallel: dict, launch: dict,
              ppo: dict) -> tuple[str, str, dict[str, float]]:
    """Returns (ppo_policy dir, ppo_critic dir, final metrics)."""
    model_cfg, parallel_cfg, launch_cfg, params = typed_params(model, parallel, launch, ppo, "ppo", PPOParams)
    fields = rl_job_fields(params, "ppo", tokenizer=tokenizer, prompts_train=prompts_train, prompts_val=prompts_val,
                           sft_policy=sft_policy, reward_model=reward_model, model=model_cfg, parallel=parallel_cfg,
                           config={"params": to_dict(params)})
    job = PPOJobConfig(**fields, critic_init=reward_model, kl=params.kl, ppo=params.ppo,
                       critic_optimizer=params.critic_optimizer)
    (policy, critic), result = launch_stage("align_pipeline.train.ppo", job, launch_cfg, params, "ppo",
                                            ("actor_dir", "critic_dir"))
    return policy, critic, rl_metrics(result)
