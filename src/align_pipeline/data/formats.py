"""On-disk formats of the tokenized artifacts, atomic writes, content fingerprints.

Artifacts written by ``data_prep`` and read by the trainers:

* ``<name>.npz`` – arrays (see :mod:`align_pipeline.data.tokenize` for the keys and conventions);
* ``<name>.jsonl`` – one JSON record per line (prompts);
* ``<file>.meta.json`` – the sidecar: ``fingerprint`` (short sha256 of the *content*, not of the file bytes – npz
  zip headers carry timestamps), ``num_samples``, ``seq_length``, ``tokenizer_fingerprint``, ``source`` and
  ``source_sha256`` (the raw jsonl it came from), plus ``format`` / ``format_version``.

Every file is written to a temp file in the same directory and moved into place with ``os.replace``; the data file
goes first and the sidecar last, so an artifact whose sidecar exists is complete (:func:`load_artifact` re-checks
the fingerprint on request). Every tokenized artifact's sidecar carries ``tokenizer_fingerprint``;
:func:`check_tokenized_with` refuses a set whose arrays were tokenized with another tokenizer than the one a stage is
given. Nothing here imports Kedro or torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from .errors import DataValidationError, display_path

FORMAT_VERSION = 1
FINGERPRINT_CHARS = 16
SIDECAR_SUFFIX = ".meta.json"

PathLike = str | os.PathLike


@dataclass
class Artifact:
    """What the Kedro datasets hand to training nodes: a path and what identifies its content."""

    path: str
    """Absolute path of the file or directory."""
    fingerprint: str
    """Short sha256 of the content."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The sidecar metadata (num_samples, seq_length, tokenizer fingerprint, source, ...)."""


@dataclass
class ArrayBundle:
    """In-memory arrays of one npz artifact plus its metadata (what ``data_prep`` nodes return)."""

    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class RecordBundle:
    """In-memory records of one jsonl artifact plus its metadata."""

    records: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# Hashing
# ---------------------------------------------------------------------------------------------------------------


def short_hash(full_hex: str) -> str:
    return full_hex[:FINGERPRINT_CHARS]


def bytes_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: PathLike) -> str:
    """Full hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _chunks(array: Any) -> Iterator[np.ndarray]:
    """The C-order contents of an array, or of a lazy one (:class:`.store.LazyArray`: its ``chunks()``)."""
    if hasattr(array, "chunks"):
        yield from array.chunks()
    else:
        yield np.ascontiguousarray(array)


def arrays_fingerprint(arrays: dict[str, Any]) -> str:
    """Short sha256 over names, dtypes, shapes and bytes of the arrays (key order does not matter); lazy arrays
    (:class:`.store.LazyArray`) are read a chunk at a time."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        a = a if hasattr(a, "chunks") else np.asarray(a)
        h.update(f"{name}|{a.dtype.str}|{tuple(a.shape)}|".encode())
        for chunk in _chunks(a):
            h.update(chunk.tobytes())
    return short_hash(h.hexdigest())


