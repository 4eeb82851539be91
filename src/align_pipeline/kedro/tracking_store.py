"""The MLflow store of a ``kedro run``, as the hooks talk to it: where it is, whether it is on, and bounded calls.

Store: ``$MLFLOW_TRACKING_URI``, else ``sqlite:////<project>/mlflow.db`` (artifacts in ``<project>/mlruns``);
experiment: ``$MLFLOW_EXPERIMENT_NAME``, else ``align-pipeline``. A remote store is probed once when the context is
created (:mod:`align_pipeline.tracking.probe`, a few seconds at most); if it does not answer, tracking is off for the
run (the jobs then get no run id, so they do not try either) and the metrics are only in the jobs' ``metrics.jsonl``
files, which ``align-pipeline mlflow-log`` re-logs later. Every call is bounded
(:mod:`align_pipeline.tracking.bounded`): a store that goes away mid-run costs a few seconds once (at most 10 s), then
tracking is off with one warning, and the nodes and catalog saves go on. Runs are created and ended through MLflow's
client, not its fluent active-run stack (whose calls cannot be bounded).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from align_pipeline.tracking import bounded
from align_pipeline.tracking.bounded import TrackingOff
from align_pipeline.tracking.mlflow_logger import clean_key, default_tracking_uri, flatten, param_value
from align_pipeline.tracking.probe import unreachable

logger = logging.getLogger("align_pipeline.kedro.mlflow_hook")

DEFAULT_EXPERIMENT = "align-pipeline"


EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
"""The experiment's kind for MLflow's UI: model training (runs, metrics, charts), not a GenAI app's traces."""


class TrackingStore:
    """The store and experiment of this run; ``enabled`` False = track nothing (unreachable, gone, or broken)."""

    def __init__(self, on_off: Callable[[], None] = lambda: None) -> None:
        self.enabled = True
        self.uri: str | None = None
        self.experiment_id: str | None = None
        self._client: Any = None
        self._on_off = on_off  # what the owner forgets when tracking goes off (its open runs)

    @contextlib.contextmanager
    def guard(self, what: str):
        """Any failure inside is a warning (tracking never fails a ``kedro run``); the store gone = tracking off."""
        try:
            yield
        except TrackingOff:  # the store went away (warned once by tracking.bounded): stop calling it
            self.switch_off()
        except Exception as exc:  # noqa: BLE001 — by design, tracking never fails a kedro run
            logger.warning("MLflow tracking failed in %s (the run continues): %s: %s", what, type(exc).__name__, exc)

    def switch_off(self) -> None:
        """Track nothing more in this run (its open runs stay as they are: the next kedro run or
        ``align-pipeline mlflow-log`` closes them)."""
        self.enabled = False
        self._on_off()

    def client(self):
        """The MlflowClient of this run's store (made once per store)."""
        from mlflow.tracking import MlflowClient

        if self._client is None or self._client.tracking_uri != self.uri:
            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def call(self, fn, *args: Any, **kwargs: Any) -> Any:
        """One call to the store, bounded (:func:`align_pipeline.tracking.bounded.call`)."""
        return bounded.call(self.uri, fn, *args, **kwargs)

    def connect(self, project_path: Path) -> None:
        """Point MLflow at the project's store and experiment (created, or restored if deleted); export
        ``MLFLOW_TRACKING_URI`` for the torchrun jobs. Leaves ``enabled`` False when the store does not answer."""
        import mlflow

        self.enabled = False
        default_uri = default_tracking_uri(project_path)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or default_uri
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        self.uri = uri
        bounded.reset(uri)  # a new kedro run: the store gets a new chance
        bounded.describe_kept(
            "<run dir>/metrics.jsonl of each job, copied into its model checkpoint (<checkpoint>/metrics.jsonl)",
            f"<checkpoint> --experiment {name}",
        )
        reason = unreachable(uri)  # one short request for a remote store; a local one is never probed
        if reason is not None:
            bounded.switch_off(uri, reason)
            return
        os.environ["MLFLOW_TRACKING_URI"] = uri
        mlflow.set_tracking_uri(uri)
        client = self.client()
        experiment = self.call(client.get_experiment_by_name, name)
        if experiment is None:
            location = (project_path / "mlruns").resolve().as_uri() if uri == default_uri else None
            try:
                experiment_id = self.call(client.create_experiment, name, artifact_location=location)
            except TrackingOff:
                raise
            except Exception:  # noqa: BLE001 — created meanwhile by another process
                experiment_id = self.call(client.get_experiment_by_name, name).experiment_id
        else:
            experiment_id = experiment.experiment_id
            if experiment.lifecycle_stage == "deleted":
                self.call(client.restore_experiment, experiment_id)
        if experiment is None or EXPERIMENT_KIND_TAG not in experiment.tags:  # a kind chosen in the UI is kept
            # MLflow 3's UI opens an experiment without a kind as a GenAI project (traces, "Detect Issues")
            self.call(client.set_experiment_tag, experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        self.experiment_id = experiment_id
        self.enabled = True

    def start_run(self, name: str, tags: dict[str, str], parent_run_id: str | None) -> str:
        """Create a RUNNING run with ``tags`` (and the context tags ``mlflow.start_run`` adds: user, source, ...)
        under ``parent_run_id``; its id."""
        from mlflow.tracking.context.registry import resolve_tags
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        tags = resolve_tags(tags)
        if parent_run_id:
            tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
        run = self.call(self.client().create_run, self.experiment_id, run_name=name, tags=tags)
        return run.info.run_id

    def end(self, run_id: str, status: str) -> None:
        self.call(self.client().set_terminated, run_id, status=status)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        client = self.client()
        for key, value in tags.items():
            self.call(client.set_tag, run_id, key, value)

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        """``params`` flattened (``dpo.loss.beta``), in batches of 100."""
        from mlflow.entities import Param

        items = [Param(clean_key(k), param_value(v)) for k, v in flatten(params).items()]
        client = self.client()
        for i in range(0, len(items), 100):
            self.call(client.log_batch, run_id, params=items[i : i + 100], synchronous=True)

    def log_metrics(self, run_id: str, metrics: list) -> None:
        """``mlflow.entities.Metric``s, in batches of 1000."""
        client = self.client()
        for i in range(0, len(metrics), 1000):
            self.call(client.log_batch, run_id, metrics=metrics[i : i + 1000], synchronous=True)


__all__ = ["DEFAULT_EXPERIMENT", "TrackingStore"]
