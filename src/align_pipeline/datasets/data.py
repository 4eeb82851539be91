"""Kedro datasets of the data artifacts. Loading gives an :class:`~align_pipeline.data.formats.Artifact` (path,
fingerprint, metadata) – never arrays: training nodes pass paths to their torchrun jobs.

* :class:`RawJsonlDataset` – a raw jsonl file (read-only); ``load()`` -> Artifact(path, sha256[:16],
  {"sha256", "source", "kind"}), so validation can name the file in its messages.
* :class:`TokenizerDirDataset` – ``save(TextTokenizer)`` writes the directory atomically; ``load()`` -> Artifact.
* :class:`TokenizedNpzDataset` – ``save(ArrayBundle | dict of arrays)`` writes ``.npz`` + ``.meta.json``
  atomically; ``load()`` -> Artifact.
* :class:`PromptsJsonlDataset` – ``save(RecordBundle | list of dicts)`` writes ``.jsonl`` + ``.meta.json``
  atomically; ``load()`` -> Artifact.

Catalog (``conf/base/catalog_data.yml``)::

    sft_train:
      type: align_pipeline.datasets.TokenizedNpzDataset
      filepath: data/05_model_input/sft_train.npz
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kedro.io import AbstractDataset, DatasetError

from align_pipeline.data.formats import (
    ArrayBundle,
    Artifact,
    RecordBundle,
    file_sha256,
    load_artifact,
    save_jsonl,
    save_npz,
    short_hash,
)
from align_pipeline.data.schemas import KINDS, display_path
from align_pipeline.data.tokenizer import META_FILE, TOKENIZER_FILE, TextTokenizer, read_tokenizer_meta


class RawJsonlDataset(AbstractDataset[None, Artifact]):
    """A raw jsonl file of ``kind`` (sft | preference | prompts). Read-only: ``save`` raises."""

    def __init__(self, filepath: str, kind: str, metadata: dict[str, Any] | None = None):
        if kind not in KINDS:
            raise DatasetError(f"RawJsonlDataset kind must be one of {KINDS}, got {kind!r}")
        self._filepath = Path(filepath)
        self._kind = kind
        self.metadata = metadata

    def load(self) -> Artifact:
        source = display_path(self._filepath)
        if not self._filepath.is_file():
            raise DatasetError(f"{source}: raw {self._kind} data file not found")
        sha = file_sha256(self._filepath)
        return Artifact(
            path=str(self._filepath.resolve()),
            fingerprint=short_hash(sha),
            meta={"sha256": sha, "source": source, "kind": self._kind},
        )

    def save(self, data: None) -> None:
        raise DatasetError(f"{self._filepath} is raw input data and is never written by the pipeline")

    def _exists(self) -> bool:
        return self._filepath.is_file()

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath), "kind": self._kind}


class TokenizerDirDataset(AbstractDataset[TextTokenizer, Artifact]):
    """A tokenizer directory (``tokenizer.json`` + ``align_tokenizer.json``)."""

    def __init__(self, path: str, metadata: dict[str, Any] | None = None):
        self._path = Path(path)
        self.metadata = metadata

    def load(self) -> Artifact:
        meta = read_tokenizer_meta(self._path)
        return Artifact(path=str(self._path.resolve()), fingerprint=meta["fingerprint"], meta=meta)

    def save(self, data: TextTokenizer) -> None:
        if not isinstance(data, TextTokenizer):
            raise DatasetError(f"TokenizerDirDataset saves a TextTokenizer, got {type(data).__name__}")
        data.save(self._path)

    def _exists(self) -> bool:
        return (self._path / META_FILE).is_file() and (self._path / TOKENIZER_FILE).is_file()

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path)}


class _ArtifactFileDataset(AbstractDataset):
    def __init__(self, filepath: str, verify: bool = False, metadata: dict[str, Any] | None = None):
        self._filepath = Path(filepath)
        self._verify = verify
        self.metadata = metadata

    def load(self) -> Artifact:
        return load_artifact(self._filepath, verify=self._verify)

    def _exists(self) -> bool:
        return self._filepath.is_file() and Path(f"{self._filepath}.meta.json").is_file()

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath), "verify": self._verify}


class TokenizedNpzDataset(_ArtifactFileDataset):
    """Tokenized arrays (``.npz``) plus their ``.meta.json`` sidecar. ``verify: true`` re-hashes on load."""

    def save(self, data: ArrayBundle | dict) -> None:
        bundle = data if isinstance(data, ArrayBundle) else ArrayBundle(arrays=dict(data))
        save_npz(self._filepath, bundle.arrays, bundle.meta)


class PromptsJsonlDataset(_ArtifactFileDataset):
    """Tokenized prompt records (``.jsonl``) plus their ``.meta.json`` sidecar."""

    def save(self, data: RecordBundle | list) -> None:
        bundle = data if isinstance(data, RecordBundle) else RecordBundle(records=list(data))
        save_jsonl(self._filepath, bundle.records, bundle.meta)


__all__ = ["PromptsJsonlDataset", "RawJsonlDataset", "TokenizedNpzDataset", "TokenizerDirDataset"]
