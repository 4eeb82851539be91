"""``metrics.jsonl``: rank 0's own record of everything it logs, kept whether or not MLflow is up.

The job's :class:`~align_pipeline.tracking.RunLogger` appends one JSON object per line to ``<run_dir>/metrics.jsonl``
(flushed per line, so a crash loses nothing written before it) and the end of a run copies the file into every model
checkpoint it exports (:func:`align_pipeline.train.core.progress.finish`), where it survives the run directory's
clean-up and travels with the catalog version. Records:

    {"type": "start", "id": "<hex>", "timestamp": ms, "mlflow_run_id": "..."|null, "tracking_uri": "..."|null}
    {"type": "params", "timestamp": ms, "params": {"job.sft.training.lr": "0.001", ...}}   # as MLflow stores them
    {"type": "metrics", "timestamp": ms, "step": 20, "metrics": {"loss": 1.23, ...}}
    {"type": "tags", "timestamp": ms, "tags": {"lineage.parent": "...", ...}}

A resumed job appends to the same file (one ``start`` record per invocation); the first record's ``id`` names the
file's history, also in its copies. :func:`relog` (``align-pipeline mlflow-log``) puts a file into MLflow with its
steps and timestamps: into a given run, or into a new run of an experiment, which a later re-log of the same file
(or of its copy) finds again by the tag ``align.metrics_source``. Metric points, params and tags already in the run
are not logged twice, so a re-log can be repeated, also into the run that was being logged when MLflow went down.

Nothing here imports Kedro; MLflow is imported only by :func:`relog`.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SOURCE_TAG = "align.metrics_source"
"""Tag of a run made by :func:`relog`: the ``id`` of the file's first record."""
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_TAGS_PER_BATCH = 100
_FLOAT_MAX = sys.float_info.max


def now_ms() -> int:
    return int(time.time() * 1000)


def job_metrics_path(argv: list[str] | None = None) -> Path | None:
    """``<run_dir>/metrics.jsonl`` of the entry point this process runs: the run directory named by its
    ``--config <json>`` (``paths.run_dir`` or ``run_dir``, else the JSON's own directory, which is where
    ``run_torchrun`` writes it); None when the process has no ``--config`` (a test, a notebook)."""
    args = sys.argv[1:] if argv is None else argv
    config = None
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            config = args[i + 1]
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
    if not config:
        return None
    path = Path(config)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    holder = data.get("paths") if isinstance(data, dict) and isinstance(data.get("paths"), dict) else data
    run_dir = holder.get("run_dir") if isinstance(holder, dict) else None
    return Path(run_dir or path.parent).resolve() / METRICS_FILE


class MetricsFile:
    """Appends records to one ``metrics.jsonl`` (rank 0 of a job). Never raises: a failing write is a warning, once."""

    def __init__(self, path: str | Path, mlflow_run_id: str | None = None, tracking_uri: str | None = None) -> None:
        self.path = Path(path)
        self._failed = False
        self.write(
            {"type": "start", "id": uuid.uuid4().hex, "mlflow_run_id": mlflow_run_id, "tracking_uri": tracking_uri}
        )

    def write(self, record: dict[str, Any], timestamp: int | None = None) -> None:
        if self._failed:
            return
        line = json.dumps({**record, "timestamp": now_ms() if timestamp is None else timestamp}, default=str)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(line + "\n")
        except OSError as exc:
            self._failed = True
            logger.warning("cannot write %s (metrics are not kept there for the rest of the run): %s", self.path, exc)

    def copy_to(self, directory: str | Path) -> Path | None:
        """Copy the file into ``directory`` (a model checkpoint); its path there, or None (nothing to copy)."""
        if not self.path.is_file():
            return None
        target = Path(directory) / METRICS_FILE
        try:
            shutil.copyfile(self.path, target)
        except OSError as exc:
            logger.warning("cannot copy %s into %s: %s", self.path, directory, exc)
            return None
        return target


def resolve(source: str | Path) -> Path:
    """A ``metrics.jsonl``, or a directory holding one (a model checkpoint or a run directory)."""
    path = Path(source)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} at {source}")
    return path.resolve()


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; an unreadable line (the torn last line of a killed job) is skipped."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            logger.warning("%s:%d: not JSON, skipped", path, number)
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _point(value: float) -> float | str:
    """A metric value as the store gives it back: NaN as one token, +-inf as +-max float (MLflow's SQL stores)."""
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return math.copysign(_FLOAT_MAX, value)
    return value


