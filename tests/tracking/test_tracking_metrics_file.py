"""metrics.jsonl (rank 0 keeps what it logs), the store probe, and re-logging a file into a real sqlite MLflow store."""

from __future__ import annotations

import json
import logging
import shutil
import socket

import mlflow
import pytest
from mlflow.tracking import MlflowClient
from projects import fresh_mlflow_db

from align_pipeline.kedro.commands import mlflow_log_command
from align_pipeline.tracking import (
    METRICS_FILE,
    RunLogger,
    bounded,
    default_tracking_uri,
    probe,
    relog,
    unreachable,
)
from align_pipeline.tracking.metrics_file import SOURCE_TAG, job_metrics_path, read_records

MLFLOW_VARS = ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID")


def closed_port() -> int:
    """A localhost port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store(tmp_path, tmp_path_factory, monkeypatch):
    """A fresh sqlite store (copied from a migrated template) and its client; MLflow's globals restored afterwards."""
    for var in (*MLFLOW_VARS, "ALIGN_METRICS_FILE"):
        monkeypatch.delenv(var, raising=False)
    fresh_mlflow_db(tmp_path / "mlflow.db")
    bounded.reset()  # tracking is off per process for a store that went away: each test is a new process
    yield MlflowClient(default_tracking_uri(tmp_path))
    bounded.reset()
    mlflow.set_tracking_uri(None)


def _write_run(path, steps=(1, 2, 3)) -> RunLogger:
    log = RunLogger(rank=0, run_id=None, metrics_file=path, system_metrics=False)
    log.log_params({"job": {"lr": 1e-3, "steps": len(steps)}})
    for step in steps:
        log.log_metrics({"loss": 1.0 / step, "grad": {"norm": float(step)}, "text": "dropped"}, step)
    log.set_tags({"lineage.parent": "v1"})
    return log


def test_rank0_keeps_what_it_logs_without_mlflow(tmp_path, store):
    path = tmp_path / "run" / METRICS_FILE
    log = _write_run(path)
    assert not log.active and log.metrics_path == path
    model = tmp_path / "model"
    model.mkdir()
    assert log.copy_metrics_to(model) == model / METRICS_FILE
    log.close()
    records = read_records(path)
    assert [r["type"] for r in records] == ["start", "params", "metrics", "metrics", "metrics", "tags"]
    assert records[1]["params"] == {"job.lr": "0.001", "job.steps": "3"}
    assert [(r["step"], r["metrics"]) for r in records[2:5]] == [
        (1, {"loss": 1.0, "grad.norm": 1.0}), (2, {"loss": 0.5, "grad.norm": 2.0}), (3, {"loss": 1 / 3, "grad.norm": 3.0})
    ]  # fmt: skip
    assert all(isinstance(r["timestamp"], int) for r in records)
    assert (model / METRICS_FILE).read_text() == path.read_text()

    other = RunLogger(rank=1, metrics_file=tmp_path / "rank1.jsonl")
    other.log_metrics({"loss": 1.0}, 1)
    assert other.metrics_path is None and not (tmp_path / "rank1.jsonl").exists()


def test_the_job_file_is_in_the_run_dir_of_its_config(tmp_path):
    run_dir = tmp_path / "runs" / "sft" / "abc"
    run_dir.mkdir(parents=True)
    config = run_dir / "config.json"
    config.write_text(json.dumps({"paths": {"run_dir": str(run_dir)}}))
    assert job_metrics_path(["--config", str(config)]) == run_dir / METRICS_FILE
    plain = tmp_path / "job.json"
    plain.write_text(json.dumps({"run_dir": str(run_dir)}))
    assert job_metrics_path([f"--config={plain}"]) == run_dir / METRICS_FILE
    assert job_metrics_path(["-c", "x"]) is None  # pytest's own argv: no file


def test_job_with_an_unreachable_store_warns_once_keeps_metrics_and_never_retries(tmp_path, store, monkeypatch, caplog):
    uri = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", "0" * 32)
    caplog.set_level(logging.WARNING)
    path = tmp_path / "run" / METRICS_FILE
    log = _write_run(path)
    assert not log.active
    again = RunLogger(rank=0, metrics_file=path, system_metrics=False)  # a second logger in the same process
    again.log_metrics({"loss": 0.1}, 4)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"MLflow at {uri} is unreachable")
    assert str(path) in messages[0] and f"--run-id {'0' * 32}" in messages[0]
    steps = [r["step"] for r in read_records(path) if r["type"] == "metrics"]
    assert steps == [1, 2, 3, 4]


