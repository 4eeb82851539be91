"""The lifecycle of a stage's run directory inside ``kedro run``: kept until the node's outputs are stored, then
deleted; kept on disk when the node or a save fails, so a rerun resumes from its training checkpoints."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

logger = logging.getLogger(__name__)


class RunDirCleanup:
    """Run directories whose deletion waits until the node that trained in them has its outputs stored.

    Inside a ``kedro run`` the hook (:class:`align_pipeline.kedro.mlflow_hook.MlflowHook`) opens a node's deferral before the
    node runs (``begin``, per thread); :func:`launch_stage` then registers its run directory (``defer``) instead of
    deleting it, and the hook deletes the node's directories (``release``) once the catalog has saved the node's last
    output, or forgets them (``keep``) when the node or a save fails, so that a rerun resumes from the training
    checkpoints in them. Outside a session (a node function called directly) no deferral is open and
    :func:`launch_stage` deletes the directory itself, as soon as the models are moved out.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pending: dict[str, list[Path]] = {}  # node name -> run dirs to delete once its outputs are stored

    def begin(self, node_name: str) -> None:
        """The node ``node_name`` runs in this thread: run dirs it registers wait for its outputs."""
        self._local.node = node_name

    def end(self) -> None:
        """The node function of this thread has returned (or raised)."""
        self._local.node = None

    def defer(self, run_dir: str | Path) -> bool:
        """Register ``run_dir`` for deletion after the current node's outputs are stored; False outside a node run by
        the hook (then the caller deletes it)."""
        node = getattr(self._local, "node", None)
        if node is None:
            return False
        with self._lock:
            self._pending.setdefault(node, []).append(Path(run_dir))
        return True

    def release(self, node_name: str) -> list[Path]:
        """The node's outputs are stored: delete its registered run dirs; returns them."""
        with self._lock:
            dirs = self._pending.pop(node_name, [])
        for run_dir in dirs:
            shutil.rmtree(run_dir, ignore_errors=True)
            logger.debug("%s: outputs stored, run directory %s deleted", node_name, run_dir)
        return dirs

    def keep(self, node_name: str | None = None) -> list[Path]:
        """Forget the run dirs of ``node_name`` (every node when None) without deleting them; returns them."""
        with self._lock:
            if node_name is None:
                dirs = [d for ds in self._pending.values() for d in ds]
                self._pending.clear()
            else:
                dirs = self._pending.pop(node_name, [])
        return dirs


RUN_DIR_CLEANUP = RunDirCleanup()
"""The process's registry of run directories waiting for their node's outputs to be stored."""
