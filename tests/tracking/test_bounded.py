"""Bounded tracking calls (align_pipeline.tracking.bounded) against a real listening socket that never answers (a
hung server: the connection is accepted by the kernel, no HTTP answer ever comes), and a closed port."""

from __future__ import annotations

import logging
import socket

import pytest

from align_pipeline.tracking import RunLogger, bounded, child_run_env
from align_pipeline.tracking.runs import clear_node_run, log_artifacts_to_active_run, set_node_run


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for var in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_RUN_ID",
                "ALIGN_MLFLOW_PROBE_TIMEOUT"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ALIGN_MLFLOW_CALL_TIMEOUT", "3")  # MLflow's own: 120 s per attempt, 7 retries
    bounded.reset()
    yield
    bounded.reset()
    clear_node_run()


@pytest.fixture
def hung():
    """``http://127.0.0.1:<port>`` of a socket that listens and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.timeout(60)
def test_a_hung_server_costs_one_bounded_call_then_tracking_is_off(hung, tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    caplog.set_level(logging.WARNING)
    calls = []

    def get_run(run_id):
        calls.append(run_id)
        return MlflowClient(hung).get_run(run_id)

    with pytest.raises(bounded.TrackingOff, match="no answer"):
        bounded.call(hung, get_run, "0" * 32)
    with pytest.raises(bounded.TrackingOff):  # at once, without calling
        bounded.call(hung, get_run, "1" * 32)
    assert calls == ["0" * 32]
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("align_pipeline")]
    assert len(ours) == 1 and ours[0].startswith(f"MLflow at {hung} is unreachable (no answer"), ours
    assert not [r for r in caplog.records if r.name.startswith("urllib3")]  # the abandoned retries are quiet

    set_node_run(hung, "0" * 32)  # the node's run on the dead store: nothing is handed on, nothing uploaded
    assert child_run_env() == {}
    (tmp_path / "rank0.log").write_text("x")
    assert log_artifacts_to_active_run(tmp_path, "logs", "*.log") == 0
    bounded.reset(hung)
    assert child_run_env() == {"MLFLOW_TRACKING_URI": hung, "MLFLOW_RUN_ID": "0" * 32}


@pytest.mark.timeout(60)
def test_the_job_logger_trains_on_when_the_server_hangs_mid_run(hung, tmp_path, caplog, monkeypatch):
    """Attached to a run, then the server hangs: one bounded call, one warning, the file keeps every step."""
    from align_pipeline.tracking.metrics_file import read_records

    caplog.set_level(logging.WARNING)
    log = RunLogger(rank=0, metrics_file=tmp_path / "metrics.jsonl", system_metrics=False)
    log.run_id, log.tracking_uri = "0" * 32, hung  # as if attached before the server hung
    log._client = __import__("mlflow").tracking.MlflowClient(hung)
    for step in range(1, 4):
        log.log_metrics({"loss": 1.0 / step}, step)
    log.log_params({"lr": 0.1})
    assert not log.active
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl") if r["type"] == "metrics"] == [1, 2, 3]
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("align_pipeline")]
    assert len(ours) == 1 and "is unreachable" in ours[0], ours


def test_local_stores_are_called_directly(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    import threading

    assert bounded.is_local(uri) and bounded.is_local("file:///x") and bounded.is_local("/x")
    assert not bounded.is_local("http://h") and not bounded.is_local("databricks")
    assert bounded.call(uri, threading.current_thread) is threading.current_thread()
