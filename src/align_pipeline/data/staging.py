"""All-or-nothing writes of several artifacts at fixed paths (``data_prep``'s tokenizer and arrays). No Kedro here.

A :class:`StagedWrites` collects the writes of one set. :meth:`~StagedWrites.stage` writes an artifact completely
to hidden siblings of its final paths (``.<name>.<id>.staged``, same directory, so same filesystem) and nothing a
reader sees changes; a write that fails removes every staged write of the set and raises
:class:`OutputsNotWritten`. :meth:`~StagedWrites.commit` then puts the set in place by renames: each existing final
path is renamed to ``.<name>.<id>.old``, the staged one renamed into its place; if a rename fails, every path
already replaced is restored from its backup, the staged files are removed and :class:`OutputsNotWritten` says the
previous outputs are unchanged. The backups are deleted after the last rename.

Leftovers: a process killed while staging or committing (SIGKILL, OOM killer, power loss) leaves
``.<name>.<id>.staged`` writes, the temp files of writes into them (``..<name>.<id>.staged.<random>.tmp``) and,
mid-commit, ``.<name>.<id>.old`` backups. Every such name carries its writer's id ``<pid>-<random>``
(:func:`new_write_id`), so a later write can tell whether the writer is gone: its pid no longer runs, or it is this
process's pid but not one of this process's ids (a restarted container reuses pids). Those of a gone writer are
removed: staged writes and temp files when the same path is staged again; backups only after the next commit of that
path has put a new version in place (mid-commit, a backup may be the only copy of the previous version). A live
writer's files are never touched (data_prep takes no lock: two runs at once each keep their own).

Rename order: artifacts in the order they were staged, each data file before its sidecar, entries staged with
``last=True`` (the tokenizer directory) after all others. Only a crash (SIGKILL, power loss) between two renames of
:meth:`~StagedWrites.commit` can leave a mixed set behind; stages refuse one whose tokenizer differs with
:func:`align_pipeline.data.formats.check_tokenized_with`.

Kedro side: datasets with a ``commit_group`` stage into the set :func:`open_group` registered for that group; the
hook :class:`align_pipeline.kedro.staged_outputs.StagedOutputsHook` opens it when the node producing them returns and
commits it once Kedro has saved the last of them::

    staging = StagedWrites("data_prep outputs")
    staged = staging.staged_path(final)
    staging.stage([(staged, final)], lambda: staged.write_bytes(blob))
    staging.commit()  # or staging.abort()
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from align_pipeline.errors import UserError

logger = logging.getLogger(__name__)

STAGED_SUFFIX = ".staged"
BACKUP_SUFFIX = ".old"


_OWN_IDS: set[str] = set()
"""Writer ids this process has handed out: its temp, staged and backup names are never leftovers of a gone writer."""


def new_write_id() -> str:
    """A writer id ``<pid>-<8 hex>`` for the temp/staged/backup names of one write (see the module docstring)."""
    ident = f"{os.getpid()}-{secrets.token_hex(4)}"
    _OWN_IDS.add(ident)
    return ident


class OutputsNotWritten(UserError, OSError):
    """A set of outputs could not be written or put in place; the previous set is unchanged."""


@dataclass
class _Entry:
    staged: Path
    final: Path
    last: bool


def _why(exc: BaseException) -> str:
    """``Read-only file system`` for an OSError (its paths are temp names), else ``Type: message``."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}"


def _display(path: Path) -> str:
    rel = os.path.relpath(os.path.abspath(path))
    return str(path) if rel.startswith("..") else rel


