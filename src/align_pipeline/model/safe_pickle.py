"""Opening a checkpoint runs no code from it: every pickle a checkpoint holds is read by a restricted unpickler.

A Megatron ``torch_dist`` checkpoint (ours: :mod:`align_pipeline.model.checkpoint`) holds three kinds of pickle:

* ``.metadata`` — torch DCP's index of the shards, which ``FileSystemReader.read_metadata`` reads with a bare
  ``pickle.load``: a crafted file runs any callable it names (``os.system``) the moment a checkpoint is opened.
  Read here by :class:`MetadataUnpickler`, which resolves only the classes :data:`METADATA_GLOBALS` lists (recorded
  from the checkpoints this project writes: SFT at TP=2, a training checkpoint, LoRA adapters) and torch's dtypes;
* the ``BYTE_IO`` items inside the ``.distcp`` files (Megatron's ``ShardedObject``s, e.g. ``*._extra_state``), which
  DCP's ``DefaultLoadPlanner.load_bytes`` reads with ``torch.load(weights_only=False)``: read with ``weights_only=True``;
* ``common.pt`` (optimizer groups, schedule, train state) and per-rank ``rng/*.pt``: read with ``weights_only=True``
  (:func:`weights_only_load`, passed to Megatron through :class:`align_pipeline.model.checkpoint` 's common strategy).

How it is wired: :func:`install` replaces the two torch methods above on their classes (``FileSystemReader`` — which
Megatron's ``CachedMetadataFileSystemReader`` extends — and ``DefaultLoadPlanner``, which Megatron's
``MCoreLoadPlanner`` extends). A class-level replacement covers every route to those files at once — Megatron's
``dist_checkpointing.load`` / ``load_sharded_metadata`` / ``load_tensors_metadata``, torch's ``dcp.load``, the HF
export's own reader — where a reader passed by argument would miss the routes Megatron builds internally
(``_get_filesystem_reader``). It is installed by importing :mod:`align_pipeline.model.checkpoint` (every entry point
that loads a checkpoint does, through :mod:`align_pipeline.model.init`) and before the HF export opens a checkpoint;
``install`` is idempotent and changes nothing else.

A refused pickle raises :class:`UnsafeCheckpoint` (a :class:`~align_pipeline.errors.UserError`) naming the file and
the refused global, before anything is built from it.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

from align_pipeline.errors import UserError

METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # Megatron's async saver keeps the save plans in the metadata (``all_local_plans``)
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch", "Size"),
    # torch's own single-process writer records the checkpoint's path (StorageMeta.checkpoint_id): a path object
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("torch.serialization", "_get_layout"),  # torch.strided & co, looked up by name among torch's layouts
})
"""(module, name) of every class torch's checkpoint metadata is built from, as recorded by :class:`MetadataUnpickler`
on the checkpoints this project writes (model and training checkpoints, TP=2, LoRA adapters)."""

TORCH_DTYPES: frozenset[str] = frozenset({
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2",
})
"""``torch.<dtype>`` a tensor's properties may name (a dtype is a value, not a callable)."""

class UnsafeCheckpoint(UserError, ValueError):
    """A checkpoint file holds a pickle that names something other than checkpoint data; it was not loaded."""


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`METADATA_GLOBALS` and torch's dtypes; anything else (``eval``,
    ``os.system``, any other class or function) raises before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (module == "torch" and name in TORCH_DTYPES):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {str(pid)[:60]!r}")


_REFUSED: list[UnsafeCheckpoint] = []
"""Refusals made inside :func:`refusals_unwrapped` blocks (this process), so that one torch wraps is found again."""


def _refused(message: str) -> UnsafeCheckpoint:
    exc = UnsafeCheckpoint(message)
    _REFUSED.append(exc)
    return exc


def refusal(path: str | os.PathLike, what: str, allowed: str = "torch checkpoint metadata classes") -> UnsafeCheckpoint:
    return _refused(f"checkpoint {path}: refused to unpickle {what} (only {allowed} may be loaded); a checkpoint from "
                    "elsewhere cannot run code")


def load_metadata(path: str | os.PathLike, stream: io.BufferedIOBase | None = None):
    """The DCP ``Metadata`` in the file ``path`` (or read from ``stream``, opened on it), through
    :class:`MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        if stream is None:
            with open(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
        else:
            metadata = MetadataUnpickler(stream).load()
    except _Refused as exc:
        raise refusal(path, exc.name) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise _refused(f"checkpoint {path}: not readable torch checkpoint metadata ({type(exc).__name__}: {exc})"
                       ) from None
    if not isinstance(metadata, Metadata):
        raise _refused(f"checkpoint {path}: holds a {type(metadata).__name__}, not torch checkpoint metadata")
    return metadata


_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|Unsupported class ([\w.]+)")


def weights_only_load(source: str | os.PathLike | io.BytesIO, path: str | os.PathLike | None = None) -> Any:
    """``torch.load(source, map_location="cpu", weights_only=True)``: tensors, containers and plain values only; a
    pickle naming anything else raises :class:`UnsafeCheckpoint` naming ``path`` (default: ``source``) and the
    refused global."""
    import torch

    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _UNSUPPORTED_GLOBAL.search(str(exc))
        what = next(g for g in found.groups() if g) if found else "a pickle torch's weights-only loader refused"
        raise refusal(path or source, what, "tensors and plain values") from None


def _read_metadata(self, *args: Any, **kwargs: Any):
    """``FileSystemReader.read_metadata`` through :class:`MetadataUnpickler` (torch's own body otherwise)."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as stream:
        metadata = load_metadata(path, stream)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    metadata.align_pipeline_source = str(self.path)  # names the checkpoint in a refusal of its BYTE_IO items
    return metadata


def _load_bytes(self, read_item, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` with ``weights_only=True`` (torch's own body otherwise)."""
    metadata = getattr(self, "metadata", None)
    where = getattr(metadata, "align_pipeline_source", "?")
    try:
        where = Path(where) / metadata.storage_data[read_item.storage_index].relative_path
    except (AttributeError, KeyError, TypeError):
        pass
    obj = weights_only_load(value, f"{where} (item {read_item.dest_index.fqn})")
    if self.flatten_state_dict:
        from torch.distributed.checkpoint._traverse import set_element

        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


@contextlib.contextmanager
def refusals_unwrapped():
    """Re-raise a refusal that torch DCP caught and replaced (its ``read_metadata`` failure becomes an
    ``AssertionError`` inside a ``CheckpointException``, without the original) as the :class:`UnsafeCheckpoint`
    itself: the first refusal this process made inside the block."""
    from torch.distributed.checkpoint.api import CheckpointException

    start = len(_REFUSED)
    try:
        yield
    except UnsafeCheckpoint:
        raise
    except (CheckpointException, Exception):
        if len(_REFUSED) > start:
            raise UnsafeCheckpoint(str(_REFUSED[start])) from None
        raise
    finally:
        del _REFUSED[start:]


_INSTALLED = False


def install() -> None:
    """Route torch DCP's metadata and ``BYTE_IO`` reads through the restricted loaders (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    FileSystemReader.read_metadata = _read_metadata
    DefaultLoadPlanner.load_bytes = _load_bytes
    _INSTALLED = True


__all__ = ["METADATA_GLOBALS", "TORCH_DTYPES", "MetadataUnpickler", "UnsafeCheckpoint", "install", "load_metadata",
           "refusals_unwrapped", "weights_only_load"]
