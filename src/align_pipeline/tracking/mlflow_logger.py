"""Rank-0 MLflow logging for torchrun entry points, and the small helpers the Kedro hook shares with it.

The Kedro hook owns the runs (one parent per ``kedro run``, one child per node). A torchrun job never creates a run:
it *attaches* to the node's child run, whose id arrives in ``MLFLOW_RUN_ID`` (and the store in
``MLFLOW_TRACKING_URI``), both set by the launcher from :func:`child_run_env`. Every rank builds a :class:`RunLogger`;
only rank 0 logs, the others get a no-op. A tracking failure is a warning, never a training failure.

Rank 0 also keeps everything it logs (params, step and final metrics, tags) in ``<run_dir>/metrics.jsonl``, whether
or not MLflow is up or a run id was given (:mod:`align_pipeline.tracking.metrics_file`); the end of the run copies it
into the model checkpoints. Before attaching, rank 0 probes a remote store once (:mod:`align_pipeline.tracking.probe`,
a few seconds at most): if it does not answer, the job warns once and trains without MLflow instead of waiting out
MLflow's retries. Every later call is bounded (:mod:`align_pipeline.tracking.bounded`): a store that stops answering
during the run costs a few seconds once (at most ``ALIGN_MLFLOW_CALL_TIMEOUT``, 10 s), then the job warns once and
trains on without MLflow. Running an entry point by hand without ``MLFLOW_RUN_ID`` logs nothing to MLflow (the file
is still written).

    log = RunLogger(rank)                       # every rank
    log.log_params(to_dict(cfg))                # nested keys flattened with "."
    log.log_metrics({"loss": 1.23, "lr": 1e-3}, step=20)
    log.log_system_metrics(step=20)             # CPU/RSS, and GPU util/memory/power when NVML finds a GPU
    log.close()

Nothing here imports Kedro; MLflow is imported only by an active logger (rank 0 with a run id).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from align_pipeline.tracking import bounded
from align_pipeline.tracking.bounded import TrackingOff
from align_pipeline.tracking.metrics_file import MetricsFile, job_metrics_path, now_ms
from align_pipeline.tracking.probe import unreachable

logger = logging.getLogger(__name__)

MAX_PARAM_VALUE = 6000
"""MLflow's limit on a param value's length."""
MAX_TAG_VALUE = 8000
"""MLflow's limit on a tag value's length."""
MAX_KEY = 250
"""MLflow's limit on a param/metric/tag key's length."""
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_TAGS_PER_BATCH = 100
_BAD_KEY_CHARS = re.compile(r"[^\w\-. /:]")


def default_tracking_uri(project_path: str | Path) -> str:
    """``sqlite:////<abs project path>/mlflow.db`` — absolute, so processes with another cwd share the store."""
    return "sqlite:///" + Path(project_path).resolve().joinpath("mlflow.db").as_posix()


def child_run_env() -> dict[str, str]:
    """``MLFLOW_TRACKING_URI`` and ``MLFLOW_RUN_ID`` of this thread's active run (the Kedro node's child run, else
    MLflow's active run: :func:`align_pipeline.tracking.runs.active_run`); ``{}`` when none, or when tracking is off
    for its store in this process (the job need not find that out again).

    The launcher puts these into the torchrun job's environment so its rank 0 logs into the Kedro node's run.
    """
    from align_pipeline.tracking.runs import active_run

    run = active_run()
    if run is None:
        return {}
    return {"MLFLOW_TRACKING_URI": run[0], "MLFLOW_RUN_ID": run[1]}


def _plain(value: Any) -> Any:
    """Dataclasses / pydantic models → dicts; everything else unchanged."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        try:
            return dump()
        except Exception:  # noqa: BLE001 — not a pydantic model after all: keep the value
            return value
    return value


def flatten(data: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (dataclasses and pydantic models are expanded too)."""
    out: dict[str, Any] = {}
    for key, value in _plain(data).items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        value = _plain(value)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name, sep))
        else:
            out[name] = value
    return out


def clean_key(key: str) -> str:
    """A key MLflow accepts: unsupported characters → ``_``, at most 250 characters."""
    return _BAD_KEY_CHARS.sub("_", str(key))[:MAX_KEY]


