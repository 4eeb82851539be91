"""DPO nodes: reference log-probs (computed once per key, verified and reused) and the DPO-family training job.

``compute_reference_logps`` writes ``<dpo.reference_cache_dir>/<key>.npz`` (key: what the sft_policy is, the
preference data and the tokenizer) through its job and returns its Artifact, which the catalog persists as
``dpo_reference_logps``; a cache that fails verification (:mod:`align_pipeline.data.reference_cache`) is recomputed
with one warning. ``train_dpo`` trusts the catalog entry only for the key of its own inputs, so Kedro's partial runs
(``--nodes train_dpo``, ``--from-nodes train_dpo``) never train on another reference's log-probs."""

from __future__ import annotations

import logging
from pathlib import Path

from align_pipeline.config.base import config_hash, from_dict, to_dict
from align_pipeline.config.common import LaunchConfig, ParallelConfig
from align_pipeline.config.dpo import REFERENCE_FREE_LOSSES, DPOConfig, DPOJob, DPOPaths, ReferenceLogpsJob
from align_pipeline.data.formats import (
    Artifact,
    check_checkpoint_tokenizers,
    check_tokenized_with,
    content_fingerprint,
)
from align_pipeline.data.reference_cache import cache_problem, npz_pairs
from align_pipeline.datasets.stored import StoredVersions
from align_pipeline.errors import UserError
from align_pipeline.launch.torchrun import run_torchrun
from align_pipeline.pipelines.common import run_supervised_stage, train_paths, typed_params
from align_pipeline.pipelines.reuse import model_identity

log = logging.getLogger(__name__)


def reference_key(reference: str, tokenizer: Artifact, pref_train: Artifact, pref_val: Artifact) -> str:
    """Cache key: what the reference model is (:func:`~align_pipeline.pipelines.reuse.model_identity`: a reused
    version of the same model keeps the key) + data + tokenizer."""
    return config_hash({"reference": model_identity(reference), "pref_train": pref_train.fingerprint, "pref_val": pref_val.fingerprint,
                        "tokenizer": tokenizer.fingerprint})


def reference_pairs(pref_train: Artifact, pref_val: Artifact) -> dict[str, int]:
    """Split -> preference pairs: what a cache of this data must hold."""
    return {"train": npz_pairs(pref_train.path), "val": npz_pairs(pref_val.path)}


def _reference_meta(key: str, sft_policy: str, tokenizer: Artifact, pref_train: Artifact, pref_val: Artifact) -> dict:
    return {"key": key, "reference": sft_policy, "pref_train": pref_train.fingerprint,
            "pref_val": pref_val.fingerprint, "tokenizer": tokenizer.fingerprint, "online": False}


def compute_reference_logps(sft_policy: str, tokenizer: Artifact, pref_train: Artifact, pref_val: Artifact,
                            parallel: dict, launch: dict, dpo: dict) -> Artifact:
    """Sequence log-probs of the frozen reference (sft_policy) on the preference data, cached by key.

    A rerun with the same reference version, data and tokenizer reuses the file once it verifies (sidecar sha256,
    the expected arrays; a cache from before sidecars is adopted if it opens with them); a corrupt one is recomputed
    with a warning; any change of the key recomputes it. With ``dpo.reference: online`` nothing is computed here (the
    DPO job runs the reference itself): an empty artifact.
    """
    params = from_dict(DPOConfig, dpo, "params:dpo")
    check_tokenized_with(tokenizer, pref_train=pref_train, pref_val=pref_val)
    check_checkpoint_tokenizers(tokenizer, sft_policy=sft_policy)
    if params.reference == "online":
        log.info("reference log-probs: computed by the DPO job itself (dpo.reference: online)")
        return Artifact("", "online", {"reference": sft_policy, "online": True})
    key = reference_key(sft_policy, tokenizer, pref_train, pref_val)
    output = (Path(params.reference_cache_dir) / f"{key}.npz").resolve()
    meta = _reference_meta(key, sft_policy, tokenizer, pref_train, pref_val)
    if output.is_file():
        problem = cache_problem(output, reference_pairs(pref_train, pref_val))
        if problem is None:
            log.info("reference log-probs: reusing %s (key %s)", output, key)
            return Artifact(str(output), content_fingerprint(output), {**meta, "reused": True})
        log.warning("reference log-probs cache %s is corrupt (%s); recomputing", output, problem)
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


