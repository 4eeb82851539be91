"""Tokenized sequences on disk: ragged arrays, memory-mapped by every rank, padded (or packed) only per batch.

A tokenized ``.npz`` holds each group of sequences (prefix ``""`` for SFT / regression data, ``chosen_`` and
``rejected_`` for preference pairs) as three ragged arrays, with no padding::

    {p}tokens    int32 [T]      every sample's tokens, one after another
    {p}response  uint8 [T]      1 where the token is a response token (unshifted: the token itself)
    {p}offsets   int64 [N + 1]  sample i is tokens[offsets[i]:offsets[i + 1]]

plus per-sample arrays (``chosen_reward`` [N], ``reward_labels`` [N, A]). :func:`load_sequences` maps the file
(``np.savez`` stores members uncompressed, so each is an ``np.memmap`` at its offset in the zip): a multi-GB set
costs each rank only the pages it touches, shared through the page cache. It returns a dict whose
``{p}input_ids`` / ``{p}labels`` / ``{p}loss_mask`` are *views*: indexing one with sample indices builds those rows
right-padded to ``seq_length``, exactly the arrays the padded layout stored (labels shifted, loss mask on response
labels). Files in the older padded layout load as they are.

    arrays = load_sequences("data/05_model_input/sft_train.npz")
    arrays["input_ids"][np.array([3, 7])]          # [2, seq_length] int64, padded with pad_id
    arrays.lengths("")                              # [N] tokens per sample (for packing)
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from array import array
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

PADDED_KEYS = ("input_ids", "labels", "loss_mask")
RAGGED_KEYS = ("tokens", "response", "offsets")


# ---------------------------------------------------------------------------------------------------------------
# Writing: samples -> ragged arrays; selecting samples
# ---------------------------------------------------------------------------------------------------------------


SPILL_BUFFER = 1 << 22
"""Bytes a spill file buffers before it writes them out."""
CHUNK_BYTES = 1 << 24
"""Bytes per chunk when a spilled array is read back (written into an ``.npz``, hashed)."""


class SpillFile:
    """An anonymous temporary file (in ``TMPDIR``; gone once closed or collected) that a builder appends to and
    readers read at byte offsets: what data_prep has tokenized stays on disk, not in memory, until it is written
    into its artifact. Set ``TMPDIR`` to a disk (not a RAM-backed tmpfs) for multi-GB data."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="align-pipeline-data-")  # noqa: SIM115 — closed when collected
        self._buffer = bytearray()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._buffer += data
        self.size += len(data)
        if len(self._buffer) >= SPILL_BUFFER:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            self._file.write(self._buffer)
            self._file.flush()
            self._buffer.clear()

    def read(self, start: int, n: int) -> bytes:
        self.flush()
        out = os.pread(self._file.fileno(), n, start)
        if len(out) != n:
            raise OSError(f"spill file {self._file.name}: read {len(out)} of {n} bytes at {start}")
        return out


class LazyArray:
    """A 1-D array not held in memory: ``dtype``, ``shape`` and :meth:`chunks` (what :func:`.formats.save_npz` and
    :func:`.formats.arrays_fingerprint` stream); ``np.asarray`` reads it whole (tests, small data)."""

    dtype: np.dtype
    shape: tuple[int]
    ndim = 1

    def chunks(self) -> Iterator[np.ndarray]:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        parts = list(self.chunks())
        out = np.concatenate(parts) if parts else np.empty(0, self.dtype)
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, key):
        return np.asarray(self)[key]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype}, shape={self.shape})"


