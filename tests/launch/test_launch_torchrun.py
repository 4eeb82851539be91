"""run_torchrun against real torchrun (gloo, world size 2) with the toy entry point in this directory."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from progress_trigger import acting_on_step
from projects import fresh_mlflow_db

from align_pipeline.config import LaunchConfig
from align_pipeline.launch import LaunchError, LaunchInterrupted, build_command, build_env, run_torchrun
from align_pipeline.launch.world import job_backend

pytestmark = pytest.mark.slow  # launches torchrun jobs or a KedroSession

HERE = Path(__file__).parent
TOY_ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), "TOY": "yes"}
TWO = LaunchConfig(nproc_per_node=2, backend="gloo", threads_per_process=1, log_tail_lines=12)


@pytest.fixture(autouse=True)
def _no_outer_mlflow_run(monkeypatch):
    for var in ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- command and environment (no launch) --------------------------------------------------------------------------


@pytest.mark.parametrize("code", [0, 3])
def test_terminate_tree_keeps_the_exit_code_of_a_process_that_ends_on_its_own_terms(code):
    """A torchrun that fails while being stopped must not read as a success: psutil reaping our child left Popen no
    status, and Popen then said 0 (a worker node reported a failed job as finished)."""
    from align_pipeline.launch import terminate_tree

    child = subprocess.Popen([sys.executable, "-c", ("import signal, sys, time\n"
                              f"signal.signal(signal.SIGTERM, lambda *a: sys.exit({code}))\n"
                              "print('ready', flush=True)\ntime.sleep(60)")], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    terminate_tree(child, grace=10)
    assert child.returncode == code


def test_multi_node_command():
    """Node 0 of a two-node job (the other runs `align-pipeline worker`): a c10d rendezvous on the port after the
    job board's, its id derived from the run directory."""
    launch = LaunchConfig(nproc_per_node=8, nnodes=2, master_addr="10.0.0.1", master_port=29511)
    cmd = build_command("align_pipeline.train.sft", "/r/config.json", launch, "/r/logs")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]  # one node: align_pipeline.launch._agent
    opts = dict(zip(cmd[3:15:2], cmd[4:15:2]))
    from align_pipeline.launch.slurm import rdzv_id

    assert opts == {
        "--nnodes": "2",
        "--nproc-per-node": "8",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "10.0.0.1:29512",
        "--rdzv-id": rdzv_id(Path("/r")),
        "--max-restarts": "0",
    }
    # the per-rank shim, then the entry point exactly as `python -m <module> --config <json>` would get it
    assert cmd[15:] == ["-m", "align_pipeline.launch._worker", "/r/logs", "align_pipeline.train.sft", "--config",
                        "/r/config.json"]  # fmt: skip


def test_port_zero_is_bound_by_the_agent_on_one_node_only():
    cmd = build_command("m", "c.json", LaunchConfig(master_port=0), "logs")
    assert cmd[1:3] == ["-m", "align_pipeline.launch._agent"]  # torchrun with its store on loopback
    assert cmd[cmd.index("--master-port") + 1] == "0"  # the agent binds a kernel-picked port itself: no race
    with pytest.raises(ValueError, match="master_port"):
        run_torchrun("m", {}, LaunchConfig(nnodes=2, master_port=0), "/nonexistent")


