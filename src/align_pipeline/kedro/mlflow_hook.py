"""Kedro hook: MLflow tracking of a ``kedro run`` - its runs, their tags, params and metrics.

One parent run per ``kedro run`` and one nested child run per node. While a node runs, its child run is MLflow's
active run, so :func:`align_pipeline.tracking.child_run_env` (used by the launcher) hands its id to the torchrun job,
whose rank 0 logs into it. Outputs named ``*_metrics`` that are dicts of numbers are logged on the child as metrics
when the node returns; the child ends FINISHED only once the catalog has saved every output of the node.

The store (where, probed, bounded calls, tracking off when it goes away): :mod:`.tracking_store`; run names and
lineage tags: :mod:`.run_tags`; exports into the model registry: :mod:`.model_registry`; run directories and worker
nodes, which do not depend on MLflow: :mod:`.jobs_hook`. The node's child run is named for the thread that runs the
node (:func:`align_pipeline.tracking.runs.set_node_run`), which fits the SequentialRunner (the default) and the
ThreadRunner.

Every run is tagged with the process that owns it (:func:`align_pipeline.tracking.stale.owner_tags`); the next
``kedro run`` of the project marks the RUNNING runs whose process has ended (killed, or stopped tracking) KILLED.

Order of Kedro's hooks for one node (kedro 1.7, ``kedro/runner/task.py``): ``before_node_run`` -> the node function
-> ``after_node_run`` (or ``on_node_error`` if the function raised) -> for each output ``before_dataset_saved``,
``catalog.save``, ``after_dataset_saved``. A failing save raises out of the task without ``on_node_error``; the
session then calls ``on_pipeline_error``. Hence the child run ends FINISHED at the last ``after_dataset_saved`` of
its node (or at ``after_node_run`` for a node without outputs); a node whose save failed is still open at
``on_pipeline_error`` and ends FAILED there, tagged with the error like a node that raised, and so does the parent.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from kedro.framework.hooks import hook_impl

from align_pipeline.datasets.checkpoint import HFModelDataset
from align_pipeline.evaluation.gates import GateFailed
from align_pipeline.kedro.console import catalog_quiet, plain_logging_when_piped, quiet_parameter_loads
from align_pipeline.kedro.jobs_hook import NodeOutputs
from align_pipeline.kedro.model_registry import promote, register
from align_pipeline.kedro.run_tags import input_lineage, is_checkpoint, join, overrides_for, run_label, runner_name
from align_pipeline.kedro.tracking_store import TrackingStore
from align_pipeline.tracking import runs, stale
from align_pipeline.tracking.lineage import git_tags
from align_pipeline.tracking.mlflow_logger import MAX_TAG_VALUE, clean_key, flatten, numeric_items

logger = logging.getLogger(__name__)

METRICS_SUFFIX = "_metrics"
PROMOTED = "promoted_policy"
"""The evaluation's output naming the promoted policy (:func:`.model_registry.promote` applies it to the registry)."""


COUNTERS = {"steps", "iterations"}
"""Node-output keys that say how far a job went: tags on the node's run (``align.steps``), not metrics."""
NOT_METRICS = COUNTERS | {"first_train_loss", "train_loss"}
"""Node-output keys that are not logged as the node's metrics: the counters, and copies of points of the job's own
``loss`` series (its first and last value). The output keeps them (gates, reuse records, tests read them)."""
PARENT_ONLY = {"train_loss"}
"""Of those, logged on the kedro run's parent (``sft/train_loss``), where each stage has one final value to compare."""


