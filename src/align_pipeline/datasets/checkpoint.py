"""A versioned Kedro dataset whose data is a checkpoint *directory*.

``save(path)`` moves a finished checkpoint directory (made by a training job, containing ``meta.json``) into
``<filepath>/<version>/<name>``: it is first moved to a hidden temp name beside the target and then renamed, so a
version directory either holds a complete checkpoint or nothing loadable. ``load()`` returns the path (str) of the
requested (default: latest complete) version, so nodes pass paths, never weights.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec
from kedro.io.core import AbstractVersionedDataset, DatasetError, Version, VersionNotFoundError

META_FILE = "meta.json"


class CheckpointDataset(AbstractVersionedDataset[str, str]):
    """Versioned checkpoint directory (local filesystem).

    ``optional: true``: loading gives "" (no path) when no complete version exists, instead of failing; the export
    pipeline reads the models through such entries so that it exports the ones a project has."""

    MARKER = META_FILE
    """The file whose presence makes a version directory complete."""

    def __init__(self, filepath: str, version: Version | None = None, metadata: dict[str, Any] | None = None,
                 optional: bool = False):
        self._fs = fsspec.filesystem("file")
        self.metadata = metadata
        self._optional = optional
        super().__init__(
            filepath=PurePosixPath(os.path.abspath(filepath)),
            version=version,
            exists_function=self._complete,
            glob_function=self._fs.glob,
        )

    def resolve_load_version(self) -> str | None:
        """An optional dataset without any version resolves to its save version (where nothing is), so that Kedro's
        check after an empty save ("" stored nothing) and the absent-input case need no special path."""
        try:
            return super().resolve_load_version()
        except VersionNotFoundError:
            if not self._optional:
                raise
            return self.resolve_save_version()

    @classmethod
    def _complete(cls, path: str) -> bool:
        return (Path(path) / cls.MARKER).is_file()

    def _load(self) -> str:
        if self._optional and not self._exists():
            return ""
        path = Path(self._get_load_path())
        if not self._complete(str(path)):
            raise DatasetError(f"{path} is not complete (missing {self.MARKER})")
        return str(path)

    def _save(self, data: str) -> None:
        if data == "" and self._optional:
            return  # nothing to store (an optional output whose source was absent)
        src = Path(data)
        if not self._complete(str(src)):
            raise DatasetError(f"refusing to store {src}: not complete (missing {self.MARKER})")
        dest = Path(self._get_save_path())
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".tmp-{dest.name}"
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.move(str(src), str(tmp))
        os.replace(tmp, dest)

    def _exists(self) -> bool:
        try:
            return self._complete(str(self._get_load_path()))
        except DatasetError:
            return False

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath), "version": self._version, "optional": self._optional}


class HFModelDataset(CheckpointDataset):
    """Versioned Hugging Face model directory (``config.json`` + safetensors + tokenizer), stored like a checkpoint:
    moved into ``<filepath>/<version>/<name>`` whole. Loading gives its path, which ``transformers`` and vLLM load.
    ``optional: true``: saving "" stores nothing (the export pipeline's models that a project does not have)."""

    MARKER = "config.json"
