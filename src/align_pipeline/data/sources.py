"""Where raw records come from: a jsonl file, a parquet file, a directory written by ``datasets``'
``Dataset.save_to_disk``, or a table the Kedro catalog loaded (a pandas or polars DataFrame, a polars LazyFrame, a
``datasets.Dataset``). Each becomes rows for :func:`~.schemas.validate_rows`, which checks and normalizes them.

* jsonl: read as bytes, line by line (messages name ``line`` N);
* parquet: ``pyarrow.parquet.ParquetFile.iter_batches`` (batches of :data:`BATCH` rows; messages name ``row`` N,
  1-based);
* a ``save_to_disk`` directory: ``datasets.load_from_disk`` (memory-mapped Arrow files), batches of rows; a
  ``DatasetDict`` directory needs its split named (``split:`` in the catalog entry);
* a catalog table: its rows in order (pandas' numpy arrays and scalars turned back into lists and numbers, NaN into
  null).

The sha256 recorded with the data (``<kind>_source_sha256``) is the file's bytes, a directory's files (names and
bytes, sorted), or a table's rows as canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import DataValidationError, display_path, make_error
from .formats import Artifact
from .schemas import RawData, Row, jsonl_file_rows, validate_rows

BATCH = 1024
"""Rows read at a time from parquet files and datasets tables."""
FORMATS = ("jsonl", "parquet", "hf_dataset")


def storage_format(path: str | os.PathLike, declared: str = "auto") -> str:
    """``jsonl``, ``parquet`` or ``hf_dataset`` (a directory) for a raw path: ``declared`` unless ``auto``, else by the
    path (a directory, a ``.parquet``/``.pq`` suffix, otherwise jsonl)."""
    if declared != "auto":
        if declared not in FORMATS:
            raise DataValidationError(f"{display_path(path)}: format {declared!r} is not one of auto, "
                                      f"{', '.join(FORMATS)}")
        return declared
    path = Path(path)
    if path.is_dir():
        return "hf_dataset"
    return "parquet" if path.suffix.lower() in (".parquet", ".pq") else "jsonl"


def source_sha256(path: str | os.PathLike, fmt: str) -> str:
    """sha256 of a raw file's bytes, or of a directory's files (relative names and bytes, sorted)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():  # each file framed by its name and size: no two trees hash alike
            h.update(f"{f.relative_to(path).as_posix()}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def read_raw(data: Any, kind: str, layout: str = "auto", name: str | None = None) -> RawData:
    """Read and validate raw records of ``kind`` from what the catalog gave: an :class:`Artifact` of a raw file or
    directory (:class:`align_pipeline.datasets.RawDataset`), or a table (``name``: its catalog entry, for messages).
    The records are not held: each later pass reads the source again (:class:`~.schemas.StreamedRecords`)."""
    if isinstance(data, Artifact):
        return read_raw_path(data.path, kind, layout, source=data.meta.get("source"),
                             fmt=data.meta.get("format", "auto"), split=data.meta.get("split"))
    source = f"{name or 'raw ' + kind} ({type(data).__module__.split('.')[0]}.{type(data).__name__})"
    rows, digest = _hashed(_table_rows(data, source))
    raw = validate_rows(rows, RawData(kind=kind, source=source, sha256="", unit="row"), layout,
                        reread=lambda: _table_rows(data, source))
    raw.sha256 = digest.hexdigest()
    return raw


def read_raw_path(path: str | os.PathLike, kind: str, layout: str = "auto", source: str | None = None,
                  fmt: str = "auto", split: str | None = None) -> RawData:
    """Read and validate the raw file or ``save_to_disk`` directory at ``path``; every problem raises
    :class:`DataValidationError` naming it (and the line or row, and the field). Rows are read a line or a batch
    at a time, and again on each later pass: a file larger than memory is never held whole."""
    source = source or display_path(path)
    if not os.path.exists(path):
        raise make_error(source, None, None, "file not found")
    fmt = storage_format(path, fmt)
    if fmt == "jsonl":
        if os.path.isdir(path):
            raise make_error(source, None, None, "is a directory, not a jsonl file")
        rows, unit = (lambda: jsonl_file_rows(path, source)), "line"
    elif fmt == "parquet":
        rows, unit = (lambda: _parquet_rows(path, source)), "row"
    else:
        rows, unit = (lambda: _dataset_rows(path, source, split)), "row"
    return validate_rows(rows(), RawData(kind=kind, source=source, sha256=source_sha256(path, fmt), unit=unit),
                         layout, reread=rows)


def _parquet_rows(path: str | os.PathLike, source: str) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        # No pre-buffering (it reads every column chunk of the file ahead), buffered reads of a column chunk's pages:
        # memory stays at a batch of rows, whatever the file's size or row groups.
        table = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
    except (pa.ArrowException, OSError) as exc:
        raise make_error(source, None, None, f"not a readable parquet file ({exc})") from None
    number = 0
    for batch in table.iter_batches(batch_size=BATCH):
        for row in batch.to_pylist():
            number += 1
            yield number, row, False  # Arrow strings are valid UTF-8


def _dataset_rows(path: str | os.PathLike, source: str, split: str | None) -> Iterator[Row]:
    if not os.path.isdir(path):
        raise make_error(source, None, None, "expected a directory written by datasets' Dataset.save_to_disk")
    if not any(Path(path).iterdir()):
        raise make_error(source, None, None, "empty directory: expected one written by datasets' "
                                             "Dataset.save_to_disk (dataset_info.json, state.json, *.arrow)")
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise make_error(source, None, None, f"not a directory written by datasets' save_to_disk ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split is None or split not in loaded:
            raise make_error(source, None, None, f"holds the splits {', '.join(loaded)}: name one as `split:` in "
                                                 "the catalog entry" + (f" ({split!r} is not one)" if split else ""))
        loaded = loaded[split]
    elif split is not None:
        raise make_error(source, None, None, f"is one Dataset, not a DatasetDict: remove `split: {split}`")
    yield from _columns_rows(loaded.with_format(None).iter(batch_size=BATCH))  # Python objects, not numpy


def _columns_rows(batches) -> Iterator[Row]:
    number = 0
    for batch in batches:
        names = list(batch)
        for values in zip(*(batch[n] for n in names)):
            number += 1
            yield number, dict(zip(names, values)), False


def _table_rows(table: Any, source: str) -> Iterator[Row]:
    """Rows of a table object the catalog loaded."""
    module = type(table).__module__.split(".")[0]
    if module == "pandas":
        number = 0
        for start in range(0, len(table), BATCH):  # a batch of rows as dicts at a time
            for row in table.iloc[start : start + BATCH].to_dict("records"):
                number += 1
                yield number, {k: _plain(v) for k, v in row.items()}, True
    elif module == "polars":
        import polars as pl

        if isinstance(table, pl.LazyFrame):  # its batches, from polars' streaming engine (the plan runs once)
            number = 0
            chunks = (table.collect_batches(chunk_size=BATCH, maintain_order=True) if hasattr(table, "collect_batches")
                      else (table.slice(i, BATCH).collect() for i in range(0, table.select(pl.len()).collect().item(),
                                                                            BATCH)))  # polars before 1.32
            for chunk in chunks:
                for row in chunk.iter_rows(named=True):
                    number += 1
                    yield number, row, True
        else:
            for number, row in enumerate(table.iter_rows(named=True), start=1):
                yield number, row, True
    elif module == "datasets":
        yield from _columns_rows(table.with_format(None).iter(batch_size=BATCH))
    else:
        raise DataValidationError(f"{source}: raw data must be a jsonl/parquet file or save_to_disk directory "
                                  "(align_pipeline.datasets.RawDataset), or a pandas/polars DataFrame or "
                                  f"datasets.Dataset from the catalog; got {type(table).__name__}")


def _plain(value: Any) -> Any:
    """A pandas cell as JSON-like Python: numpy arrays -> lists, numpy scalars -> numbers, NaN -> None."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _hashed(rows: Iterator[Row]) -> tuple[Iterator[Row], Any]:
    """``rows`` passed through, each hashed as canonical JSON on the way (the digest is complete once they are
    consumed)."""
    digest = hashlib.sha256()

    def passing() -> Iterator[Row]:
        for row in rows:
            digest.update(json.dumps(row[1], sort_keys=True, ensure_ascii=False, default=str).encode() + b"\n")
            yield row

    return passing(), digest


__all__ = ["BATCH", "FORMATS", "read_raw", "read_raw_path", "source_sha256", "storage_format"]