class MlflowHook:
    """Parent MLflow run per pipeline run, child run per node; see the module docstring."""

    def __init__(self) -> None:
        self.store = TrackingStore(on_off=self._forget_runs)
        self._project_path: Path | None = None
        self._parent_run_id: str | None = None
        self._parent_params: set[str] = set()  # the keys logged on the parent run (MLflow params are immutable)
        self._session_id = ""
        self._default_env = "local"
        self._node_runs: dict[str, str] = {}  # node name -> child run id (still open)
        self._outputs = NodeOutputs()
        self._lock = threading.Lock()
        self._atexit = False
        self._catalog: Any = None
        self._save_version: str | None = None
        self._runtime_params: dict[str, Any] = {}
        self._owner_tags: dict[str, str] = {}  # align.host/pid/pid_started/project of the runs this process starts

    @property
    def _enabled(self) -> bool:
        return self.store.enabled

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _forget_runs(self) -> None:
        with self._lock:
            self._node_runs, self._parent_run_id = {}, None
        runs.clear_node_run()

    def _end_open_runs(self, status: str) -> None:
        """End still-open child runs, then the parent, with ``status``."""
        with self._lock:
            children, self._node_runs = list(self._node_runs.values()), {}
            parent, self._parent_run_id = self._parent_run_id, None
        for run_id in [*children, *([parent] if parent else [])]:
            with self.store.guard("ending a run"):
                self.store.end(run_id, status)

    def _outputs_stored(self, node_name: str) -> None:
        """Every output of the node is in the catalog: end its child run FINISHED."""
        with self._lock:
            run_id = self._node_runs.pop(node_name, None)
        if run_id is not None:
            with self.store.guard("ending the node run"):
                self.store.end(run_id, "FINISHED")

    def _at_exit(self) -> None:  # Ctrl-C or a crash the pipeline hooks never saw
        if self._parent_run_id or self._node_runs:
            self._end_open_runs("KILLED")

    def _registers(self) -> bool:
        """``export.register`` (default true): HF exports are logged as MLflow models and registered."""
        try:
            with catalog_quiet():
                return bool(self._catalog.load("params:export").get("register", True))
        except Exception:  # noqa: BLE001 — no export parameters: the default
            return True

    def _latest_promotion(self) -> dict[str, Any] | None:
        """The latest stored ``promoted_policy`` entry (None when the project has none)."""
        try:
            with catalog_quiet():
                entry = self._catalog.load(PROMOTED)
        except Exception:  # noqa: BLE001 — never evaluated (no version), or no such entry in this project
            return None
        return entry if isinstance(entry, dict) else None

    def _log_node_metrics(self, run_id: str, outputs: dict[str, Any]) -> None:
        """``*_metrics`` outputs: on the child, only the keys its job has not logged itself (the job logs each metric's
        history, final value included, at its steps: re-logging the final value would add a point at another step),
        at the node's last step (``steps`` / ``iterations``, else 0; those are tags: :data:`COUNTERS`); on the parent,
        every value but the counters and the first loss, as ``<output>/<key>`` (``dpo/val_accuracy``,
        ``evaluation/dpo/accuracy``), so parent runs compare."""
        from mlflow.entities import Metric

        logged = set(self.store.call(self.store.client().get_run, run_id).data.metrics)
        now = int(time.time() * 1000)
        child, parent = [], []
        for name, value in outputs.items():
            if not (name.endswith(METRICS_SUFFIX) and isinstance(value, dict)):
                continue
            values = numeric_items(value)
            step = int(values.get("steps", values.get("iterations", 0)))
            for key in COUNTERS & set(values):  # how far the job went: a tag, not a one-point metric
                self.store.call(self.store.client().set_tag, run_id, f"align.{key}", str(int(values[key])))
            child += [Metric(k, v, now, step) for k, v in values.items() if k not in logged and k not in NOT_METRICS]
            parent += [Metric(clean_key(f"{name.removesuffix(METRICS_SUFFIX)}/{k}"), v, now, 0)
                       for k, v in values.items() if k not in NOT_METRICS - PARENT_ONLY]
        self.store.log_metrics(run_id, child)
        if self._parent_run_id:
            self.store.log_metrics(self._parent_run_id, parent)

    # -- hooks -----------------------------------------------------------------------------------------------------

    @hook_impl
    def after_context_created(self, context: Any) -> None:
        """Point MLflow at the project's store and experiment; export ``MLFLOW_TRACKING_URI`` for torchrun jobs. Also
        switch Kedro's console logging to one plain line per record when the output is not a terminal."""
        plain_logging_when_piped()
        quiet_parameter_loads()
        self.store.enabled = False
        with self.store.guard("after_context_created"):
            self._project_path = Path(context.project_path)
            self._default_env = getattr(getattr(context, "config_loader", None), "default_run_env", None) or "local"
            self.store.connect(self._project_path)

    @hook_impl
    def after_catalog_created(self, catalog: Any, save_version: str) -> None:
        """Keep the catalog (to tell checkpoint datasets apart) and the version this run saves its outputs under."""
        self._catalog, self._save_version = catalog, save_version

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        """Start the parent run (tags: pipeline, session id, env, git commit, kedro version, node names)."""
        self._outputs.clear()  # left by an interrupted earlier run in this process
        if not self._enabled:
            return
        project_path = Path(run_params.get("project_path") or self._project_path or ".")
        session = str(run_params.get("run_id") or run_params.get("session_id") or "")
        if self._parent_run_id or self._node_runs:
            logger.warning("MLflow: ending runs left open by a previous kedro run as KILLED")
            self._end_open_runs("KILLED")
        with self.store.guard("closing stale runs"):  # this project's runs whose process was killed or went offline
            stale.close_stale_runs(self.store.uri, self.store.client(), project_path, f"kedro run {session}")
        if not self._enabled:
            return
        with self.store.guard("before_pipeline_run"):
            import kedro
            import mlflow

            active = mlflow.active_run()  # a run the user started around this kedro run (no call to the store)
            if active is not None:
                logger.warning("MLflow run %s is already active; this kedro run is nested under it", active.info.run_id)

            names = run_params.get("pipeline_names") or [run_params.get("pipeline_name") or "__default__"]
            tags = {
                "kedro.pipeline": ",".join(names),
                "kedro.run_id": session,
                "kedro.env": str(run_params.get("env") or self._default_env),
                "kedro.version": str(run_params.get("kedro_version") or kedro.__version__),
                "kedro.runner": runner_name(run_params.get("runner")),
                "kedro.nodes": join(n.name for n in pipeline.nodes),
                **git_tags(project_path),
            }
            self._owner_tags = stale.owner_tags(project_path)
            tags.update(self._owner_tags)
            for tag, var in (("align.sweep", "ALIGN_SWEEP"), ("align.sweep.point", "ALIGN_SWEEP_POINT")):
                if os.environ.get(var):  # a run of `align-pipeline sweep` (align_pipeline/kedro/sweep.py)
                    tags[tag] = os.environ[var][:MAX_TAG_VALUE]
            for key in ("tags", "node_names", "from_nodes", "to_nodes", "from_inputs", "to_outputs", "namespaces"):
                if run_params.get(key):
                    tags[f"kedro.{key}"] = join(run_params[key])
            self._runtime_params = dict(run_params.get("runtime_params") or {})
            tags["kedro.overrides"] = json.dumps(overrides_for(self._runtime_params), sort_keys=True)[:MAX_TAG_VALUE]
            version = self._save_version or tags["kedro.run_id"]
            run_id = self.store.start_run(
                run_label(f"kedro:{','.join(names)}", overrides_for(self._runtime_params), version),
                tags,
                active.info.run_id if active is not None else None,
            )
            self._parent_run_id, self._session_id = run_id, tags["kedro.run_id"]
            # The overrides under the names users type (--params dpo.loss.beta=0.3), so MLflow's table and compare
            # view work on parent runs; the node's child run has the whole sections.
            first = {**self._runtime_params, "kedro.env": tags["kedro.env"], "kedro.pipeline": tags["kedro.pipeline"]}
            self.store.log_params(self._parent_run_id, first)
            self._parent_params = {clean_key(k) for k in flatten(first)}
            if not self._atexit:
                atexit.register(self._at_exit)  # Ctrl-C / SIGTERM: the open runs end KILLED
                self._atexit = True

    @hook_impl
    def before_node_run(self, node: Any, inputs: dict[str, Any]) -> None:
        """Start the node's child run (tags: node, session id, inputs, outputs; params: its ``params:`` inputs)."""
        runs.clear_node_run()
        if not self._enabled or self._parent_run_id is None:
            return
        with self.store.guard("before_node_run"):
            left_open = self._node_runs.pop(node.name, None)
            if left_open:
                self.store.end(left_open, "KILLED")
            tags = {
                "kedro.node": node.name,
                "kedro.run_id": self._session_id,
                "kedro.node.inputs": join(node.inputs),
                "kedro.node.outputs": join(node.outputs),
            }
            if node.tags:
                tags["kedro.node.tags"] = join(node.tags)
            if getattr(node, "namespace", None):
                tags["kedro.node.namespace"] = node.namespace
            params = {
                name.removeprefix("params:"): value
                for name, value in (inputs or {}).items()
                if name.startswith("params:") or name == "parameters"
            }
            lineage, datasets = input_lineage(self._catalog, inputs, params)
            tags.update(lineage)
            tags.update(self._owner_tags)
            overrides = overrides_for(self._runtime_params, set(params))
            run_id = self.store.start_run(
                run_label(node.name, overrides, self._save_version or self._session_id), tags, self._parent_run_id
            )
            with self._lock:
                self._node_runs[node.name] = run_id
            runs.set_node_run(self.store.uri, run_id)  # what the launcher hands to the torchrun job
            if params:  # one namespace: the Kedro parameter names (the jobs log no config of their own)
                self.store.log_params(run_id, params)
                # ... and on the parent, every resolved value of the sections its nodes read (once per key: MLflow
                # params are immutable), so MLflow's own compare view of two kedro runs plots dpo.loss.beta whether
                # it was overridden or not
                new = {k: v for k, v in flatten(params).items() if clean_key(k) not in self._parent_params}
                if new:
                    self.store.log_params(self._parent_run_id, new)
                    self._parent_params |= {clean_key(k) for k in new}
            if datasets:
                self.store.call(self.store.client().log_inputs, run_id, datasets=datasets)

    @hook_impl
    def after_node_run(self, node: Any, outputs: dict[str, Any]) -> None:
        """Log ``*_metrics`` outputs (dicts of numbers, nested keys joined with ``.``) on the child run, which stays
        open until the catalog has stored the outputs (:meth:`after_dataset_saved`)."""
        runs.clear_node_run()
        with self._lock:
            run_id = self._node_runs.get(node.name)
        done = self._outputs.returned(node.name, outputs)
        if run_id is not None:
            with self.store.guard("after_node_run"):
                self._log_node_metrics(run_id, outputs or {})
        if done:
            self._outputs_stored(node.name)

    @hook_impl
    def after_dataset_saved(self, dataset_name: str, data: Any, node: Any) -> None:
        """Tag a stored checkpoint's catalog version (``lineage.out.<name>``) on the node's child run and the parent
        (an HF export is also registered, :mod:`.model_registry`); after the node's last output is stored, end its
        child run FINISHED."""
        stored = isinstance(data, str) and bool(data)  # a checkpoint node returns its directory ("" = nothing)
        version = self._save_version if stored and is_checkpoint(self._catalog, dataset_name) else None
        if version:
            try:  # <filepath>/<version>/<name>: where the catalog moved the node's directory
                where = self._catalog.get(dataset_name)._get_versioned_path(version)
            except Exception:  # noqa: BLE001 — only the log line is lost
                where = f"version {version}"
            logger.info("%s: stored %s -> %s", node.name, dataset_name, where)
        run_id = self._node_runs.get(node.name)
        if version and run_id is not None and self._enabled:
            with self.store.guard("after_dataset_saved"):
                for target in (run_id, self._parent_run_id):
                    if target:
                        self.store.set_tags(target, {clean_key(f"lineage.out.{dataset_name}"): version})
                if isinstance(self._catalog.get(dataset_name), HFModelDataset) and self._registers():
                    register(self.store, dataset_name, version, str(where), run_id, self._latest_promotion())
        if dataset_name == PROMOTED and isinstance(data, dict) and self._enabled:
            with self.store.guard("after_dataset_saved"):
                promote(self.store, data)
        if self._outputs.saved(node.name, dataset_name):
            self._outputs_stored(node.name)

    @hook_impl
    def on_node_error(self, error: Exception, node: Any) -> None:
        """Mark the node's child run and the parent FAILED (both ended)."""
        runs.clear_node_run()
        with self._lock:
            run_id = self._node_runs.pop(node.name, None)
        gate_tags = {}
        if isinstance(error, GateFailed):  # searchable: tags.`gate.failed` = 'ppo.gate.min_reward_model_accuracy'
            gate_tags = {"gate.failed": error.gate,
                         clean_key(f"gate.{error.gate}"): f"fail: {error.value} vs threshold {error.threshold}"}
        if run_id is not None:
            with self.store.guard("on_node_error"):
                self.store.set_tags(run_id, {"kedro.error": f"{type(error).__name__}: {error}"[:MAX_TAG_VALUE],
                                             **gate_tags})
                self.store.end(run_id, "FAILED")
        if self._parent_run_id is not None:
            with self.store.guard("on_node_error"):
                self.store.set_tags(self._parent_run_id, {"kedro.failed_node": node.name, **gate_tags})
            self._end_open_runs("FAILED")

    @hook_impl
    def after_pipeline_run(self) -> None:
        """End the parent run FINISHED (every node has stored its outputs: the run succeeded)."""
        for name in self._outputs.clear():  # none in kedro 1.7, which saves a node's outputs before it counts as done
            self._outputs_stored(name)
        self._end_open_runs("FINISHED")

    @hook_impl
    def on_pipeline_error(self, error: Exception) -> None:
        """End the parent run (and any open child) FAILED. A node whose outputs were not all stored (a failing
        save: Kedro calls no ``on_node_error`` then) gets the error as its child's ``kedro.error`` tag and is the
        parent's ``kedro.failed_node``."""
        message = f"{type(error).__name__}: {error}"[:MAX_TAG_VALUE]
        unsaved = self._outputs.clear()
        with self._lock:
            children = {name: self._node_runs[name] for name in unsaved if name in self._node_runs}
        for run_id in children.values():
            with self.store.guard("on_pipeline_error"):
                self.store.set_tags(run_id, {"kedro.error": message})
        if self._parent_run_id is not None:
            with self.store.guard("on_pipeline_error"):
                tags = {"kedro.error": message}
                if unsaved:
                    tags["kedro.failed_node"] = join(unsaved)
                self.store.set_tags(self._parent_run_id, tags)
        self._end_open_runs("FAILED")


__all__ = ["MlflowHook"]
