"""Reward-model node: initialised from ``sft_policy`` (or ``reward_model.init_from``), trained on preference pairs."""

from __future__ import annotations

from align_pipeline.config import RewardModelJobConfig, RewardModelParams, to_dict
from align_pipeline.data.formats import Artifact
from align_pipeline.pipelines.common import run_stage, stage_job_paths, typed_params


def train_reward_model(
    tokenizer: Artifact,
    pref_train: Artifact,
    pref_val: Artifact,
    sft_policy: str,
    model: dict,
    parallel: dict,
    launch: dict,
    reward_model: dict,
) -> tuple[str, dict[str, float]]:
    model_cfg, parallel_cfg, launch_cfg, stage = typed_params(model, parallel, launch, reward_model, "reward_model",
                                                              RewardModelParams)
    head = stage.reward
    init_from = stage.init_from or sft_policy
    paths = stage_job_paths(stage, "reward_model", tokenizer=tokenizer, train=pref_train, val=pref_val,
                            parent=init_from, config={"model": to_dict(model_cfg), "parallel": to_dict(parallel_cfg),
                                                      "training": to_dict(stage.training), "reward": to_dict(head)})
    job = RewardModelJobConfig(
        run_dir=paths.run_dir, train_data=paths.train, val_data=paths.val, tokenizer=paths.tokenizer,
        init_from=init_from, model=model_cfg, parallel=parallel_cfg, training=stage.training, reward=head,
        lineage=paths.lineage,
    )
    return run_stage("align_pipeline.train.reward_model", job, launch_cfg, stage, "reward_model",
                     metric_keys=("val_loss", "val_accuracy", "val_reward_margin", "train_loss"))
