"""Lineage tags: which code (git commit) and which parents (checkpoints, data, config) produced a run.

Tags are plain strings so they can be searched in the MLflow UI (``tags.lineage.parent_checkpoint = '...'``).
Nothing here imports MLflow or Kedro.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MAX_TAG_VALUE = 8000
"""MLflow's limit on a tag value's length."""


def _git(path: str | Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(path), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit(path: str | Path = ".") -> str | None:
    """Full SHA of ``HEAD`` of the git work tree containing ``path``; None outside a repo or before the first commit."""
    return _git(path, "rev-parse", "--verify", "--quiet", "HEAD") or None


def git_dirty(path: str | Path = ".") -> bool | None:
    """True when tracked files differ from ``HEAD`` (untracked files are ignored); None outside a repo."""
    if git_commit(path) is None:
        return None
    status = _git(path, "status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def git_tags(path: str | Path = ".") -> dict[str, str]:
    """``{"git.commit": sha, "git.dirty": "true"|"false"}``; empty outside a git repo."""
    commit = git_commit(path)
    if commit is None:
        return {}
    tags = {"git.commit": commit}
    dirty = git_dirty(path)
    if dirty is not None:
        tags["git.dirty"] = "true" if dirty else "false"
    return tags


def _tag_value(value: Any) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, (list, tuple, set)):
        text = json.dumps(sorted(value) if isinstance(value, set) else list(value), default=str)
    else:
        text = str(value)
    return text[:MAX_TAG_VALUE]


def lineage_tags(lineage: Mapping[str, Any], prefix: str = "lineage") -> dict[str, str]:
    """Flatten a (nested) lineage dict into ``{"lineage.<key>[.<subkey>]": str}`` tags; None values are dropped.

    >>> lineage_tags({"parent": {"sft_policy": "2024-01-01T00.00.00.000Z"}, "config_hash": "ab12"})
    {'lineage.parent.sft_policy': '2024-01-01T00.00.00.000Z', 'lineage.config_hash': 'ab12'}
    """
    tags: dict[str, str] = {}
    for key, value in lineage.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            tags.update(lineage_tags(value, name))
        elif value is not None:
            tags[name] = _tag_value(value)
    return tags


__all__ = ["git_commit", "git_dirty", "git_tags", "lineage_tags"]
