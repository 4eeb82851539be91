"""``launch.backend: slurm`` against a real Slurm (slurmctld + slurmd + munge, one node on loopback, started here):
the SFT stage through Kedro gives the local launcher's numbers and logs into MLflow the same way; a rank that raises
fails the launch with its error and log tail; Ctrl-C cancels the Slurm job. Skipped with the reason where Slurm
cannot start (binaries missing, not root); .ci/run installs Debian's packages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from progress_trigger import acting_on_step
from projects import copy_project, enter_project, run_kedro
from slurm_cluster import SlurmCluster, SlurmUnavailable, unavailable_reason

from align_pipeline.config import LaunchConfig
from align_pipeline.launch import LaunchError, run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable_reason() is not None,
                                                   reason=f"Slurm cannot start here: {unavailable_reason()}")]

HERE = Path(__file__).parent
TOY_ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
SLURM_TWO = LaunchConfig(nproc_per_node=2, backend="slurm", dist_backend="gloo", threads_per_process=1,
                         log_tail_lines=12)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        env = c.start()
    except SlurmUnavailable as exc:
        pytest.skip(f"Slurm cannot start here: {exc}")
    mp = pytest.MonkeyPatch()
    for key, value in env.items():
        mp.setenv(key, value)
    for var in [v for v in os.environ if v.startswith("SLURM_") and v not in env]:
        mp.delenv(var)  # sbatch, not a step of some outer allocation
    yield c
    mp.undo()
    c.stop()


def _queue() -> str:
    return subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, check=True).stdout.strip()


def _sft_params(launch: dict) -> dict:
    return {"test/fast": {
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64},
        "launch": {"nproc_per_node": 2, "threads_per_process": 1, "dist_backend": "gloo", **launch},
        "sft": {"training": {"train_steps": 6, "global_batch_size": 8, "micro_batch_size": 2, "log_interval": 2,
                             "eval_interval": 0, "eval_samples": 16}}}}


def test_sft_stage_through_slurm_equals_the_local_launcher(cluster, tmp_path, monkeypatch):
    """`kedro run --pipelines sft` with `launch.backend: slurm` (sbatch, world size 2, c10d rendezvous): the same
    losses as the local launcher on the same seed, the stage's MLflow child run gets the job's metrics, and the job
    left the queue."""
    from mlflow.tracking import MlflowClient

    root = enter_project(monkeypatch, copy_project(tmp_path / "p", params=_sft_params({})), "slurm")
    run_kedro(root, "data_prep", "sft")
    import yaml

    (root / "conf" / "test" / "parameters_fast.yml").write_text(yaml.safe_dump(_sft_params({"backend": "slurm"})[
        "test/fast"]))
    run_kedro(root, "sft")
    local, on_slurm = sorted((root / "data" / "06_models" / "sft_policy").iterdir())
    metrics = [json.loads((v / "sft_policy" / "meta.json").read_text())["metrics"] for v in (local, on_slurm)]
    assert metrics[0]["val_loss"] == metrics[1]["val_loss"] and metrics[0]["train_loss"] == metrics[1]["train_loss"]
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("slurm").experiment_id],
                              "tags.`kedro.node` = 'train_sft'", order_by=["start_time ASC"])
    assert len(runs) == 2
    assert [r.data.metrics.get("val_loss") for r in runs] == [m["val_loss"] for m in metrics]  # rank 0 logged it
    assert _queue() == ""


def test_failing_rank_fails_the_launch_with_its_error(cluster, tmp_path):
    with pytest.raises(LaunchError) as info:
        run_torchrun("toy_entry", {"mode": "fail", "fail_rank": 1}, SLURM_TWO, tmp_path, env=TOY_ENV)
    text = str(info.value)
    assert "rank 1" in text and "ValueError: boom from rank 1" in text, text
    assert "#SBATCH --nodes=1" in (tmp_path / "slurm_job.sh").read_text()
    assert _queue() == ""


def test_ctrl_c_cancels_the_slurm_job(cluster, tmp_path):
    # Python's own Ctrl-C handler, whatever this process inherited (a suite started in the background by a script
    # has SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with acting_on_step(lambda: os.kill(os.getpid(), signal.SIGINT)) as handler, \
                pytest.raises(KeyboardInterrupt):
            run_torchrun("toy_entry", {"mode": "hang", "steps": 10_000}, SLURM_TWO, tmp_path, env=TOY_ENV)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert handler.procs  # it fired
    assert _queue() == ""  # cancelled, and gone from the queue
    ranks = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) for p in ranks)


def test_inside_an_allocation_the_job_runs_as_a_step_of_it(cluster, tmp_path, monkeypatch):
    """With SLURM_JOB_ID set (kedro started inside `salloc` / a batch job) nothing is submitted: the script runs
    as a step of that allocation (`srun`), and the allocation is still there afterwards."""
    job_id = subprocess.run(["salloc", "--no-shell", "--nodes=1", "--job-name=outer"], capture_output=True,
                            text=True, check=True).stderr
    job_id = next(w for w in job_id.split() if w.isdigit())
    node = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True,
                          check=True).stdout.strip()
    monkeypatch.setenv("SLURM_JOB_ID", job_id)
    monkeypatch.setenv("SLURM_JOB_NODELIST", node)
    try:
        result = run_torchrun("toy_entry", {"mode": "ok", "steps": 3}, SLURM_TWO, tmp_path, env=TOY_ENV)
        assert result["world_size"] == 2 and result["final_loss"] == pytest.approx(1 / 3)
        assert _queue().split() == [job_id, "RUNNING"]  # no job of its own; the allocation lives on
    finally:
        subprocess.run(["scancel", job_id], check=False)
