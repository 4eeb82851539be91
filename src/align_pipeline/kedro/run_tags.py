"""What the MLflow runs of a ``kedro run`` are named and tagged with: run names that tell runs apart, the ``--params``
overrides that reach a node, the lineage of a node's inputs (checkpoint versions, data fingerprints, its params'
hash) and the MLflow dataset inputs of its data artifacts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from align_pipeline.config.base import config_hash
from align_pipeline.data.formats import Artifact
from align_pipeline.datasets.checkpoint import CheckpointDataset
from align_pipeline.tracking.lineage import lineage_tags
from align_pipeline.tracking.mlflow_logger import MAX_TAG_VALUE, flatten

MAX_RUN_NAME = 250


def join(items: Any) -> str:
    """Sorted, comma-separated, cut to a tag's length."""
    return ",".join(sorted(str(i) for i in items))[:MAX_TAG_VALUE]


def runner_name(runner: Any) -> str:
    """``"<kedro.runner.sequential_runner.SequentialRunner object at 0x...>"`` → ``"SequentialRunner"``."""
    text = str(runner) if runner not in (None, "None", "") else "SequentialRunner"  # None: Kedro's default
    match = re.match(r"<([\w.]+) object at", text)
    return match.group(1).rsplit(".", 1)[-1] if match else text


def run_label(base: str, overrides: dict[str, Any], version: str | None) -> str:
    """A run name that tells runs apart at a glance: ``train_dpo dpo.loss.beta=0.3 @2026-12-04T10.55.12.345Z``
    (the CLI overrides that reach the node, then the catalog version its outputs are saved under)."""
    parts = [base, *(f"{k}={v}" for k, v in sorted(overrides.items()))]
    if version:
        parts.append(f"@{version}")
    return " ".join(parts)[:MAX_RUN_NAME]


def overrides_for(runtime_params: dict[str, Any] | None, sections: set[str] | None = None) -> dict[str, Any]:
    """The ``--params`` overrides (flattened, ``dpo.loss.beta``) whose top-level section is in ``sections`` (all when
    None)."""
    flat = flatten(runtime_params or {})
    return {k: v for k, v in flat.items() if sections is None or k.split(".", 1)[0] in sections}


def dataset_input(name: str, artifact: Artifact):
    """An MLflow dataset input for a data artifact: its path as the source, its fingerprint as the digest."""
    import warnings

    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    with warnings.catch_warnings():  # "can be interpreted in multiple ways": both are the local source
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(artifact.path)
    dataset = MetaDataset(source, name=name, digest=artifact.fingerprint)._to_mlflow_entity()
    return DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "training")])


def is_checkpoint(catalog: Any, name: str) -> bool:
    """True for a catalog entry of versioned checkpoint directories (models, evaluation reports)."""
    if catalog is None:
        return False
    try:
        return isinstance(catalog.get(name), CheckpointDataset)
    except Exception:  # noqa: BLE001 — not a catalog entry (e.g. a free output)
        return False


def input_lineage(catalog: Any, inputs: dict[str, Any], params: dict[str, Any]) -> tuple[dict[str, str], list]:
    """``lineage.*`` tags of a node from its inputs (checkpoint versions by catalog name: a loaded checkpoint's path
    is ``<filepath>/<version>/<name>``; data fingerprints; the hash of its params) and the MLflow dataset inputs of its
    data artifacts."""
    lineage: dict[str, Any] = {}
    datasets = []
    for name, value in (inputs or {}).items():
        plain = name.split("@", 1)[0]  # a transcoded entry (dpo_policy@export) is its dataset's version
        if isinstance(value, str) and value and is_checkpoint(catalog, name):
            lineage[plain] = Path(value).parent.name
        elif isinstance(value, Artifact):
            lineage[f"data.{plain}"] = value.fingerprint
            datasets.append(dataset_input(plain, value))
    if params:
        lineage["config_hash"] = config_hash(params)
    return lineage_tags(lineage), datasets
