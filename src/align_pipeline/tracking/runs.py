"""The node's MLflow run, for code running inside a Kedro node (the launcher, node functions).

The hook (:class:`align_pipeline.kedro.mlflow_hook.MlflowHook`) starts each node's child run through MLflow's client and names
it here for the thread that runs the node (:func:`set_node_run`), instead of pushing it on MLflow's fluent
active-run stack, whose calls cannot be bounded. :func:`active_run` gives that run, else MLflow's own active run (an
entry point called inside a user's ``with mlflow.start_run():``). Every call to the store is bounded
(:mod:`align_pipeline.tracking.bounded`): a store that has gone away costs seconds once, then nothing.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from align_pipeline.tracking.bounded import TrackingOff, call, off_reason

logger = logging.getLogger(__name__)

_node = threading.local()


def set_node_run(tracking_uri: str, run_id: str) -> None:
    """The node running in this thread logs into ``run_id`` of the store ``tracking_uri``."""
    _node.run = (tracking_uri, run_id)


def clear_node_run() -> None:
    """The node of this thread has returned (or raised)."""
    _node.run = None


def active_run() -> tuple[str, str] | None:
    """``(tracking uri, run id)`` of this thread's node run, else of MLflow's active run; None when there is none or
    tracking is off for its store in this process."""
    run = getattr(_node, "run", None)
    if run is None:
        mlflow = sys.modules.get("mlflow")  # not imported → no run can be active; don't pay for the import
        active = mlflow.active_run() if mlflow is not None else None
        run = (mlflow.get_tracking_uri(), active.info.run_id) if active is not None else None
    if run is None or off_reason(run[0]) is not None:
        return None
    return run


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def tag_active_run(tags: Mapping[str, str]) -> bool:
    """Set ``tags`` on this thread's active run (the node's child run in a ``kedro run``); False when there is none
    (tracking off, a node called directly). A tracking error is a warning."""
    run = active_run()
    if run is None:
        return False
    from mlflow.entities import RunTag

    uri, run_id = run
    try:
        call(uri, _client(uri).log_batch, run_id, tags=[RunTag(k, str(v)[:8000]) for k, v in tags.items()],
             synchronous=True)  # fmt: skip
    except TrackingOff:
        return False
    except Exception as exc:  # noqa: BLE001 — tracking never fails a node
        logger.warning("MLflow: could not tag the node's run: %s: %s", type(exc).__name__, exc)
        return False
    return True


def log_artifacts_to_active_run(directory, artifact_path: str, pattern: str = "*") -> int:
    """Upload the files of ``directory`` matching ``pattern`` to this thread's active run under ``artifact_path`` (a
    node's rank logs before its run directory is deleted); returns how many (0 without an active run). A tracking
    error is a warning; each upload is bounded, so a store that has gone away costs seconds once."""
    files = sorted(p for p in Path(directory).glob(pattern) if p.is_file()) if Path(directory).is_dir() else []
    run = active_run() if files else None
    if run is None:
        return 0
    uri, run_id = run
    client = _client(uri)
    try:
        for f in files:
            call(uri, client.log_artifact, run_id, str(f), artifact_path)
    except TrackingOff:
        return 0
    except Exception as exc:  # noqa: BLE001 — tracking never fails a node
        logger.warning("MLflow: could not keep the logs of %s: %s: %s", directory, type(exc).__name__, exc)
        return 0
    return len(files)


__all__ = ["active_run", "clear_node_run", "log_artifacts_to_active_run", "set_node_run", "tag_active_run"]
