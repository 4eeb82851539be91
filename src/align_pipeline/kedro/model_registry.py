"""HF exports into MLflow's model registry: a stored ``HFModelDataset`` version becomes a version of the registered
model named like its catalog entry, with the node's lineage tags and ``export.check`` - only when its
``align_export_check.json`` says passed (or skipped: ``export.check: false``)."""

from __future__ import annotations

import logging

from align_pipeline.kedro.tracking_store import TrackingStore
from align_pipeline.model.export_check import CHECK_FILE, read_status
from align_pipeline.tracking.mlflow_logger import clean_key

logger = logging.getLogger("align_pipeline.kedro.mlflow_hook")


def register(store: TrackingStore, name: str, version: str, path: str, run_id: str) -> None:
    """Register the export at ``path`` (catalog ``name``, ``version``) as made by the node run ``run_id``; an export
    whose check failed, or that has no check record, is not registered (one warning)."""
    from mlflow.exceptions import MlflowException

    status = read_status(path)
    if status not in ("passed", "skipped"):
        logger.warning("%s version %s: not registered in MLflow's model registry (its %s says %s)", name,
                       version, CHECK_FILE, status or "nothing: missing or unreadable")
        return
    client = store.client()
    run_tags = store.call(client.get_run, run_id).data.tags
    tags = {k: v for k, v in run_tags.items() if k.startswith(("lineage.", "kedro.run"))}
    tags[clean_key(f"lineage.out.{name}")] = version
    tags["export.check"] = status
    try:
        store.call(client.create_registered_model, name, tags={"align.dataset": name},
                   description=f"Hugging Face exports of the catalog entry {name}")  # fmt: skip
    except MlflowException:  # already registered
        pass
    registered = store.call(client.create_model_version, name, source=path, run_id=run_id, tags=tags)
    logger.info("%s: registered in MLflow's model registry as %s version %s", name, name, registered.version)
