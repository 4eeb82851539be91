"""The reference log-probs cache: ``<cache_dir>/<key>.npz`` per (reference version, preference data, tokenizer).

For each split (``train``, ``val``) the npz holds four per-pair arrays [N]: ``<split>_chosen_logps``,
``<split>_rejected_logps``, ``<split>_chosen_tokens``, ``<split>_rejected_tokens``. :func:`write_cache` (rank 0 of
:mod:`align_pipeline.train.reference_logps`) removes an old sidecar, writes the npz atomically (temp file + rename)
and then its sidecar ``<key>.npz.meta.json`` (the npz file's ``sha256`` and every array's dtype and shape): a cache
whose sidecar matches is complete. :func:`cache_problem` verifies a cache before it is reused: sidecar present, sha256
equal, and the file opens with the expected arrays (and, when given, as many pairs per split as the data). A cache
without a sidecar (written before sidecars existed, or killed between the npz and its sidecar) is read in full
(the zip's CRC-32 of each member checked), and adopted – its sidecar written – only if it has the expected arrays;
else it counts as corrupt. Nothing here imports Kedro or torch.
"""

from __future__ import annotations

import io
import json
import logging
import zipfile
from pathlib import Path

import numpy as np

from .formats import PathLike, atomic_write_bytes, atomic_write_json, bytes_sha256, file_sha256, sidecar_path

log = logging.getLogger(__name__)

FORMAT = "reference_logps"
FORMAT_VERSION = 1
FIELDS = ("chosen_logps", "rejected_logps", "chosen_tokens", "rejected_tokens")
"""The per-pair arrays of each split, stored as ``<split>_<field>``."""


def _describe(arrays: dict[str, np.ndarray]) -> dict[str, dict]:
    return {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in sorted(arrays.items())}


def write_cache(path: PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Write the npz atomically, then its sidecar (sha256 of the npz bytes + array shapes)."""
    path = Path(path)
    buf = io.BytesIO()
    np.savez(buf, **{k: np.ascontiguousarray(v) for k, v in arrays.items()})
    data = buf.getvalue()
    sidecar_path(path).unlink(missing_ok=True)  # an old sidecar never vouches for the new file
    atomic_write_bytes(path, data)
    atomic_write_json(sidecar_path(path), {"format": FORMAT, "format_version": FORMAT_VERSION,
                                           "sha256": bytes_sha256(data), "arrays": _describe(arrays)})


def _read_all(path: Path) -> dict[str, np.ndarray]:
    """Every array, read to its end (zipfile checks each member's CRC-32 there); no pickles."""
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _arrays_problem(arrays: dict[str, np.ndarray], splits: dict[str, int | None]) -> str | None:
    for split, n in splits.items():
        names = [f"{split}_{f}" for f in FIELDS]
        missing = [k for k in names if k not in arrays]
        if missing:
            return f"no array {missing[0]}"
        shapes = {tuple(arrays[k].shape) for k in names}
        want = {(n,)} if n is not None else {(len(arrays[names[0]]),)}
        if shapes != want:
            return (f"{split} arrays have shapes {sorted(shapes)}, expected "
                    f"{'[' + str(n) + ']' if n is not None else 'one 1-d length'}")
    return None


def cache_problem(path: PathLike, splits: dict[str, int | None], adopt: bool = True) -> str | None:
    """Why the cache at ``path`` must not be used (None: it is sound). ``splits``: split -> the pairs it must have
    (None: any). A missing file is reported as ``"missing"``; a cache without a sidecar that opens with the expected
    arrays gets its sidecar written when ``adopt`` (logged), else is reported as ``"no sidecar"``."""
    path = Path(path)
    if not path.is_file():
        return "missing"
    side = sidecar_path(path)
    if not side.is_file():
        try:
            arrays = _read_all(path)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            return f"no sidecar and it does not open: {type(e).__name__}: {e}"
        problem = _arrays_problem(arrays, splits)
        if problem:
            return f"no sidecar and {problem}"
        if not adopt:
            return "no sidecar"
        atomic_write_json(side, {"format": FORMAT, "format_version": FORMAT_VERSION, "sha256": file_sha256(path),
                                 "arrays": _describe(arrays), "adopted": True})
        log.info("reference log-probs cache %s had no sidecar (an older version wrote it): it opens with the expected "
                 "arrays, sidecar written", path)
        return None
    try:
        meta = json.loads(side.read_text())
        recorded = meta["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable sidecar {side.name}: {type(e).__name__}"
    if file_sha256(path) != recorded:
        return "sha256 mismatch"
    try:
        arrays = _read_all(path)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        return f"it does not open: {type(e).__name__}: {e}"
    return _arrays_problem(arrays, splits)


def npz_pairs(path: PathLike, array: str = "chosen_offsets") -> int:
    """The number of pairs of a tokenized preference npz, from one member's header alone (no data read): ragged
    files have ``chosen_offsets`` [N + 1]; the older padded layout ``chosen_input_ids`` [N, S]."""
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        for name, minus in ((array, 1), ("chosen_input_ids", 0)):
            if f"{name}.npy" in names:
                with zf.open(f"{name}.npy") as f:
                    major, _ = np.lib.format.read_magic(f)
                    read_header = (np.lib.format.read_array_header_1_0 if major == 1
                                   else np.lib.format.read_array_header_2_0)
                    shape, _, _ = read_header(f)
                return int(shape[0]) - minus
    raise ValueError(f"{path}: no chosen_offsets or chosen_input_ids array (not preference data)")


__all__ = ["FIELDS", "cache_problem", "npz_pairs", "write_cache"]
