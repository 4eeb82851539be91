"""A real ``mlflow server`` (sqlite backend in tmp, on 127.0.0.1) killed with SIGKILL in the middle of an SFT run
through a real KedroSession on a temp copy of the project: every tracking call is bounded, so the job trains on and
the Kedro process stores the model (no MLflow retries of minutes); each process warns once; ``metrics.jsonl`` keeps
every step. Once the server is back, ``align-pipeline mlflow-log`` fills the node's run and closes it KILLED with the
last step, and the next ``kedro run`` of the project marks the parent run it left RUNNING KILLED.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from launch.progress_trigger import acting_on_step
from projects import copy_project

pytestmark = pytest.mark.slow  # an mlflow server, KedroSessions that launch torchrun jobs

STEPS = 16
PARAMS = {
    "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
              "ffn_hidden_size": 64},
    "sft": {"training": {"train_steps": STEPS, "global_batch_size": 8, "micro_batch_size": 8, "log_interval": 1,
                         "eval_interval": 0, "eval_samples": 8, "save_interval": 0}},
}  # fmt: skip
MLFLOW_VARS = ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "ALIGN_METRICS_FILE", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
               "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "ALIGN_MLFLOW_CALL_TIMEOUT")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` on 127.0.0.1:<free port>, sqlite store and artifacts under ``root``, in its own process
    group (the server forks uvicorn and a job runner): :meth:`kill` SIGKILLs the whole group."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180) -> None:
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
               "--port", str(self.port), "--workers", "1"]  # fmt: skip
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 — the server's own output, for a failing test
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runner processes
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"mlflow server did not start: {(self.root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.3)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def server(tmp_path):
    (tmp_path / "server").mkdir()
    server = MlflowServer(tmp_path / "server")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def project(tmp_path, monkeypatch, server):
    root = copy_project(tmp_path / "proj", params={"test/faults": PARAMS})
    monkeypatch.chdir(root)
    for var in MLFLOW_VARS:  # MLflow's retries at their defaults: the bound is ours
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "server-dies")
    yield root
    import mlflow

    from align_pipeline.tracking import bounded

    bounded.reset()
    mlflow.set_tracking_uri(None)


class Lines(logging.Handler):
    """Messages of our loggers: warnings of this process, and the relayed lines of the jobs (INFO)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.warnings: list[str] = []
        self.job: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        (self.warnings if record.levelno >= logging.WARNING else self.job).append(record.getMessage())


def _run(root: Path, *pipelines: str, on_step=None) -> tuple[dict, Lines]:
    """``kedro run -e test --pipelines ...``; ``on_step()`` runs when the job reaches step 2."""
    import contextlib

    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    bootstrap_project(root)  # (configures logging: handlers put on our loggers before this are dropped)
    lines = Lines()
    ours = logging.getLogger("align_pipeline")
    ours.addHandler(lines)
    try:
        with (
            acting_on_step(on_step) if on_step else contextlib.nullcontext(),
            KedroSession.create(project_path=root, env="test") as session,
        ):
            return session.run(pipeline_names=list(pipelines)), lines
    finally:
        ours.removeHandler(lines)


def _relog(source: Path, uri: str, *args: str) -> dict:
    """``align-pipeline mlflow-log`` as a user runs it (a separate process)."""
    proc = subprocess.run(
        [sys.executable, "-m", "align_pipeline", "mlflow-log", "--json", str(source), *args],
        env={**os.environ, "MLFLOW_TRACKING_URI": uri}, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(420)  # without the bound: MLflow's ~4 min of retries in the job, then again in the Kedro process
def test_server_killed_mid_run_costs_seconds_the_model_is_stored_and_the_runs_are_closed(project, server):
    from mlflow import MlflowClient

    from align_pipeline.tracking.metrics_file import read_records

    outputs, lines = _run(project, "data_prep", "sft", on_step=server.kill)

    assert server.proc.poll() is not None  # it was killed mid-run
    assert outputs["sft_metrics"].load()["steps"] == STEPS  # the run finished ...
    base = project / "data" / "06_models" / "sft_policy"
    (checkpoint,) = [v / "sft_policy" for v in base.iterdir() if (v / "sft_policy" / "meta.json").is_file()]
    records = read_records(checkpoint / "metrics.jsonl")  # ... the catalog stored the model, with every step
    steps = [r["step"] for r in records if r["type"] == "metrics" and "loss" in r["metrics"]]
    assert steps == list(range(1, STEPS + 1))
    (start,) = [r for r in records if r["type"] == "start"]
    child_id = start["mlflow_run_id"]  # the job was attached to the node's run when the server died
    assert child_id

    ours = [w for w in lines.warnings if "is unreachable" in w]  # the Kedro process: one warning
    assert len(ours) == 1 and ours[0].startswith(f"MLflow at {server.uri} is unreachable"), lines.warnings
    assert "align-pipeline mlflow-log" in ours[0]
    assert not [w for w in lines.warnings if "MLflow tracking failed" in w]
    job = [line for line in lines.job if "is unreachable" in line]  # the job (relayed): one warning
    assert len(job) == 1 and f"--run-id {child_id}" in job[0], job

    server.start()  # back, on the same store
    client = MlflowClient(server.uri)
    child = client.get_run(child_id)
    parent_id = child.data.tags["mlflow.parentRunId"]
    assert child.info.status == client.get_run(parent_id).info.status == "RUNNING"  # left so by the dead server
    assert len(client.get_metric_history(child_id, "loss")) < STEPS

    summary = _relog(checkpoint, server.uri, "--run-id", child_id)
    assert child_id in summary["closed_runs"] and parent_id not in summary["closed_runs"]  # its kedro process lives
    child = client.get_run(child_id)
    assert child.info.status == "KILLED" and child.data.tags["align.last_step"] == str(STEPS)
    assert child.info.end_time == max(r["timestamp"] for r in records)
    assert sorted(m.step for m in client.get_metric_history(child_id, "loss")) == list(range(1, STEPS + 1))

    _run(project, "data_prep")  # the next kedro run of the project closes the parent left RUNNING
    parent = client.get_run(parent_id)
    assert parent.info.status == "KILLED" and "kedro run" in parent.data.tags["align.closed_by"]
    runs = client.search_runs([child.info.experiment_id], "attributes.status = 'RUNNING'")
    assert runs == []
