"""REINFORCE node (RLOO / GRPO): launches the job and hands the policy to the catalog."""

from __future__ import annotations

from align_pipeline.config.base import ConfigError
from align_pipeline.config.checks import check_reward_model
from align_pipeline.config.reinforce import ReinforceConfig, ReinforceJob
from align_pipeline.data.formats import Artifact
from align_pipeline.datasets.stored import StoredVersions
from align_pipeline.pipelines.common import check_rl_gate, reuse_or_launch, rl_metrics, rl_paths, typed_params


def train_reinforce(tokenizer: Artifact, prompts_train: Artifact, prompts_val: Artifact, model: dict,
                    parallel: dict, launch: dict, reinforce: dict, sft_policy: str | None = None,
                    reward_model: str | None = None, stored: StoredVersions | None = None
                    ) -> tuple[str, dict[str, float]]:
    """Returns (reinforce_policy dir, final metrics). ``reward_model`` is wired only by the ``reinforce_rm``
    pipeline; the default ``reinforce`` pipeline optimises the reward functions alone. Without ``sft_policy`` (the
    ``reasoning`` pipeline) the policy and its KL reference start from ``reinforce.init_from``."""
    model_cfg, parallel_cfg, launch_cfg, cfg = typed_params(model, parallel, launch, reinforce, ReinforceConfig,
                                                            "reinforce")
    if sft_policy is None and not cfg.init_from:
        raise ConfigError("this pipeline has no sft_policy input: the policy starts from params:reinforce.init_from "
                          "(an HF model directory or a checkpoint), which is not set")
    if cfg.reward.reward_model_weight and reward_model is None:
        raise ConfigError(
            f"params:reinforce.reward.reward_model_weight is {cfg.reward.reward_model_weight} but this pipeline "
            "has no reward model input: run `kedro run --pipelines reinforce_rm`, or set the weight to 0")
    if not cfg.reward.reward_model_weight:
        reward_model = None
    check_reward_model(cfg.reward, reward_model, "params:reinforce.reward")
    check_rl_gate(cfg, "reinforce", reward_model)
    paths, lineage = rl_paths(cfg, "reinforce", tokenizer=tokenizer, prompts_train=prompts_train,
                              prompts_val=prompts_val, sft_policy=sft_policy, reward_model=reward_model,
                              key={"model": model_cfg, "parallel": parallel_cfg, "reinforce": cfg})
    job = ReinforceJob(reinforce=cfg, model=model_cfg, parallel=parallel_cfg, paths=paths, lineage=lineage)
    (policy,), metrics = reuse_or_launch("align_pipeline.train.reinforce", job, launch_cfg, cfg, "reinforce",
                                         ("actor_dir",), [stored], rl_metrics)
    return policy, metrics
