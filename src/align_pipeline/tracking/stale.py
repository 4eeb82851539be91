"""MLflow runs left RUNNING by a process that can no longer end them, and closing them as KILLED.

A ``kedro run`` whose process was killed (SIGKILL, OOM, a lost node), or whose tracking server went away mid-run
(tracking is then off in that process: :mod:`align_pipeline.tracking.bounded`), leaves its parent and child runs
RUNNING for good. So the hook tags every run it starts with the process that owns it (:func:`owner_tags`:
``align.host``, ``align.pid``, ``align.pid_started`` — the process's start time, so a reused pid is not mistaken
for it — and ``align.project``), and two places close such runs as KILLED, tagged ``align.closed_by``:

- the next ``kedro run`` of the same project (:func:`close_stale_runs`): its RUNNING runs whose process on this host
  is gone, or is this very process (left by an earlier ``kedro run`` in it, which can only have been interrupted);
- ``align-pipeline mlflow-log`` (:func:`close_runs_left_running`): the runs the re-logged ``metrics.jsonl`` was being
  logged into (its ``start`` records' ``mlflow_run_id``), with the last step the job logged (``align.last_step``)
  and the end time of its last record, and their parent ``kedro run`` once its process is gone.

Runs without these tags (another tool's, an older version's) are never touched. Nothing here imports Kedro; the
MLflow calls go through :func:`align_pipeline.tracking.bounded.call`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

from align_pipeline.tracking.bounded import call

logger = logging.getLogger(__name__)

HOST_TAG, PID_TAG, STARTED_TAG, PROJECT_TAG = "align.host", "align.pid", "align.pid_started", "align.project"
CLOSED_BY_TAG, LAST_STEP_TAG = "align.closed_by", "align.last_step"
_MAX_PAGES = 20  # of 1000 RUNNING runs each: more than any project has


def _process_started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def owner_tags(project_path: str | Path) -> dict[str, str]:
    """Tags naming this process as the owner of a run it starts, and the project it runs."""
    return {
        HOST_TAG: socket.gethostname(),
        PID_TAG: str(os.getpid()),
        STARTED_TAG: repr(_process_started(os.getpid())),
        PROJECT_TAG: str(Path(project_path).resolve()),
    }


def owner_state(tags: Mapping[str, str]) -> str:
    """``"this"`` (this process owns the run), ``"alive"`` (another live process on this host), ``"gone"`` (its
    process on this host has ended) or ``"unknown"`` (no owner tags, or another host)."""
    if tags.get(HOST_TAG) != socket.gethostname() or not str(tags.get(PID_TAG, "")).isdigit():
        return "unknown"
    pid = int(tags[PID_TAG])
    started = _process_started(pid)
    if started is None or repr(started) != tags.get(STARTED_TAG):
        return "gone"
    return "this" if pid == os.getpid() else "alive"


def _kill(
    uri: str | None, client: Any, run_id: str, why: str, end_time: int | None = None, last_step: int | None = None
) -> None:
    tags = {CLOSED_BY_TAG: why[:8000]}
    if last_step is not None:
        tags[LAST_STEP_TAG] = str(last_step)
    for key, value in tags.items():
        call(uri, client.set_tag, run_id, key, value)
    call(uri, client.set_terminated, run_id, "KILLED", end_time)


def close_stale_runs(uri: str | None, client: Any, project_path: str | Path, closer: str) -> list[str]:
    """KILLED: the RUNNING runs of ``project_path`` (any experiment of the store) whose owning process on this host
    is gone or is this process; ``closer`` names who closes them (``align.closed_by``). Returns their ids."""
    project = str(Path(project_path).resolve())
    experiments = [e.experiment_id for e in call(uri, client.search_experiments, max_results=1000)]
    closed: list[str] = []
    token = None
    for _ in range(_MAX_PAGES if experiments else 0):
        page = call(uri, client.search_runs, experiments, "attributes.status = 'RUNNING'", max_results=1000,
                    page_token=token)  # fmt: skip
        for run in page:
            tags = run.data.tags
            state = owner_state(tags)
            if tags.get(PROJECT_TAG) != project or state not in ("gone", "this"):
                continue
            owner = f"process {tags[PID_TAG]} on {tags[HOST_TAG]}"
            why = f"{closer}: left RUNNING by {owner}, " + (
                "which has ended" if state == "gone" else "an earlier kedro run of this process"
            )
            _kill(uri, client, run.info.run_id, why)
            closed.append(run.info.run_id)
        token = page.token
        if not token:
            break
    if closed:
        logger.warning("MLflow: %d run(s) of this project left RUNNING by an ended kedro run marked KILLED: %s",
                       len(closed), ", ".join(closed))  # fmt: skip
    return closed


def _segments(records: Iterable[Mapping[str, Any]]) -> dict[str, tuple[int | None, int | None]]:
    """Run id -> (last step, last timestamp) of the records logged into it (from its ``start`` record on)."""
    out: dict[str, tuple[int | None, int | None]] = {}
    current = None
    for record in records:
        if record.get("type") == "start":
            current = record.get("mlflow_run_id") or None
            if current:
                out.setdefault(current, (None, None))
        if not current:
            continue
        step, ts = out[current]
        if record.get("type") == "metrics" and isinstance(record.get("step"), int):
            step = record["step"] if step is None else max(step, record["step"])
        if isinstance(record.get("timestamp"), int):
            ts = record["timestamp"] if ts is None else max(ts, record["timestamp"])
        out[current] = (step, ts)
    return out


def close_runs_left_running(uri: str | None, client: Any, records: list[Mapping[str, Any]], source: str
                            ) -> list[str]:  # fmt: skip
    """KILLED, with the last step the job logged and the time of its last record: the runs ``records`` (a
    ``metrics.jsonl``) were logged into that are still RUNNING — the job that wrote the file is over, and its
    ``kedro run`` stopped tracking (or it would have ended them) — unless this process owns them; then their parent
    ``kedro run`` when its process is gone. Runs this store does not have are skipped. Returns the ids closed."""
    from mlflow.exceptions import MlflowException

    closed: list[str] = []
    parents: dict[str, int | None] = {}
    why = f"align-pipeline mlflow-log {source}: left RUNNING when its kedro run stopped tracking"
    for run_id, (step, end) in _segments(records).items():
        try:
            run = call(uri, client.get_run, run_id)
        except MlflowException:  # not in this store
            continue
        parent = run.data.tags.get("mlflow.parentRunId")
        if parent:
            parents[parent] = max(filter(None, (parents.get(parent), end)), default=None)
        if run.info.status != "RUNNING" or owner_state(run.data.tags) == "this":
            continue
        _kill(uri, client, run_id, why, end, step)
        closed.append(run_id)
    for run_id, end in parents.items():
        try:
            run = call(uri, client.get_run, run_id)
        except MlflowException:
            continue
        if run.info.status == "RUNNING" and owner_state(run.data.tags) == "gone":
            _kill(uri, client, run_id, why.replace("left RUNNING when", "its process ended after"), end)
            closed.append(run_id)
    return closed


__all__ = [
    "CLOSED_BY_TAG",
    "LAST_STEP_TAG",
    "close_runs_left_running",
    "close_stale_runs",
    "owner_state",
    "owner_tags",
]
