"""Evaluation node: launches the evaluation job over every policy checkpoint it receives."""

from __future__ import annotations

import logging
from pathlib import Path

from align_pipeline.config import (
    EvaluationConfig,
    EvaluationJob,
    EvaluationPaths,
    LaunchConfig,
    ParallelConfig,
    config_hash,
    from_dict,
    to_dict,
)
from align_pipeline.config.checks import check_reward_model
from align_pipeline.data.formats import Artifact, check_tokenized_with
from align_pipeline.launch import run_torchrun
from align_pipeline.report import flat_metrics

log = logging.getLogger(__name__)


def evaluate_policies(tokenizer: Artifact, prompts_val: Artifact, pref_val: Artifact, sft_val: Artifact,
                      parallel: dict, launch: dict, evaluation: dict, reward_model: str | None = None,
                      **policies: str) -> tuple[str, dict[str, float]]:
    """``policies``: catalog name (``<stage>_policy``) -> checkpoint path; ``reward_model`` None skips the RM metrics.

    Returns (report dir, flat metrics)."""
    cfg = from_dict(EvaluationConfig, evaluation, "params:evaluation")
    check_reward_model(cfg.reward, reward_model, "params:evaluation.reward")
    check_tokenized_with(tokenizer, prompts_val=prompts_val, pref_val=pref_val, sft_val=sft_val)
    named = {name.removesuffix("_policy"): path for name, path in policies.items()}
    key = config_hash({"policies": named, "rm": reward_model, "prompts": prompts_val.fingerprint,
                       "params": to_dict(cfg)})
    run_dir = (Path(cfg.runs_dir) / "evaluation" / key).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = EvaluationPaths(
        run_dir=str(run_dir), output_dir=str(run_dir / "eval_report"), tokenizer=str(Path(tokenizer.path).resolve()),
        prompts=str(Path(prompts_val.path).resolve()), policies=named, reference=named.get("sft"),
        reward_model=reward_model, preference_data=str(Path(pref_val.path).resolve()) if reward_model else None,
        sft_data=str(Path(sft_val.path).resolve()))
    job = EvaluationJob(evaluation=cfg, parallel=from_dict(ParallelConfig, parallel, "params:parallel"), paths=paths,
                        lineage={"policies": named, "reward_model": reward_model, "prompts": prompts_val.fingerprint})
    result = run_torchrun("align_pipeline.train.evaluate", to_dict(job), from_dict(LaunchConfig, launch), run_dir,
                          name="evaluation")
    log.info("Evaluation report %s, policies ranked:\n%s", result["output_dir"],
             (Path(result["output_dir"]) / "report.md").read_text())
    return result["output_dir"], flat_metrics(result["report"])  # the names the job logged them under
