"""Retention of stored artifact versions: ``keep_versions: N`` after a save, and ``align-pipeline gc``.

A version is ``<root>/<artifact>/<version>/<artifact>`` (a hidden ``.tmp-*`` / ``.gc-*`` directory is an interrupted
save or deletion, never a version). What may go:

* with a keep count N: the versions of an artifact beyond its newest N complete ones;
* with ``gc``: also the incomplete ones (no ``meta.json`` / ``config.json``, or failing their manifest's sizes) that a
  load refuses anyway.

What never goes: the newest complete version of an artifact, and any version that a *kept* artifact names, anywhere
in the JSON files of a stored version under the same data directory (``meta.json`` lineage: parent checkpoint, KL
reference, reward model, LoRA base; an HF export's ``align_pipeline_meta.json``; an evaluation report's policies;
``promoted_policy.json``) or in a file under ``conf/`` (an ``init_from`` path). Deciding is a fixpoint: a version
that only versions being removed name may go with them.

Byte-identical files are never stored twice: a save hard-links the files an older version already stores
(:func:`align_pipeline.datasets.manifest.link_duplicates`), and ``gc`` does the same for versions stored before that,
so N identical reruns cost one copy of the weights plus their small per-run files (``meta.json``,
``metrics.jsonl``, the checkpoint index ``.metadata``, which records a per-save id). Keeping whole duplicate
versions, rather than deleting the newer or the older one, keeps every version a lineage, an MLflow run tag
(``lineage.out.*``) or a registered model names.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align_pipeline.errors import UserError

from .manifest import ManifestError, check_files, link_duplicates, read_manifest

logger = logging.getLogger(__name__)
MARKERS = ("meta.json", "config.json")
"""A version directory holding one of these (checkpoint, HF export) and no manifest was stored before manifests."""
_MAX_JSON_BYTES = 16 << 20
_CONF_SUFFIXES = (".yml", ".yaml", ".json")


@dataclass(frozen=True)
class StoredVersion:
    """One version of an artifact under a root."""

    artifact: str
    """The artifact's directory name (its catalog name)."""
    version: str
    """The version (a Kedro timestamp)."""
    dir: Path
    """``<root>/<artifact>/<version>``: what removing it deletes."""

    @property
    def path(self) -> Path:
        """``<root>/<artifact>/<version>/<artifact>``: the artifact itself."""
        return self.dir / self.artifact

    @property
    def label(self) -> str:
        return f"{self.artifact}/{self.version}"


@dataclass(frozen=True)
class Decision:
    """What retention does with one version."""

    version: StoredVersion
    """The version."""
    remove: bool
    """True: it goes; False: it would go but something kept names it."""
    reason: str
    """Why (shown by ``gc``)."""
    size: int
    """Its files' apparent size in bytes."""


def stored_versions(root: Path, only: str | None = None) -> list[StoredVersion]:
    """Every version under ``root`` (newest first per artifact); ``only``: one artifact's."""
    found = []
    for art in sorted(root.iterdir()) if root.is_dir() else []:
        if art.name.startswith(".") or not art.is_dir() or (only is not None and art.name != only):
            continue
        for ver in sorted(art.iterdir(), reverse=True):
            if not ver.name.startswith(".") and ver.is_dir() and os.path.lexists(ver / art.name):
                found.append(StoredVersion(art.name, ver.name, ver))
    return found


def problem_of(v: StoredVersion) -> str | None:
    """Why a version cannot load (no marker, a manifest it fails on sizes), or None."""
    if not v.path.is_dir() or v.path.is_symlink():
        return "not a directory"
    try:
        entries = read_manifest(v.path)
    except ManifestError as e:
        if "missing" in str(e) and any((v.path / m).is_file() for m in MARKERS):
            return None  # stored before manifests
        return str(e) if "missing" not in str(e) else f"missing {' / '.join(MARKERS)} and manifest.json"
    if not any(m in entries for m in MARKERS):
        return f"its manifest lists no {' / '.join(MARKERS)}"
    return check_files(v.path, entries, full=False)


