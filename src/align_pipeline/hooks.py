"""Kedro hooks: MLflow tracking of a ``kedro run``, and the clean-up of training run directories.

One parent run per ``kedro run`` and one nested child run per node. While a node runs, its child run is MLflow's
active run, so :func:`align_pipeline.tracking.child_run_env` (used by the launcher) hands its id to the torchrun job,
whose rank 0 logs into it. Outputs named ``*_metrics`` that are dicts of numbers are logged on the child as metrics
when the node returns; the child ends FINISHED only once the catalog has saved every output of the node.

Store: ``$MLFLOW_TRACKING_URI``, else ``sqlite:////<project>/mlflow.db`` (artifacts in ``<project>/mlruns``);
experiment: ``$MLFLOW_EXPERIMENT_NAME``, else ``align-pipeline``. Browse with
``mlflow ui --backend-store-uri sqlite:///mlflow.db``.

A tracking failure is logged as a warning and never fails the run. A remote store is probed once when the context is
created (:mod:`align_pipeline.tracking.probe`, a few seconds at most); if it does not answer, the hook warns once and
tracks nothing in this run (the jobs then get no run id, so they do not try either) and the metrics are only in the
jobs' ``metrics.jsonl`` files, which ``align-pipeline mlflow-log`` re-logs later. Every call to the store is bounded
(:mod:`align_pipeline.tracking.bounded`): a store that goes away mid-run costs a few seconds once (at most 10 s),
then tracking is off for the process with one warning, and the nodes and catalog saves go on. Runs are created and
ended through MLflow's client, not its fluent active-run stack (whose calls cannot be bounded); the node's child run
is named for the thread that runs the node (:func:`align_pipeline.tracking.runs.set_node_run`), which fits the
SequentialRunner (the default) and the ThreadRunner.

Every run is tagged with the process that owns it (:func:`align_pipeline.tracking.stale.owner_tags`); the next
``kedro run`` of the project marks the RUNNING runs whose process has ended (killed, or stopped tracking) KILLED.

Order of Kedro's hooks for one node (kedro 1.7, ``kedro/runner/task.py``): ``before_node_run`` -> the node function
-> ``after_node_run`` (or ``on_node_error`` if the function raised) -> for each output ``before_dataset_saved``,
``catalog.save``, ``after_dataset_saved``. A failing save raises out of the task without ``on_node_error``; the
session then calls ``on_pipeline_error``. Hence:

- the child run ends FINISHED at the last ``after_dataset_saved`` of its node (or at ``after_node_run`` for a node
  without outputs); a node whose save failed is still open at ``on_pipeline_error`` and ends FAILED there, tagged
  with the error like a node that raised, and so does the parent;
- the run directory of a training node (:func:`align_pipeline.pipelines.common.launch_stage`) is deleted at the
  same point, after the last output is stored, through :data:`~align_pipeline.pipelines.common.RUN_DIR_CLEANUP`; when
  the node or a save fails it is kept, so that a rerun resumes from its training checkpoints. This part works whether
  or not MLflow is on.
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

from align_pipeline.config import config_hash
from align_pipeline.console import plain_logging_when_piped
from align_pipeline.data.formats import Artifact
from align_pipeline.datasets import CheckpointDataset, HFModelDataset
from align_pipeline.gates import GateFailed
from align_pipeline.launch import multinode
from align_pipeline.pipelines.common import RUN_DIR_CLEANUP
from align_pipeline.tracking import bounded, runs, stale
from align_pipeline.tracking.bounded import TrackingOff
from align_pipeline.tracking.lineage import git_tags, lineage_tags
from align_pipeline.tracking.mlflow_logger import (
    MAX_TAG_VALUE,
    clean_key,
    default_tracking_uri,
    flatten,
    numeric_items,
    param_value,
)
from align_pipeline.tracking.probe import unreachable

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


MAX_RUN_NAME = 250


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
        self._unsaved: dict[str, set[str]] = {}  # node name -> its outputs the catalog has not stored yet
        self._lock = threading.Lock()
        self._atexit = False
        self._catalog: Any = None
        self._save_version: str | None = None
        self._runtime_params: dict[str, Any] = {}
        self._mlflow_client: Any = None
        self._owner_tags: dict[str, str] = {}  # align.host/pid/pid_started/project of the runs this process starts

    # -- helpers ---------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _guard(self, what: str):
        try:
            yield
        except TrackingOff:  # the store went away (warned once by tracking.bounded): stop calling it
            self._tracking_off()
        except Exception as exc:  # noqa: BLE001 — by design, tracking never fails a kedro run
            logger.warning("MLflow tracking failed in %s (the run continues): %s: %s", what, type(exc).__name__, exc)

    def _tracking_off(self) -> None:
        """Track nothing more in this run (its open runs stay as they are: the next kedro run or
        ``align-pipeline mlflow-log`` closes them)."""
        self._enabled = False
        with self._lock:
            self._node_runs, self._parent_run_id = {}, None
        runs.clear_node_run()

    def _client(self):
        """The MlflowClient of this run's store (made once per store)."""
        from mlflow.tracking import MlflowClient

        if self._mlflow_client is None or self._mlflow_client.tracking_uri != self._tracking_uri:
            self._mlflow_client = MlflowClient(tracking_uri=self._tracking_uri)
        return self._mlflow_client

    def _call(self, fn, *args: Any, **kwargs: Any) -> Any:
        """One call to the store, bounded (:func:`align_pipeline.tracking.bounded.call`)."""
        return bounded.call(self._tracking_uri, fn, *args, **kwargs)

    def _start_run(self, name: str, tags: dict[str, str], parent_run_id: str | None) -> str:
        """Create a RUNNING run with ``tags`` (and the context tags ``mlflow.start_run`` adds: user, source, ...)
        under ``parent_run_id``; its id."""
        from mlflow.tracking.context.registry import resolve_tags
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        tags = resolve_tags(tags)
        if parent_run_id:
            tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
        run = self._call(self._client().create_run, self._experiment_id, run_name=name, tags=tags)
        return run.info.run_id

    def _end(self, run_id: str, status: str) -> None:
        self._call(self._client().set_terminated, run_id, status=status)

    def _end_open_runs(self, status: str) -> None:
        """End still-open child runs, then the parent, with ``status``."""
        with self._lock:
            children, self._node_runs = list(self._node_runs.values()), {}
            parent, self._parent_run_id = self._parent_run_id, None
        for run_id in [*children, *([parent] if parent else [])]:
            with self._guard("ending a run"):
                self._end(run_id, status)

    def _outputs_stored(self, node_name: str) -> None:
        """Every output of the node is in the catalog: end its child run FINISHED, delete its deferred run dirs."""
        with self._lock:
            run_id = self._node_runs.pop(node_name, None)
        if run_id is not None:
            with self._guard("ending the node run"):
                self._end(run_id, "FINISHED")
        RUN_DIR_CLEANUP.release(node_name)

    def _at_exit(self) -> None:  # Ctrl-C or a crash the pipeline hooks never saw
        if self._parent_run_id or self._node_runs:
            self._end_open_runs("KILLED")

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(clean_key(k), param_value(v)) for k, v in flatten(params).items()]
        client = self._client()
        for i in range(0, len(items), 100):
            self._call(client.log_batch, run_id, params=items[i : i + 100], synchronous=True)

    # -- hooks -----------------------------------------------------------------------------------------------------

    @hook_impl
    def after_context_created(self, context: Any) -> None:
        """Point MLflow at the project's store and experiment; export ``MLFLOW_TRACKING_URI`` for torchrun jobs. Also
        switch Kedro's console logging to one plain line per record when the output is not a terminal."""
        plain_logging_when_piped()
        self._enabled = False
        with self._guard("after_context_created"):
            import mlflow

            self._project_path = Path(context.project_path)
            self._default_env = getattr(getattr(context, "config_loader", None), "default_run_env", None) or "local"
            default_uri = default_tracking_uri(self._project_path)
            uri = os.environ.get("MLFLOW_TRACKING_URI") or default_uri
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
            self._tracking_uri = uri
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
            client = self._client()
            experiment = self._call(client.get_experiment_by_name, name)
            if experiment is None:
                location = (self._project_path / "mlruns").resolve().as_uri() if uri == default_uri else None
                try:
                    experiment_id = self._call(client.create_experiment, name, artifact_location=location)
                except TrackingOff:
                    raise
                except Exception:  # noqa: BLE001 — created meanwhile by another process
                    experiment_id = self._call(client.get_experiment_by_name, name).experiment_id
            else:
                experiment_id = experiment.experiment_id
                if experiment.lifecycle_stage == "deleted":
                    self._call(client.restore_experiment, experiment_id)
            self._experiment_id = experiment_id
            self._enabled = True

    @hook_impl
    def after_catalog_created(self, catalog: Any, save_version: str) -> None:
        """Keep the catalog (to tell checkpoint datasets apart) and the version this run saves its outputs under."""
        self._catalog, self._save_version = catalog, save_version

    def _is_checkpoint(self, name: str) -> bool:
        """True for a catalog entry of versioned checkpoint directories (models, evaluation reports)."""
        if self._catalog is None:
            return False
        try:
            return isinstance(self._catalog.get(name), CheckpointDataset)
        except Exception:  # noqa: BLE001 — not a catalog entry (e.g. a free output)
            return False

    def _checkpoint_version(self, name: str, value: Any) -> str | None:
        """The catalog version of a loaded checkpoint (its path is ``<filepath>/<version>/<name>``), else None."""
        if not isinstance(value, str) or not value or not self._is_checkpoint(name):
            return None
        return Path(value).parent.name

    def _input_lineage(self, inputs: dict[str, Any], params: dict[str, Any]) -> tuple[dict[str, str], list]:
        """``lineage.*`` tags of a node from its inputs (checkpoint versions by catalog name, data fingerprints, the
        hash of its params) and the MLflow dataset inputs of its data artifacts."""
        lineage: dict[str, Any] = {}
        datasets = []
        for name, value in (inputs or {}).items():
            version = self._checkpoint_version(name, value)
            plain = name.split("@", 1)[0]  # a transcoded entry (dpo_policy@export) is its dataset's version
            if version is not None:
                lineage[plain] = version
            elif isinstance(value, Artifact):
                lineage[f"data.{plain}"] = value.fingerprint
                datasets.append(dataset_input(plain, value))
        if params:
            lineage["config_hash"] = config_hash(params)
        return lineage_tags(lineage), datasets

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        """Start the parent run (tags: pipeline, session id, env, git commit, kedro version, node names)."""
        with self._lock:
            self._unsaved.clear()  # left by an interrupted earlier run in this process
        RUN_DIR_CLEANUP.keep()  # ... and so are the run dirs it had not released: kept on disk, for a resume
        RUN_DIR_CLEANUP.end()
        if not self._enabled:
            return
        project_path = Path(run_params.get("project_path") or self._project_path or ".")
        session = str(run_params.get("run_id") or run_params.get("session_id") or "")
        if self._parent_run_id or self._node_runs:
            logger.warning("MLflow: ending runs left open by a previous kedro run as KILLED")
            self._end_open_runs("KILLED")
        with self._guard("closing stale runs"):  # runs of this project whose process was killed or stopped tracking
            stale.close_stale_runs(self._tracking_uri, self._client(), project_path, f"kedro run {session}")
        if not self._enabled:
            return
        with self._guard("before_pipeline_run"):
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
                "kedro.runner": _runner_name(run_params.get("runner")),
                "kedro.nodes": _join(n.name for n in pipeline.nodes),
                **git_tags(project_path),
            }
            self._owner_tags = stale.owner_tags(project_path)
            tags.update(self._owner_tags)
            for tag, var in (("align.sweep", "ALIGN_SWEEP"), ("align.sweep.point", "ALIGN_SWEEP_POINT")):
                if os.environ.get(var):  # a run of `align-pipeline sweep` (align_pipeline/sweep.py)
                    tags[tag] = os.environ[var][:MAX_TAG_VALUE]
            for key in ("tags", "node_names", "from_nodes", "to_nodes", "from_inputs", "to_outputs", "namespaces"):
                if run_params.get(key):
                    tags[f"kedro.{key}"] = _join(run_params[key])
            self._runtime_params = dict(run_params.get("runtime_params") or {})
            version = self._save_version or tags["kedro.run_id"]
            run_id = self._start_run(
                run_label(f"kedro:{','.join(names)}", overrides_for(self._runtime_params), version),
                tags,
                active.info.run_id if active is not None else None,
            )
            self._parent_run_id, self._session_id = run_id, tags["kedro.run_id"]
            # The overrides under the names users type (--params dpo.loss.beta=0.3), so MLflow's table and compare
            # view work on parent runs; the node's child run has the whole sections.
            self._log_params(self._parent_run_id, {**self._runtime_params, "kedro.env": tags["kedro.env"],
                                                   "kedro.pipeline": tags["kedro.pipeline"]})
            if not self._atexit:
                atexit.register(self._at_exit)  # Ctrl-C / SIGTERM: the open runs end KILLED
                self._atexit = True

    @hook_impl
    def before_node_run(self, node: Any, inputs: dict[str, Any]) -> None:
        """Start the node's child run (tags: node, session id, inputs, outputs; params: its ``params:`` inputs), and
        open the deferral of run-dir clean-up for the node (in this thread, where Kedro runs the node function)."""
        RUN_DIR_CLEANUP.begin(node.name)
        runs.clear_node_run()
        if not self._enabled or self._parent_run_id is None:
            return
        with self._guard("before_node_run"):
            left_open = self._node_runs.pop(node.name, None)
            if left_open:
                self._end(left_open, "KILLED")
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
            params = {
                name.removeprefix("params:"): value
                for name, value in (inputs or {}).items()
                if name.startswith("params:") or name == "parameters"
            }
            lineage, datasets = self._input_lineage(inputs, params)
            tags.update(lineage)
            tags.update(self._owner_tags)
            overrides = overrides_for(self._runtime_params, set(params))
            run_id = self._start_run(
                run_label(node.name, overrides, self._save_version or self._session_id), tags, self._parent_run_id
            )
            with self._lock:
                self._node_runs[node.name] = run_id
            runs.set_node_run(self._tracking_uri, run_id)  # what the launcher hands to the torchrun job
            if params:  # one namespace: the Kedro parameter names (the jobs log no config of their own)
                self._log_params(run_id, params)
            if datasets:
                self._call(self._client().log_inputs, run_id, datasets=datasets)

    @hook_impl
    def after_node_run(self, node: Any, outputs: dict[str, Any]) -> None:
        """Log ``*_metrics`` outputs (dicts of numbers, nested keys joined with ``.``) on the child run, which stays
        open until the catalog has stored the outputs (:meth:`after_dataset_saved`)."""
        RUN_DIR_CLEANUP.end()
        runs.clear_node_run()
        with self._lock:
            run_id = self._node_runs.get(node.name)
            if outputs:
                self._unsaved[node.name] = set(outputs)
        if run_id is not None:
            with self._guard("after_node_run"):
                self._log_node_metrics(run_id, outputs or {})
        if not outputs:
            self._outputs_stored(node.name)

    def _register(self, client: Any, name: str, version: str, path: str, run_id: str) -> None:
        """An HF export (an ``HFModelDataset`` version) becomes a version of the registered model ``name`` in MLflow's
        model registry, with the node's lineage tags (which checkpoint version it exports, the kedro run) and
        ``export.check`` (passed, or skipped: ``export.check: false``) - only when its ``align_export_check.json``
        says so: an export whose check failed, or that has no check record, is not registered."""
        from mlflow.exceptions import MlflowException

        from align_pipeline.model.export_check import CHECK_FILE, read_status

        status = read_status(path)
        if status not in ("passed", "skipped"):
            logger.warning("%s version %s: not registered in MLflow's model registry (its %s says %s)", name,
                           version, CHECK_FILE, status or "nothing: missing or unreadable")
            return
        run_tags = self._call(client.get_run, run_id).data.tags
        tags = {k: v for k, v in run_tags.items() if k.startswith(("lineage.", "kedro.run"))}
        tags[clean_key(f"lineage.out.{name}")] = version
        tags["export.check"] = status
        try:
            self._call(client.create_registered_model, name, tags={"align.dataset": name},
                       description=f"Hugging Face exports of the catalog entry {name}")  # fmt: skip
        except MlflowException:  # already registered
            pass
        registered = self._call(client.create_model_version, name, source=path, run_id=run_id, tags=tags)
        logger.info("%s: registered in MLflow's model registry as %s version %s", name, name, registered.version)

    def _log_node_metrics(self, run_id: str, outputs: dict[str, Any]) -> None:
        """``*_metrics`` outputs: on the child, only the keys its job has not logged itself (the job logs each metric's
        history, final value included, at its steps: re-logging the final value would add a point at another step),
        at the node's last step (``steps`` / ``iterations``, else 0); on the parent, every value, as
        ``<output>/<key>`` (``dpo/val_accuracy``, ``evaluation/dpo/accuracy``), so parent runs compare."""
        from mlflow.entities import Metric

        client = self._client()
        logged = set(self._call(client.get_run, run_id).data.metrics)
        now = int(time.time() * 1000)
        child, parent = [], []
        for name, value in outputs.items():
            if not (name.endswith(METRICS_SUFFIX) and isinstance(value, dict)):
                continue
            values = numeric_items(value)
            step = int(values.get("steps", values.get("iterations", 0)))
            child += [Metric(k, v, now, step) for k, v in values.items() if k not in logged]
            parent += [Metric(clean_key(f"{name.removesuffix(METRICS_SUFFIX)}/{k}"), v, now, 0)
                       for k, v in values.items()]
        for target, items in ((run_id, child), (self._parent_run_id, parent)):
            for i in range(0, len(items) if target else 0, 1000):
                self._call(client.log_batch, target, metrics=items[i : i + 1000], synchronous=True)

    @hook_impl
    def after_dataset_saved(self, dataset_name: str, data: Any, node: Any) -> None:
        """Tag a stored checkpoint's catalog version (``lineage.out.<name>``) on the node's child run and the parent;
        after the node's last output is stored: end its child run FINISHED and delete its run directory."""
        stored = isinstance(data, str) and bool(data)  # a checkpoint node returns its directory ("" = nothing)
        version = self._save_version if stored and self._is_checkpoint(dataset_name) else None
        if version:
            try:  # <filepath>/<version>/<name>: where the catalog moved the node's directory
                where = self._catalog.get(dataset_name)._get_versioned_path(version)
            except Exception:  # noqa: BLE001 — only the log line is lost
                where = f"version {version}"
            logger.info("%s: stored %s -> %s", node.name, dataset_name, where)
        run_id = self._node_runs.get(node.name)
        if version and run_id is not None and self._enabled:
            with self._guard("after_dataset_saved"):
                client = self._client()
                for target in (run_id, self._parent_run_id):
                    if target:
                        self._call(client.set_tag, target, clean_key(f"lineage.out.{dataset_name}"), version)
                if isinstance(self._catalog.get(dataset_name), HFModelDataset):
                    self._register(client, dataset_name, version, str(where), run_id)
        with self._lock:
            unsaved = self._unsaved.get(node.name)
            if unsaved is None:
                return
            unsaved.discard(dataset_name)
            done = not unsaved
            if done:
                del self._unsaved[node.name]
        if done:
            self._outputs_stored(node.name)

    @hook_impl
    def on_node_error(self, error: Exception, node: Any) -> None:
        """Mark the node's child run and the parent FAILED (both ended); keep the node's run directory."""
        RUN_DIR_CLEANUP.end()
        runs.clear_node_run()
        for run_dir in RUN_DIR_CLEANUP.keep(node.name):
            logger.info("%s failed: run directory %s kept (a rerun resumes from it)", node.name, run_dir)
        with self._lock:
            run_id = self._node_runs.pop(node.name, None)
        gate_tags = {}
        if isinstance(error, GateFailed):  # searchable: tags.`gate.failed` = 'ppo.gate.min_reward_model_accuracy'
            gate_tags = {"gate.failed": error.gate,
                         clean_key(f"gate.{error.gate}"): f"fail: {error.value} vs threshold {error.threshold}"}
        if run_id is not None:
            with self._guard("on_node_error"):
                client = self._client()
                self._call(client.set_tag, run_id, "kedro.error", f"{type(error).__name__}: {error}"[:MAX_TAG_VALUE])
                for key, value in gate_tags.items():
                    self._call(client.set_tag, run_id, key, value)
                self._end(run_id, "FAILED")
        if self._parent_run_id is not None:
            with self._guard("on_node_error"):
                client = self._client()
                self._call(client.set_tag, self._parent_run_id, "kedro.failed_node", node.name)
                for key, value in gate_tags.items():
                    self._call(client.set_tag, self._parent_run_id, key, value)
            self._end_open_runs("FAILED")

    @hook_impl
    def after_pipeline_run(self) -> None:
        """End the parent run FINISHED (every node has stored its outputs: the run succeeded); multi-node: the
        worker nodes exit."""
        RUN_DIR_CLEANUP.end()
        multinode.shutdown()
        with self._lock:
            stored, self._unsaved = list(self._unsaved), {}
        for name in stored:  # none in kedro 1.7, which saves a node's outputs before the node counts as done
            self._outputs_stored(name)
        self._end_open_runs("FINISHED")

    @hook_impl
    def on_pipeline_error(self, error: Exception) -> None:
        """End the parent run (and any open child) FAILED. A node whose outputs were not all stored (a failing
        save: Kedro calls no ``on_node_error`` then) gets the error as its child's ``kedro.error`` tag and is the
        parent's ``kedro.failed_node``; its run directory is kept for a rerun to resume from."""
        message = f"{type(error).__name__}: {error}"[:MAX_TAG_VALUE]
        RUN_DIR_CLEANUP.end()
        multinode.shutdown()
        with self._lock:
            unsaved, self._unsaved = sorted(self._unsaved), {}
            children = {name: self._node_runs[name] for name in unsaved if name in self._node_runs}
        for name in unsaved:
            for run_dir in RUN_DIR_CLEANUP.keep(name):
                logger.warning(
                    "%s: its outputs were not all stored (%s); run directory %s kept, a rerun resumes "
                    "from its checkpoint",
                    name,
                    message,
                    run_dir,
                )
        RUN_DIR_CLEANUP.keep()
        for run_id in children.values():
            with self._guard("on_pipeline_error"):
                self._call(self._client().set_tag, run_id, "kedro.error", message)
        if self._parent_run_id is not None:
            with self._guard("on_pipeline_error"):
                tags = {"kedro.error": message}
                if unsaved:
                    tags["kedro.failed_node"] = _join(unsaved)
                client = self._client()
                for key, value in tags.items():
                    self._call(client.set_tag, self._parent_run_id, key, value)
        self._end_open_runs("FAILED")


__all__ = ["MlflowHook"]
