"""Multi-node without Slurm, simulated on one machine: node 0 is this process (`kedro run` through a KedroSession, or
run_torchrun), the other node an `align-pipeline worker` process; their torchruns meet in a c10d rendezvous on
loopback. The SFT stage gives the same numbers as one node with the same world size, rank 0's result is the Kedro
node's output, the worker exits 0 when the run ends; a rank that raises fails node 0 with its error and the worker
exits 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from projects import copy_project, enter_project, run_kedro

from align_pipeline.config import LaunchConfig
from align_pipeline.launch import LaunchError, board_auth, free_port, multinode, run_torchrun

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
TOY_PATH = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])


@pytest.fixture(autouse=True)
def board_secret(tmp_path, monkeypatch):
    """Node 0 (this process) writes the board's secret there, the worker reads it there."""
    monkeypatch.setenv(board_auth.SECRET_FILE_ENV, str(tmp_path / "board.key"))


def _worker(port: int) -> subprocess.Popen:
    # toy_entry: the test entry point this worker's operator allows besides the stages
    env = {**os.environ, "PYTHONPATH": TOY_PATH, "KEDRO_DISABLE_TELEMETRY": "true",
           board_auth.WORKER_MODULES_ENV: "toy_entry"}
    return subprocess.Popen([sys.executable, "-m", "align_pipeline", "worker", "--master-addr", "127.0.0.1",
                             "--master-port", str(port), "--connect-timeout", "120"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _params(launch: dict) -> dict:
    return {"model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64},
            "launch": {"threads_per_process": 1, "dist_backend": "gloo", **launch},
            "sft": {"training": {"train_steps": 6, "global_batch_size": 8, "micro_batch_size": 2, "log_interval": 2,
                                 "eval_interval": 0, "eval_samples": 16}}}


def test_two_nodes_through_kedro_equal_one_node_of_two(tmp_path, monkeypatch):
    port = free_port()
    two_nodes = {"nnodes": 2, "nproc_per_node": 1, "master_addr": "127.0.0.1", "master_port": port}
    root = enter_project(monkeypatch, copy_project(tmp_path / "p", params={"test/fast": _params(two_nodes)}), "mn")
    worker = _worker(port)
    try:
        run_kedro(root, "data_prep", "sft")
        out, _ = worker.communicate(timeout=60)
    finally:
        worker.kill()
    assert worker.returncode == 0, out
    assert "job 0: align_pipeline.train.sft" in out and "node 0 finished; exiting (ok)" in out, out
    (root / "conf" / "test" / "parameters_fast.yml").write_text(yaml.safe_dump(_params({"nproc_per_node": 2})))
    run_kedro(root, "sft")
    two, one = sorted((root / "data" / "06_models" / "sft_policy").iterdir())
    metas = [json.loads((v / "sft_policy" / "meta.json").read_text()) for v in (two, one)]
    assert metas[0]["metrics"] == metas[1]["metrics"]  # world size 2 either way: the same numbers


def test_a_rank_failing_on_either_node_fails_node_0_with_its_error(tmp_path):
    port = free_port()
    launch = LaunchConfig(nnodes=2, nproc_per_node=1, master_addr="127.0.0.1", master_port=port,
                          dist_backend="gloo", threads_per_process=1, log_tail_lines=12)
    worker = _worker(port)
    try:
        with pytest.raises(LaunchError) as info:
            run_torchrun("toy_entry", {"mode": "fail", "fail_rank": 1}, launch, tmp_path,
                         env={"PYTHONPATH": TOY_PATH})
        multinode.shutdown()
        out, _ = worker.communicate(timeout=60)
    finally:
        worker.kill()
    assert "ValueError: boom from rank 1" in str(info.value), str(info.value)
    assert worker.returncode == 1, out
