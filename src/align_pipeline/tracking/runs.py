"""Small helpers for code running inside a Kedro node whose MLflow child run is active (the hook started it)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

logger = logging.getLogger(__name__)


def tag_active_run(tags: Mapping[str, str]) -> bool:
    """Set ``tags`` on this thread's active MLflow run (the node's child run in a ``kedro run``); False when there is
    none (MLflow never imported, tracking off, a node called directly). A tracking error is a warning."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or mlflow.active_run() is None:
        return False
    try:
        mlflow.set_tags({k: str(v)[:8000] for k, v in tags.items()})
    except Exception as exc:  # noqa: BLE001 — tracking never fails a node
        logger.warning("MLflow: could not tag the node's run: %s: %s", type(exc).__name__, exc)
        return False
    return True


def log_artifacts_to_active_run(directory, artifact_path: str, pattern: str = "*") -> int:
    """Upload the files of ``directory`` matching ``pattern`` to this thread's active MLflow run under
    ``artifact_path`` (a node's rank logs before its run directory is deleted); returns how many (0 without an
    active run). A tracking error is a warning."""
    from pathlib import Path

    mlflow = sys.modules.get("mlflow")
    files = sorted(p for p in Path(directory).glob(pattern) if p.is_file()) if Path(directory).is_dir() else []
    if mlflow is None or mlflow.active_run() is None or not files:
        return 0
    try:
        for f in files:
            mlflow.log_artifact(str(f), artifact_path)
    except Exception as exc:  # noqa: BLE001 — tracking never fails a node
        logger.warning("MLflow: could not keep the logs of %s: %s: %s", directory, type(exc).__name__, exc)
        return 0
    return len(files)


__all__ = ["log_artifacts_to_active_run", "tag_active_run"]
