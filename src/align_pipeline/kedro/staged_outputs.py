"""Kedro hook that saves a node's outputs of one ``commit_group`` all-or-nothing (``data_prep``'s tokenizer and
tokenized arrays: a stage must never read a tokenizer the arrays were not tokenized with).

Kedro saves a node's outputs one by one after the node has returned (``after_node_run`` comes first). So:

1. ``after_node_run``: for every ``commit_group`` among the node's output datasets, open the group's set
   (:func:`align_pipeline.data.staging.open_group`); the datasets' ``save`` now only stages their writes.
2. ``after_dataset_saved``: once the last output of the group is saved, commit the set: every artifact is renamed
   into place, or – if a rename fails – the previous ones are restored (:class:`~align_pipeline.data.staging.
   StagedWrites`).
3. A failed ``save`` aborts the set itself (staged writes removed, previous outputs unchanged);
   ``on_pipeline_error`` / ``after_pipeline_run`` abort any set still open.

Register it in ``settings.py``: ``HOOKS = (..., StagedOutputsHook())``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kedro.framework.hooks import hook_impl

from align_pipeline.data.staging import StagedWrites, close_group, open_group

logger = logging.getLogger(__name__)


class StagedOutputsHook:
    """Opens, commits and aborts the staged sets of ``commit_group`` datasets; see the module docstring."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, str], tuple[StagedWrites, set[str]]] = {}  # (node, group) -> set, unsaved
        self._lock = threading.Lock()

    @staticmethod
    def _groups(node: Any, catalog: Any) -> dict[str, set[str]]:
        """``commit_group`` -> names of the node's outputs in it."""
        groups: dict[str, set[str]] = {}
        for name in node.outputs:
            dataset = catalog.get(name) if hasattr(catalog, "get") else None
            group = getattr(dataset, "commit_group", None)
            if group:
                groups.setdefault(group, set()).add(name)
        return groups

    @hook_impl
    def after_node_run(self, node: Any, catalog: Any) -> None:
        """The node returned: from now on its ``commit_group`` outputs stage their writes."""
        for group, names in self._groups(node, catalog).items():
            staging = open_group(group, label=f"{group} outputs ({', '.join(sorted(names))})")
            with self._lock:
                self._pending[(node.name, group)] = (staging, set(names))

    @hook_impl
    def after_dataset_saved(self, dataset_name: str, node: Any) -> None:
        """Commit a group's set once its last output is saved."""
        ready = []
        with self._lock:
            for key, (staging, unsaved) in list(self._pending.items()):
                if key[0] == node.name and dataset_name in unsaved:
                    unsaved.discard(dataset_name)
                    if not unsaved:
                        ready.append((key, staging))
                        del self._pending[key]
        for (_, group), staging in ready:
            try:
                staging.commit()
            finally:
                close_group(group, staging)
            logger.info("%s: put in place together", staging.label)

    def _abort_all(self, why: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for (_, group), (staging, unsaved) in pending.items():
            staging.abort()
            close_group(group, staging)
            logger.warning(
                "%s: not written (%s; unsaved: %s); the previous ones are unchanged",
                staging.label,
                why,
                ", ".join(sorted(unsaved)),
            )

    @hook_impl
    def on_pipeline_error(self, error: Exception) -> None:
        self._abort_all(f"the run failed: {type(error).__name__}")

    @hook_impl
    def after_pipeline_run(self) -> None:
        self._abort_all("the run ended before every output was saved")


__all__ = ["StagedOutputsHook"]
