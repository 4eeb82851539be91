"""RunLogger, child_run_env and system metrics against a real sqlite MLflow store in tmp_path."""

from __future__ import annotations

import logging
import sys

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from projects import fresh_mlflow_db

from align_pipeline.tracking import (
    RunLogger,
    SystemMetrics,
    child_run_env,
    default_tracking_uri,
    flatten,
    numeric_items,
)


@pytest.fixture
def store(tmp_path, tmp_path_factory, monkeypatch):
    """A fresh sqlite store, an experiment and a run in it (not active); MLflow's globals restored afterwards."""
    for var in ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(var, raising=False)
    fresh_mlflow_db(tmp_path / "mlflow.db")
    uri = default_tracking_uri(tmp_path)
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("tracking-test", artifact_location=(tmp_path / "mlruns").as_uri())
    run = client.create_run(experiment_id)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    yield client, run.info.run_id
    while mlflow.active_run():
        mlflow.end_run()
    mlflow.set_tracking_uri(None)


def test_default_tracking_uri_is_absolute_sqlite(tmp_path, monkeypatch):
    uri = default_tracking_uri(tmp_path / "proj")
    assert uri == f"sqlite:////{(tmp_path / 'proj' / 'mlflow.db').resolve().as_posix().lstrip('/')}"
    assert uri.startswith("sqlite:////")


def test_child_run_env_names_the_active_run(store):
    client, _ = store
    assert child_run_env() == {}
    mlflow.set_tracking_uri(client.tracking_uri)
    with mlflow.start_run(experiment_id=client.get_experiment_by_name("tracking-test").experiment_id) as run:
        assert child_run_env() == {"MLFLOW_TRACKING_URI": client.tracking_uri, "MLFLOW_RUN_ID": run.info.run_id}
    assert child_run_env() == {}


def test_rank0_logs_params_metrics_tags_artifacts(store, monkeypatch, tmp_path):
    client, run_id = store
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    log = RunLogger(rank=0)
    assert log.active
    log.log_params({"optim": {"lr": 1e-3, "betas": [0.9, 0.95]}, "model": {"layers": 2}, "long": "x" * 7000})
    for step in (1, 2, 3):
        log.log_metrics({"loss": 1.0 / step, "acc": np.float32(step / 4), "grad": {"norm": torch.tensor(step)}}, step)
    log.log_metrics({"not_a_number": "hello", "vector": torch.ones(3)}, step=4)  # dropped, no error
    log.set_tags({"lineage.parent": "v1", "ignored": None})
    artifact = tmp_path / "note.txt"
    artifact.write_text("hi")
    log.log_artifact(artifact)
    sample = log.log_system_metrics(step=3)
    log.close()
    assert not log.active

    data = client.get_run(run_id).data
    assert data.params["optim.lr"] == "0.001"
    assert data.params["optim.betas"] == "[0.9, 0.95]"
    assert data.params["model.layers"] == "2"
    assert len(data.params["long"]) == 6000
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, round(m.value, 6)) for m in sorted(history, key=lambda m: m.step)] == [
        (1, 1.0), (2, 0.5), (3, 0.333333)
    ]  # fmt: skip
    assert [m.value for m in client.get_metric_history(run_id, "grad.norm")] == [1.0, 2.0, 3.0]
    assert data.metrics["acc"] == 0.75
    assert "not_a_number" not in data.metrics and "vector" not in data.metrics
    assert data.tags["lineage.parent"] == "v1" and "ignored" not in data.tags
    assert [a.path for a in client.list_artifacts(run_id)] == ["note.txt"]
    assert "system/cpu_utilization_percentage" in sample
    assert "system/process_rss_megabytes" in data.metrics
    assert data.metrics["system/process_rss_megabytes"] > 1


def test_other_ranks_and_runless_processes_log_nothing(store, monkeypatch):
    client, run_id = store
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    for log in (RunLogger(rank=1), RunLogger(rank=3, run_id=run_id)):
        assert not log.active
        log.log_params({"a": 1})
        log.log_metrics({"loss": 1.0}, step=1)
        assert log.log_system_metrics(step=1) == {}
        log.set_tags({"t": "x"})
        log.close()
    monkeypatch.delenv("MLFLOW_RUN_ID")
    assert not RunLogger(rank=0).active  # entry point run by hand: no run id, no logging
    monkeypatch.setenv("RANK", "2")
    assert RunLogger(run_id=run_id).rank == 2 and not RunLogger(run_id=run_id).active
    data = client.get_run(run_id).data
    assert data.params == {} and data.metrics == {}
    assert not any(k.startswith("t") and k == "t" for k in data.tags)


def test_tracking_failures_warn_and_never_raise(store, caplog):
    client, run_id = store
    caplog.set_level(logging.WARNING)
    missing = RunLogger(rank=0, run_id="0" * 32)  # no such run: warning, inactive
    assert not missing.active
    assert "attach" in caplog.text
    log = RunLogger(rank=0, run_id=run_id)
    log.log_params({"lr": 1})
    log.log_params({"lr": 2})  # MLflow params are immutable: rejected → warning only
    assert "log_params" in caplog.text
    log.log_metrics({"loss": float("nan")}, step=1)  # NaN is a value MLflow keeps
    log.log_metrics({"loss": float("inf")}, step=2)
    assert len(client.get_metric_history(run_id, "loss")) == 2
    client.set_terminated(run_id)
    client.delete_run(run_id)
    log.log_metrics({"loss": 1.0}, step=3)  # the run is gone: warning, training goes on


def test_system_metrics_without_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if nvidia-ml-py were missing
    sampler = SystemMetrics()
    assert sampler.gpu_count == 0
    sample = sampler.sample()
    assert {"system/cpu_utilization_percentage", "system/process_rss_megabytes",
            "system/system_memory_usage_percentage"} <= set(sample)  # fmt: skip
    assert not any(key.startswith("system/gpu") for key in sample)
    sampler.close()


def test_system_metrics_with_whatever_is_here():
    sampler = SystemMetrics()  # NVML may or may not find a GPU; never raises
    sample = sampler.sample()
    assert all(isinstance(v, float) for v in sample.values())
    if sampler.gpu_count:
        assert "system/gpu_0_memory_usage_megabytes" in sample
    sampler.close()


def test_flatten_and_numeric_items():
    assert flatten({"a": {"b": {"c": 1}}, "d": [1, 2], "e": {}}) == {"a.b.c": 1, "d": [1, 2], "e": {}}
    assert numeric_items({"x": 1, "y": True, "z": "s", "w": {"v": np.int64(3)}, "bad key!": 2.5}) == {
        "x": 1.0, "y": 1.0, "w.v": 3.0, "bad key_": 2.5
    }  # fmt: skip
