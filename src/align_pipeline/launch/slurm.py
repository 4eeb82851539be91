"""A stage's torchrun job as a Slurm job (``launch.backend: slurm``).

The node writes ``<run_dir>/slurm_job.sh`` and submits it with ``sbatch`` (or, inside an allocation, where
``SLURM_JOB_ID`` is set, runs it directly: its ``srun`` is then a step of that allocation). The script starts one
task per node, and each task runs torchrun with a c10d rendezvous on the job's first node::

    srun --nodes N --ntasks-per-node 1 python -m torch.distributed.run --nnodes N --nproc-per-node G \\
        --rdzv-backend c10d --rdzv-endpoint <first node>:<rdzv_port> --rdzv-id <from the run directory> \\
        -m align_pipeline.launch._worker <run_dir>/logs <module> --config <run_dir>/config.json

Everything else is the local launcher's (:mod:`align_pipeline.launch.torchrun`): the rank logs in
``<run_dir>/logs`` (the run directory must be on a filesystem every node sees, as the checkpoints already require),
rank 0's log streamed with the usual progress lines, its ``result.json`` returned, a failing rank's error raised
with its log tail. The job's environment is the launching process's (``sbatch`` exports it), so MLflow attaches
exactly as for local runs. Ctrl-C, a SIGTERM or any exception in the launching process cancels the job
(``scancel``) and waits until Slurm has ended it.
"""

from __future__ import annotations

import hashlib
import logging
import shlex
import subprocess
import sys
import time
from pathlib import Path

from align_pipeline.config.base import ConfigError, control_character
from align_pipeline.config.common import LaunchConfig

logger = logging.getLogger("align_pipeline.launch")

CANCEL_WAIT_S = 60.0
"""How long a cancelled job may take to leave the queue before the launcher gives up waiting."""
_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
          "OUT_OF_MEMORY"}


class SlurmError(RuntimeError):
    """Slurm refused or lost the job (``sbatch`` failed, the job vanished): not a rank's failure."""


def rdzv_id(run_dir: Path) -> str:
    """The c10d rendezvous id of a stage's job: derived from its run directory (a rerun of the same stage, e.g. a
    resume, gets the same id; two stages never share one)."""
    return "align-" + hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def job_script(module: str, config_path: Path, launch: LaunchConfig, log_dir: Path, label: str,
               worker_module: str) -> str:
    """The batch script: ``#SBATCH`` options from ``launch`` and ``launch.slurm``, then one torchrun per node.

    Every word is ``shlex.quote``-d (the interpreter, the paths, the modules, the options), so a space or ``$(...)``
    in any of them stays part of that word; the one expansion is the first node's name (``"$head"``). A value with a
    control character cannot be written into a line of the script at all: the config's Slurm fields are refused when
    the parameters are loaded (:class:`~align_pipeline.config.SlurmConfig`), and any other value (the run directory,
    the interpreter's path) here, with a :class:`~align_pipeline.config.ConfigError` naming it.
    """
    s = launch.slurm
    name = "align-" + "".join(c if c.isalnum() or c in "._-" else "_" for c in label)
    options = [f"--job-name={name}", f"--nodes={launch.nnodes}", "--ntasks-per-node=1",
               f"--output={log_dir / 'torchrun.log'}", "--open-mode=append",
               "--no-requeue"]  # a preempted / failed-node job ends: the launcher reports it, a rerun resumes
    options += [f"--{key.replace('_', '-')}={value}" for key, value in
                (("partition", s.partition), ("account", s.account), ("time", s.time),
                 ("gpus_per_node", s.gpus_per_node), ("cpus_per_task", s.cpus_per_task)) if value is not None]
    options += [str(line) for line in s.sbatch_lines]
    srun = ["srun", "--kill-on-bad-exit=1", f"--nodes={launch.nnodes}", f"--ntasks={launch.nnodes}",
            "--ntasks-per-node=1", *([f"--cpus-per-task={s.cpus_per_task}"] if s.cpus_per_task else [])]
    torchrun = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(launch.nnodes), "--nproc-per-node", str(launch.nproc_per_node),
        "--rdzv-backend", "c10d", "--rdzv-id", rdzv_id(log_dir.parent), "--max-restarts", "0",
    ]  # fmt: skip
    worker = ["-m", worker_module, str(log_dir), module, "--config", str(config_path)]
    for what, value in (("the job's label", label), ("the Python interpreter's path (sys.executable)", sys.executable),
                        ("the run directory", str(log_dir.parent)), ("the job's config path", str(config_path)),
                        *(("an #SBATCH option", o) for o in options),
                        *(("a word of the srun command", w) for w in srun + torchrun + worker)):
        found = control_character(value)
        if found:
            raise ConfigError(f"launch.backend=slurm: {what} {value!r} contains {found}; it cannot be written into "
                              "a line of slurm_job.sh")
    endpoint = f'"$head":{int(s.rdzv_port)}'  # the first node's name, expanded by the job's shell
    command = " ".join([shlex.join(srun + torchrun), "--rdzv-endpoint", endpoint, shlex.join(worker)])
    return "\n".join([
        "#!/bin/bash",
        f"# {name}: written by align_pipeline.launch.slurm; submit with sbatch (or run inside an allocation)",
        *(f"#SBATCH {shlex.quote(option)}" for option in options),
        "set -euo pipefail",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',  # sed reads all: no SIGPIPE under pipefail
        command,
        "",
    ])  # fmt: skip


