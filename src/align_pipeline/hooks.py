"""Kedro hooks: MLflow tracking of a ``kedro run``.

One parent run per ``kedro run`` and one nested child run per node. While a node runs, its child run is MLflow's
active run, so :func:`align_pipeline.tracking.child_run_env` (used by the launcher) hands its id to the torchrun job,
whose rank 0 logs into it. Outputs named ``*_metrics`` that are dicts of numbers are logged on the child as metrics
when the node finishes.

Store: ``$MLFLOW_TRACKING_URI``, else ``sqlite:////<project>/mlflow.db`` (artifacts in ``<project>/mlruns``);
experiment: ``$MLFLOW_EXPERIMENT_NAME``, else ``align-pipeline``. Browse with
``mlflow ui --backend-store-uri sqlite:///mlflow.db``.

A tracking failure is logged as a warning and never fails the run. Runs are tracked per thread (MLflow's active-run
stack is thread-local), which fits the SequentialRunner (the default) and the ThreadRunner.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from kedro.framework.hooks import hook_impl

from align_pipeline.tracking.lineage import git_tags
from align_pipeline.tracking.mlflow_logger import (
    MAX_TAG_VALUE,
    clean_key,
    default_tracking_uri,
    flatten,
    numeric_items,
    param_value,
)

logger = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "align-pipeline"
METRICS_SUFFIX = "_metrics"


def _join(items: Any) -> str:
    return ",".join(sorted(str(i) for i in items))[:MAX_TAG_VALUE]


def _runner_name(runner: Any) -> str:
    """``"<kedro.runner.sequential_runner.SequentialRunner object at 0x...>"`` → ``"SequentialRunner"``."""
    text = str(runner) if runner not in (None, "None", "") else "SequentialRunner"  # None: Kedro's default
    match = re.match(r"<([\w.]+) object at", text)
    return match.group(1).rsplit(".", 1)[-1] if match else text


class MlflowHook:
    """Parent MLflow run per pipeline run, child run per node; see the module docstring."""

    def __init__(self) -> None:
        self._enabled = True
        self._tracking_uri: str | None = None
        self._experiment_id: str | None = None
        self._project_path: Path | None = None
        self._parent_run_id: str | None = None
        self._session_id = ""
        self._default_env = "local"
        self._node_runs: dict[str, str] = {}  # node name -> child run id (still open)
        self._lock = threading.Lock()
        self._atexit = False

    # -- helpers ---------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _guard(self, what: str):
        try:
            yield
        except Exception as exc:  # noqa: BLE001 — by design, tracking never fails a kedro run
            logger.warning("MLflow tracking failed in %s (the run continues): %s: %s", what, type(exc).__name__, exc)

    @staticmethod
    def _client():
        from mlflow.tracking import MlflowClient

        return MlflowClient()

    def _end(self, run_id: str, status: str) -> None:
        """End ``run_id``: through the fluent API if it is this thread's active run, else through the client."""
        import mlflow

        active = mlflow.active_run()
        if active is not None and active.info.run_id == run_id:
            mlflow.end_run(status=status)
        else:
            self._client().set_terminated(run_id, status=status)

    def _end_open_runs(self, status: str) -> None:
        """End still-open child runs, then the parent, with ``status``."""
        with self._lock:
            children, self._node_runs = list(self._node_runs.values()), {}
            parent, self._parent_run_id = self._parent_run_id, None
        for run_id in [*children, *([parent] if parent else [])]:
            with self._guard("ending a run"):
                self._end(run_id, status)

    def _at_exit(self) -> None:  # Ctrl-C or a crash the pipeline hooks never saw
        if self._parent_run_id or self._node_runs:
            self._end_open_runs("KILLED")

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(clean_key(k), param_value(v)) for k, v in flatten(params).items()]
        client = self._client()
        for i in range(0, len(items), 100):
            client.log_batch(run_id, params=items[i : i + 100], synchronous=True)

    # -- hooks -----------------------------------------------------------------------------------------------------

    @hook_impl
    def after_context_created(self, context: Any) -> None:
        """Point MLflow at the project's store and experiment; export ``MLFLOW_TRACKING_URI`` for torchrun jobs."""
        self._enabled = False
        with self._guard("after_context_created"):
            import mlflow

            self._project_path = Path(context.project_path)
            self._default_env = getattr(getattr(context, "config_loader", None), "default_run_env", None) or "local"
            default_uri = default_tracking_uri(self._project_path)
            uri = os.environ.get("MLFLOW_TRACKING_URI") or default_uri
            os.environ["MLFLOW_TRACKING_URI"] = uri
            mlflow.set_tracking_uri(uri)
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
            client = self._client()
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                location = (self._project_path / "mlruns").resolve().as_uri() if uri == default_uri else None
                try:
                    experiment_id = client.create_experiment(name, artifact_location=location)
                except Exception:  # noqa: BLE001 — created meanwhile by another process
                    experiment_id = client.get_experiment_by_name(name).experiment_id
            else:
                experiment_id = experiment.experiment_id
                if experiment.lifecycle_stage == "deleted":
                    client.restore_experiment(experiment_id)
            mlflow.set_experiment(experiment_id=experiment_id)
            self._tracking_uri, self._experiment_id = uri, experiment_id
            self._enabled = True

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        """Start the parent run (tags: pipeline, session id, env, git commit, kedro version, node names)."""
        if not self._enabled:
            return
        with self._guard("before_pipeline_run"):
            import kedro
            import mlflow

            if self._parent_run_id or self._node_runs:
                logger.warning("MLflow: ending runs left open by a previous kedro run as KILLED")
                self._end_open_runs("KILLED")
            active = mlflow.active_run()
            while active is not None and "kedro.run_id" in active.data.tags:  # left over by an earlier hook
                logger.warning("MLflow: ending run %s left open by an earlier kedro run as KILLED", active.info.run_id)
                mlflow.end_run(status="KILLED")
                active = mlflow.active_run()
            if active is not None:
                logger.warning("MLflow run %s is already active; this kedro run is nested under it", active.info.run_id)

            names = run_params.get("pipeline_names") or [run_params.get("pipeline_name") or "__default__"]
            project_path = Path(run_params.get("project_path") or self._project_path or ".")
            tags = {
                "kedro.pipeline": ",".join(names),
                "kedro.run_id": str(run_params.get("run_id") or run_params.get("session_id") or ""),
                "kedro.env": str(run_params.get("env") or self._default_env),
                "kedro.version": str(run_params.get("kedro_version") or kedro.__version__),
                "kedro.runner": _runner_name(run_params.get("runner")),
                "kedro.nodes": _join(n.name for n in pipeline.nodes),
                **git_tags(project_path),
            }
            for key in ("tags", "node_names", "from_nodes", "to_nodes", "from_inputs", "to_outputs", "namespaces"):
                if run_params.get(key):
                    tags[f"kedro.{key}"] = _join(run_params[key])
            run = mlflow.start_run(
                run_name=f"kedro:{','.join(names)}",
                experiment_id=self._experiment_id,
                nested=active is not None,
                tags=tags,
            )
            self._parent_run_id, self._session_id = run.info.run_id, tags["kedro.run_id"]
            if run_params.get("runtime_params"):
                self._log_params(self._parent_run_id, {"runtime": run_params["runtime_params"]})
            if not self._atexit:
                atexit.register(self._at_exit)  # runs before MLflow's own atexit (which would mark it FINISHED)
                self._atexit = True

    @hook_impl
    def before_node_run(self, node: Any, inputs: dict[str, Any]) -> None:
        """Start the node's child run (tags: node, session id, inputs, outputs; params: its ``params:`` inputs)."""
        if not self._enabled or self._parent_run_id is None:
            return
        with self._guard("before_node_run"):
            import mlflow

            stale = self._node_runs.pop(node.name, None)
            if stale:
                self._end(stale, "KILLED")
            active = mlflow.active_run()
            if active is not None and active.info.run_id != self._parent_run_id:  # a child left on the stack
                self._end(active.info.run_id, "KILLED")
            tags = {
                "kedro.node": node.name,
                "kedro.run_id": self._session_id,
                "kedro.node.inputs": _join(node.inputs),
                "kedro.node.outputs": _join(node.outputs),
            }
            if node.tags:
                tags["kedro.node.tags"] = _join(node.tags)
            if getattr(node, "namespace", None):
                tags["kedro.node.namespace"] = node.namespace
            run = mlflow.start_run(
                run_name=node.name,
                experiment_id=self._experiment_id,
                parent_run_id=self._parent_run_id,
                nested=True,
                tags=tags,
            )
            with self._lock:
                self._node_runs[node.name] = run.info.run_id
            params = {
                name.removeprefix("params:"): value
                for name, value in (inputs or {}).items()
                if name.startswith("params:") or name == "parameters"
            }
            if params:
                self._log_params(run.info.run_id, params)

    @hook_impl
    def after_node_run(self, node: Any, outputs: dict[str, Any]) -> None:
        """Log ``*_metrics`` outputs (dicts of numbers, nested keys joined with ``.``) and end the child FINISHED."""
        with self._lock:
            run_id = self._node_runs.pop(node.name, None)
        if run_id is None:
            return
        with self._guard("after_node_run"):
            from mlflow.entities import Metric

            metrics: dict[str, float] = {}
            for name, value in (outputs or {}).items():
                if name.endswith(METRICS_SUFFIX) and isinstance(value, dict):
                    metrics.update(numeric_items(value))
            if metrics:
                now = int(time.time() * 1000)
                items = [Metric(k, v, now, 0) for k, v in metrics.items()]
                client = self._client()
                for i in range(0, len(items), 1000):
                    client.log_batch(run_id, metrics=items[i : i + 1000], synchronous=True)
        with self._guard("ending the node run"):
            self._end(run_id, "FINISHED")

    @hook_impl
    def on_node_error(self, error: Exception, node: Any) -> None:
        """Mark the node's child run and the parent FAILED (both ended)."""
        with self._lock:
            run_id = self._node_runs.pop(node.name, None)
        if run_id is not None:
            with self._guard("on_node_error"):
                self._client().set_tag(run_id, "kedro.error", f"{type(error).__name__}: {error}"[:MAX_TAG_VALUE])
                self._end(run_id, "FAILED")
        if self._parent_run_id is not None:
            with self._guard("on_node_error"):
                self._client().set_tag(self._parent_run_id, "kedro.failed_node", node.name)
            self._end_open_runs("FAILED")

    @hook_impl
    def after_pipeline_run(self) -> None:
        """End the parent run FINISHED."""
        self._end_open_runs("FINISHED")

    @hook_impl
    def on_pipeline_error(self, error: Exception) -> None:
        """End the parent run (and any open child) FAILED."""
        if self._parent_run_id is not None:
            with self._guard("on_pipeline_error"):
                self._client().set_tag(
                    self._parent_run_id, "kedro.error", f"{type(error).__name__}: {error}"[:MAX_TAG_VALUE]
                )
        self._end_open_runs("FAILED")


__all__ = ["MlflowHook"]
