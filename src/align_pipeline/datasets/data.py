"""Kedro datasets of the data artifacts. Loading gives an :class:`~align_pipeline.data.formats.Artifact` (path,
fingerprint, metadata) – never arrays: training nodes pass paths to their torchrun jobs.

* :class:`RawDataset` – raw data (read-only): a jsonl or parquet file, or a ``save_to_disk`` directory; ``load()``
  -> Artifact(path, sha256[:16], {"sha256", "source", "kind", "format", "split"}), so validation can read it a batch
  at a time and name the file in its messages. :class:`RawJsonlDataset`: the same, jsonl only.
* :class:`TokenizerDirDataset` – ``save(TextTokenizer)`` writes the directory atomically; ``load()`` -> Artifact.
* :class:`TokenizedNpzDataset` – ``save(ArrayBundle | dict of arrays)`` writes ``.npz`` + ``.meta.json``
  atomically; ``load()`` -> Artifact.
* :class:`PromptsJsonlDataset` – ``save(RecordBundle | list of dicts)`` writes ``.jsonl`` + ``.meta.json``
  atomically; ``load()`` -> Artifact.
* :class:`ReferenceLogpsDataset` – ``dpo_reference_logps``: ``save(Artifact)`` records which reference log-probs
  cache (``<dpo.reference_cache_dir>/<key>.npz``) ``compute_reference_logps`` produced, as a small JSON file;
  ``load()`` -> that Artifact, so ``kedro run --nodes train_dpo`` / ``--from-nodes train_dpo`` find it on disk.

``commit_group: <name>`` (the three writable datasets) makes the outputs of one node land together or not at all:
while :class:`align_pipeline.kedro.staged_outputs.StagedOutputsHook` has the group's set open (from the node's return
until Kedro has saved its last output of the group), ``save`` only stages the write next to the final path, and the
hook renames the whole set into place at the end (:mod:`align_pipeline.data.staging`). Without an open set (the hook
not registered, or a direct ``catalog.save``) ``save`` writes at once, one artifact at a time, and logs a warning.

Catalog (``conf/base/catalog_data.yml``)::

    sft_train:
      type: align_pipeline.datasets.TokenizedNpzDataset
      filepath: data/05_model_input/sft_train.npz
      commit_group: data_prep
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kedro.io import AbstractDataset, DatasetError

from align_pipeline.data.formats import (
    ArrayBundle,
    Artifact,
    RecordBundle,
    atomic_write_json,
    load_artifact,
    save_jsonl,
    save_npz,
    short_hash,
    sidecar_path,
)
from align_pipeline.data.schemas import KINDS, display_path
from align_pipeline.data.sources import FORMATS, source_sha256, storage_format
from align_pipeline.data.staging import current_group
from align_pipeline.data.tokenizer import META_FILE, TOKENIZER_FILE, TextTokenizer, read_tokenizer_meta

logger = logging.getLogger(__name__)
_warned_groups: set[str] = set()


class _GroupWrite:
    """``save`` of a dataset that may belong to a ``commit_group`` (see the module docstring)."""

    commit_group: str | None = None

    def _write(self, path: Path, write: Callable[[Path], object], sidecar: bool, last: bool = False) -> None:
        """``write(target)`` writes the artifact at ``target`` (plus ``<target>.meta.json`` when ``sidecar``): the
        final ``path`` itself, or its staged sibling while the group's set is open."""
        staging = current_group(self.commit_group) if self.commit_group else None
        if staging is None:
            if self.commit_group and self.commit_group not in _warned_groups:
                _warned_groups.add(self.commit_group)
                logger.warning(
                    "commit_group %r has no open set (is align_pipeline.kedro.staged_outputs.StagedOutputsHook in "
                    "settings.HOOKS?): its outputs are written one by one, not all-or-nothing",
                    self.commit_group,
                )
            write(path)
            return
        staged = staging.staged_path(path)
        pairs = [(staged, path)] + ([(sidecar_path(staged), sidecar_path(path))] if sidecar else [])
        staging.stage(pairs, lambda: write(staged), last=last)


class RawDataset(AbstractDataset[None, Artifact]):
    """Raw data (``kind``, optional: sft | preference | prompts | regression): a jsonl file, a parquet file or a directory
    written by ``datasets.Dataset.save_to_disk`` (``format``: auto = by the path; ``split``: the split of a
    ``DatasetDict`` directory). Read-only: ``save`` raises. ``load()`` gives an Artifact (path, sha256[:16],
    ``{"sha256", "source", "kind", "format", "split"}``); data_prep reads the rows itself, a batch at a time
    (:mod:`align_pipeline.data.sources`), and names the file in its messages."""

    def __init__(self, filepath: str, kind: str | None = None, format: str = "auto", split: str | None = None,
                 metadata: dict[str, Any] | None = None):
        if kind is not None and kind not in KINDS:
            raise DatasetError(f"{type(self).__name__} kind must be one of {KINDS}, got {kind!r}")
        if format not in ("auto", *FORMATS):
            raise DatasetError(f"{type(self).__name__} format must be auto or one of {FORMATS}, got {format!r}")
        self._filepath = Path(filepath)
        self._kind = kind
        self._format = format
        self._split = split
        self.metadata = metadata

    def load(self) -> Artifact:
        source = display_path(self._filepath)
        if not self._exists():
            raise DatasetError(f"{source}: raw {self._kind or ''} data not found".replace("  ", " "))
        fmt = storage_format(self._filepath, self._format)
        sha = source_sha256(self._filepath, fmt)
        return Artifact(
            path=str(self._filepath.resolve()),
            fingerprint=short_hash(sha),
            meta={"sha256": sha, "source": source, "kind": self._kind, "format": fmt, "split": self._split},
        )

    def save(self, data: None) -> None:
        raise DatasetError(f"{self._filepath} is raw input data and is never written by the pipeline")

    def _exists(self) -> bool:
        return self._filepath.is_file() or self._filepath.is_dir()

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath), "kind": self._kind, "format": self._format, "split": self._split}