def relog(
    source: str | Path, client, *, run_id: str | None = None, experiment: str | None = None, run_name: str | None = None
) -> dict[str, Any]:
    """Log a ``metrics.jsonl`` (or the one in a checkpoint / run directory) into MLflow through ``client``.

    Into ``run_id`` when given; else into a new run of ``experiment`` (created if needed), or the run an earlier
    re-log of the same file made there. Steps and timestamps are kept; what the run already has is skipped (metric
    points equal in key, step, timestamp and value; params already set — a different value is reported, MLflow
    cannot change a param). Returns a summary (run id, counts)."""
    from mlflow.entities import Metric, Param, RunTag

    path = resolve(source)
    records = read_records(path)
    starts = [r for r in records if r.get("type") == "start"]
    source_id = str(starts[0].get("id")) if starts and starts[0].get("id") else None
    params: dict[str, str] = {}
    tags: dict[str, str] = {}
    points: list[tuple[str, float, int, int]] = []
    for r in records:
        if r.get("type") == "params" and isinstance(r.get("params"), Mapping):
            params.update({str(k): str(v) for k, v in r["params"].items()})
        elif r.get("type") == "tags" and isinstance(r.get("tags"), Mapping):
            tags.update({str(k): str(v) for k, v in r["tags"].items()})
        elif r.get("type") == "metrics" and isinstance(r.get("metrics"), Mapping):
            ts, step = int(r.get("timestamp") or 0), int(r.get("step") or 0)
            points += [
                (str(k), float(v), ts, step)
                for k, v in r["metrics"].items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            ]
    times = [int(r["timestamp"]) for r in records if isinstance(r.get("timestamp"), (int, float))]

    created = False
    if run_id is None:
        name = experiment or "align-pipeline"
        found = client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(name)
        earlier = (
            client.search_runs([experiment_id], f"tags.`{SOURCE_TAG}` = '{source_id}'", max_results=1)
            if source_id
            else []
        )
        if earlier:
            run_id = earlier[0].info.run_id
        else:
            run = client.create_run(
                experiment_id,
                start_time=min(times) if times else None,
                tags={SOURCE_TAG: source_id or "", "align.relogged_from": str(path)},
                run_name=run_name or f"relog:{path.parent.name}",
            )
            run_id, created = run.info.run_id, True
    run = client.get_run(run_id)

    have_params = run.data.params
    new_params = [Param(k, v) for k, v in params.items() if k not in have_params]
    conflicts = sorted(k for k, v in params.items() if k in have_params and have_params[k] != v)
    if conflicts:
        logger.warning(
            "run %s already has %d of these params with other values (kept): %s",
            run_id,
            len(conflicts),
            ", ".join(conflicts[:10]),
        )
    new_tags = [RunTag(k, v) for k, v in tags.items() if run.data.tags.get(k) != v]
    have_points: dict[str, set] = {}
    new_points = []
    for key, value, ts, step in points:
        if key not in have_points:
            have_points[key] = {(m.step, m.timestamp, _point(m.value)) for m in client.get_metric_history(run_id, key)}
        mark = (step, ts, _point(value))
        if mark not in have_points[key]:
            have_points[key].add(mark)
            new_points.append(Metric(key, value, ts, step))
    for i in range(0, len(new_params), _PARAMS_PER_BATCH):
        client.log_batch(run_id, params=new_params[i : i + _PARAMS_PER_BATCH], synchronous=True)
    for i in range(0, len(new_tags), _TAGS_PER_BATCH):
        client.log_batch(run_id, tags=new_tags[i : i + _TAGS_PER_BATCH], synchronous=True)
    for i in range(0, len(new_points), _METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=new_points[i : i + _METRICS_PER_BATCH], synchronous=True)
    if created:
        client.set_terminated(run_id, "FINISHED", end_time=max(times) if times else None)
    return {
        "run_id": run_id,
        "experiment_id": run.info.experiment_id,
        "created": created,
        "source": str(path),
        "metrics_logged": len(new_points),
        "metrics_skipped": len(points) - len(new_points),
        "params_logged": len(new_params),
        "params_conflicting": len(conflicts),
        "tags_logged": len(new_tags),
    }


__all__ = ["METRICS_FILE", "SOURCE_TAG", "MetricsFile", "job_metrics_path", "read_records", "relog", "resolve"]
