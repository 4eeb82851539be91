"""DPO nodes: reference log-probs (computed once per key, then reused) and the DPO-family training job."""

from __future__ import annotations

import logging
from pathlib import Path

from align_pipeline.config import (
    DPOJobConfig,
    DPOParams,
    LaunchConfig,
    ParallelConfig,
    ReferenceLogpsJobConfig,
    config_hash,
    from_dict,
    to_dict,
)
from align_pipeline.data.formats import Artifact, content_fingerprint
from align_pipeline.launch import run_torchrun
from align_pipeline.losses.preference import REFERENCE_FREE_LOSSES
from align_pipeline.model.checkpoint import read_meta
from align_pipeline.pipelines.common import run_stage, stage_job_paths, typed_params

log = logging.getLogger(__name__)


def reference_key(reference: str, tokenizer: Artifact, pref_train: Artifact, pref_val: Artifact) -> str:
    """Cache key: the reference checkpoint version (its path, stage, step and config hash) + data + tokenizer."""
    meta = read_meta(reference)
    ref_id = {"path": str(Path(reference).resolve()), "stage": meta.get("stage"), "step": meta.get("step"),
              "config_hash": meta.get("lineage", {}).get("config_hash")}
    return config_hash({"reference": ref_id, "pref_train": pref_train.fingerprint, "pref_val": pref_val.fingerprint,
                        "tokenizer": tokenizer.fingerprint})


def compute_reference_logps(sft_policy: str, tokenizer: Artifact, pref_train: Artifact, pref_val: Artifact,
                            parallel: dict, launch: dict, dpo: dict) -> Artifact:
    """Sequence log-probs of the frozen reference (sft_policy) on the preference data, cached by key.

    A rerun with the same reference version, data and tokenizer reuses the file; any change recomputes it.
    """
    params = from_dict(DPOParams, dpo, "params:dpo")
    key = reference_key(sft_policy, tokenizer, pref_train, pref_val)
    output = (Path(params.reference_cache_dir) / f"{key}.npz").resolve()
    meta = {"key": key, "reference": sft_policy, "pref_train": pref_train.fingerprint, "pref_val": pref_val.fingerprint,
            "tokenizer": tokenizer.fingerprint}
    if output.is_file():
        log.info("reference log-probs: reusing %s (key %s)", output, key)
        return Artifact(str(output), content_fingerprint(output), {**meta, "reused": True})
    if params.loss.name in REFERENCE_FREE_LOSSES:
        log.info("reference log-probs: computing anyway for metrics although %s is reference-free", params.loss.name)
    run_dir = Path(params.runs_dir) / "reference_logps" / key
    run_dir.mkdir(parents=True, exist_ok=True)
    job = ReferenceLogpsJobConfig(
        run_dir=str(run_dir.resolve()), checkpoint=sft_policy,
        data={"train": str(Path(pref_train.path).resolve()), "val": str(Path(pref_val.path).resolve())},
        output=str(output), parallel=from_dict(ParallelConfig, parallel, "params:parallel"),
        micro_batch_size=params.reference_micro_batch_size,
    )
    run_torchrun("align_pipeline.train.reference_logps", to_dict(job), from_dict(LaunchConfig, launch), run_dir,
                 name="reference_logps")
    return Artifact(str(output), content_fingerprint(output), {**meta, "reused": False})


def train_dpo(tokenizer: Artifact, pref_train: Artifact, pref_val: Artifact, sft_policy: str,
              dpo_reference_logps: Artifact, model: dict, parallel: dict, launch: dict,
              dpo: dict) -> tuple[str, dict[str, float]]:
    model_cfg, parallel_cfg, launch_cfg, stage = typed_params(model, parallel, launch, dpo, "dpo", DPOParams)
    init_from = stage.init_from or sft_policy
    paths = stage_job_paths(stage, "dpo", tokenizer=tokenizer, train=pref_train, val=pref_val, parent=init_from,
                            config={"model": to_dict(model_cfg), "parallel": to_dict(parallel_cfg),
                                    "training": to_dict(stage.training), "loss": to_dict(stage.loss),
                                    "reference_logps": dpo_reference_logps.fingerprint})
    job = DPOJobConfig(
        run_dir=paths.run_dir, train_data=paths.train, val_data=paths.val, tokenizer=paths.tokenizer,
        init_from=init_from, reference_logps=dpo_reference_logps.path, model=model_cfg, parallel=parallel_cfg,
        training=stage.training, loss=stage.loss,
        lineage={**paths.lineage, "reference": sft_policy, "reference_logps": dpo_reference_logps.fingerprint},
    )
    return run_stage("align_pipeline.train.dpo", job, launch_cfg, stage, "dpo",
                     metric_keys=("val_loss", "val_accuracy", "val_rewards_margin", "train_loss"))