def _jsonl_lines(records: Any) -> Iterator[bytes]:
    """Each record as its canonical line (keys sorted); a :class:`.store.SpilledRecords` gives its stored lines."""
    if hasattr(records, "jsonl_lines"):
        yield from records.jsonl_lines()
    else:
        for r in records:
            yield (json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n").encode()


def records_fingerprint(records: list[dict[str, Any]]) -> str:
    """Short sha256 of the canonical jsonl serialisation of ``records``."""
    h = hashlib.sha256()
    for line in _jsonl_lines(records):
        h.update(line)
    return short_hash(h.hexdigest())


# ---------------------------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_open(path: PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temp file next to ``path``; on success it replaces ``path`` (``os.replace``), on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once at import: os.umask is process-wide


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_json(path: PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def sidecar_path(path: PathLike) -> Path:
    """``<file>.meta.json``."""
    return Path(f"{os.fspath(path)}{SIDECAR_SUFFIX}")


# ---------------------------------------------------------------------------------------------------------------
# npz / jsonl artifacts
# ---------------------------------------------------------------------------------------------------------------


def save_npz(path: PathLike, arrays: dict[str, Any], meta: dict[str, Any] | None = None) -> Artifact:
    """Write ``arrays`` to ``path`` (uncompressed npz, as ``np.savez`` writes it) and its sidecar, both atomically;
    return the artifact. Lazy arrays (:class:`.store.LazyArray`, what data_prep spilled to disk) are streamed into
    the file a chunk at a time."""
    fingerprint = arrays_fingerprint(arrays)
    full_meta = {
        **(meta or {}),
        "format": "npz",
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "arrays": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in sorted(arrays.items())},
    }
    with atomic_open(path, "wb") as f:  # straight into the file: no second copy of the arrays in memory
        _write_npz(f, arrays)
    atomic_write_json(sidecar_path(path), full_meta)
    return Artifact(path=os.path.abspath(path), fingerprint=fingerprint, meta=full_meta)


def _write_npz(f: IO[bytes], arrays: dict[str, Any]) -> None:
    """np.savez's layout (a stored zip of ``<name>.npy`` members), with lazy arrays written chunk by chunk."""
    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, value in arrays.items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as member:
                if not hasattr(value, "chunks"):
                    np.lib.format.write_array(member, np.asanyarray(value), allow_pickle=False)
                    continue
                header = {"descr": np.lib.format.dtype_to_descr(value.dtype), "fortran_order": False,
                          "shape": tuple(value.shape)}
                np.lib.format.write_array_header_1_0(member, header)
                for chunk in value.chunks():
                    member.write(chunk.tobytes())


def save_jsonl(path: PathLike, records: Any, meta: dict[str, Any] | None = None) -> Artifact:
    """Write ``records`` (a list of dicts, or a :class:`.store.SpilledRecords`) as jsonl (keys sorted) and its
    sidecar, both atomically, a line at a time; return the artifact."""
    h = hashlib.sha256()
    with atomic_open(path, "wb") as f:
        for line in _jsonl_lines(records):
            h.update(line)
            f.write(line)
    fingerprint = short_hash(h.hexdigest())
    full_meta = {**(meta or {}), "format": "jsonl", "format_version": FORMAT_VERSION, "fingerprint": fingerprint}
    atomic_write_json(sidecar_path(path), full_meta)
    return Artifact(path=os.path.abspath(path), fingerprint=fingerprint, meta=full_meta)


def load_npz(path: PathLike) -> dict[str, np.ndarray]:
    """All arrays of an npz file, fully read into memory."""
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def load_jsonl(path: PathLike) -> list[dict[str, Any]]:
    """Records of a jsonl file (blank lines skipped). For raw, unvalidated data use :mod:`.schemas` instead."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_meta(path: PathLike) -> dict[str, Any]:
    """The sidecar of an artifact file; ``FileNotFoundError`` with a clear message when it is missing."""
    side = sidecar_path(path)
    if not side.exists():
        raise FileNotFoundError(f"{side} not found: {path} is missing or was not completely written")
    return json.loads(side.read_text())


CHECKPOINT_META = "meta.json"
"""The metadata file of a checkpoint directory (model config, head, tokenizer, step, lineage)."""


def is_checkpoint(path: PathLike) -> bool:
    """A complete checkpoint directory (its meta.json is written last, after every shard)."""
    return (Path(path) / CHECKPOINT_META).is_file()


def checkpoint_meta(path: PathLike) -> dict[str, Any]:
    """``meta.json`` of a checkpoint directory, read as JSON (no torch, no Megatron: the Kedro side reads it too)."""
    meta_path = Path(path) / CHECKPOINT_META
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {CHECKPOINT_META})")
    return json.loads(meta_path.read_text())


TOKENIZER_DIR = "tokenizer"
"""A model checkpoint's own copy of the tokenizer it was trained with (``<checkpoint>/tokenizer``, named by meta.json's
``tokenizer.path`` relative to the checkpoint): export, evaluation and later stages read the artifact's own."""


def checkpoint_tokenizer(path: PathLike) -> tuple[Path | None, str | None]:
    """(directory, fingerprint) of the tokenizer a checkpoint was trained with, from its meta.json: its own copy
    (a relative ``tokenizer.path``) or, for checkpoints written before they carried one, the recorded absolute path;
    (None, None) for an HF directory or a checkpoint that records no tokenizer."""
    if not is_checkpoint(path):
        return None, None
    entry = checkpoint_meta(path).get("tokenizer")
    if not isinstance(entry, dict):
        return None, None
    where = Path(entry["path"]) if entry.get("path") else None
    if where is not None and not where.is_absolute():
        where = Path(path) / where
    return where, entry.get("fingerprint")


