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
from kedro.io.core import AbstractVersionedDataset, DatasetError, Version

META_FILE = "meta.json"


class CheckpointDataset(AbstractVersionedDataset[str, str]):
    """Versioned checkpoint directory (local filesystem)."""

    def __init__(self, filepath: str, version: Version | None = None, metadata: dict[str, Any] | None = None):
        self._fs = fsspec.filesystem("file")
        self.metadata = metadata
        super().__init__(
            filepath=PurePosixPath(os.path.abspath(filepath)),
            version=version,
            exists_function=self._complete,
            glob_function=self._fs.glob,
        )

    @staticmethod
    def _complete(path: str) -> bool:
        return (Path(path) / META_FILE).is_file()

    def _load(self) -> str:
        path = Path(self._get_load_path())
        if not self._complete(str(path)):
            raise DatasetError(f"{path} is not a complete checkpoint (missing {META_FILE})")
        return str(path)

    def _save(self, data: str) -> None:
        src = Path(data)
        if not self._complete(str(src)):
            raise DatasetError(f"refusing to store {src}: not a complete checkpoint (missing {META_FILE})")
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
        return {"filepath": str(self._filepath), "version": self._version}
