"""The manifest of a stored artifact version: every file's relative path, size and sha256, in ``manifest.json``.

The catalog writes it (:func:`write_manifest`) when it stores a version, after the directory is moved into its hidden
temp name and before the rename that makes the version visible, so every version stored since has one. Loading checks
the version against it (:func:`check_files`): every file present with its size always, its sha256 too when asked
(``verify: full``). The manifest is read as hostile input: a malformed one is a failed check, never a crash, and
no path in it may leave the artifact directory.

Files that are the same bytes as a file of an older version of the same artifact are stored once
(:func:`link_duplicates`: a hard link to the older file, after re-hashing it), so identical reruns cost no disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

MANIFEST_FILE = "manifest.json"
FORMAT = 1
VERIFY_LEVELS = ("sizes", "full")
"""``sizes``: every file present with the size the manifest gives (cheap: one stat per file); ``full``: and its
sha256 (reads every byte)."""
SHARD_SUFFIXES = (".distcp", ".safetensors", ".bin", ".pt", ".pth")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileEntry:
    """One file of a manifest."""

    size: int
    """Its size in bytes."""
    sha256: str
    """Its sha256 (hex)."""


def sha256_of(path: Path) -> str:
    """The sha256 (hex) of the file at ``path``, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(artifact: Path) -> list[str]:
    """Relative POSIX paths of the regular files under ``artifact`` (the manifest itself excluded), sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(artifact):
        dirnames.sort()
        for name in filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(artifact).as_posix()
            if rel != MANIFEST_FILE and full.is_file() and not full.is_symlink():
                found.append(rel)
    return sorted(found)


FileId = tuple[int, int, int, int]
"""(device, inode, size, mtime_ns) of a file: the same for a hard link of it, changed by any write to it."""


def _file_id(path: Path) -> FileId:
    stat = path.stat()
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def known_hashes(versions: list[Path]) -> dict[FileId, str]:
    """The sha256 of each file of ``versions`` by its :data:`FileId`, from their manifests (a file written since, or
    absent, is left out): a hard link to one of them need not be read again."""
    known: dict[FileId, str] = {}
    for version in versions:
        try:
            entries = read_manifest(version)
        except ManifestError:
            continue
        for rel, entry in entries.items():
            try:
                file_id = _file_id(version / rel)
            except OSError:
                continue
            if file_id[2] == entry.size:
                known[file_id] = entry.sha256
    return known


def build_manifest(artifact: Path, known: dict[FileId, str] | None = None) -> dict[str, FileEntry]:
    """Size and sha256 of every file under ``artifact`` (hashes every byte, except of a file that ``known`` has:
    a hard link to an older version's file, unchanged since its manifest was written)."""
    entries = {}
    for rel in _files(artifact):
        file_id = _file_id(artifact / rel)
        sha = (known or {}).get(file_id) or sha256_of(artifact / rel)
        entries[rel] = FileEntry(file_id[2], sha)
    return entries


def write_manifest(artifact: Path, known: dict[FileId, str] | None = None) -> dict[str, FileEntry]:
    """Write ``artifact/manifest.json`` (atomically: temp file + rename) and return its entries (``known``: see
    :func:`build_manifest`)."""
    files = build_manifest(artifact, known)
    body = {"format": FORMAT, "files": {rel: {"size": e.size, "sha256": e.sha256} for rel, e in files.items()}}
    tmp = artifact / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
    os.replace(tmp, artifact / MANIFEST_FILE)
    return files


class ManifestError(ValueError):
    """A manifest that is missing or cannot be trusted (the message says why, without the artifact's path)."""


def _safe_relpath(rel: Any) -> bool:
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        return False
    parts = PurePosixPath(rel).parts
    return not PurePosixPath(rel).is_absolute() and ".." not in parts and "." not in parts and rel == "/".join(parts)


def read_manifest(artifact: Path) -> dict[str, FileEntry]:
    """The entries of ``artifact/manifest.json``; ``ManifestError`` when it is absent or malformed."""
    path = artifact / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(f"missing {MANIFEST_FILE}")
    try:
        body = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ManifestError(f"{MANIFEST_FILE} is not JSON ({type(e).__name__})") from None
    files = body.get("files") if isinstance(body, dict) else None
    if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(files, dict) or not files:
        raise ManifestError(f"{MANIFEST_FILE} is not a format-{FORMAT} manifest with a non-empty 'files' table")
    entries = {}
    for rel, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        sha = entry.get("sha256") if isinstance(entry, dict) else None
        if (not _safe_relpath(rel) or not isinstance(size, int) or isinstance(size, bool) or size < 0
                or not isinstance(sha, str) or not _SHA256.fullmatch(sha)):
            raise ManifestError(f"{MANIFEST_FILE} has a malformed entry {str(rel)[:80]!r}")
        entries[rel] = FileEntry(size, sha)
    return entries


def _what(rel: str) -> str:
    return f"shard {rel}" if rel.endswith(SHARD_SUFFIXES) else f"file {rel}"


def check_files(artifact: Path, entries: dict[str, FileEntry], full: bool) -> str | None:
    """The first way ``artifact`` differs from its manifest ``entries`` (a missing file, a size, with ``full`` a
    sha256), or None when it matches. Files the manifest does not list are ignored."""
    for rel, entry in entries.items():
        path = artifact / rel
        if path.is_symlink() or not path.is_file():
            return f"{_what(rel)} is missing"
        size = path.stat().st_size
        if size != entry.size:
            return f"{_what(rel)} has {size} bytes, the manifest says {entry.size}"
    if full:
        for rel, entry in entries.items():
            if sha256_of(artifact / rel) != entry.sha256:
                return f"{_what(rel)} does not match its sha256 in the manifest (same size, different bytes)"
    return None


def link_duplicates(artifact: Path, entries: dict[str, FileEntry], older: list[Path]) -> int:
    """Replace each file of ``artifact`` whose bytes equal a file of an ``older`` version of the same artifact (by
    the manifests' size + sha256, confirmed by re-hashing the older file) with a hard link to that file; returns the
    bytes saved. Anything that prevents a link (another filesystem, a damaged older file) just keeps the copy."""
    by_hash: dict[tuple[int, str], Path] = {}
    for other in older:
        try:
            theirs = read_manifest(other)
        except ManifestError:
            continue
        for rel, entry in theirs.items():
            by_hash.setdefault((entry.size, entry.sha256), other / rel)
    saved = 0
    for rel, entry in entries.items():
        source = by_hash.get((entry.size, entry.sha256))
        if source is None or entry.size == 0 or rel == MANIFEST_FILE:
            continue
        target = artifact / rel
        try:
            if os.path.samefile(source, target) or sha256_of(source) != entry.sha256:
                continue
            tmp = target.with_name(f".{target.name}.link")
            os.link(source, tmp)
            os.replace(tmp, target)
            saved += entry.size
        except OSError:
            continue
    return saved


__all__ = [
    "MANIFEST_FILE",
    "VERIFY_LEVELS",
    "FileEntry",
    "ManifestError",
    "build_manifest",
    "check_files",
    "known_hashes",
    "link_duplicates",
    "read_manifest",
    "sha256_of",
    "write_manifest",
]