def test_local_stores_are_never_probed_over_the_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("probed")

    monkeypatch.setattr(probe, "_http_unreachable", no_network)
    monkeypatch.setattr(probe.socket, "create_connection", no_network)
    for uri in (
        "sqlite:////abs/path/mlflow.db",
        "sqlite:///rel.db",
        "file:///tmp/mlruns",
        "/tmp/mlruns",
        "",
        None,
        "databricks",
    ):
        assert unreachable(uri) is None


def test_probe_is_one_short_attempt(monkeypatch):
    for var in ("ALIGN_MLFLOW_PROBE_TIMEOUT", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    assert probe.probe_timeout() == probe.PROBE_TIMEOUT_S
    port = closed_port()
    assert "Connection refused" in unreachable(f"http://127.0.0.1:{port}")
    assert "Connection refused" in unreachable(f"postgresql://u:p@127.0.0.1:{port}/db")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    assert probe.probe_timeout() == 1.0  # MLflow's own timeout, when shorter
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")
    assert probe.probe_timeout() == probe.PROBE_TIMEOUT_S
    monkeypatch.setenv("ALIGN_MLFLOW_PROBE_TIMEOUT", "10")  # a slow server
    assert probe.probe_timeout() == 10.0


def test_relog_into_a_new_run_keeps_steps_and_timestamps_and_is_idempotent(tmp_path, store):
    client = store
    path = tmp_path / "run" / METRICS_FILE
    _write_run(path).close()
    first = relog(path.parent, client, experiment="relogged")
    assert first["created"] and first["metrics_logged"] == 6 and first["params_logged"] == 2
    run = client.get_run(first["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params == {"job.lr": "0.001", "job.steps": "3"}
    assert run.data.tags["lineage.parent"] == "v1"
    kept = [r for r in read_records(path) if r["type"] == "metrics"]
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    assert [(m.step, m.timestamp, m.value) for m in history] == [
        (r["step"], r["timestamp"], r["metrics"]["loss"]) for r in kept
    ]
    assert run.info.start_time == read_records(path)[0]["timestamp"]

    copy = tmp_path / "checkpoint"
    copy.mkdir()
    shutil.copy(path, copy / METRICS_FILE)
    again = relog(copy, client, experiment="relogged")  # the checkpoint's copy: the same history, the same run
    assert again["run_id"] == first["run_id"] and not again["created"]
    assert again["metrics_logged"] == 0 and again["params_logged"] == 0
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 3
    experiment = client.get_experiment_by_name("relogged").experiment_id
    assert len(client.search_runs([experiment], f"tags.`{SOURCE_TAG}` = '{read_records(path)[0]['id']}'")) == 1


def test_relog_into_a_run_fills_only_the_gaps(tmp_path, store):
    """MLflow went down during the run: the points it has are skipped, the missing ones are added."""
    client = store
    experiment = client.create_experiment("gaps")
    run_id = client.create_run(experiment).info.run_id
    path = tmp_path / METRICS_FILE
    log = RunLogger(rank=0, run_id=run_id, tracking_uri=client.tracking_uri, metrics_file=path, system_metrics=False)
    assert log.active
    log.log_params({"lr": 0.1})
    log.log_metrics({"loss": 1.0}, 1)
    log._client = None  # the store "goes away": the file goes on
    log.log_metrics({"loss": 0.5}, 2)
    log.log_metrics({"loss": float("nan")}, 3)
    log.close()
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1]
    summary = relog(path, client, run_id=run_id)
    assert summary == {**summary, "run_id": run_id, "created": False, "metrics_logged": 2, "metrics_skipped": 1}
    assert summary["params_logged"] == 0 and summary["params_conflicting"] == 0
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2, 3]
    assert relog(path, client, run_id=run_id)["metrics_logged"] == 0  # NaN included: nothing twice


def test_mlflow_log_command(tmp_path, store, capsys):
    path = tmp_path / "run" / METRICS_FILE
    _write_run(path).close()
    assert mlflow_log_command(["--json", str(path.parent), "--tracking-uri", store.tracking_uri, "--experiment", "cli"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["metrics_logged"] == 6 and summary["tracking_uri"] == store.tracking_uri
    assert store.get_run(summary["run_id"]).data.params["job.lr"] == "0.001"
    assert mlflow_log_command([str(tmp_path / "nowhere"), "--tracking-uri", store.tracking_uri]) == 2
    down = f"http://127.0.0.1:{closed_port()}"
    assert mlflow_log_command([str(path), "--tracking-uri", down]) == 2
    assert "unreachable" in capsys.readouterr().err


@pytest.mark.timeout(90)  # MLflow's own retries (left at their defaults here) would take ~4 minutes
def test_store_that_stops_answering_during_the_run_turns_tracking_off(tmp_path, store, monkeypatch, caplog):
    for var in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT", "ALIGN_MLFLOW_CALL_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    client = store
    run_id = client.create_run(client.create_experiment("away")).info.run_id
    path = tmp_path / METRICS_FILE
    log = RunLogger(rank=0, run_id=run_id, tracking_uri=client.tracking_uri, metrics_file=path, system_metrics=False)
    assert log.active
    down = f"http://127.0.0.1:{closed_port()}"
    log._client, log.tracking_uri = MlflowClient(down), down  # the server goes away
    caplog.set_level(logging.WARNING)
    log.log_metrics({"loss": 1.0}, 1)  # bounded: MLflow's retries are abandoned after a probe
    assert not log.active  # no more attempts
    log.log_metrics({"loss": 0.5}, 2)
    log.set_tags({"t": "x"})
    assert [r.getMessage()[:40] for r in caplog.records] == [f"MLflow at {down} is unreachable"[:40]]
    assert f"--run-id {run_id}" in caplog.records[0].getMessage()
    assert [r["step"] for r in read_records(path) if r["type"] == "metrics"] == [1, 2]


def _dead_pid() -> int:
    """The pid of a process that has ended."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)  # fmt: skip
    return int(proc.stdout)


def test_mlflow_log_closes_the_runs_left_running_with_the_last_step(tmp_path, store, capsys):
    """The server went away mid-run: the node's run and its kedro run stayed RUNNING. ``mlflow-log`` fills the node's
    run and closes both KILLED (the node's with the job's last step and end time); a run of this process's own live
    kedro run is left alone; a repeat closes nothing."""
    import os

    import psutil

    client = store
    experiment = client.create_experiment("left")
    gone = {"align.host": socket.gethostname(), "align.pid": str(_dead_pid()), "align.pid_started": "1.0",
            "align.project": str(tmp_path)}  # fmt: skip
    parent = client.create_run(experiment, tags=gone).info.run_id
    child = client.create_run(experiment, tags={**gone, "mlflow.parentRunId": parent}).info.run_id
    path = tmp_path / "run" / METRICS_FILE
    log = RunLogger(rank=0, run_id=child, tracking_uri=client.tracking_uri, metrics_file=path, system_metrics=False)
    log.log_metrics({"loss": 1.0}, 1)
    log.log_metrics({"loss": 0.5}, 2)
    log._client = None  # the store went away: the file goes on
    for step in (3, 4, 5):
        log.log_metrics({"loss": 1.0 / step}, step)
    log.close()
    last = max(r["timestamp"] for r in read_records(path))

    this = {**gone, "align.pid": str(os.getpid()), "align.pid_started": repr(psutil.Process().create_time())}
    mine = client.create_run(experiment, tags=this).info.run_id  # this process: still running
    own = tmp_path / "own" / METRICS_FILE
    RunLogger(rank=0, run_id=mine, tracking_uri=client.tracking_uri, metrics_file=own, system_metrics=False).close()
    assert mlflow_log_command(["--json", str(own), "--tracking-uri", client.tracking_uri, "--run-id", mine]) == 0
    assert json.loads(capsys.readouterr().out)["closed_runs"] == []
    assert client.get_run(mine).info.status == "RUNNING"

    assert mlflow_log_command(["--json", str(path.parent), "--tracking-uri", client.tracking_uri, "--run-id", child]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["closed_runs"] == [child, parent] and summary["metrics_logged"] == 3
    run = client.get_run(child)
    assert run.info.status == "KILLED" and run.info.end_time == last
    assert run.data.tags["align.last_step"] == "5" and "mlflow-log" in run.data.tags["align.closed_by"]
    assert sorted(m.step for m in client.get_metric_history(child, "loss")) == [1, 2, 3, 4, 5]
    assert client.get_run(parent).info.status == "KILLED"
    assert mlflow_log_command(["--json", str(path.parent), "--tracking-uri", client.tracking_uri, "--run-id", child]) == 0
    assert json.loads(capsys.readouterr().out)["closed_runs"] == []
