"""Evaluation node: launches the evaluation job over every policy checkpoint it receives."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from align_pipeline.config.base import config_hash, from_dict, to_dict
from align_pipeline.config.checks import check_reward_model
from align_pipeline.config.common import LaunchConfig, ParallelConfig
from align_pipeline.config.evaluation import EvaluationConfig, EvaluationJob, EvaluationPaths
from align_pipeline.data.formats import Artifact, check_checkpoint_tokenizers, check_tokenized_with
from align_pipeline.datasets.stored import StoredVersions
from align_pipeline.evaluation.gates import gates_markdown, promotion
from align_pipeline.evaluation.report import flat_metrics
from align_pipeline.launch.torchrun import run_torchrun
from align_pipeline.pipelines.reuse import StageReuse, content_key
from align_pipeline.tracking.runs import tag_active_run

log = logging.getLogger(__name__)


def evaluate_policies(tokenizer: Artifact, prompts_val: Artifact, pref_val: Artifact, sft_val: Artifact,
                      parallel: dict, launch: dict, evaluation: dict, reward_model: str | None = None,
                      stored: StoredVersions | None = None, **policies: str
                      ) -> tuple[str, dict[str, float], dict[str, Any]]:
    """``policies``: catalog name (``<stage>_policy``) -> checkpoint path; ``reward_model`` None skips the RM metrics.

    Returns (report dir, flat metrics, the promoted policy: the best one passing ``evaluation.gate``). A stored
    eval_report (``stored``: eval_report_stored) made from the same policies, reward model, data, config and code is
    reused instead of evaluating again; its promotion names this run's policy versions."""
    cfg = from_dict(EvaluationConfig, evaluation, "params:evaluation")
    check_reward_model(cfg.reward, reward_model, "params:evaluation.reward")
    check_tokenized_with(tokenizer, prompts_val=prompts_val, pref_val=pref_val, sft_val=sft_val)
    check_checkpoint_tokenizers(tokenizer, reward_model=reward_model, **policies)
    named = {name.removesuffix("_policy"): path for name, path in policies.items()}
    key = config_hash({"policies": named, "rm": reward_model, "prompts": prompts_val.fingerprint,
                       "params": to_dict(cfg)})
    parallel_cfg = from_dict(ParallelConfig, parallel, "params:parallel")
    data = {"prompts_val": prompts_val.fingerprint, "pref_val": pref_val.fingerprint, "sft_val": sft_val.fingerprint,
            "tokenizer": tokenizer.fingerprint}
    reuse = StageReuse("evaluation", content_key("evaluation", {"data": data}, {"evaluation": cfg,
                                                                               "parallel": parallel_cfg},
                                                 models={"reward_model": reward_model, **policies}),
                       cfg.reuse, [stored], (Path(cfg.runs_dir) / "evaluation").resolve())
    found = reuse.find()
    if found is not None:
        (report_dir,), record = found
        return report_dir, {k: float(v) for k, v in record["metrics"].items()}, repromote(record, policies,
                                                                                            Path(report_dir))
    run_dir = (Path(cfg.runs_dir) / "evaluation" / key).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = EvaluationPaths(
        run_dir=str(run_dir), output_dir=str(run_dir / "eval_report"), tokenizer=str(Path(tokenizer.path).resolve()),
        prompts=str(Path(prompts_val.path).resolve()), policies=named, reference=named.get("sft"),
        reward_model=reward_model, preference_data=str(Path(pref_val.path).resolve()) if reward_model else None,
        sft_data=str(Path(sft_val.path).resolve()))
    job = EvaluationJob(evaluation=cfg, parallel=parallel_cfg, paths=paths,
                        lineage={"policies": named, "reward_model": reward_model, "prompts": prompts_val.fingerprint})
    result = run_torchrun("align_pipeline.train.evaluate", to_dict(job), from_dict(LaunchConfig, launch), run_dir,
                          name="evaluation")
    promoted = promote(result["report"], policies, cfg, Path(result["output_dir"]))
    log.info("Evaluation (stored as the eval_report catalog version once the node ends):\n%s",
             (Path(result["output_dir"]) / "report.md").read_text())
    metrics = flat_metrics(result["report"])  # the names the job logged them under
    metrics.update({f"{name}/gates_passed": float(passed) for name, passed in promoted["passed"].items()})
    reuse.record([result["output_dir"]], metrics, promoted=promoted)
    return result["output_dir"], metrics, promoted


def promote(report: dict[str, Any], policies: dict[str, str], cfg: EvaluationConfig, out_dir: Path) -> dict[str, Any]:
    """Apply ``evaluation.gate`` to the report's policies: ``gates.json`` and a "Gates" section in ``report.md``,
    ``gate.*`` / ``promoted`` tags on the node's MLflow run; returns the ``promoted_policy`` entry (the policy's
    name, catalog dataset, version and path; all None when no policy passed)."""
    results, best = promotion(report["policies"], report["ranking"], "sft" if "sft" in report["policies"] else None,
                              cfg.gate.min_gain_over_sft, cfg.gate.max_kl_to_reference)
    dataset = f"{best}_policy" if best else None
    path = policies.get(dataset) if dataset else None
    entry = {"policy": best, "dataset": dataset, "version": Path(path).parent.name if path else None, "path": path,
             "accuracy": report["policies"][best].get("accuracy") if best else None,
             "versions": evaluated_versions(policies),
             "gates": {name: [r.as_dict() for r in checks] for name, checks in results.items()},
             "passed": {name: all(r.passed for r in checks) for name, checks in results.items()}}
    (out_dir / "gates.json").write_text(json.dumps(entry, indent=1))
    with (out_dir / "report.md").open("a") as f:
        f.write("\n" + gates_markdown(results, best))
    tag_active_run(gate_tags(entry))
    return entry


def evaluated_versions(policies: dict[str, str]) -> dict[str, str]:
    """Catalog name -> version of each evaluated policy (a checkpoint's path is ``<filepath>/<version>/<name>``)."""
    return {name: Path(path).parent.name for name, path in sorted(policies.items())}


def gate_tags(entry: dict[str, Any]) -> dict[str, str]:
    """The node run's ``gate.<policy>.<gate>`` (pass / fail) and ``promoted`` tags of a ``promoted_policy`` entry."""
    tags = {f"gate.{name}.{r['gate'].rsplit('.', 1)[-1]}": "pass" if r["passed"] else "fail"
            for name, checks in entry["gates"].items() for r in checks}
    tags["promoted"] = f"{entry['dataset']}@{entry['version']}" if entry["policy"] else "none"
    return tags


def repromote(record: dict[str, Any], policies: dict[str, str], report_dir: Path) -> dict[str, Any]:
    """The stored evaluation's promotion (``record["promoted"]``), naming this run's version of the promoted policy
    (the same model: the key covers every policy's identity): written as the report's ``gates.json``, tagged on the
    node's run, and logged with the report."""
    entry = dict(record["promoted"])
    entry["versions"] = evaluated_versions(policies)
    if entry.get("dataset"):
        entry["path"] = policies.get(entry["dataset"])
        entry["version"] = Path(entry["path"]).parent.name if entry["path"] else None
    (report_dir / "gates.json").write_text(json.dumps(entry, indent=1))
    tag_active_run(gate_tags(entry))
    log.info("Evaluation (reused; stored as the eval_report catalog version once the node ends):\n%s",
             (report_dir / "report.md").read_text())
    return entry