class RawJsonlDataset(RawDataset):
    """A raw jsonl file of ``kind`` (the catalog type of earlier configurations: :class:`RawDataset` with
    ``format: jsonl``)."""

    def __init__(self, filepath: str, kind: str | None = None, metadata: dict[str, Any] | None = None):
        super().__init__(filepath, kind, format="jsonl", metadata=metadata)

    def _exists(self) -> bool:
        return self._filepath.is_file()


class TokenizerDirDataset(_GroupWrite, AbstractDataset[TextTokenizer, Artifact]):
    """A tokenizer directory (``tokenizer.json`` + ``align_tokenizer.json``). In a commit group it is put in place
    after every other artifact of the set."""

    def __init__(self, path: str, commit_group: str | None = None, metadata: dict[str, Any] | None = None):
        self._path = Path(path)
        self.commit_group = commit_group
        self.metadata = metadata

    def load(self) -> Artifact:
        meta = read_tokenizer_meta(self._path)
        return Artifact(path=str(self._path.resolve()), fingerprint=meta["fingerprint"], meta=meta)

    def save(self, data: TextTokenizer) -> None:
        if not isinstance(data, TextTokenizer):
            raise DatasetError(f"TokenizerDirDataset saves a TextTokenizer, got {type(data).__name__}")
        self._write(self._path, data.save, sidecar=False, last=True)

    def _exists(self) -> bool:
        return (self._path / META_FILE).is_file() and (self._path / TOKENIZER_FILE).is_file()

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path), "commit_group": self.commit_group}


class _ArtifactFileDataset(_GroupWrite, AbstractDataset):
    def __init__(
        self,
        filepath: str,
        verify: bool = False,
        commit_group: str | None = None,
        metadata: dict[str, Any] | None = None,
    ):
        self._filepath = Path(filepath)
        self._verify = verify
        self.commit_group = commit_group
        self.metadata = metadata

    def load(self) -> Artifact:
        return load_artifact(self._filepath, verify=self._verify)

    def _exists(self) -> bool:
        return self._filepath.is_file() and Path(f"{self._filepath}.meta.json").is_file()

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath), "verify": self._verify, "commit_group": self.commit_group}


class TokenizedNpzDataset(_ArtifactFileDataset):
    """Tokenized arrays (``.npz``) plus their ``.meta.json`` sidecar. ``verify: true`` re-hashes on load."""

    def save(self, data: ArrayBundle | dict) -> None:
        bundle = data if isinstance(data, ArrayBundle) else ArrayBundle(arrays=dict(data))
        self._write(self._filepath, lambda path: save_npz(path, bundle.arrays, bundle.meta), sidecar=True)


class PromptsJsonlDataset(_ArtifactFileDataset):
    """Tokenized prompt records (``.jsonl``) plus their ``.meta.json`` sidecar."""

    def save(self, data: RecordBundle | list) -> None:
        bundle = data if isinstance(data, RecordBundle) else RecordBundle(records=list(data))
        self._write(self._filepath, lambda path: save_jsonl(path, bundle.records, bundle.meta), sidecar=True)


class ReferenceLogpsDataset(AbstractDataset[Artifact, Artifact]):
    """Which reference log-probs cache ``compute_reference_logps`` last produced: a JSON file ``{"path",
    "fingerprint", "meta"}`` (meta: ``key``, ``reference``, data and tokenizer fingerprints; ``online: true`` for
    ``dpo.reference: online``). The cache file itself stays where the node keeps it (``dpo.reference_cache_dir``),
    one per key.

    ``load()`` trusts nothing it reads: ``train_dpo`` recomputes the key from its own inputs and verifies the cache
    (:func:`align_pipeline.pipelines.dpo.nodes.resolve_reference_logps`) before a job uses it. Without the JSON file
    (a project from before this entry existed) it returns an Artifact with no key, which ``train_dpo`` resolves to
    the cache of the current key in ``dpo.reference_cache_dir``."""

    def __init__(self, filepath: str, metadata: dict[str, Any] | None = None):
        self._filepath = Path(filepath)
        self.metadata = metadata

    def load(self) -> Artifact:
        source = display_path(self._filepath)
        if not self._filepath.is_file():
            logger.info("%s not found: train_dpo uses the reference log-probs cache of its current inputs", source)
            return Artifact(path="", fingerprint="unresolved", meta={"key": None, "online": False})
        try:
            saved = json.loads(self._filepath.read_text())
            artifact = Artifact(path=str(saved["path"]), fingerprint=str(saved["fingerprint"]),
                                meta=dict(saved["meta"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DatasetError(f"{source} is not a reference log-probs record ({type(e).__name__}: {e}); delete it and "
                               "run `kedro run --nodes compute_reference_logps,train_dpo`") from None
        return artifact

    def save(self, data: Artifact) -> None:
        if not isinstance(data, Artifact):
            raise DatasetError(f"ReferenceLogpsDataset saves an Artifact, got {type(data).__name__}")
        atomic_write_json(self._filepath, {"path": data.path, "fingerprint": data.fingerprint, "meta": data.meta})

    def _exists(self) -> bool:
        return self._filepath.is_file()

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath)}


__all__ = ["PromptsJsonlDataset", "RawDataset", "RawJsonlDataset", "ReferenceLogpsDataset", "TokenizedNpzDataset",
           "TokenizerDirDataset"]