class DiskArray(LazyArray):
    """``n`` items of ``dtype`` at the start of a :class:`SpillFile`."""

    def __init__(self, spill: SpillFile, dtype: Any, n: int):
        self.spill, self.dtype, self.shape = spill, np.dtype(dtype), (int(n),)

    def read(self, start: int, stop: int) -> np.ndarray:
        size = self.dtype.itemsize
        return np.frombuffer(self.spill.read(start * size, (stop - start) * size), dtype=self.dtype)

    def chunks(self) -> Iterator[np.ndarray]:
        step = max(CHUNK_BYTES // self.dtype.itemsize, 1)
        for a in range(0, self.shape[0], step):
            yield self.read(a, min(a + step, self.shape[0]))

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(self.shape[0])
            return self.read(start, max(start, stop))
        return super().__getitem__(key)


class TakenArray(LazyArray):
    """The items ``[starts[i], ends[i])`` of a :class:`DiskArray`, one range after another (a ragged group's
    selected samples): contiguous ranges are read together, a chunk at a time."""

    def __init__(self, source: DiskArray, starts: np.ndarray, ends: np.ndarray):
        self.source, self.starts, self.ends = source, starts, ends
        self.dtype, self.shape = source.dtype, (int((ends - starts).sum()),)

    def _runs(self) -> Iterator[tuple[int, int]]:
        limit = max(CHUNK_BYTES // self.dtype.itemsize, 1)
        run_start = run_end = None
        for s, e in zip(self.starts.tolist(), self.ends.tolist()):
            if run_start is not None and s == run_end and e - run_start <= limit:
                run_end = e
                continue
            if run_start is not None:
                yield run_start, run_end
            run_start, run_end = s, e
        if run_start is not None:
            yield run_start, run_end

    def chunks(self) -> Iterator[np.ndarray]:
        for s, e in self._runs():
            if e > s:
                yield self.source.read(s, e)


class RaggedBuilder:
    """Samples appended one at a time, their tokens (int32) and response flags (uint8) written to spill files
    (:class:`SpillFile`); only the offsets (8 bytes a sample) stay in memory. :meth:`arrays` gives the ragged
    arrays, the two long ones as :class:`DiskArray`."""

    def __init__(self) -> None:
        self.tokens, self.response, self.offsets = SpillFile(), SpillFile(), array("q", [0])
        self.longest = 0

    def append(self, sample: tuple[Any, Any]) -> None:
        ids, is_response = sample
        self.tokens.write(np.asarray(ids, dtype=np.int32).tobytes())
        self.response.write(np.asarray(is_response, dtype=np.uint8).tobytes())
        self.offsets.append(self.offsets[-1] + len(ids))
        self.longest = max(self.longest, len(ids))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def arrays(self, prefix: str = "") -> dict[str, Any]:
        """``{p}tokens``, ``{p}response`` (on disk), ``{p}offsets``."""
        n = self.offsets[-1]
        return {f"{prefix}tokens": DiskArray(self.tokens, np.int32, n),
                f"{prefix}response": DiskArray(self.response, np.uint8, n),
                f"{prefix}offsets": np.frombuffer(self.offsets, dtype=np.int64)}


class SpilledRecords:
    """Records appended one at a time as canonical JSON lines (keys sorted, the bytes a ``.jsonl`` artifact holds)
    in a :class:`SpillFile`; only line offsets stay in memory. A read-only sequence: ``len``, iteration, ``[i]``,
    :meth:`take` (a selection in a given order) and :meth:`jsonl_lines` (the bytes, for writing)."""

    def __init__(self, spill: SpillFile | None = None, starts: np.ndarray | None = None,
                 ends: np.ndarray | None = None):
        self._spill = spill or SpillFile()
        self._offsets = array("q", [0]) if starts is None else None
        self._starts, self._ends = starts, ends

    def append(self, record: dict[str, Any]) -> None:
        assert self._offsets is not None, "a selection is read-only"
        line = (json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n").encode()
        self._spill.write(line)
        self._offsets.append(self._offsets[-1] + len(line))

    def _bounds(self) -> tuple[np.ndarray, np.ndarray]:
        if self._offsets is not None:
            offsets = np.frombuffer(self._offsets, dtype=np.int64)
            return offsets[:-1], offsets[1:]
        return self._starts, self._ends

    def __len__(self) -> int:
        return len(self._bounds()[0])

    def take(self, idx: Iterable[int]) -> SpilledRecords:
        starts, ends = self._bounds()
        idx = np.asarray(list(idx) if not isinstance(idx, np.ndarray) else idx, dtype=np.int64)
        return SpilledRecords(self._spill, starts[idx], ends[idx])

    def jsonl_lines(self) -> Iterator[bytes]:
        for s, e in zip(*(b.tolist() for b in self._bounds())):
            yield self._spill.read(s, e - s)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (json.loads(line) for line in self.jsonl_lines())

    def __getitem__(self, key):
        if isinstance(key, slice):
            return [self[i] for i in range(*key.indices(len(self)))]
        starts, ends = self._bounds()
        s, e = int(starts[key]), int(ends[key])
        return json.loads(self._spill.read(s, e - s))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (list, SpilledRecords)) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SpilledRecords({len(self)} records)"


def ragged(samples: list[tuple[Any, Any]], prefix: str = "") -> dict[str, np.ndarray]:
    """``[(ids, is_response), ...]`` -> ``{p}tokens``, ``{p}response``, ``{p}offsets``."""
    lengths = np.array([len(ids) for ids, _ in samples], dtype=np.int64)
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.zeros(int(offsets[-1]), dtype=np.int32)
    response = np.zeros(int(offsets[-1]), dtype=np.uint8)
    for (ids, resp), start, end in zip(samples, offsets[:-1], offsets[1:]):
        tokens[start:end] = ids
        response[start:end] = resp
    return {f"{prefix}tokens": tokens, f"{prefix}response": response, f"{prefix}offsets": offsets}


def groups(arrays: Mapping[str, Any]) -> list[str]:
    """The prefixes of the ragged groups in ``arrays`` (``""``, ``chosen_``, ``rejected_``)."""
    return sorted(k[: -len("offsets")] for k in arrays if k.endswith("offsets") and f"{k[:-7]}tokens" in arrays)


def select(arrays: Mapping[str, np.ndarray], idx: Iterable[int]) -> dict[str, np.ndarray]:
    """The samples ``idx`` (in that order) of ragged + per-sample arrays, as new ragged + per-sample arrays."""
    idx = np.asarray(list(idx), dtype=np.int64)
    out: dict[str, np.ndarray] = {}
    ragged_keys = set()
    for p in groups(arrays):
        offsets = np.asarray(arrays[f"{p}offsets"])
        starts, ends = offsets[idx], offsets[idx + 1]
        new_offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(ends - starts, out=new_offsets[1:])
        for name in ("tokens", "response"):  # sample by sample: no index array of every token
            if isinstance(arrays[f"{p}{name}"], DiskArray):  # spilled: selected lazily, read when written
                out[f"{p}{name}"] = TakenArray(arrays[f"{p}{name}"], starts, ends)
                continue
            source = np.asarray(arrays[f"{p}{name}"])
            target = np.empty(int(new_offsets[-1]), dtype=source.dtype)
            for s, e, at in zip(starts.tolist(), ends.tolist(), new_offsets[:-1].tolist()):
                target[at : at + e - s] = source[s:e]
            out[f"{p}{name}"] = target
        out[f"{p}offsets"] = new_offsets
        ragged_keys |= {f"{p}{k}" for k in RAGGED_KEYS}
    for k, v in arrays.items():
        if k not in ragged_keys:
            out[k] = np.asarray(v)[idx]
    return out


def num_samples(arrays: Mapping[str, Any]) -> int:
    for p in groups(arrays):
        return len(arrays[f"{p}offsets"]) - 1
    return len(next(iter(arrays.values())))


# ---------------------------------------------------------------------------------------------------------------
# Reading: padded views over ragged groups
# ---------------------------------------------------------------------------------------------------------------


class Rows:
    """One ragged group, padded on demand: :meth:`take` gives ``input_ids``/``labels``/``loss_mask`` [k, S]."""

    def __init__(self, tokens: np.ndarray, response: np.ndarray, offsets: np.ndarray, seq_length: int, pad_id: int):
        self.tokens, self.response, self.offsets = tokens, response, np.asarray(offsets)
        self.seq_length, self.pad_id = int(seq_length), int(pad_id)
        self._last: tuple[bytes, dict[str, np.ndarray]] | None = None  # the three views ask for the same rows

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """[N] tokens per sample."""
        return np.diff(self.offsets)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, response) of sample ``i``."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return np.asarray(self.tokens[a:b], dtype=np.int64), np.asarray(self.response[a:b])

    def take(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        idx = np.asarray(idx, dtype=np.int64)
        key = idx.tobytes()
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        n, S = len(idx), self.seq_length
        input_ids = np.full((n, S), self.pad_id, dtype=np.int64)  # [k, S]
        labels = np.full((n, S), self.pad_id, dtype=np.int64)  # [k, S]
        loss_mask = np.zeros((n, S), dtype=np.float32)  # [k, S]
        for row, i in enumerate(idx):
            ids, resp = self.sample(int(i))
            L = len(ids)
            if L > S:
                raise ValueError(f"sample {i} has {L} tokens > seq_length {S}")
            input_ids[row, :L] = ids
            labels[row, : L - 1] = ids[1:]
            loss_mask[row, : L - 1] = resp[1:]
        out = {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask}
        self._last = (key, out)
        return out


class RowView:
    """``input_ids``, ``labels`` or ``loss_mask`` of a :class:`Rows`: ``view[idx]`` -> [len(idx), S]."""

    def __init__(self, rows: Rows, key: str):
        self.rows, self.key = rows, key

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows), self.rows.seq_length

    def __getitem__(self, idx) -> np.ndarray:
        if isinstance(idx, slice):
            idx = np.arange(len(self.rows))[idx]
        return self.rows.take(np.atleast_1d(idx))[self.key]

    def __array__(self, dtype=None, copy=None):
        out = self[np.arange(len(self.rows))]
        return out if dtype is None else out.astype(dtype)


class SequenceArrays(dict):
    """A tokenized file's arrays: per-sample arrays as they are, every ragged group as padded views
    (``{p}input_ids``, ``{p}labels``, ``{p}loss_mask``); :attr:`rows` holds the groups (for packing)."""

    def __init__(self, arrays: Mapping[str, np.ndarray], seq_length: int | None, pad_id: int | None):
        super().__init__()
        self.rows: dict[str, Rows] = {}
        ragged_keys = set()
        for p in groups(arrays):
            if seq_length is None or pad_id is None:
                raise ValueError("ragged sequences need seq_length and pad_id (the file's sidecar has them)")
            rows = Rows(arrays[f"{p}tokens"], arrays[f"{p}response"], arrays[f"{p}offsets"], seq_length, pad_id)
            self.rows[p] = rows
            for k in PADDED_KEYS:
                self[f"{p}{k}"] = RowView(rows, k)
            ragged_keys |= {f"{p}{k}" for k in RAGGED_KEYS}
        for k, v in arrays.items():
            if k not in ragged_keys:
                self[k] = v

    def lengths(self, prefix: str = "") -> np.ndarray:
        """[N] tokens per sample of group ``prefix``."""
        return self.rows[prefix].lengths


def as_rows(arrays: Mapping[str, np.ndarray], seq_length: int, pad_id: int) -> dict[str, np.ndarray]:
    """Every sample padded (what the padded layout stored): ``{p}input_ids``/``labels``/``loss_mask`` [N, S] plus the
    per-sample arrays. For tests and small data; training takes rows per batch."""
    view = SequenceArrays(arrays, seq_length, pad_id)
    return {k: np.asarray(v) for k, v in view.items()}


def load_rows(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every sample of a tokenized ``.npz`` padded to its seq_length (:func:`as_rows`), per-sample arrays as read."""
    return {k: np.asarray(v) for k, v in load_sequences(path).items()}


def mmap_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of an uncompressed ``.npz`` as a read-only ``np.memmap`` (compressed members are read)."""
    out: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            name = info.filename.removesuffix(".npy")
            if info.compress_type != zipfile.ZIP_STORED:
                with z.open(info) as member:
                    out[name] = np.lib.format.read_array(member, allow_pickle=False)
                continue
            f.seek(info.header_offset)
            local = f.read(30)  # the local file header: its name and extra field lengths are at bytes 26..29
            start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(
                local[28:30], "little")
            f.seek(start)
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read_header:
                raise ValueError(f"{path}: {name} is in .npy format {version}; rewrite it with numpy's np.savez")
            shape, fortran, dtype = read_header[version](f)
            if dtype.hasobject:
                raise ValueError(f"{path}: {name} holds Python objects")
            count = int(np.prod(shape))
            out[name] = (np.memmap(path, dtype=dtype, mode="r", offset=f.tell(), shape=shape,
                                   order="F" if fortran else "C") if count else np.zeros(shape, dtype))
    return out


def load_sequences(path: str | os.PathLike) -> SequenceArrays:
    """The arrays of a tokenized ``.npz``, memory-mapped, ragged groups as padded views (see the module doc)."""
    from .formats import read_meta

    meta = read_meta(path) if os.path.exists(f"{os.fspath(path)}.meta.json") else {}
    return SequenceArrays(mmap_npz(path), meta.get("seq_length"), meta.get("pad_id"))


__all__ = ["DiskArray", "LazyArray", "RaggedBuilder", "Rows", "SequenceArrays", "SpillFile", "SpilledRecords",
           "TakenArray", "as_rows", "groups", "load_rows", "load_sequences", "mmap_npz", "num_samples", "ragged",
           "select"]
