"""Reward-model node: initialised from ``sft_policy`` (or ``reward_model.init_from``), trained on preference pairs
(Bradley-Terry) or on SteerLM attribute data (``loss: regression``, the ``steerlm_reward_model`` pipeline)."""

from __future__ import annotations

from align_pipeline.config.base import ConfigError
from align_pipeline.config.reward_model import RewardModelConfig, RewardModelJob
from align_pipeline.data.formats import Artifact
from align_pipeline.datasets.stored import StoredVersions
from align_pipeline.pipelines.common import run_supervised_stage, train_paths, typed_params


def train_reward_model(tokenizer: Artifact, pref_train: Artifact, pref_val: Artifact, sft_policy: str, model: dict,
                       parallel: dict, launch: dict, reward_model: dict,
                       stored: StoredVersions | None = None) -> tuple[str, dict[str, float]]:
    model_cfg, parallel_cfg, launch_cfg, cfg = typed_params(model, parallel, launch, reward_model, RewardModelConfig,
                                                            "reward_model")
    kind = pref_train.meta.get("kind")
    if (cfg.loss == "regression") != (kind == "regression"):
        how = ("`kedro run --pipelines steerlm_reward_model` (attribute data from data/01_raw/regression.jsonl)"
               if cfg.loss == "regression" else "reward_model.loss: regression")
        raise ConfigError(f"reward_model.loss is {cfg.loss!r} but its training data {pref_train.path} is {kind!r} "
                          f"data; use {how}")
    paths, lineage = train_paths(cfg, "reward_model", tokenizer=tokenizer, train=pref_train, val=pref_val,
                                 init_from=cfg.init_from or sft_policy,
                                 key={"model": model_cfg, "parallel": parallel_cfg, "reward_model": cfg})
    job = RewardModelJob(reward_model=cfg, model=model_cfg, parallel=parallel_cfg, paths=paths, lineage=lineage)
    return run_supervised_stage("align_pipeline.train.reward_model", job, launch_cfg, cfg,
                                "reward_model", metric_keys=("val_loss", "val_accuracy", "val_reward_margin",
                                                             "train_loss"), stored=stored)
