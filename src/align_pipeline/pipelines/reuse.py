"""Content-keyed stage reuse: a node whose inputs, resolved config and code equal those of a stored version hands
that version on instead of running its job.

The key (:func:`content_key`) hashes what determines a stage's result and nothing else:

* the data it reads (the artifacts' content fingerprints, the tokenizer's), and the models it starts from, scores
  with or compares to by *what they are*, not where they are stored (:func:`model_identity`: the key a model was
  made with, so a chain of reused stages keeps its keys; else its manifest's sha256; else, for an HF directory, its
  files' names, sizes and mtimes);
* every config section the job gets (the stage's own without ``reuse``, ``keep_run_dir`` and ``runs_dir``, which
  change nothing in the model), and the source of any reward function outside this package;
* the code: a hash of this package's Python files and the versions of torch, megatron-core and transformers.

After training, the node writes the key and its final metrics into each output directory (``reuse.json``, covered
by the manifest the catalog writes). On the next run with the same key the node finds that version through its
``<artifact>_stored`` input (:class:`~align_pipeline.datasets.stored.StoredVersions`: the newest version with the
key that passes its manifest check), and returns a clone of it (large files hard-linked, so no bytes are copied)
with the stored metrics; the catalog stores the clone as this run's version. The console and the node's MLflow run
say ``reused_from=<version>``; ``<stage>.reuse: false`` (``kedro run --params <stage>.reuse=false``) trains anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from align_pipeline.config.base import config_hash, to_dict
from align_pipeline.datasets.manifest import MANIFEST_FILE, sha256_of
from align_pipeline.datasets.stored import REUSE_FILE, StoredVersions, read_reuse_record

logger = logging.getLogger(__name__)

NOT_IN_KEY = ("reuse", "keep_run_dir", "runs_dir")
"""Fields of a stage's section that do not change its result."""
MODEL_ROLES = ("parent_checkpoint", "reference", "reward_model", "teacher")
"""The lineage entries that name models (by path)."""
LINK_FROM_BYTES = 1 << 20
"""A clone hard-links files of at least this size (weights; never rewritten) and copies smaller ones (reports,
meta.json), which a node may rewrite without touching the stored version."""


@functools.cache
def code_identity() -> dict[str, str]:
    """What code a job runs: a hash of this package's ``.py`` files, and the versions of the libraries that compute
    the result."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    found = {"align_pipeline": digest.hexdigest()[:16]}
    for dist in ("torch", "megatron-core", "transformers"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "absent"
    return found


def model_identity(path: str | None) -> str | None:
    """What the model at ``path`` is, independent of where it is stored (see the module docstring)."""
    if not path:
        return None
    where = Path(path)
    record = read_reuse_record(where)
    if record is not None:
        return f"key:{record['key']}"
    if (where / MANIFEST_FILE).is_file():
        return f"manifest:{sha256_of(where / MANIFEST_FILE)[:16]}"
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(where):
        dirs.sort()
        for name in sorted(files):
            stat = (Path(root) / name).stat()
            rel = (Path(root) / name).relative_to(where).as_posix()
            digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return f"files:{digest.hexdigest()[:16]}"


def _reward_code(section: Any) -> dict[str, str]:
    """module -> sha256 of its source, for the reward functions of ``section`` outside this package."""
    functions = getattr(getattr(section, "reward", None), "functions", None) or []
    found = {}
    for function in functions:
        module = function.name.split(":", 1)[0]
        if module == "align_pipeline" or module.startswith("align_pipeline."):
            continue  # in code_identity
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        origin = getattr(spec, "origin", None)
        found[module] = sha256_of(Path(origin))[:16] if origin and Path(origin).is_file() else "unknown"
    return found


def content_key(stage: str, lineage: dict[str, Any], sections: dict[str, Any],
                models: dict[str, str | None] | None = None) -> str:
    """The reuse key of a ``stage`` job: its ``lineage`` (data fingerprints; the models in :data:`MODEL_ROLES` by
    identity), its config ``sections`` (dataclasses, or plain values such as a fingerprint), the code, and
    ``models`` (role -> path, by identity) when the job's models are not in its lineage."""
    config: dict[str, Any] = {}
    rewards: dict[str, str] = {}
    for name, section in sections.items():
        if not dataclasses.is_dataclass(section):
            config[name] = section
            continue
        plain = to_dict(section)
        if name == stage:
            for field in NOT_IN_KEY:
                plain.pop(field, None)
            if plain.get("init_from"):
                plain["init_from"] = model_identity(plain["init_from"])
        config[name] = plain
        rewards |= _reward_code(section)
    models = {role: model_identity(path) for role, path in (models or {}).items()} | {
        role: model_identity(lineage.get(role)) for role in MODEL_ROLES if role in lineage}
    rest = {k: v for k, v in lineage.items() if k not in MODEL_ROLES}
    return config_hash({"stage": stage, "lineage": rest, "models": models, "config": config, "reward_code": rewards,
                        "code": code_identity()})


