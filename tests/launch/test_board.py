"""The multi-node job board against a third process: node 0 is this process (its real board, a ``TCPStore`` on
loopback), the other node a real `align-pipeline worker`, the intruder a real process with a plain ``TCPStore``
client (board_intruder.py). The board listens on master_addr only; unsigned, wrong-key, replayed and forged control
posts are refused with a line naming why while the real jobs still run; a worker runs only the stage entry points
with the job environment keys the project uses; without this run's secret a worker exits 2 with one line."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from align_pipeline.config import LaunchConfig
from align_pipeline.launch import board_auth, free_port, multinode, run_torchrun

HERE = Path(__file__).parent
TOY_PATH = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])


class _Worker:
    """`align-pipeline worker` on loopback, its output collected line by line."""

    def __init__(self, port: int, timeout_s: float = 120, **env: str) -> None:
        env = {**os.environ, "PYTHONPATH": TOY_PATH, "KEDRO_DISABLE_TELEMETRY": "true", **env}
        self.proc = subprocess.Popen([sys.executable, "-m", "align_pipeline", "worker", "--master-addr", "127.0.0.1",
                                      "--master-port", str(port), "--connect-timeout", str(timeout_s)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.out:
            assert time.monotonic() < deadline and self.proc.poll() is None, f"no {text!r} in:\n{self.out}"
            time.sleep(0.1)

    def finish(self, timeout_s: float = 60) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        finally:
            self.proc.kill()
            self._reader.join(timeout=10)
        return code


class _Intruder:
    """board_intruder.py: posts what it is told, as a client of the board."""

    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "board_intruder.py"), str(port)], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout.readline() == "ok\n"  # connected

    def __call__(self, *args: str) -> None:
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "ok\n"


def _launch(port: int) -> LaunchConfig:
    return LaunchConfig(nnodes=2, nproc_per_node=1, master_addr="127.0.0.1", master_port=port, dist_backend="gloo",
                        threads_per_process=1)


@pytest.fixture
def secret_file(tmp_path, monkeypatch):
    path = tmp_path / "secret" / "board.key"
    monkeypatch.setenv(board_auth.SECRET_FILE_ENV, str(path))
    yield path
    multinode.shutdown()


def test_the_board_listens_on_master_addr_only(secret_file):
    port = free_port()
    multinode.board(_launch(port))
    with socket.create_connection(("127.0.0.1", port), timeout=10):
        pass
    with pytest.raises(ConnectionRefusedError):  # another address of this machine (all of 127/8 is loopback)
        socket.create_connection(("127.0.0.2", port), timeout=10).close()
    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert listening == {("127.0.0.1", port)}, listening
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert len(board_auth.read_secret(secret_file)) == board_auth.SECRET_BYTES
    multinode.shutdown()
    assert not secret_file.exists()  # the secret lives as long as the run's board


@pytest.mark.slow
def test_forged_posts_are_refused_and_the_real_job_runs(tmp_path, secret_file, caplog):
    port = free_port()
    launch = _launch(port)
    multinode.board(launch)
    worker, intrude = _Worker(port, ALIGN_WORKER_MODULES="toy_entry"), None
    evil = tmp_path / "evil"
    (evil / "logs").mkdir(parents=True)
    (evil / "config.json").write_text(json.dumps({"run_dir": str(evil), "mode": "ok"}))
    forged_job = json.dumps({"module": "toy_entry", "config": str(evil / "config.json"), "rdzv_id": "evil",
                             "launch": {"nnodes": 2, "nproc_per_node": 1, "master_port": port},
                             "env": {"PYTHONPATH": str(evil)}})
    try:
        intrude = _Intruder(port)
        worker.wait_for("joined the job board")
        intrude("set", "job/0", forged_job)
        worker.wait_for("refused job/0 on the job board: unsigned")
        intrude("sign-wrong", "job/0", forged_job)
        worker.wait_for("refused job/0 on the job board: bad signature (not signed with this run's board secret)")
        intrude("set", "shutdown", "1")
        worker.wait_for("refused shutdown on the job board: unsigned")
        intrude("set", "done/0", json.dumps({"ok": False}))  # would stop the worker's job 0
        intrude("add", "status_count/0", "1")  # a worker's failure of job 0: would stop node 0's
        intrude("set", "status/0/0", json.dumps({"ok": False, "node": "x", "message": "forged"}))
        with caplog.at_level(logging.INFO, logger="align_pipeline.launch"):
            result = run_torchrun("toy_entry", {"mode": "ok"}, launch, tmp_path / "run", env={"PYTHONPATH": TOY_PATH})
        worker.wait_for("job 0 finished")
        intrude("copy", "job/0", "job/1")  # the genuine job 0, posted again as job 1
        worker.wait_for("refused job/1 on the job board: replayed: signed for 'job/0'")
        multinode.shutdown()
        code = worker.finish()
    finally:
        worker.proc.kill()
        if intrude is not None:
            intrude.proc.kill()
    out = worker.out
    assert code == 0, out
    assert result["world_size"] == 2
    assert "node 0 finished; exiting (ok)" in out, out
    assert "refused done/0 on the job board: unsigned" in out, out
    assert "job 0: dropped environment key(s) PYTHONPATH (not job settings)" in out, out
    assert "ignored status/0/0 on the job board: unsigned" in caplog.text, caplog.text
    assert not list((evil / "logs").iterdir())  # the forged job never ran


def test_a_message_is_refused_when_stale_or_replayed_on_its_own_key(monkeypatch):
    node0, worker = board_auth.Channel(b"k" * 32, "node0"), board_auth.Channel(b"k" * 32, "w")
    first, second = node0.seal("done/0", {"ok": True}), node0.seal("done/0", {"ok": False})
    assert worker.open("done/0", first) == worker.open("done/0", first) == {"ok": True}  # polled again: the same post
    assert worker.open("done/0", second) == {"ok": False}
    with pytest.raises(board_auth.Refused, match="replayed: its nonce was used before"):
        worker.open("done/0", first)
    now = time.time()
    monkeypatch.setattr(board_auth.time, "time", lambda: now - 2 * board_auth.MAX_AGE_S)
    old = node0.seal("job/1", {})
    monkeypatch.setattr(board_auth.time, "time", lambda: now)
    with pytest.raises(board_auth.Refused, match=r"stale: signed 3600 s ago \(limit 1800 s\)"):
        worker.open("job/1", old)


def test_a_worker_runs_only_stage_entry_points(tmp_path, secret_file):
    port = free_port()
    launch = _launch(port)
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"run_dir": str(run_dir), "mode": "ok"}))
    multinode.board(launch)
    worker = _Worker(port)  # toy_entry is importable there, but not a stage entry point
    try:
        n = multinode.post(launch, "toy_entry", run_dir / "config.json", None)  # genuine, signed by node 0
        failures = multinode.worker_failures(launch, n, wait_s=60)
        multinode.shutdown()
        code = worker.finish()
    finally:
        worker.proc.kill()
    expected = (f"worker {failures[0]['node']} refused job 0: module 'toy_entry' is not a stage entry point of "
                f"align_pipeline ({', '.join(board_auth.entry_points())}) nor in this worker's $ALIGN_WORKER_MODULES")
    assert [f["message"] for f in failures] == [expected], failures
    assert "refused job 0: module 'toy_entry' is not a stage entry point" in worker.out, worker.out
    assert code == 1, worker.out
    assert not list((run_dir / "logs").iterdir())  # nothing started


def test_a_worker_without_this_runs_secret_exits_2_with_one_line(tmp_path, secret_file):
    port = free_port()
    multinode.board(_launch(port))
    old = tmp_path / "old.key"
    board_auth.write_secret(old)  # another run's secret
    worker = _Worker(port, timeout_s=3, ALIGN_BOARD_SECRET_FILE=str(old))
    try:
        code = worker.finish()
    finally:
        worker.proc.kill()
    assert code == 2, worker.out
    errors = [line for line in worker.lines if " ERROR " in line]
    assert len(errors) == 1 and f"node 0's hello does not open with the secret in {old}: bad signature" in errors[0]
    assert f"name it in ${board_auth.SECRET_FILE_ENV}" in errors[0], worker.out