def test_job_environment(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # setdefault: an explicit user choice is kept
    monkeypatch.setenv("SOME_USER_VAR", "kept")
    env = build_env(LaunchConfig(nproc_per_node=2, threads_per_process=3), "gloo", {"EXTRA": 5, "SOME_USER_VAR": "x"})
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["ALIGN_BACKEND"] == "gloo"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["OMP_WAIT_POLICY"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")  # a user's own choice is kept
    assert env["NCCL_NVLS_ENABLE"] == "1"
    assert env["EXTRA"] == "5" and env["SOME_USER_VAR"] == "x"
    monkeypatch.delenv("NCCL_NVLS_ENABLE")
    env = build_env(LaunchConfig(nproc_per_node=64), "nccl")
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["OMP_NUM_THREADS"] == "1"  # max(1, cores // 64)
    assert "MLFLOW_RUN_ID" not in env
    # dist_backend auto: no backend for the ranks, not even one left in the launcher's own environment
    monkeypatch.setenv("ALIGN_BACKEND", "nccl")
    assert "ALIGN_BACKEND" not in build_env(LaunchConfig(), job_backend("auto"))


# -- real torchrun ------------------------------------------------------------------------------------------------


def test_success_returns_result_streams_rank0_and_keeps_rank_logs(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="align_pipeline.launch")
    result = run_torchrun("toy_entry", {"steps": 3}, TWO, tmp_path, env=TOY_ENV, name="toy")

    assert result["world_size"] == 2
    assert result["allreduced"] == 8.0  # 3 all-reduces of ones over 2 ranks
    # TWO asks for gloo (the legacy spelling launch.backend: gloo is dist_backend), so the launcher sets it
    assert result["env"] == {"OMP_NUM_THREADS": "1", "ALIGN_BACKEND": "gloo", "NCCL_NVLS_ENABLE": "0", "TOY": "yes"}
    assert json.loads((tmp_path / "config.json").read_text())["run_dir"] == str(tmp_path.resolve())

    streamed = [r.getMessage() for r in caplog.records if r.name == "align_pipeline.launch"]
    assert any("step 3/3 | loss 0.333" in m for m in streamed), streamed
    assert any("rank 0 on stderr" in m for m in streamed)
    assert not any("rank 1 on stderr" in m for m in streamed)  # only rank 0 is streamed

    logs = tmp_path / "logs"
    assert "step 3/3" in (logs / "rank0.log").read_text()
    assert "rank 1 on stderr" in (logs / "rank1.log").read_text()  # stdout and stderr in one file per rank
    assert (logs / "torchrun.log").exists()


def test_failing_rank_raises_launch_error_with_its_traceback(tmp_path):
    with pytest.raises(LaunchError) as info:
        run_torchrun("toy_entry", {"mode": "fail", "fail_rank": 1}, TWO, tmp_path, env=TOY_ENV)
    err = info.value
    text = str(err)
    assert "toy_entry" in text
    assert "rank 1" in text
    assert "code 1" in text
    assert "boom from rank 1" in text
    assert 'toy_entry.py", line' in text  # the tail of rank 1's traceback ...
    assert "_worker.py" not in (tmp_path / "logs" / "rank1.log").read_text()  # ... without the launch shim's frames
    assert (err.rank, err.exitcode) == (1, 1)
    assert err.log_path == tmp_path.resolve() / "logs" / "rank1.log"
    assert len(text.splitlines()) < 12 + 6


def test_exit_zero_without_result_is_an_error(tmp_path):
    one = LaunchConfig(nproc_per_node=1, backend="gloo", threads_per_process=1)
    with pytest.raises(LaunchError, match="result.json"):
        run_torchrun("toy_entry", {"mode": "no_result", "steps": 1}, one, tmp_path, env=TOY_ENV)


def _run_interrupted(tmp_path, action, expected):
    with acting_on_step(action) as handler, pytest.raises(expected):
        run_torchrun("toy_entry", {"mode": "hang", "steps": 10_000}, TWO, tmp_path, env=TOY_ENV)
    worker_pids = {int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)}
    assert worker_pids <= {p.pid for p in handler.procs}  # the workers were among what we watched
    assert len(handler.procs) >= 3  # torchrun + 2 workers
    alive = [p for p in handler.procs if not _gone(p)]
    assert not alive, f"orphans left: {alive}"


def test_ctrl_c_stops_the_whole_job(tmp_path):
    # Python's own Ctrl-C handler, whatever this process inherited: a suite started in the background by a script
    # has SIGINT ignored, and the signal would then never arrive (test_launch_faults covers that case with SIGTERM).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _run_interrupted(tmp_path, lambda: os.kill(os.getpid(), signal.SIGINT), KeyboardInterrupt)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_exception_in_parent_stops_the_whole_job(tmp_path):
    def fail():
        raise RuntimeError("parent failed while streaming")

    _run_interrupted(tmp_path, fail, RuntimeError)


def test_sigterm_to_the_parent_stops_the_whole_job(tmp_path):
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    _run_interrupted(tmp_path, lambda: os.kill(os.getpid(), signal.SIGTERM), LaunchInterrupted)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the launcher's handler is gone again


PARENT_SCRIPT = """
import sys
from align_pipeline.launch import run_torchrun
run_torchrun("toy_entry", {"mode": "hang", "steps": 10_000}, {"nproc_per_node": 2, "backend": "gloo"}, sys.argv[1],
             env={"PYTHONPATH": sys.argv[2]})
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")
def test_sigkilled_parent_leaves_no_job_behind(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT_SCRIPT, str(tmp_path), str(HERE)])
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        job = psutil.Process(parent.pid).children(recursive=True)
        assert len(job) >= 3
    finally:
        parent.kill()  # SIGKILL: no clean-up code runs in the parent
        parent.wait()
    _, alive = psutil.wait_procs(job, timeout=15)
    assert all(_gone(p) for p in alive), f"orphans left: {alive}"


def test_a_one_process_job_runs_without_an_agent_its_store_on_loopback_and_dies_with_its_parent(tmp_path):
    """nproc_per_node 1 on one node: the launcher starts the rank itself (no torchrun agent in between), the rank hosts
    its rendezvous store on 127.0.0.1 only, and a SIGKILLed launcher leaves nothing behind."""
    script = PARENT_SCRIPT.replace('"nproc_per_node": 2', '"nproc_per_node": 1')
    parent = subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(HERE)])
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pid0").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        rank = psutil.Process(int((tmp_path / "pid0").read_text()))
        assert rank.ppid() == parent.pid  # the launcher's own child: no agent
        deadline = time.monotonic() + 120
        listening = []
        while not listening and time.monotonic() < deadline:
            listening = [c.laddr for c in rank.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
            time.sleep(0.1)
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
        job = [rank, *rank.children(recursive=True)]
    finally:
        parent.kill()
        parent.wait()
    _, alive = psutil.wait_procs(job, timeout=15)
    assert all(_gone(p) for p in alive), f"orphans left: {alive}"


def test_job_logs_into_the_active_mlflow_run(tmp_path, monkeypatch):
    """The launcher hands the active run to the job; rank 0 alone logs into it."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from align_pipeline.tracking import default_tracking_uri

    fresh_mlflow_db(tmp_path / "mlflow.db")
    uri = default_tracking_uri(tmp_path)
    mlflow.set_tracking_uri(uri)
    try:
        experiment_id = MlflowClient(uri).create_experiment("launch-test")
        with mlflow.start_run(experiment_id=experiment_id) as run:
            result = run_torchrun("toy_entry", {"steps": 3}, TWO, tmp_path / "job", env=TOY_ENV)
        assert result["world_size"] == 2
        client = MlflowClient(uri)
        history = client.get_metric_history(run.info.run_id, "loss")
        assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]  # once: rank 0 only
        data = client.get_run(run.info.run_id).data
        assert data.params["toy.steps"] == "3"
        assert "system/cpu_utilization_percentage" in data.metrics
    finally:
        mlflow.set_tracking_uri(None)
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