def param_value(value: Any) -> str:
    """A param value as MLflow stores it: a string of at most 6000 characters (lists/dicts as JSON)."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, (list, tuple, dict)):
        text = json.dumps(value, default=str)
    else:
        text = str(value)
    return text if len(text) <= MAX_PARAM_VALUE else text[: MAX_PARAM_VALUE - 3] + "..."


def as_number(value: Any) -> float | None:
    """A float for ints, floats, bools, numpy/torch scalars; None for anything else."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            out = item()
        except (ValueError, RuntimeError, TypeError):  # a tensor/array with more than one element
            return None
        return float(out) if isinstance(out, (int, float)) else None
    return None


def numeric_items(data: Mapping[str, Any]) -> dict[str, float]:
    """Flattened numeric entries of ``data`` with MLflow-safe keys; non-numbers are dropped."""
    out = {}
    for key, value in flatten(data).items():
        number = as_number(value)
        if number is not None:
            out[clean_key(key)] = number
    return out


def _metrics_path(metrics_file: str | Path | bool | None) -> Path | None:
    if metrics_file is False:
        return None
    if metrics_file not in (None, True):
        return Path(metrics_file).resolve()
    from_env = os.environ.get("ALIGN_METRICS_FILE")
    return Path(from_env).resolve() if from_env else job_metrics_path()


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


