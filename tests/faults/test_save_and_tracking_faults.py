"""Faults around a training node, through a real KedroSession on a temp copy of the project (the tiny default model,
data_prep + a 2-step SFT on CPU):

- MLflow down (a closed localhost port): training starts at once with one warning, the job keeps its metrics in
  metrics.jsonl (copied into the model checkpoint), and ``align-pipeline mlflow-log`` re-logs them into a real sqlite
  store with the same steps, values and timestamps;
- the catalog cannot store the model (its directory made immutable, which stops root too): the node and the kedro
  run are FAILED in MLflow, the run directory with its training checkpoint is kept, and a rerun resumes at the final
  step and stores the same weights.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from projects import copy_project

pytestmark = pytest.mark.slow  # KedroSessions that launch torchrun jobs

STEPS = 2
PARAMS = {
    "sft": {
        "training": {
            "train_steps": STEPS,
            "global_batch_size": 8,
            "micro_batch_size": 8,
            "log_interval": 1,
            "eval_interval": 0,
            "eval_samples": 8,
            "save_interval": 0,
        }
    }
}


def closed_port() -> int:
    """A localhost port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A temp copy of the project (conf, raw data) with env ``test`` = the default config and a 2-step SFT."""
    root = copy_project(tmp_path / "proj", params={"test/faults": PARAMS})
    monkeypatch.chdir(root)
    for var in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "ALIGN_METRICS_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "faults")
    yield root
    import mlflow

    while mlflow.active_run():
        mlflow.end_run()
    mlflow.set_tracking_uri(None)


def _run(root: Path, *pipelines: str, warnings: list[str] | None = None):
    """``kedro run -e test --pipelines ...``; ``warnings`` collects the warnings of our loggers."""
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(root)  # (configures logging: handlers put on our loggers before this are dropped)
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage()) if warnings is not None else None
    logging.getLogger("align_pipeline").addHandler(handler)
    try:
        with KedroSession.create(project_path=root, env="test") as session:
            return session.run(pipeline_names=list(pipelines))
    finally:
        logging.getLogger("align_pipeline").removeHandler(handler)


def _versions(root: Path, name: str) -> list[Path]:
    base = root / "data" / "06_models" / name
    return sorted(v / name for v in base.iterdir() if (v / name / "meta.json").is_file()) if base.is_dir() else []


def _relog(source: Path, uri: str, *args: str) -> dict:
    """``align-pipeline mlflow-log`` as a user runs it (a separate process)."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    proc = subprocess.run(
        [sys.executable, "-m", "align_pipeline", "mlflow-log", "--json", str(source), *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_mlflow_down_trains_at_once_keeps_metrics_and_relogs_them(project, monkeypatch):
    from mlflow import MlflowClient

    from align_pipeline.tracking import default_tracking_uri
    from align_pipeline.tracking.metrics_file import read_records

    down = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", down)
    logged: list[str] = []
    outputs = _run(project, "data_prep", "sft", warnings=logged)

    warnings = [w for w in logged if "unreachable" in w]
    assert len(warnings) == 1 and warnings[0].startswith(f"MLflow at {down} is unreachable"), warnings
    assert "tracking off for this run" in warnings[0] and "align-pipeline mlflow-log" in warnings[0]
    assert outputs["sft_metrics"].load()["steps"] == STEPS  # the run completed
    (checkpoint,) = _versions(project, "sft_policy")
    kept = checkpoint / "metrics.jsonl"
    records = read_records(kept)
    steps = [(r["step"], r["metrics"]["loss"]) for r in records if r["type"] == "metrics" and "loss" in r["metrics"]]
    assert [s for s, _ in steps] == list(range(1, STEPS + 1))  # log_interval 1: every step
    assert any(r["type"] == "params" and "sft.training.train_steps" in r["params"] for r in records)
    assert not any((project / "data" / "06_models" / "_runs" / "sft").iterdir())  # run dir cleaned up after the save

    uri = default_tracking_uri(project / "later")  # MLflow is "back": a sqlite store
    (project / "later").mkdir()
    summary = _relog(checkpoint, uri, "--experiment", "relogged")
    client = MlflowClient(uri)
    run = client.get_run(summary["run_id"])
    assert run.info.experiment_id == client.get_experiment_by_name("relogged").experiment_id
    assert run.data.params["sft.training.train_steps"] == str(STEPS)
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    expected = [(r["step"], r["timestamp"], r["metrics"]["loss"]) for r in records if "loss" in r.get("metrics", {})]
    assert [(m.step, m.timestamp, m.value) for m in history] == expected
    assert set(run.data.metrics) == {k for r in records if r["type"] == "metrics" for k in r["metrics"]}
    again = _relog(checkpoint, uri, "--experiment", "relogged")
    assert again["run_id"] == summary["run_id"] and again["metrics_logged"] == 0


def _immutable(path: Path) -> bool:
    """Make the directory ``path`` immutable (``chattr +i``: even root cannot create entries in it); False when the
    filesystem or the tools do not allow it."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("chattr") is None:
        return False
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False).returncode != 0:
        return False
    try:
        (path / "probe").mkdir()
    except OSError:
        return True
    (path / "probe").rmdir()
    subprocess.run(["chattr", "-i", str(path)], check=False)
    return False


def _weights(checkpoint: Path) -> dict:
    """The tensors of a model checkpoint (torch distributed checkpoint format), read without process groups."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(checkpoint), f"{tmp}/w.pt")
        state = torch.load(f"{tmp}/w.pt", weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_failed_save_keeps_the_run_dir_fails_the_runs_and_a_rerun_resumes(project, monkeypatch):
    import torch
    from kedro.io.core import DatasetError
    from mlflow import MlflowClient

    store = project / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    _run(project, "data_prep")
    models = project / "data" / "06_models" / "sft_policy"
    if not _immutable(models):
        pytest.skip("chattr +i does not stop this process from writing here (filesystem or privileges)")
    try:
        with pytest.raises(DatasetError, match="sft_policy"):
            _run(project, "sft")
        runs_dir = project / "data" / "06_models" / "_runs" / "sft"
        (run_dir,) = [d for d in runs_dir.iterdir() if not d.name.startswith(".")]
        checkpoints = sorted((run_dir / "checkpoints").iterdir())
        assert [c.name for c in checkpoints] == [f"iter_{STEPS:07d}"] and (checkpoints[0] / "meta.json").is_file()
        first_model = runs_dir / f".{run_dir.name}-model"  # moved out of the run dir for the catalog, not stored
        assert (first_model / "meta.json").is_file() and (first_model / "metrics.jsonl").is_file()
        first_weights = _weights(first_model)
    finally:
        subprocess.run(["chattr", "-i", str(models)], check=True)

    client = MlflowClient(f"sqlite:///{store}")
    runs = client.search_runs([client.get_experiment_by_name("faults").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("kedro.pipeline") == "sft"]
    (child,) = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FAILED" and parent.data.tags["kedro.failed_node"] == "train_sft"
    assert child.info.status == "FAILED" and "sft_policy" in child.data.tags["kedro.error"]
    assert child.data.tags["align.steps"] == str(STEPS)  # the node's metrics are logged all the same
    assert [m.step for m in client.get_metric_history(child.info.run_id, "loss")] == list(range(1, STEPS + 1))

    outputs = _run(project, "sft")  # the obstacle is gone: the rerun resumes at the final step
    (stored,) = _versions(project, "sft_policy")
    metrics = outputs["sft_metrics"].load()
    assert metrics["steps"] == STEPS and "first_train_loss" not in metrics  # its result has no trained step
    runs = client.search_runs([client.get_experiment_by_name("faults").experiment_id])
    (rerun,) = [r for r in runs if r.data.tags.get("kedro.pipeline") == "sft" and r.info.run_id != parent.info.run_id]
    (rerun_child,) = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == rerun.info.run_id]
    assert rerun.info.status == rerun_child.info.status == "FINISHED"
    assert rerun_child.data.params["resumed_from_step"] == str(STEPS)  # resumed, not retrained from step 0
    assert client.get_metric_history(rerun_child.info.run_id, "loss") == []  # no training step ran again
    weights = _weights(stored)
    assert weights.keys() == first_weights.keys() and weights
    assert all(torch.equal(weights[k], first_weights[k]) for k in weights)
    assert not run_dir.exists()  # stored: now the run dir is cleaned up