def check_checkpoint_tokenizers(tokenizer: Artifact, **checkpoints: str | None) -> None:
    """Raise ``DataValidationError`` unless every checkpoint of ``checkpoints`` (catalog name or parameter key ->
    path; None and HF directories are skipped) was trained with ``tokenizer``, the one this run's data was tokenized
    with: a model trained on other token ids would read this data as noise (or index past its embeddings). One
    message names both fingerprints and what fixes it."""

    bad = []
    for name, path in checkpoints.items():
        fingerprint = checkpoint_tokenizer(path)[1] if path else None
        if fingerprint is not None and fingerprint != tokenizer.fingerprint:
            bad.append(f"{name} ({display_path(path)}) was trained with tokenizer {fingerprint}")
    if bad:
        raise DataValidationError(
            f"{'; '.join(bad)}, but this run's data was tokenized with tokenizer {tokenizer.fingerprint} "
            f"({display_path(tokenizer.path)}): run data_prep with the tokenizer that checkpoint was trained with (the "
            "same data_prep.tokenizer settings and env), or pin a checkpoint trained on this data "
            "(`kedro run --load-versions <dataset>:<version>`)")


def lora_adapters_only(meta: dict[str, Any]) -> bool:
    """Whether a model checkpoint's meta describes a LoRA artifact that holds its adapters alone (merged into its
    base, ``meta["lora"]["base"]``, by whoever loads it)."""
    return (meta.get("lora") or {}).get("storage") == "adapters"


def content_fingerprint(path: PathLike) -> str:
    """Recompute the fingerprint of an npz or jsonl artifact from its content."""
    if os.fspath(path).endswith(".npz"):
        return arrays_fingerprint(load_npz(path))
    return short_hash(file_sha256(path))


def load_artifact(path: PathLike, verify: bool = False) -> Artifact:
    """The :class:`Artifact` of an npz/jsonl file from its sidecar; ``verify`` re-hashes the content."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found")
    meta = read_meta(path)
    if verify:
        actual = content_fingerprint(path)
        if actual != meta["fingerprint"]:
            raise ValueError(
                f"{path}: content fingerprint {actual} does not match its sidecar ({meta['fingerprint']}); "
                "the artifact was modified or partially written – rerun data_prep"
            )
    return Artifact(path=os.path.abspath(path), fingerprint=meta["fingerprint"], meta=meta)


def check_tokenized_with(tokenizer: Artifact, **data: Artifact) -> None:
    """Raise ``DataValidationError`` unless every artifact of ``data`` (catalog name -> Artifact) was tokenized with
    ``tokenizer``: its sidecar's ``tokenizer_fingerprint`` must equal ``tokenizer.fingerprint``. One message names
    every mismatching dataset (and one without the key), e.g.::

        check_tokenized_with(tokenizer, sft_train=sft_train, sft_val=sft_val)
    """

    bad = {name: art for name, art in data.items() if art.meta.get("tokenizer_fingerprint") != tokenizer.fingerprint}
    if not bad:
        return
    details = []
    for name, art in bad.items():
        found = art.meta.get("tokenizer_fingerprint")
        details.append(
            f"{name} ({display_path(art.path)}: {f'tokenizer {found}' if found else 'no tokenizer_fingerprint'})"
        )
    raise DataValidationError(
        f"{', '.join(bad)} {'was' if len(bad) == 1 else 'were'} not tokenized with the tokenizer "
        f"{display_path(tokenizer.path)} (fingerprint {tokenizer.fingerprint}): {', '.join(details)}. The data_prep outputs come "
        "from different runs; rerun `kedro run --pipelines data_prep`"
    )


__all__ = [
    "CHECKPOINT_META",
    "TOKENIZER_DIR",
    "ArrayBundle",
    "Artifact",
    "RecordBundle",
    "arrays_fingerprint",
    "atomic_open",
    "atomic_write_bytes",
    "atomic_write_json",
    "check_checkpoint_tokenizers",
    "check_tokenized_with",
    "checkpoint_meta",
    "checkpoint_tokenizer",
    "content_fingerprint",
    "file_sha256",
    "is_checkpoint",
    "load_artifact",
    "load_jsonl",
    "load_npz",
    "read_meta",
    "records_fingerprint",
    "save_jsonl",
    "save_npz",
    "short_hash",
    "sidecar_path",
]
