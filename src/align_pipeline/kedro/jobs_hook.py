"""Kedro hook: the lifecycle of what a ``kedro run``'s jobs leave behind, whether or not MLflow is on.

* Run directories: a training node (:func:`align_pipeline.pipelines.common.launch_stage`) hands its run directory to
  :data:`~align_pipeline.kedro.run_dirs.RUN_DIR_CLEANUP`; it is deleted once the catalog has stored the node's last
  output, and kept when the node or a save fails, so that a rerun resumes from its training checkpoints.
* Multi-node: when the run ends (done or failed), node 0's job board tells the worker nodes to exit.

Order of Kedro's hooks for one node (kedro 1.7, ``kedro/runner/task.py``): ``before_node_run`` -> the node function
-> ``after_node_run`` (or ``on_node_error``) -> for each output ``catalog.save`` then ``after_dataset_saved``. A
failing save raises out of the task without ``on_node_error``; the session then calls ``on_pipeline_error``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kedro.framework.hooks import hook_impl

from align_pipeline.kedro.run_dirs import RUN_DIR_CLEANUP
from align_pipeline.launch import multinode

logger = logging.getLogger(__name__)


class NodeOutputs:
    """The outputs of each running node the catalog has not stored yet (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unsaved: dict[str, set[str]] = {}

    def clear(self) -> list[str]:
        """Forget every node; returns those that still had outputs to store."""
        with self._lock:
            names, self._unsaved = sorted(self._unsaved), {}
        return names

    def returned(self, node_name: str, outputs: dict[str, Any] | None) -> bool:
        """The node returned ``outputs``; True when there is nothing to store (the node is done)."""
        if not outputs:
            return True
        with self._lock:
            self._unsaved[node_name] = set(outputs)
        return False

    def saved(self, node_name: str, dataset_name: str) -> bool:
        """``dataset_name`` is stored; True when it was the node's last output."""
        with self._lock:
            unsaved = self._unsaved.get(node_name)
            if unsaved is None:
                return False
            unsaved.discard(dataset_name)
            if unsaved:
                return False
            del self._unsaved[node_name]
            return True


class JobsHook:
    """Run directories deleted once their node's outputs are stored (kept on failure); worker nodes released."""

    def __init__(self) -> None:
        self.outputs = NodeOutputs()

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        self.outputs.clear()  # left by an interrupted earlier run in this process ...
        RUN_DIR_CLEANUP.keep()  # ... and so are the run dirs it had not released: kept on disk, for a resume
        RUN_DIR_CLEANUP.end()

    @hook_impl
    def before_node_run(self, node: Any, inputs: dict[str, Any]) -> None:
        """Open the node's deferral (in this thread, where Kedro runs the node function)."""
        RUN_DIR_CLEANUP.begin(node.name)

    @hook_impl
    def after_node_run(self, node: Any, outputs: dict[str, Any]) -> None:
        RUN_DIR_CLEANUP.end()
        if self.outputs.returned(node.name, outputs):
            RUN_DIR_CLEANUP.release(node.name)

    @hook_impl
    def after_dataset_saved(self, dataset_name: str, data: Any, node: Any) -> None:
        if self.outputs.saved(node.name, dataset_name):
            RUN_DIR_CLEANUP.release(node.name)

    @hook_impl
    def on_node_error(self, error: Exception, node: Any) -> None:
        RUN_DIR_CLEANUP.end()
        for run_dir in RUN_DIR_CLEANUP.keep(node.name):
            logger.info("%s failed: run directory %s kept (a rerun resumes from it)", node.name, run_dir)

    @hook_impl
    def after_pipeline_run(self) -> None:
        RUN_DIR_CLEANUP.end()
        multinode.shutdown()
        for name in self.outputs.clear():  # none in kedro 1.7, which saves a node's outputs before it counts as done
            RUN_DIR_CLEANUP.release(name)

    @hook_impl
    def on_pipeline_error(self, error: Exception) -> None:
        RUN_DIR_CLEANUP.end()
        multinode.shutdown()
        for name in self.outputs.clear():
            for run_dir in RUN_DIR_CLEANUP.keep(name):
                logger.warning("%s: its outputs were not all stored (%s: %s); run directory %s kept, a rerun resumes "
                               "from its checkpoint", name, type(error).__name__, error, run_dir)
        RUN_DIR_CLEANUP.keep()


__all__ = ["JobsHook", "NodeOutputs"]
