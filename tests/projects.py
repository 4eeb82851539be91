"""Temp copies of this Kedro project for tests that run a real KedroSession or the ``kedro`` CLI."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
_EMPTY_STORE: list[Path] = []


def fresh_mlflow_db(path: Path) -> Path:
    """A migrated, empty sqlite MLflow store at ``path`` (made once per process and copied: creating one costs
    seconds of migrations and fsync, copying it does not)."""
    if not _EMPTY_STORE:
        from mlflow.tracking import MlflowClient

        template = Path(tempfile.mkdtemp(prefix="mlflow-template-")) / "mlflow.db"
        atexit.register(shutil.rmtree, template.parent, True)
        MlflowClient(f"sqlite:///{template}").search_experiments()
        _EMPTY_STORE.append(template)
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(_EMPTY_STORE[0], path)
    return path


def copy_project(root: Path, *, raw: bool = True, params: dict[str, dict[str, Any]] | None = None,
                 store: bool = True) -> Path:
    """``root`` becomes a project: pyproject.toml, conf/ (an empty conf/local), src/ (the package itself is installed;
    Kedro only needs the directory), with ``raw`` the shipped data/01_raw, with ``store`` an empty migrated MLflow
    store at the project's default location (``mlflow.db``). ``params``: ``{"<env>/<name>": {...}}`` written as
    ``conf/<env>/parameters_<name>.yml``."""
    (root / "src").mkdir(parents=True)
    shutil.copytree(REPO / "conf", root / "conf", ignore=shutil.ignore_patterns("local"))
    (root / "conf" / "local").mkdir()
    # the tests run in env "test" and look for outputs where a plain `kedro run` writes them (data/, not data/test/)
    (root / "conf" / "test").mkdir()
    (root / "conf" / "test" / "globals.yml").write_text("data_root: data\n")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    if store:
        fresh_mlflow_db(root / "mlflow.db")
    if raw:
        shutil.copytree(REPO / "data" / "01_raw", root / "data" / "01_raw")
    for where, values in (params or {}).items():
        env, name = where.split("/")
        (root / "conf" / env).mkdir(exist_ok=True)
        (root / "conf" / env / f"parameters_{name}.yml").write_text(yaml.safe_dump(values))
    return root


def run_kedro(root: Path, *pipelines: str, env: str | None = "test"):
    """``kedro run --env <env> --pipelines <pipelines>`` (all of them when none) through a KedroSession; returns the
    free outputs."""
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(root)
    with KedroSession.create(project_path=root, env=env) as session:
        return session.run(pipeline_names=list(pipelines) or None)


def enter_project(monkeypatch, root: Path, experiment: str) -> Path:
    """Work in ``root`` with its own sqlite MLflow store and experiment (undone after the test)."""
    monkeypatch.chdir(root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    return root