def _remove(path: Path) -> None:
    """Delete a file, link or directory tree; a missing path is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


class StagedWrites:
    """One set of writes that lands completely or not at all; see the module docstring."""

    def __init__(self, label: str):
        self.label = label
        """How messages name the set, e.g. ``"data_prep outputs"``."""
        self.id = new_write_id()
        self.state = "open"
        """``open`` -> ``committed`` | ``aborted``."""
        self._entries: list[_Entry] = []
        self._failure: str | None = None  # the message of the write that aborted the set
        self._lock = threading.Lock()  # Kedro's async saving stages from several threads

    def staged_path(self, final: str | os.PathLike) -> Path:
        """The hidden sibling a write of ``final`` goes to: ``<dir>/.<name>.<id>.staged``."""
        final = Path(final)
        return final.parent / f".{final.name}.{self.id}{STAGED_SUFFIX}"

    def stage(self, pairs: Sequence[tuple[Path, Path]], write: Callable[[], object], last: bool = False) -> None:
        """Run ``write()``, which writes every ``staged`` path of ``pairs`` (``(staged, final)``, a file or a
        directory each) completely. On failure the whole set is aborted and :class:`OutputsNotWritten` raised."""
        pairs = [(Path(s), Path(f)) for s, f in pairs]
        with self._lock:
            if self.state != "open":
                raise OutputsNotWritten(self._why_closed())
            self._entries += [_Entry(s, f, last) for s, f in pairs]
        try:
            for _, final in pairs:
                final.parent.mkdir(parents=True, exist_ok=True)
                remove_leftovers(final, backups=False)
            write()
            missing = [s for s, _ in pairs if not _exists(s)]
            if missing:
                raise FileNotFoundError(f"the write did not produce {_display(missing[0])}")
        except Exception as exc:
            with self._lock:
                first = self.state == "open"  # else another thread's write failed first: report that one
                if first:
                    self._failure = (
                        f"{_display(pairs[0][1])}: cannot write ({_why(exc)}); nothing of the {self.label} was "
                        "written – the previous ones are unchanged"
                    )
            self.abort()
            for staged, _ in pairs:  # a set aborted by another thread mid-write: what this write left after that
                with contextlib.suppress(OSError):
                    _remove(staged)
            raise OutputsNotWritten(self._why_closed()) from exc
        with self._lock:
            closed = self.state != "open"  # aborted meanwhile by a write that failed in another thread
        if closed:
            for staged, _ in pairs:
                with contextlib.suppress(OSError):
                    _remove(staged)
            raise OutputsNotWritten(self._why_closed())

    def _why_closed(self) -> str:
        return self._failure or f"{self.label}: the set was already {self.state}; nothing more is written"

    def commit(self) -> None:
        """Rename every staged write into place (see the module docstring); on failure restore the previous set."""
        with self._lock:
            if self.state != "open":
                raise OutputsNotWritten(f"{self.label}: cannot commit a set that was {self.state}")
            self.state = "committing"
            order = [e for e in self._entries if not e.last] + [e for e in self._entries if e.last]
        done: list[tuple[_Entry, Path | None]] = []
        for entry in order:
            try:
                backup = None
                if _exists(entry.final):
                    backup = entry.final.parent / f".{entry.final.name}.{self.id}{BACKUP_SUFFIX}"
                    os.replace(entry.final, backup)
                done.append((entry, backup))
                os.replace(entry.staged, entry.final)
            except OSError as exc:
                problems = self._rollback(done)
                self._remove_staged()
                self.state = "aborted"
                restored = (
                    "the previous ones were restored, nothing was changed"
                    if not problems
                    else "restoring the previous ones failed too: " + "; ".join(problems)
                )
                raise OutputsNotWritten(
                    f"{_display(entry.final)}: cannot put the new version in place ({_why(exc)}); "
                    f"{self.label}: {restored}"
                ) from exc
        for _, backup in done:
            if backup is not None:
                with contextlib.suppress(OSError):
                    _remove(backup)
        for entry in order:  # the new version is in place: what killed writers left of it is no use any more
            remove_leftovers(entry.final, backups=True)
        for directory in {e.final.parent for e in order}:
            _fsync_dir(directory)
        self.state = "committed"

    def abort(self) -> None:
        """Remove every staged write; the final paths are untouched. Idempotent; a committed set stays."""
        with self._lock:
            if self.state in ("committed", "aborted"):
                return
            self.state = "aborted"
        self._remove_staged()

    def _remove_staged(self) -> None:
        for entry in self._entries:
            with contextlib.suppress(OSError):
                _remove(entry.staged)

    @staticmethod
    def _rollback(done: list[tuple[_Entry, Path | None]]) -> list[str]:
        """Undo the renames of ``done`` (newest first); returns what could not be undone."""
        problems = []
        for entry, backup in reversed(done):
            try:
                if not _exists(entry.staged):  # the new version is in place: take it out again
                    _remove(entry.final)
                if backup is not None:
                    os.replace(backup, entry.final)
            except OSError as exc:
                problems.append(f"{_display(entry.final)} (previous version kept as {_display(backup)}: {exc})")
        return problems


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists
        return True
    return True


def leftover_writer(name: str, final_name: str) -> tuple[str, str] | None:
    """``(writer id, kind)`` when ``name`` is a temp/staged/backup name of ``final_name`` (kind ``staged``, ``tmp``
    or ``old``), else None:

    * ``.<final>.<id>.staged`` (and its sidecar ``.<final>.<id>.staged.meta.json``): a staged write;
    * ``..<final>.<id>.staged<...>.tmp``: the temp file or directory of an atomic write into a staged path;
    * ``.<final>.<id>.tmp``: the temp directory of a tokenizer written in place;
    * ``.<final>.<id>.old``: a backup of the previous version, mid-commit or mid-replace.
    """
    for lead in (f".{final_name}.", f"..{final_name}."):
        if not name.startswith(lead):
            continue
        ident, _, rest = name[len(lead) :].partition(".")
        pid, dash, token = ident.partition("-")
        if not (pid.isdigit() and dash and token):
            continue
        tail = "." + rest
        if lead == f"..{final_name}.":
            if tail.startswith(STAGED_SUFFIX) and tail.endswith(".tmp"):
                return ident, "tmp"
        elif tail == STAGED_SUFFIX or tail.startswith(STAGED_SUFFIX + "."):
            return ident, "staged"
        elif tail in (BACKUP_SUFFIX, ".tmp"):
            return ident, "old" if tail == BACKUP_SUFFIX else "tmp"
    return None


def _writer_gone(ident: str) -> bool:
    """Whether the writer ``<pid>-<random>`` cannot be running: its pid is gone, or it is this process's pid but an
    id this process never handed out (an earlier process with the same pid)."""
    pid = int(ident.split("-", 1)[0])
    if pid == os.getpid():
        return ident not in _OWN_IDS
    return not _pid_alive(pid)


def remove_leftovers(final: str | os.PathLike, backups: bool) -> list[Path]:
    """Remove what writers that are gone (killed while staging, committing or replacing) left of ``final``: staged
    writes and temp files, and with ``backups`` their ``.old`` backups too. Returns what was removed."""
    final = Path(final)
    removed = []
    with contextlib.suppress(OSError):
        for path in final.parent.iterdir():
            found = leftover_writer(path.name, final.name)
            if found is None or (found[1] == "old" and not backups) or not _writer_gone(found[0]):
                continue
            with contextlib.suppress(OSError):
                _remove(path)
                removed.append(path)
    if removed:
        logger.info("%s: removed what interrupted earlier writes left (%s)", _display(final),
                    ", ".join(p.name for p in removed))  # fmt: skip
    return removed


def _fsync_dir(directory: Path) -> None:
    """Make the renames in ``directory`` durable (best effort: not every platform can open a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------------------------------
# Open sets by group name (what a Kedro dataset with ``commit_group`` stages into)
# ---------------------------------------------------------------------------------------------------------------

_OPEN: dict[str, StagedWrites] = {}
_OPEN_LOCK = threading.Lock()


def open_group(group: str, label: str | None = None) -> StagedWrites:
    """Start the set of ``group``; a set of the group still open is aborted first (left by a failed run)."""
    staging = StagedWrites(label or f"{group} outputs")
    with _OPEN_LOCK:
        stale = _OPEN.pop(group, None)
        _OPEN[group] = staging
    if stale is not None:
        stale.abort()
    return staging


def current_group(group: str) -> StagedWrites | None:
    """The open set of ``group``, if any (a set that was committed or aborted is forgotten)."""
    with _OPEN_LOCK:
        staging = _OPEN.get(group)
        if staging is not None and staging.state != "open":
            del _OPEN[group]
            staging = None
        return staging


def close_group(group: str, staging: StagedWrites) -> None:
    """Forget ``staging`` as the set of ``group`` (after its commit or abort)."""
    with _OPEN_LOCK:
        if _OPEN.get(group) is staging:
            del _OPEN[group]


__all__ = [
    "OutputsNotWritten",
    "StagedWrites",
    "close_group",
    "current_group",
    "leftover_writer",
    "new_write_id",
    "open_group",
    "remove_leftovers",
]