def resolve_reference_logps(saved: Artifact, cfg: DPOConfig, sft_policy: str, tokenizer: Artifact,
                            pref_train: Artifact, pref_val: Artifact) -> Artifact:
    """The reference log-probs ``train_dpo`` uses: ``saved`` (the catalog's ``dpo_reference_logps``) when it was
    computed for this very sft_policy, data and tokenizer, else the cache of that key in ``dpo.reference_cache_dir``
    (e.g. after ``--load-versions sft_policy:...``); verified either way. ``UserError`` (one line) when there is
    none or it is corrupt: nothing stale or damaged reaches the job."""
    if cfg.reference == "online":
        return Artifact("", "online", {"reference": sft_policy, "online": True})
    key = reference_key(sft_policy, tokenizer, pref_train, pref_val)
    rerun = "run `kedro run --nodes compute_reference_logps,train_dpo`"
    if saved.meta.get("key") == key:
        problem = cache_problem(saved.path, reference_pairs(pref_train, pref_val))
        if problem:
            state = "is missing" if problem == "missing" else f"is corrupt ({problem})"
            raise UserError(f"reference log-probs cache {saved.path} {state}; {rerun} to recompute it")
        return saved
    path = (Path(cfg.reference_cache_dir) / f"{key}.npz").resolve()
    problem = cache_problem(path, reference_pairs(pref_train, pref_val))
    if saved.meta.get("online"):
        was = "was saved for dpo.reference: online"
    elif saved.meta.get("key") is None:
        was = "has no record on disk"
    else:
        was = f"was computed for sft_policy {saved.meta.get('reference')} (key {saved.meta['key']})"
    if problem:
        found = "there is no cache" if problem == "missing" else f"the cache is corrupt ({problem})"
        raise UserError(f"dpo_reference_logps {was}, not for sft_policy {sft_policy} with the current preference data "
                        f"and tokenizer (key {key}), and {found} at {path}; {rerun}")
    log.info("reference log-probs: dpo_reference_logps %s; using the cache of the current key, %s", was, path)
    return Artifact(str(path), content_fingerprint(path),
                    {**_reference_meta(key, sft_policy, tokenizer, pref_train, pref_val), "reused": True})


def train_dpo(tokenizer: Artifact, pref_train: Artifact, pref_val: Artifact, sft_policy: str,
              dpo_reference_logps: Artifact, model: dict, parallel: dict, launch: dict,
              dpo: dict, stored: StoredVersions | None = None) -> tuple[str, dict[str, float]]:
    model_cfg, parallel_cfg, launch_cfg, cfg = typed_params(model, parallel, launch, dpo, DPOConfig, "dpo")
    dpo_reference_logps = resolve_reference_logps(dpo_reference_logps, cfg, sft_policy, tokenizer, pref_train,
                                                  pref_val)
    paths, lineage = train_paths(cfg, "dpo", tokenizer=tokenizer, train=pref_train, val=pref_val,
                                 init_from=cfg.init_from or sft_policy,
                                 key={"model": model_cfg, "parallel": parallel_cfg, "dpo": cfg,
                                      "reference_logps": dpo_reference_logps.fingerprint,
                                      "reference": model_identity(sft_policy)})
    job = DPOJob(dpo=cfg, model=model_cfg, parallel=parallel_cfg,
                 paths=DPOPaths(**to_dict(paths), reference_logps=dpo_reference_logps.path or None,
                                reference=sft_policy if cfg.reference == "online" else None),
                 lineage={**lineage, "reference": sft_policy, "reference_logps": dpo_reference_logps.fingerprint})
    return run_supervised_stage("align_pipeline.train.dpo", job, launch_cfg, cfg, "dpo",
                                metric_keys=("val_loss", "val_rewards/accuracies", "val_rewards/margins", "train_loss"),
                                stored=stored)