class RunLogger:
    """Logs into an existing MLflow run from rank 0 of a torchrun job, and keeps what it logs in ``metrics.jsonl``;
    a no-op on other ranks.

    Args:
        rank: this process's global rank (``None`` = ``$RANK``, default 0).
        run_id: the run to attach to (``None`` = ``$MLFLOW_RUN_ID``). The run must exist; none is created.
        tracking_uri: the store (``None`` = ``$MLFLOW_TRACKING_URI``, else MLflow's default).
        system_metrics: sample CPU/memory/GPU in :meth:`log_system_metrics`.
        metrics_file: where rank 0 keeps its record (``None`` = ``$ALIGN_METRICS_FILE``, else ``metrics.jsonl`` in
            the run directory of the job's ``--config``, else nowhere; ``False`` = nowhere).
    """

    def __init__(
        self,
        rank: int | None = None,
        run_id: str | None = None,
        tracking_uri: str | None = None,
        *,
        system_metrics: bool = True,
        metrics_file: str | Path | bool | None = None,
    ) -> None:
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
        self.run_id = run_id or os.environ.get("MLFLOW_RUN_ID") or None
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self._client: Any = None
        self._system: Any = None
        self._file: MetricsFile | None = None
        self._warned: set[str] = set()
        if self.rank != 0:
            return
        path = _metrics_path(metrics_file)
        if self.run_id:
            kept = str(path) if path is not None else "no metrics.jsonl (this process has no --config run dir)"
            bounded.describe_kept(kept, f"{path.parent if path is not None else '<run dir>'} --run-id {self.run_id}")
            reason = unreachable(self.tracking_uri) if bounded.off_reason(self.tracking_uri) is None else None
            if reason is not None:
                bounded.switch_off(self.tracking_uri, reason)
            with self._safely("attach"):
                from mlflow.tracking import MlflowClient

                client = MlflowClient(tracking_uri=self.tracking_uri)
                self._client = client
                self._call(client.get_run, self.run_id)  # fail now (→ warning, inactive) if the run is not there
        if path is not None:
            self._file = MetricsFile(path, self.run_id if self._client is not None else None, self.tracking_uri)
        if (self._client is not None or self._file is not None) and system_metrics:
            with self._safely("system_metrics"):
                from align_pipeline.tracking.system_metrics import SystemMetrics

                self._system = SystemMetrics()

    @property
    def active(self) -> bool:
        """True when this logger writes to MLflow (rank 0, attached to a run, its store answering)."""
        return self._client is not None and bounded.off_reason(self.tracking_uri) is None

    @property
    def metrics_path(self) -> Path | None:
        """The ``metrics.jsonl`` rank 0 keeps (None on other ranks, or when it keeps none)."""
        return self._file.path if self._file is not None else None

    def _call(self, fn, *args, **kwargs):
        """One MLflow call, bounded (:func:`align_pipeline.tracking.bounded.call`)."""
        return bounded.call(self.tracking_uri, fn, *args, **kwargs)

    @contextlib.contextmanager
    def _safely(self, what: str):
        """Turn any tracking error into a warning (once per kind; later ones at DEBUG): training goes on. A store
        that has stopped answering switches tracking off for the rest of the process (warned once, by
        :mod:`~align_pipeline.tracking.bounded`)."""
        try:
            yield
        except TrackingOff:
            self._client = None
        except Exception as exc:  # noqa: BLE001 — by contract, tracking never fails training
            if what == "attach":
                self._client = None
            if what in self._warned:
                logger.debug("MLflow %s failed again: %s", what, exc)
                return
            self._warned.add(what)
            logger.warning(
                "MLflow %s failed (run %s); training continues, further %s errors are logged at DEBUG: %s: %s",
                *(what, self.run_id, what, type(exc).__name__, exc),
            )

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log (nested) params; keys flattened with ``.``, values stringified and cut to 6000 characters."""
        if not self.active and self._file is None:
            return
        with self._safely("log_params"):
            items = {clean_key(k): param_value(v) for k, v in flatten(params).items()}
            if self._file is not None:
                self._file.write({"type": "params", "params": items})
            if self.active:
                from mlflow.entities import Param

                for chunk in _chunks([Param(k, v) for k, v in items.items()], _PARAMS_PER_BATCH):
                    self._call(self._client.log_batch, self.run_id, params=chunk, synchronous=True)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log numeric metrics at ``step`` in one batch; nested keys flattened, non-numbers dropped."""
        if not self.active and self._file is None:
            return
        with self._safely("log_metrics"):
            now, step = now_ms(), int(step or 0)  # the same timestamp in the file and in MLflow
            values = numeric_items(metrics)
            if self._file is not None and values:
                self._file.write({"type": "metrics", "step": step, "metrics": values}, timestamp=now)
            if self.active:
                from mlflow.entities import Metric

                items = [Metric(key, value, now, step) for key, value in values.items()]
                for chunk in _chunks(items, _METRICS_PER_BATCH):
                    self._call(self._client.log_batch, self.run_id, metrics=chunk, synchronous=True)

    def log_system_metrics(self, step: int | None = None) -> dict[str, float]:
        """Sample CPU %, process RSS, system memory and (with NVML) GPU utilisation/memory/power; log them at
        ``step``. Returns the sample ({} when inactive)."""
        if self._system is None or (not self.active and self._file is None):
            return {}
        sample: dict[str, float] = {}
        with self._safely("system_metrics"):
            sample = self._system.sample()
        if sample:
            self.log_metrics(sample, step)
        return sample

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set string tags (values stringified, cut to 8000 characters)."""
        if not self.active and self._file is None:
            return
        with self._safely("set_tags"):
            values = {clean_key(k): str(v)[:MAX_TAG_VALUE] for k, v in tags.items() if v is not None}
            if self._file is not None:
                self._file.write({"type": "tags", "tags": values})
            if self.active:
                from mlflow.entities import RunTag

                for chunk in _chunks([RunTag(k, v) for k, v in values.items()], _TAGS_PER_BATCH):
                    self._call(self._client.log_batch, self.run_id, tags=chunk, synchronous=True)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file, or a directory's contents, to the run's artifacts (under ``artifact_path``)."""
        if not self.active:
            return
        with self._safely("log_artifact"):
            path = Path(path)
            if path.is_dir():
                self._call(self._client.log_artifacts, self.run_id, str(path), artifact_path)
            else:
                self._call(self._client.log_artifact, self.run_id, str(path), artifact_path)

    def copy_metrics_to(self, directory: str | Path) -> Path | None:
        """Copy ``metrics.jsonl`` into ``directory`` (a model checkpoint the job exports); the copy's path or None."""
        return self._file.copy_to(directory) if self._file is not None else None

    def close(self) -> None:
        """Stop logging. The run itself is left open: the Kedro hook ends it when the node finishes."""
        if self._system is not None:
            self._system.close()
        self._client = None
        self._system = None
        self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = [
    "RunLogger",
    "child_run_env",
    "clean_key",
    "default_tracking_uri",
    "flatten",
    "numeric_items",
    "param_value",
]
