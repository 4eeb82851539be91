"""Temp copies of this Kedro project for tests that run a real KedroSession or the ``kedro`` CLI."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


def copy_project(root: Path, *, raw: bool = True, params: dict[str, dict[str, Any]] | None = None) -> Path:
    """``root`` becomes a project: pyproject.toml, conf/ (an empty conf/local), src/ (the package itself is installed;
    Kedro only needs the directory) and, with ``raw``, the shipped data/01_raw. ``params``: ``{"<env>/<name>": {...}}``
    written as ``conf/<env>/parameters_<name>.yml``."""
    (root / "src").mkdir(parents=True)
    shutil.copytree(REPO / "conf", root / "conf", ignore=shutil.ignore_patterns("local"))
    (root / "conf" / "local").mkdir()
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    if raw:
        shutil.copytree(REPO / "data" / "01_raw", root / "data" / "01_raw")
    for where, values in (params or {}).items():
        env, name = where.split("/")
        (root / "conf" / env).mkdir(exist_ok=True)
        (root / "conf" / env / f"parameters_{name}.yml").write_text(yaml.safe_dump(values))
    return root
