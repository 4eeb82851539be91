"""REINFORCE node (RLOO / GRPO): launches the job and hands the policy to the catalog."""

from __future__ import annotations

from align_pipeline.config import ConfigError, ReinforceJobConfig, ReinforceParams, to_dict
from align_pipeline.data.formats import Artifact
from align_pipeline.pipelines.common import launch_stage, rl_job_fields, rl_metrics, typed_params


def train_reinforce(tokenizer: Artifact, prompts_train: Artifact, prompts_val: Artifact, sft_policy: str,
                    model: dict, parallel: dict, launch: dict, reinforce: dict,
                    reward_model: str | None = None) -> tuple[str, dict[str, float]]:
    """Returns (reinforce_policy dir, final metrics). ``reward_model`` is wired only by the ``reinforce_rm``
    pipeline; the default ``reinforce`` pipeline optimises the verifiable reward alone."""
    model_cfg, parallel_cfg, launch_cfg, params = typed_params(model, parallel, launch, reinforce, "reinforce",
                                                               ReinforceParams)
    if params.reward.reward_model_weight and reward_model is None:
        raise ConfigError(
            f"params:reinforce.reward.reward_model_weight is {params.reward.reward_model_weight} but this pipeline "
            "has no reward model input: run `kedro run --pipeline reinforce_rm`, or set the weight to 0")
    if not params.reward.reward_model_weight:
        reward_model = None
    fields = rl_job_fields(params, "reinforce", tokenizer=tokenizer, prompts_train=prompts_train,
                           prompts_val=prompts_val, sft_policy=sft_policy, reward_model=reward_model, model=model_cfg,
                           parallel=parallel_cfg, config={"params": to_dict(params)})
    job = ReinforceJobConfig(**fields, loss=params.loss)
    (policy,), result = launch_stage("align_pipeline.train.reinforce", job, launch_cfg, params, "reinforce",
                                     ("actor_dir",))
    return policy, rl_metrics(result)