def _size(directory: Path) -> int:
    return sum(p.lstat().st_size for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


def _strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def _json_files(artifact: Path) -> list[Path]:
    if artifact.is_dir() and not artifact.is_symlink():
        return sorted(f for f in artifact.iterdir() if f.suffix == ".json" and f.is_file() and not f.is_symlink())
    return [artifact] if artifact.suffix == ".json" and artifact.is_file() else []


def _all_versions(data_dir: Path) -> Iterator[StoredVersion]:
    """Every stored version of every versioned artifact under ``data_dir/<layer>/``."""
    for layer in sorted(data_dir.iterdir()) if data_dir.is_dir() else []:
        if layer.is_dir() and not layer.name.startswith("."):
            yield from stored_versions(layer)


def _target(path: str, targets: dict[str, Path]) -> Path | None:
    """The target ``path`` lies in (as written, or with its symlinks resolved), if any."""
    for p in (path, os.path.realpath(path)):
        while p not in targets and p != os.path.dirname(p):
            p = os.path.dirname(p)
        if p in targets:
            return targets[p]
    return None


def references(roots: list[Path], candidates: list[StoredVersion]) -> dict[Path, set[str]]:
    """Who names each candidate: ``{candidate.dir: {referrer}}``; a referrer is a stored version's dir (str) or a
    conf file. Read: the JSON files of every version under the roots' data directories, files under ./conf."""
    targets: dict[str, Path] = {}
    for c in candidates:
        targets[os.path.normpath(os.path.abspath(c.dir))] = c.dir
        targets[os.path.realpath(c.dir)] = c.dir
    named: dict[Path, set[str]] = {c.dir: set() for c in candidates}
    data_dirs = sorted({root.resolve().parent for root in roots})
    cwd = os.getcwd()
    for data_dir in data_dirs:
        for v in _all_versions(data_dir):
            for f in _json_files(v.path):
                try:
                    if f.stat().st_size > _MAX_JSON_BYTES:
                        continue
                    body = json.loads(f.read_text())
                except (OSError, UnicodeDecodeError, ValueError):
                    continue
                for s in _strings(body):
                    if "/" not in s or len(s) > 4096 or "\0" in s:
                        continue
                    hit = _target(os.path.normpath(os.path.join(cwd, s)), targets)
                    if hit is not None and hit != v.dir:
                        named[hit].add(str(v.dir))
    conf = Path(cwd) / "conf"
    for f in sorted(conf.rglob("*")) if conf.is_dir() else []:
        if f.suffix in _CONF_SUFFIXES and f.is_file() and f.stat().st_size <= _MAX_JSON_BYTES:
            text = f.read_text(errors="replace")
            for c in candidates:
                if c.label in text:
                    named[c.dir].add(str(f.relative_to(cwd)))
    return named


def plan(roots: list[Path], keep: int | None, only: str | None = None, incomplete: bool = True,
         protect: str | None = None) -> list[Decision]:
    """What retention removes under ``roots`` (and what it keeps only because something names it): versions beyond
    the newest ``keep`` complete ones per artifact (None: no limit), with ``incomplete`` the incomplete ones;
    ``only``: one artifact; ``protect``: a version never removed (the one just saved)."""
    roots = [Path(root).resolve() for root in roots]
    reasons: dict[Path, tuple[StoredVersion, str]] = {}
    for root in roots:
        by_artifact: dict[str, list[StoredVersion]] = {}
        for v in stored_versions(root, only):
            by_artifact.setdefault(v.artifact, []).append(v)
        for versions in by_artifact.values():
            complete = 0
            for v in versions:  # newest first
                problem = problem_of(v)
                if problem is not None:
                    if incomplete and v.version != protect:
                        reasons[v.dir] = (v, f"incomplete ({problem})")
                    continue
                complete += 1
                if keep is not None and complete > keep and v.version != protect:
                    reasons[v.dir] = (v, f"beyond the newest {keep}")
    named = references(roots, [v for v, _ in reasons.values()])
    kept: dict[Path, str] = {}
    while True:  # a version named by anything that stays, stays
        going = set(reasons) - set(kept)
        newly = {d: who for d in going
                 if (who := sorted(r for r in named[d] if Path(r) not in going))}
        if not newly:
            break
        for d, who in newly.items():
            kept[d] = ", ".join(_referrer(r) for r in who[:3]) + (f" and {len(who) - 3} more" if len(who) > 3 else "")
    decisions = []
    for d, (v, reason) in reasons.items():
        if d in kept:
            decisions.append(Decision(v, False, f"{reason}, but named by {kept[d]}", _size(v.dir)))
        else:
            decisions.append(Decision(v, True, reason, _size(v.dir)))
    return decisions


def _referrer(r: str) -> str:
    p = Path(r)
    if p.is_absolute() and p.parent.parent.is_dir():
        return f"the lineage of {p.parent.name}/{p.name}"
    return r


def freed_bytes(decisions: list[Decision]) -> int:
    """Bytes removing the ``remove`` decisions frees (a hard-linked file counts once, and only when every link to it
    goes)."""
    inodes: dict[tuple[int, int], list[int]] = {}
    for d in decisions:
        if d.remove:
            for p in d.version.dir.rglob("*"):
                if p.is_file() and not p.is_symlink():
                    st = p.lstat()
                    entry = inodes.setdefault((st.st_dev, st.st_ino), [st.st_size, st.st_nlink, 0])
                    entry[2] += 1
    return sum(size for size, nlink, seen in inodes.values() if seen >= nlink)


def remove(v: StoredVersion) -> None:
    """Delete a version: renamed to a hidden ``.gc-<version>`` first (no longer a version), then removed."""
    hidden = v.dir.parent / f".gc-{v.version}"
    os.replace(v.dir, hidden)
    shutil.rmtree(hidden)


def share_duplicates(roots: list[Path], dry_run: bool) -> int:
    """Hard-link the files of each version that are the same bytes as an older version's (of the same artifact,
    by manifests); returns the bytes that are (or, ``dry_run``, would be) stored once."""
    total = 0
    for root in roots:
        by_artifact: dict[str, list[StoredVersion]] = {}
        for v in stored_versions(root):
            by_artifact.setdefault(v.artifact, []).append(v)
        for versions in by_artifact.values():
            oldest_first = [v for v in reversed(versions) if problem_of(v) is None]
            for i, v in enumerate(oldest_first):
                try:
                    entries = read_manifest(v.path)
                except ManifestError:
                    continue
                older = [o.path for o in reversed(oldest_first[:i])]
                if dry_run:
                    total += _shareable(v.path, entries, older)
                else:
                    total += link_duplicates(v.path, entries, older)
    return total


def _shareable(artifact: Path, entries: dict, older: list[Path]) -> int:
    known: dict[tuple[int, str], Path] = {}
    for o in older:
        try:
            for rel, e in read_manifest(o).items():
                known.setdefault((e.size, e.sha256), o / rel)
        except ManifestError:
            continue
    total = 0
    for rel, e in entries.items():
        source = known.get((e.size, e.sha256))
        try:
            if source is not None and e.size and not os.path.samefile(source, artifact / rel):
                total += e.size
        except OSError:
            continue
    return total


def apply_keep_versions(artifact_dir: Path, keep: int, protect: str) -> None:
    """After a save of ``protect`` into ``artifact_dir``: remove the versions beyond the newest ``keep`` that nothing
    kept names (logged); incomplete ones stay for the user (a load names them). A failure to remove is a warning."""
    for d in plan([artifact_dir.parent], keep, only=artifact_dir.name, incomplete=False, protect=protect):
        if not d.remove:
            logger.info("%s: kept version %s (%s)", d.version.artifact, d.version.version, d.reason)
            continue
        try:
            remove(d.version)
            logger.info("%s: removed version %s (%s; keep_versions: %d; %.1f MiB)", d.version.artifact,
                        d.version.version, d.reason, keep, d.size / 2**20)
        except OSError as e:
            logger.warning("%s: could not remove version %s (%s): %s", d.version.artifact, d.version.version,
                           d.reason, e)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def gc_command(argv: list[str]) -> int:
    """``align-pipeline gc [--dry-run] [--keep N] [root=data/06_models ...]``: show (``--dry-run``) or free the
    versions retention removes, with sizes and reasons; exit 2 with one line on a bad argument."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="align-pipeline gc",
        description="Remove stored artifact versions: incomplete ones, and with --keep N those beyond the newest N "
                    "of each artifact, never one that a kept artifact's lineage or a conf file names; files identical "
                    "to an older version's are stored once (hard links). Run from the project directory.")
    parser.add_argument("roots", nargs="*", metavar="root=PATH",
                        help="directories of versioned artifacts (default: root=data/06_models)")
    parser.add_argument("--keep", type=int, default=None, metavar="N",
                        help="keep the newest N complete versions of each artifact (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="show what would go; delete nothing")
    args = parser.parse_args(argv)
    try:
        roots = [Path(r.removeprefix("root=")) for r in args.roots or ["root=data/06_models"]]
        for root in roots:
            if not root.is_dir():
                raise UserError(f"root={root}: not a directory (run from the project directory, or name the "
                                f"directory of versioned artifacts)")
        if args.keep is not None and args.keep < 1:
            raise UserError(f"--keep {args.keep}: keep at least 1 version (omit --keep to keep all)")
        decisions = plan(roots, args.keep)
    except UserError as exc:
        print(f"align-pipeline gc: {exc}", file=sys.stderr)
        return 2
    for d in decisions:
        print(f"{'remove' if d.remove else 'keep  '} {d.version.label:<48} {_mib(d.size):>12}  {d.reason}")
    gone = [d for d in decisions if d.remove]
    freed = freed_bytes(gone)
    if not args.dry_run:
        for d in gone:
            remove(d.version)
    shared = share_duplicates(roots, args.dry_run)
    if args.dry_run:
        print(f"dry run: would free {_mib(freed)} ({len(gone)} version{'s' * (len(gone) != 1)}) and store "
              f"{_mib(shared)} of identical files once; nothing deleted")
    else:
        print(f"freed {_mib(freed)} ({len(gone)} version{'s' * (len(gone) != 1)}); {_mib(shared)} of identical "
              f"files now stored once")
    return 0


__all__ = ["Decision", "StoredVersion", "apply_keep_versions", "freed_bytes", "gc_command", "plan", "problem_of",
           "references", "remove", "share_duplicates", "stored_versions"]