def _clone(source: Path, target: Path, record: dict[str, Any]) -> Path:
    """``target``: ``source``'s files (large ones hard-linked, small ones copied; its manifest left out: the catalog
    writes the new version's) with ``record`` as its ``reuse.json``."""
    if target.exists():
        shutil.rmtree(target)
    for root, dirs, files in os.walk(source):
        dirs.sort()
        here = target / Path(root).relative_to(source)
        here.mkdir(parents=True, exist_ok=True)
        for name in files:
            src = Path(root) / name
            if src.is_symlink() or (root == str(source) and name in (MANIFEST_FILE, REUSE_FILE)):
                continue
            if src.stat().st_size >= LINK_FROM_BYTES:
                try:
                    os.link(src, here / name)
                    continue
                except OSError:  # another filesystem: copy
                    pass
            shutil.copy2(src, here / name)
    (target / REUSE_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
    return target


@dataclasses.dataclass
class StageReuse:
    """Reuse for one node: its key, whether reuse is on, where its outputs are stored (one
    :class:`~align_pipeline.datasets.stored.StoredVersions` per output, in output order; None = not wired, e.g. a
    node function called directly) and where clones are staged before the catalog stores them."""

    stage: str
    key: str
    enabled: bool
    stores: Sequence[StoredVersions | None]
    staging: Path

    def find(self) -> tuple[list[str], dict[str, Any]] | None:
        """(clones of the stored outputs made with this key, the stored record) - or None: run the job."""
        if not self.stores or any(store is None for store in self.stores):
            return None
        if not self.enabled:
            logger.info("%s: %s.reuse is false: training (key %s)", self.stage, self.stage, self.key)
            return None
        first = self.stores[0].find(self.key)
        if first is None:
            return None
        version = first[0]
        found = [first] + [store.find(self.key, version) for store in self.stores[1:]]  # outputs of one run
        if any(f is None for f in found):
            return None
        record = found[0][2]
        origin = record.get("trained_in") or {"artifact": self.stores[0].name, "version": version}
        clones = []
        for store, (_, path, stored) in zip(self.stores, found):
            new = {**stored, "reused_from": {"artifact": store.name, "version": version}, "trained_in": origin}
            clones.append(str(_clone(path, self.staging / f".reuse-{store.name}", new)))
        logger.info("%s: reused_from=%s: %s version %s was made from the same inputs, config and code (key %s); "
                    "nothing trained (--params %s.reuse=false retrains)", self.stage, version, self.stores[0].name,
                    version, self.key, self.stage)
        from align_pipeline.tracking.runs import tag_active_run

        tag_active_run({"reused_from": version, "reuse.key": self.key,
                        "reuse.trained_in": f"{origin['artifact']}@{origin['version']}"})
        return clones, record

    def record(self, paths: Sequence[str], metrics: dict[str, float], **extra: Any) -> None:
        """After training: the key and the node's final metrics into each output directory (``reuse.json``)."""
        for path in paths:
            if path:
                body = {"key": self.key, "stage": self.stage, "metrics": metrics, **extra}
                (Path(path) / REUSE_FILE).write_text(json.dumps(body, indent=1, sort_keys=True))
        from align_pipeline.tracking.runs import tag_active_run

        tag_active_run({"reuse.key": self.key})
