"""Item 12: ``kedro run`` started in the background by a script (SIGINT ignored, as cron/CI/schedulers leave it)
is stopped by SIGTERM as cleanly as by Ctrl-C: no process of the job left, the MLflow runs KILLED, the resumable
checkpoints kept; the rerun resumes and ends with the same weights as a run that was never interrupted.

Real ``kedro`` CLI in subprocesses on a temp copy of the project, a tiny model, a real sqlite MLflow store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from projects import copy_project

pytestmark = pytest.mark.slow  # kedro CLI + torchrun jobs

STEPS = 12
FAST = {
    "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
              "ffn_hidden_size": 64},
    "sft": {"training": {"train_steps": STEPS, "global_batch_size": 8, "micro_batch_size": 4, "log_interval": 1,
                         "eval_interval": STEPS, "eval_samples": 16, "save_interval": 2,
                         "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 2}}},
}  # fmt: skip


@pytest.fixture
def project(tmp_path):
    return copy_project(tmp_path / "proj", params={"local/fast": FAST})


def _kedro(root: Path, *args: str, **popen: object) -> subprocess.Popen:
    env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "true", "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
           "MLFLOW_EXPERIMENT_NAME": "signals", "COLUMNS": "200"}  # fmt: skip
    env.pop("MLFLOW_RUN_ID", None)
    cmd = [sys.executable, "-c", "from kedro.framework.cli import main; main()", "run", *args]
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen)  # fmt: skip


def _ignore_sigint() -> None:  # what a background job of a non-interactive shell inherits
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from align_pipeline.model.hf_export import CheckpointTensors

    tensors = CheckpointTensors(model_dir)
    return tensors.read(*[name for name in tensors.shapes if not name.startswith("optimizer")])


def test_sigterm_to_a_background_kedro_run_stops_it_cleanly_and_the_rerun_resumes_exactly(project):
    from mlflow import MlflowClient

    from align_pipeline.model.checkpoint import complete_checkpoints

    run = _kedro(project, "--pipelines", "data_prep,sft", preexec_fn=_ignore_sigint)
    runs_root = project / "data" / "06_models" / "_runs" / "sft"
    try:
        deadline = time.monotonic() + 240
        while not any(len(complete_checkpoints(d)) >= 2 for d in runs_root.glob("*")):  # two saves done
            assert run.poll() is None, run.stdout.read()
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
        job = psutil.Process(run.pid).children(recursive=True)
        assert any("align_pipeline.launch._worker" in " ".join(p.cmdline()) for p in job)
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 128 + signal.SIGTERM, out
    _, alive = psutil.wait_procs(job, timeout=15)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes of the job outlived it: {alive}"

    (run_dir,) = list(runs_root.glob("*"))
    kept = complete_checkpoints(run_dir)
    assert kept and max(kept) < STEPS  # the resumable checkpoints are still there

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("signals").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]  # named after the pipelines, any order
    status = {r.data.tags.get("kedro.node", "parent"): r.info.status for r in runs}
    assert status["train_sft"] == "KILLED" and parent.info.status == "KILLED", status

    resumed = _kedro(project, "--pipelines", "sft")  # the rerun: same inputs, same run dir
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert f"[sft] resumed at step {max(kept)}" in out

    fresh = _kedro(project, "--pipelines", "sft")  # the run dir was handed over: this one trains from step 0
    out, _ = fresh.communicate(timeout=300)
    assert fresh.returncode == 0, out
    assert "resumed at step" not in out
    first, second = sorted((project / "data" / "06_models" / "sft_policy").iterdir())
    a, b = _weights(first / "sft_policy"), _weights(second / "sft_policy")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run's weights differ from an uninterrupted run's"