def inside_allocation(env: dict[str, str]) -> bool:
    """Whether the launching process runs inside a Slurm allocation (the job then runs as a step of it)."""
    return bool(env.get("SLURM_JOB_ID"))


def _run(cmd: list[str], env: dict[str, str]) -> str:
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError as exc:
        raise SlurmError(f"launch.backend=slurm but {cmd[0]!r} is not on PATH (Slurm's client commands are needed "
                         "on the machine that runs kedro)") from exc
    if out.returncode != 0:
        raise SlurmError(f"{shlex.join(cmd)} failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip()


def submit(script: Path, env: dict[str, str]) -> str:
    """``sbatch`` the script; returns the job id."""
    return _run(["sbatch", "--parsable", str(script)], env).split(";")[0]


QUERY_RETRY_S = 300.0
"""How long ``scontrol`` may keep failing (a busy or restarting controller) before the launcher gives up."""


def job_state(job_id: str, env: dict[str, str], retry_s: float = QUERY_RETRY_S) -> tuple[str, int | None, str]:
    """(state, exit code or None while running, reason) of a job from ``scontrol show job``; a failing query is
    retried for ``retry_s`` seconds (then :class:`SlurmError`)."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            text = _run(["scontrol", "show", "job", "-o", job_id], env)
            break
        except SlurmError as exc:
            if "Invalid job id" in str(exc):
                return "GONE", None, "purged from slurmctld"
            if time.monotonic() >= deadline:
                raise
            logger.warning("Slurm job %s: state query failed (%s); retrying", job_id, exc)
            time.sleep(5.0)
    fields = dict(item.split("=", 1) for item in text.split() if "=" in item)
    state = fields.get("JobState", "UNKNOWN")
    code, _, sig = fields.get("ExitCode", "0:0").partition(":")
    exit_code = (128 + int(sig) if sig and int(sig) else int(code)) if state in _ENDED else None
    return state, exit_code, fields.get("Reason", "")


def cancel(job_id: str, env: dict[str, str], label: str) -> None:
    """``scancel`` the job and wait until Slurm has ended it (at most :data:`CANCEL_WAIT_S`); never raises (it runs
    while another exception is on its way), but says so when the end could not be confirmed."""
    logger.warning("%s: cancelling Slurm job %s", label, job_id)
    state = "unknown"
    try:
        subprocess.run(["scancel", job_id], env=env, capture_output=True, check=False, timeout=60)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            state, _, _ = job_state(job_id, env, retry_s=10.0)
            if state in _ENDED or state == "GONE":
                return
            time.sleep(0.5)
    except Exception as exc:  # noqa: BLE001 - report, do not mask the exception being handled
        state = f"unknown ({exc})"
    logger.error("%s: could not confirm that Slurm job %s ended (state %s): check `squeue -j %s` and scancel it",
                 label, job_id, state, job_id)


def wait(job_id: str, env: dict[str, str], launch: LaunchConfig, label: str, pump) -> tuple[int, str]:
    """Poll the job until it ends, calling ``pump()`` (the log follower) in between; returns (its exit code, how
    it ended: "" when it completed, else e.g. "Slurm job 12 ended TIMEOUT (reason)"). Any exception (Ctrl-C,
    SIGTERM turned into one, Slurm unreachable) cancels the job first."""
    shown = ""
    try:
        while True:
            state, exit_code, reason = job_state(job_id, env)
            pump()
            if state == "GONE":
                raise SlurmError(f"Slurm job {job_id} left slurmctld's records before its end was seen")
            if state in _ENDED:
                if state == "COMPLETED":
                    return int(exit_code or 0), ""
                why = f" ({reason})" if reason and reason != "None" else ""
                # CANCELLED by someone else, TIMEOUT, NODE_FAIL...: a failure even with ExitCode 0:0
                return int(exit_code or 1), f"Slurm job {job_id} ended {state}{why}"
            if state != shown:
                logger.info("%s: Slurm job %s %s%s", label, job_id, state.lower(),
                            f" ({reason})" if reason and reason != "None" else "")
                shown = state
            time.sleep(launch.slurm.poll_s)
    except BaseException:
        cancel(job_id, env, label)
        raise


def describe(launch: LaunchConfig, env: dict[str, str]) -> str:
    where = f"step of allocation {env['SLURM_JOB_ID']}" if inside_allocation(env) else "sbatch"
    return f"Slurm ({where}) {launch.nnodes} node(s) x {launch.nproc_per_node} proc(s)"


__all__ = ["SlurmError", "cancel", "job_script", "job_state", "rdzv_id", "submit", "wait"]
