"""DPO nodes: reference log-probs (computed once per key, then reused) and the DPO-family training job."""

from __future__ import annotations

import logging
from pathlib import Path

from align_pipeline.config import (
    REFERENCE_FREE_LOSSES,
    DPOConfig,
    DPOJob,
    DPOPaths,
    LaunchConfig,
    ParallelConfig,
    ReferenceLogpsJob,
    config_hash,
    from_dict,
    to_dict,
)
from align_pipeline.data.formats import Artifact, check_tokenized_with, checkpoint_meta, content_fingerprint
from align_pipeline.launch import run_torchrun
from align_pipeline.pipelines.common import run_supervised_stage, train_paths, typed_params

log = logging.getLogger(__name__)


def reference_key(reference: str, tokenizer: Artifact, pref_train: Artifact, pref_val: Artifact) -> str:
    """Cache key: the reference checkpoint version (its path, stage, step and config hash) + data + tokenizer."""
    meta = checkpoint_meta(reference)
    ref_id = {"path": str(Path(reference).resolve()), "stage": meta.get("stage"), "step": meta.get("step"),
              "config_hash": meta.get("lineage", {}).get("config_hash")}
    return config_hash({"reference": ref_id, "pref_train": pref_train.fingerprint, "pref_val": pref_val.fingerprint,
                        "tokenizer": tokenizer.fingerprint})


def compute_reference_logps(sft_policy: str, tokenizer: Artifact, pref_train: Artifact, pref_val: Artifact,
                            parallel: dict, launch: dict, dpo: dict) -> Artifact:
    """Sequence log-probs of the frozen reference (sft_policy) on the preference data, cached by key.

    A rerun with the same reference version, data and tokenizer reuses the file; any change recomputes it. With
    ``dpo.reference: online`` nothing is computed here (the DPO job runs the reference itself): an empty artifact.
    """
    params = from_dict(DPOConfig, dpo, "params:dpo")
    check_tokenized_with(tokenizer, pref_train=pref_train, pref_val=pref_val)
    if params.reference == "online":
        log.info("reference log-probs: computed by the DPO job itself (dpo.reference: online)")
        return Artifact("", "online", {"reference": sft_policy, "online": True})
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
    job = ReferenceLogpsJob(
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
    model_cfg, parallel_cfg, launch_cfg, cfg = typed_params(model, parallel, launch, dpo, DPOConfig, "dpo")
    paths, lineage = train_paths(cfg, "dpo", tokenizer=tokenizer, train=pref_train, val=pref_val,
                                 init_from=cfg.init_from or sft_policy,
                                 key={"model": model_cfg, "parallel": parallel_cfg, "dpo": cfg,
                                      "reference_logps": dpo_reference_logps.fingerprint})
    job = DPOJob(dpo=cfg, model=model_cfg, parallel=parallel_cfg,
                 paths=DPOPaths(**to_dict(paths), reference_logps=dpo_reference_logps.path or None,
                                reference=sft_policy if cfg.reference == "online" else None),
                 lineage={**lineage, "reference": sft_policy, "reference_logps": dpo_reference_logps.fingerprint})
    return run_supervised_stage("align_pipeline.train.dpo", job, launch_cfg, cfg, "dpo",
                                metric_keys=("val_loss", "val_accuracy", "val_rewards_margin", "train_loss"))
