"""A versioned Kedro dataset whose data is a checkpoint *directory*.

``save(path)`` moves a finished checkpoint directory (made by a training job, containing ``meta.json``) into
``<filepath>/<version>/<name>``: it is first moved to a hidden temp name beside the target (``.tmp-<name>``), its
manifest (``manifest.json``: every file's path, size and sha256) is written there, files whose bytes an older version
already stores become hard links to them, and only then is it renamed into place, so a version directory either holds
a complete checkpoint with its manifest or nothing loadable. With ``keep_versions: N`` the versions beyond the newest
N are deleted after the save, except those a kept artifact's lineage names (:mod:`.retention`).

``load()`` returns the path (str) of the requested version (default: the latest), so nodes pass paths, never weights,
after checking it against its manifest: every file present with its size, and its sha256 with ``verify: full``. A
version that is incomplete (no ``meta.json``, no manifest) or fails the check is refused with one line naming it and
the ways out; ``load_version: latest_complete`` loads the newest version that passes instead, with a warning naming
the ones it skipped.

Versions stored before manifests existed (no ``manifest.json``) load as before, with a warning that they are not
verified, as long as no older version of the same artifact has a manifest: the old save was already atomic (temp
dir + rename), so such a version was complete when stored, and refusing it would strand every model trained before
the upgrade. A version stored by this code has a record beside it (``<filepath>/<version>/.manifest-sha256-<name>``:
the sha256 of its manifest), and so has any version newer than one with a manifest: a missing or replaced manifest
there means someone removed or edited it, refused like a missing ``meta.json``.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec
from kedro.io.core import AbstractVersionedDataset, DatasetError, Version, VersionNotFoundError

from align_pipeline.errors import UserError

from .manifest import (
    MANIFEST_FILE,
    VERIFY_LEVELS,
    ManifestError,
    check_files,
    known_hashes,
    link_duplicates,
    read_manifest,
    sha256_of,
    write_manifest,
)

META_FILE = "meta.json"
LATEST_COMPLETE = "latest_complete"
RECORD_PREFIX = ".manifest-sha256-"
"""``<filepath>/<version>/.manifest-sha256-<name>``: the sha256 of the version's manifest.json, written beside the
artifact at save; a version with it and without (or with another) manifest.json is refused."""
logger = logging.getLogger(__name__)


class ArtifactVersionError(DatasetError, UserError):
    """A stored version that cannot be loaded (incomplete or failing its manifest): one line naming it."""


def _shown(path: Path) -> str:
    """``path`` relative to the working directory (the project) when inside it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class CheckpointDataset(AbstractVersionedDataset[str, str]):
    """Versioned checkpoint directory (local filesystem).

    ``optional: true``: loading gives "" (no path) when no version exists, instead of failing; the export pipeline
    reads the models through such entries so that it exports the ones a project has. ``verify``: ``sizes`` (default
    for checkpoints: every file of the manifest present with its size) or ``full`` (and its sha256).
    ``load_version: latest_complete``: an unpinned load skips incomplete or failing versions (with a warning) instead
    of refusing. ``keep_versions: N``: keep the newest N versions after each save (and any a kept artifact's lineage
    names); default: keep all."""

    MARKER = META_FILE
    """The file whose presence makes a version directory complete."""
    DEFAULT_VERIFY = "sizes"
    """``verify`` when the catalog entry does not set it."""

    def __init__(self, filepath: str, version: Version | None = None, metadata: dict[str, Any] | None = None,
                 optional: bool = False, verify: str | None = None, load_version: str | None = None,
                 keep_versions: int | None = None):
        self._fs = fsspec.filesystem("file")
        self.metadata = metadata
        self._optional = optional
        name = PurePosixPath(os.path.abspath(filepath)).name
        self._verify = self.DEFAULT_VERIFY if verify is None else verify
        if self._verify not in VERIFY_LEVELS:
            raise DatasetError(f"{name}: verify must be one of {', '.join(VERIFY_LEVELS)}, got {verify!r}")
        if load_version not in (None, LATEST_COMPLETE):
            raise DatasetError(f"{name}: load_version must be {LATEST_COMPLETE!r} or unset, got {load_version!r} "
                               f"(pin a version with --load-versions {name}:<version>)")
        if keep_versions is not None and (type(keep_versions) is not int or keep_versions < 1):
            raise DatasetError(f"{name}: keep_versions must be a whole number >= 1 (or unset: keep all), "
                               f"got {keep_versions!r}")
        self._latest_complete = load_version == LATEST_COMPLETE
        self._keep_versions = keep_versions
        self._verified: str | None = None  # the version last checked against its manifest (not again on load)
        super().__init__(
            filepath=PurePosixPath(os.path.abspath(filepath)),
            version=version,
            exists_function=os.path.lexists,
            glob_function=self._fs.glob,
        )

    @property
    def _name(self) -> str:
        """The artifact's name in messages: the filepath's last component (the catalog name in this project)."""
        return self._filepath.name

    def resolve_load_version(self) -> str | None:
        """An optional dataset without any version resolves to its save version (where nothing is), so that Kedro's
        check after an empty save ("" stored nothing) and the absent-input case need no special path."""
        try:
            return super().resolve_load_version()
        except VersionNotFoundError:
            if not self._optional:
                raise
            return self.resolve_save_version()

    def _clear_version_cache(self) -> None:
        super()._clear_version_cache()
        self._verified = None

    @classmethod
    def _complete(cls, path: str) -> bool:
        return (Path(path) / cls.MARKER).is_file()

    def _version_names(self) -> list[str]:
        """Stored versions, newest first: ``<filepath>/<version>/<name>`` exists (a hidden ``.tmp-*`` / ``.gc-*``
        directory, an interrupted save or deletion, is none)."""
        root = Path(self._filepath)
        if not root.is_dir():
            return []
        return sorted((d.name for d in root.iterdir()
                       if not d.name.startswith(".") and d.is_dir() and os.path.lexists(d / self._name)),
                      reverse=True)

    def _record(self, version: str) -> Path:
        return Path(self._filepath) / version / f"{RECORD_PREFIX}{self._name}"

    def _legacy(self, version: str) -> bool:
        """Stored before manifests: no record of a manifest beside it, and no older version has one."""
        root = Path(self._filepath)
        return not os.path.lexists(self._record(version)) and not any(
            (root / v / self._name / MANIFEST_FILE).is_file() for v in self._version_names() if v < version)

    def _problem(self, version: str | None, full: bool) -> tuple[str, str] | None:
        """(verdict, why) when the version cannot be loaded, else None."""
        path = Path(self._get_versioned_path(version)) if version is not None else Path(self._filepath)
        if not path.is_dir() or path.is_symlink():
            return "is incomplete", "no artifact directory" if not os.path.lexists(path) else "not a directory"
        if not self._complete(str(path)):
            return "is incomplete", f"missing {self.MARKER}"
        try:
            entries = read_manifest(path)
        except ManifestError as e:
            if not (path / MANIFEST_FILE).is_file() and version is not None and self._legacy(version):
                logger.warning("%s version %s has no %s (stored before manifests): its files are not verified",
                               self._name, version, MANIFEST_FILE)
                return None
            return ("is incomplete" if "missing" in str(e) else "failed its manifest check"), str(e)
        if version is not None and os.path.lexists(record := self._record(version)):
            try:
                recorded = record.read_text().strip()
            except (OSError, UnicodeDecodeError):
                recorded = ""
            if recorded != sha256_of(path / MANIFEST_FILE):
                return "failed its manifest check", f"{MANIFEST_FILE} is not the one written when it was stored"
        problem = check_files(path, entries, full)
        if problem is None:
            return None
        return ("is incomplete" if problem.endswith("is missing") else "failed its manifest check"), problem

    @property
    def name(self) -> str:
        """The artifact's name (its filepath's last component)."""
        return self._name

    def stored_versions(self) -> list[str]:
        """The stored versions' names, newest first (complete or not)."""
        return self._version_names()

    def version_path(self, version: str) -> Path:
        """Where ``version`` of this artifact is (``<filepath>/<version>/<name>``)."""
        return Path(self._get_versioned_path(version))

    def check_version(self, version: str, full: bool | None = None) -> str | None:
        """Why ``version`` cannot be loaded ("is incomplete (missing meta.json)", ...), or None when it passes its
        manifest check (sizes; sha256 too with ``full``, default: the entry's ``verify``)."""
        problem = self._problem(version, full=self._verify == "full" if full is None else full)
        return None if problem is None else f"{problem[0]} ({problem[1]})"

    def _refusal(self, version: str, problem: tuple[str, str], pinned: bool) -> ArtifactVersionError:
        verdict, why = problem
        where = _shown(Path(self._filepath))
        if pinned:
            return ArtifactVersionError(f"{self._name} version {version} {verdict} ({why}) in {where}; delete it or "
                                        f"pin another with --load-versions {self._name}:<version>")
        good = next((v for v in self._version_names() if v < version and self._problem(v, full=False) is None), None)
        hint = f" ({good} is complete)" if good else ""
        return ArtifactVersionError(
            f"{self._name} version {version} {verdict} ({why}) in {where}; delete it, pin another with "
            f"--load-versions {self._name}:<version>{hint}, or set load_version: {LATEST_COMPLETE} in its catalog entry")

    def _fetch_latest_load_version(self) -> str:
        """The newest version, checked against its manifest: refused when it fails, unless ``load_version:
        latest_complete`` (then the newest that passes, with a warning naming the skipped ones)."""
        if self._cached_load_version is not None:
            return self._cached_load_version
        versions = self._version_names()
        if not versions:
            raise VersionNotFoundError(f"Did not find any versions for {self}")
        skipped = []
        for version in versions:
            problem = self._problem(version, full=self._verify == "full")
            if problem is None:
                if skipped:
                    logger.warning("%s: skipped version%s %s (load_version: %s); loading %s", self._name,
                                   "s" * (len(skipped) > 1), "; ".join(f"{v} ({p[0]}: {p[1]})" for v, p in skipped),
                                   LATEST_COMPLETE, version)
                self._cached_load_version = self._verified = version
                return version
            if not self._latest_complete:
                raise self._refusal(version, problem, pinned=False)
            skipped.append((version, problem))
        raise ArtifactVersionError(
            f"{self._name}: no version in {_shown(Path(self._filepath))} is complete (load_version: {LATEST_COMPLETE} "
            f"skipped {'; '.join(f'{v} ({p[0]}: {p[1]})' for v, p in skipped)})")

    def _load(self) -> str:
        version = self.resolve_load_version()
        path = Path(self._get_versioned_path(version)) if version is not None else Path(self._filepath)
        if self._optional and not os.path.lexists(path):
            return ""  # no version at all (or a pinned one that is absent): the export pipeline skips it
        if version is None or version != self._verified:  # pinned: checked here
            problem = self._problem(version, full=self._verify == "full")
            if problem is not None:
                raise self._refusal(str(version), problem, pinned=True)
            self._verified = version
        return str(path)

    def _save(self, data: str) -> None:
        if data == "" and self._optional:
            return  # nothing to store (an optional output whose source was absent)
        src = Path(data)
        if not self._complete(str(src)):
            raise DatasetError(f"refusing to store {src}: not complete (missing {self.MARKER})")
        dest = Path(self._get_save_path())
        version = dest.parent.name
        older = [Path(self._get_versioned_path(v)) for v in self._version_names() if v != version]
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".tmp-{dest.name}"
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.move(str(src), str(tmp))
        try:
            entries = write_manifest(tmp, known_hashes(older))  # a reused version's hard links are not read again
            saved = link_duplicates(tmp, entries, older)
            self._record(version).write_text(sha256_of(tmp / MANIFEST_FILE) + "\n")
            os.replace(tmp, dest)
        except BaseException:
            self._record(version).unlink(missing_ok=True)
            if tmp.is_dir() and not os.path.lexists(src):  # nothing a finished job produced is lost
                (tmp / MANIFEST_FILE).unlink(missing_ok=True)
                shutil.move(str(tmp), str(src))
            raise
        if saved:
            logger.info("%s version %s: %.1f MiB of its files are the same bytes as an older version's, stored once",
                        self._name, version, saved / 2**20)
        self._cached_load_version = self._verified = version if self._version and not self._version.load else None
        if self._keep_versions is not None:
            from .retention import apply_keep_versions

            apply_keep_versions(Path(self._filepath), self._keep_versions, protect=version)

    def _exists(self) -> bool:
        try:
            version = self.resolve_load_version()
            path = Path(self._get_versioned_path(version)) if version is not None else Path(self._filepath)
            return self._complete(str(path))
        except DatasetError:
            return False

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath), "version": self._version, "optional": self._optional,
                "verify": self._verify, "load_version": LATEST_COMPLETE if self._latest_complete else None,
                "keep_versions": self._keep_versions}


class HFModelDataset(CheckpointDataset):
    """Versioned Hugging Face model directory (``config.json`` + safetensors + tokenizer), stored like a checkpoint:
    moved into ``<filepath>/<version>/<name>`` whole, with its manifest. Loading gives its path, which
    ``transformers`` and vLLM load; ``verify`` defaults to ``full`` (every byte hashed: a directory handed to the
    outside world). ``optional: true``: saving "" stores nothing (the export pipeline's models that a project does
    not have)."""

    MARKER = "config.json"
    DEFAULT_VERIFY = "full"
