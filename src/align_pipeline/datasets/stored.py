"""The stored versions of a versioned artifact, as a node input: what a stage consults to reuse a version that was
made from the same inputs, config and code (:mod:`align_pipeline.pipelines.reuse`).

A catalog entry ``<artifact>_stored`` (``StoredVersionsDataset``, the artifact's ``filepath``) loads a
:class:`StoredVersions`: read-only, it lists nothing up front; :meth:`StoredVersions.find` reads the small
``reuse.json`` record of each version, newest first, and returns the first whose key matches and which passes its
manifest check (as loading the artifact would check it; ``verify`` as in the artifact's entry). A version that
matches but fails the check is skipped with a warning naming it: it is never handed on.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kedro.io.core import AbstractDataset, DatasetError, Version

from .checkpoint import CheckpointDataset, HFModelDataset

REUSE_FILE = "reuse.json"
"""In a stored model / report directory: {"key", "stage", "metrics", ...} - how it was made, for reuse."""
_MAX_RECORD_BYTES = 1 << 20
logger = logging.getLogger(__name__)


def read_reuse_record(path: str | Path) -> dict[str, Any] | None:
    """The ``reuse.json`` of an artifact directory, or None (absent, too large, not a JSON object with a string
    ``key``: read as hostile input, never an error)."""
    record = Path(path) / REUSE_FILE
    try:
        if record.is_symlink() or not record.is_file() or record.stat().st_size > _MAX_RECORD_BYTES:
            return None
        body = json.loads(record.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return body if isinstance(body, dict) and isinstance(body.get("key"), str) else None


class StoredVersions:
    """The versions stored under one artifact's filepath (see the module docstring)."""

    def __init__(self, dataset: CheckpointDataset):
        self._dataset = dataset
        self.name = dataset.name
        """The artifact's catalog name (its filepath's last component)."""

    def versions(self) -> list[str]:
        """Stored version names, newest first."""
        return self._dataset.stored_versions()

    def path(self, version: str) -> Path:
        return self._dataset.version_path(version)

    def find(self, key: str, version: str | None = None) -> tuple[str, Path, dict[str, Any]] | None:
        """(version, path, its reuse record) of the newest stored version made with ``key`` that passes its manifest
        check; only ``version`` when given; None when there is none."""
        for candidate in [version] if version else self.versions():
            path = self.path(candidate)
            record = read_reuse_record(path)
            if record is None or record["key"] != key:
                continue
            problem = self._dataset.check_version(candidate)
            if problem is not None:
                logger.warning("%s version %s was made with the same inputs and config but %s: not reused",
                               self.name, candidate, problem)
                continue
            return candidate, path, record
        return None

    def __repr__(self) -> str:
        return f"StoredVersions({self.name!r})"


class StoredVersionsDataset(AbstractDataset[None, StoredVersions]):
    """Read-only catalog entry: the stored versions of the artifact at ``filepath`` (a :class:`StoredVersions`).
    ``hf: true`` for an HF-directory artifact (``config.json`` marks a complete version); ``verify`` as the
    artifact's entry (default: sizes for checkpoints, full for HF directories)."""

    def __init__(self, filepath: str, verify: str | None = None, hf: bool = False,
                 metadata: dict[str, Any] | None = None):
        self._filepath = filepath
        self._verify = verify
        self._hf = hf
        self.metadata = metadata

    def _load(self) -> StoredVersions:
        cls = HFModelDataset if self._hf else CheckpointDataset
        return StoredVersions(cls(self._filepath, version=Version(None, None), verify=self._verify))

    def _save(self, data: Any) -> None:
        raise DatasetError(f"{self._filepath}: the stored versions are read-only (the artifact's own entry saves)")

    def _exists(self) -> bool:
        return True  # no versions yet is a valid (empty) answer

    def _describe(self) -> dict[str, Any]:
        return {"filepath": self._filepath, "verify": self._verify, "hf": self._hf}
