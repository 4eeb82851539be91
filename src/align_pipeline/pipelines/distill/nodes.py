"""Distillation node: launches the job and hands the student to the catalog."""

from __future__ import annotations

from align_pipeline.config.base import ConfigError, to_dict
from align_pipeline.config.distill import DistillConfig, DistillJob, DistillPaths
from align_pipeline.data.formats import Artifact
from align_pipeline.datasets.stored import StoredVersions
from align_pipeline.pipelines.common import reuse_or_launch, rl_metrics, rl_paths, typed_params


def train_distill(tokenizer: Artifact, prompts_train: Artifact, prompts_val: Artifact, model: dict, parallel: dict,
                  launch: dict, distill: dict, sft_policy: str | None = None, teacher: str | None = None,
                  stored: StoredVersions | None = None) -> tuple[str, dict[str, float]]:
    """Returns (distill_policy dir, final metrics). The student starts from ``distill.init_from``, else
    ``sft_policy``; the teacher is ``distill.teacher`` when set, else the pipeline's teacher input (``distill``:
    the catalog's reinforce_policy)."""
    model_cfg, parallel_cfg, launch_cfg, cfg = typed_params(model, parallel, launch, distill, DistillConfig, "distill")
    teacher = cfg.teacher or teacher
    if teacher is None:
        raise ConfigError("this pipeline has no teacher input: set params:distill.teacher (a policy checkpoint or an HF "
                          "model directory)")
    if sft_policy is None and not cfg.init_from:
        raise ConfigError("this pipeline has no sft_policy input: the student starts from params:distill.init_from, "
                          "which is not set")
    paths, lineage = rl_paths(cfg, "distill", tokenizer=tokenizer, prompts_train=prompts_train,
                              prompts_val=prompts_val, sft_policy=sft_policy, reward_model=None, teacher=teacher,
                              key={"model": model_cfg, "parallel": parallel_cfg, "distill": cfg})
    job = DistillJob(distill=cfg, model=model_cfg, parallel=parallel_cfg, lineage=lineage,
                     paths=DistillPaths(**to_dict(paths), teacher=teacher))
    (policy,), metrics = reuse_or_launch("align_pipeline.train.distill", job, launch_cfg, cfg, "distill",
                                         ("actor_dir",), [stored], rl_metrics)
    return policy, metrics
