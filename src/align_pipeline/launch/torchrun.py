"""Run a training entry point as a torchrun job from a Kedro node, stream its progress, report its failures.

    result = run_torchrun("align_pipeline.train.sft", config, LaunchConfig(nproc_per_node=2), run_dir)

starts, in its own session (process group),

    python -m align_pipeline.launch._agent --nnodes 1 --nproc-per-node 2 --node-rank 0 \\
        --master-addr 127.0.0.1 --master-port 0 --max-restarts 0 \\
        -m align_pipeline.launch._worker <run_dir>/logs align_pipeline.train.sft --config <run_dir>/config.json

``launch._agent`` is torchrun itself with its rendezvous store listening on 127.0.0.1 only (multi-node jobs run
``torch.distributed.run`` directly). ``launch._worker`` is a thin shim: it sends the rank's stdout+stderr to ``<run_dir>/logs/rank<N>.log`` and then runs
the entry point exactly like ``python -m <module> --config <json>``. torchrun's own (agent) output goes to
``<run_dir>/logs/torchrun.log``.

- Progress: the log of this node's first rank (rank 0 on the master node) is followed while the job runs and each
  line goes to the ``align_pipeline.launch`` logger at INFO, so ``kedro run`` shows the entry point's progress.
- Result: on exit 0, rank 0 must have written ``<run_dir>/result.json`` (a dict); it is returned.
- Failure: :class:`LaunchError` names the module, the rank that failed first, its exit code and the last
  ``log_tail_lines`` lines of its log (the Python traceback). The first failing rank is the earliest
  ``rank<N>.exit.json`` written by the shim; for a rank killed by a signal, torchrun's "Root Cause" summary.
- Interrupts: on Ctrl-C or any exception in the parent, torchrun and all of its descendants (workers run in their
  own sessions) get SIGTERM, then SIGKILL after ``TERMINATE_GRACE_S``; the exception is re-raised. While the job
  runs, a SIGTERM to the parent (``kill``, Slurm, ``docker stop``) raises :class:`LaunchInterrupted` so the same
  clean-up happens (only where SIGTERM had its default action, in the main thread). On Linux torchrun also gets a
  parent-death signal, so even a SIGKILLed parent leaves no job behind (torchrun then stops its workers).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from align_pipeline.config.base import from_dict
from align_pipeline.config.common import LaunchConfig
from align_pipeline.errors import UserError
from align_pipeline.launch import multinode, slurm, world
from align_pipeline.launch.env import job_warning_filters, parallel_env
from align_pipeline.tracking.mlflow_logger import child_run_env
from align_pipeline.tracking.runs import log_artifacts_to_active_run

logger = logging.getLogger("align_pipeline.launch")

WORKER_MODULE = "align_pipeline.launch._worker"
AGENT_MODULE = "align_pipeline.launch._agent"
"""torchrun with its store bound to ``master_addr`` (loopback): used for single-node jobs."""
TERMINATE_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL when the parent stops the job."""
_POLL_S = 0.1


class LaunchInterrupted(SystemExit):
    """The parent got SIGTERM while a job ran; the job was stopped. Exits the process with 128 + 15 if uncaught."""


class LaunchError(UserError, RuntimeError):
    """A torchrun job failed. ``rank``/``exitcode`` are those of the first failing rank (None when unknown)."""

    def __init__(
        self,
        message: str,
        *,
        module: str | None = None,
        rank: int | None = None,
        exitcode: int | None = None,
        log_path: Path | None = None,
    ) -> None:
        super().__init__(message)
        self.module = module
        self.rank = rank
        self.exitcode = exitcode
        self.log_path = log_path


class RunDirBusy(UserError, RuntimeError):
    """Another job (or what is left of one) still runs in this run directory."""


LOCK_NAME = ".lock"


class _RunDirLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock`` while no process of another job holds it.

    The launcher takes it exclusively, writes who it is, then downgrades to shared before starting torchrun; every
    rank takes it shared too (``ALIGN_RUN_LOCK``, see :mod:`align_pipeline.launch._worker`) and its forked children
    inherit it. So a second launcher is refused while the first launcher, any of its ranks, or any child a rank forked
    is alive – even if the first launcher was killed.
    """

    def __init__(self, run_dir: Path, label: str) -> None:
        self.path, self.label, self.fd = run_dir / LOCK_NAME, label, -1

    def __enter__(self) -> _RunDirLock:  # noqa: PYI034
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 4096, 0).decode(errors="replace")
            os.close(self.fd)
            raise RunDirBusy(_busy_message(self.path, holder)) from None
        os.ftruncate(self.fd, 0)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "job": self.label, "since": time.time()}
        os.pwrite(self.fd, json.dumps(info).encode(), 0)
        fcntl.flock(self.fd, fcntl.LOCK_SH)
        return self

    def __exit__(self, *exc_info: object) -> None:
        os.close(self.fd)  # releases our share; the ranks' shares go with their processes


def _busy_message(path: Path, holder: str) -> str:
    try:
        info = json.loads(holder)
        pid, host = int(info["pid"]), info.get("host", "?")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
        who = f"job {info.get('job')!r} started by PID {pid} on {host} at {since}"
        if host == socket.gethostname() and not _pid_alive(pid):
            who += f" (PID {pid} is gone, but processes of its job still hold the lock)"
    except (ValueError, KeyError, TypeError):
        who = "another job"
    holders = _lock_holders(path)
    return (
        f"run directory {path.parent} is in use by {who}; two jobs must never train in one run directory. "
        f"Wait for it to finish or stop it"
        + (f" (processes holding {path.name}: {', '.join(map(str, holders))})" if holders else "")
        + "."
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock_holders(path: Path) -> list[int]:
    """PIDs of this machine's processes that have ``path`` open (best effort: /proc/<pid>/fd)."""
    target, pids = str(path.resolve()), []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if any(os.readlink(fd) == target for fd in (entry / "fd").iterdir()):
                pids.append(int(entry.name))
        except OSError:
            continue
    return sorted(pid for pid in pids if pid != os.getpid())


class _RankWatch:
    """Notes when each rank's process (named by the shim's ``rank<N>.pid``) is first seen gone: a rank killed by a
    signal leaves no exit record, and its peers fail a moment later with "connection reset"."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.pids, self.gone_at = log_dir, {}, {}
        self._next_scan = 0.0

    def poll(self) -> None:
        now = time.time()
        if now >= self._next_scan:  # new pid files: a few times a second is plenty
            self._next_scan = now + 0.5
            for path in self.log_dir.glob("rank*.pid"):
                try:
                    record = json.loads(path.read_text())
                    self.pids.setdefault(int(record["rank"]), int(record["pid"]))
                except (OSError, ValueError, KeyError):
                    pass
        for rank, pid in self.pids.items():
            if rank not in self.gone_at and not _process_running(pid):
                self.gone_at[rank] = now


def _process_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return _pid_alive(pid) if not os.path.isdir("/proc") else False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _as_launch_config(launch: LaunchConfig | Mapping[str, Any]) -> LaunchConfig:
    launch = launch if isinstance(launch, LaunchConfig) else from_dict(LaunchConfig, dict(launch))
    on_slurm = launch.backend == "slurm"
    launch = world.resolved(launch)
    if launch.nproc_per_node < 1 or launch.nnodes < 1:
        raise ValueError(f"nproc_per_node and nnodes must be >= 1, got {launch.nproc_per_node}, {launch.nnodes}")
    if not 0 <= launch.node_rank < launch.nnodes:
        raise ValueError(f"node_rank must be in [0, {launch.nnodes}), got {launch.node_rank}")
    if launch.nnodes > 1 and launch.master_port == 0 and not on_slurm:
        raise ValueError("multi-node jobs need an explicit master_port (0 = pick a free one works on one node only)")
    return launch


def build_command(module: str, config_path: str | Path, launch: LaunchConfig, log_dir: str | Path) -> list[str]:
    """The torchrun command line. A single-node job runs torchrun through :mod:`align_pipeline.launch._agent`, so its
    store listens on ``master_addr`` alone (127.0.0.1); ``master_port`` 0 is passed on, and the agent binds a port the
    kernel picks (a port chosen here and bound later could be taken in between by a parallel job)."""
    if launch.nnodes > 1:  # c10d rendezvous with the workers of the other nodes (launch/multinode.py)
        from align_pipeline.launch import multinode

        rendezvous = multinode.rdzv_args(launch, Path(log_dir).parent)
        agent = "torch.distributed.run"
    else:
        rendezvous = ["--node-rank", "0", "--master-addr", launch.master_addr, "--master-port", str(launch.master_port)]
        agent = AGENT_MODULE
    return [
        sys.executable, "-m", agent,
        "--nnodes", str(launch.nnodes),
        "--nproc-per-node", str(launch.nproc_per_node),
        *rendezvous,
        "--max-restarts", "0",
        "-m", WORKER_MODULE, str(log_dir),
        module, "--config", str(config_path),
    ]  # fmt: skip


def direct(launch: LaunchConfig) -> bool:
    """A one-process local job runs without a torchrun agent (:func:`build_direct_command`): the launcher starts the
    rank itself, a second or so sooner than through torchrun."""
    return launch.nnodes == 1 and launch.nproc_per_node == 1 and launch.backend != "slurm"


def build_direct_command(module: str, config_path: str | Path, launch: LaunchConfig,
                         log_dir: str | Path) -> tuple[list[str], dict[str, str]]:
    """A one-process job: the per-rank shim started by the launcher, with the environment torchrun would give rank 0
    of a world of one, and its rendezvous store hosted by the shim on ``master_addr`` alone (``ALIGN_HOST_STORE``;
    ``MASTER_PORT`` 0: the shim binds a port the kernel picks)."""
    port = launch.master_port
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
           "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "1", "ROLE_NAME": "default",
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "MASTER_ADDR": launch.master_addr, "MASTER_PORT": str(port), "ALIGN_HOST_STORE": "1"}
    return [sys.executable, "-m", WORKER_MODULE, str(log_dir), module, "--config", str(config_path)], env


def build_env(launch: LaunchConfig, backend: str | None, env: Mapping[str, Any] | None = None) -> dict[str, str]:
    """os.environ + job settings + the active MLflow run (:func:`child_run_env`), then ``env`` overrides.
    ``backend`` None (``dist_backend: auto``): no ``ALIGN_BACKEND``, each rank picks nccl with CUDA, else gloo."""
    out = dict(os.environ)
    out["PYTHONUNBUFFERED"] = "1"
    out.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
    out.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off: shared-GPU safety rule
    threads = launch.threads_per_process or max(1, _cpu_count() // launch.nproc_per_node)
    out["OMP_NUM_THREADS"] = str(threads)
    # OpenMP threads waiting for work sleep instead of spinning: the same results, and a second job (or kedro run)
    # on the same CPUs is no longer slowed ~20x by spinning threads (measured: 2 demo runs on 2 cores)
    out.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if backend is None:
        out.pop("ALIGN_BACKEND", None)
    else:
        out["ALIGN_BACKEND"] = backend
    out["PYTHONWARNINGS"] = job_warning_filters(os.environ.get("PYTHONWARNINGS"))  # known third-party noise off
    out.update(child_run_env())
    out.update({k: str(v) for k, v in (env or {}).items()})
    return out


class _LogFollower:
    """Follows a growing log file and emits its complete lines (``\\r`` progress updates count as lines)."""

    def __init__(self, path: Path, emit: Callable[[str], None]) -> None:
        self.path, self.emit = path, emit
        self._file: Any = None
        self._pending = b""

    def pump(self, final: bool = False) -> None:
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 — kept open while following
            except FileNotFoundError:
                return
        data = self._file.read()
        if data:
            *lines, self._pending = re.split(rb"\r\n|\r|\n", self._pending + data)
            for line in lines:
                if line.strip():
                    self.emit(line.decode("utf-8", "replace"))
        if final:
            if self._pending.strip():
                self.emit(self._pending.decode("utf-8", "replace"))
            self._pending = b""
            self._file.close()
            self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _signal_tree(procs: list, sig: int) -> None:
    """Send ``sig`` to each process and to its process group (never to our own group)."""
    own_group = os.getpgrp()
    for p in procs:
        try:
            pgid = os.getpgid(p.pid)
            if pgid != own_group:
                os.killpg(pgid, sig)
            os.kill(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def terminate_tree(proc: subprocess.Popen, grace: float = TERMINATE_GRACE_S) -> None:
    """SIGTERM ``proc`` and all its descendants, wait up to ``grace`` s, SIGKILL whatever is left; reap ``proc``.

    Only ``proc.wait`` reaps ``proc``: psutil would reap it too (it is our child), and ``Popen`` then finds no
    status and sets ``returncode`` to 0 - a torchrun that failed while being stopped read as a success."""
    import psutil

    if proc.poll() is not None:  # already gone (and reaped): its pid may be someone else's now
        return
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    _signal_tree([proc, *children], signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    _, alive = psutil.wait_procs(children, timeout=max(0.0, deadline - time.monotonic()))
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in list(alive):
        try:
            alive.extend(p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    if proc.poll() is None:
        _signal_tree([proc], signal.SIGKILL)
    _signal_tree(alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when this process dies (Linux); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def set_pdeathsig() -> None:  # runs in the child between fork and exec: keep it to one call
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)

    return set_pdeathsig


class _SigtermRaises:
    """While active, SIGTERM raises :class:`LaunchInterrupted` in the main thread (if SIGTERM had its default action)."""

    def __enter__(self):
        self._previous = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
            signal.SIG_DFL,
            None,
        ):
            self._previous = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise LaunchInterrupted(128 + signum)

    def __exit__(self, *exc_info: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:]) if lines > 0 else ""


_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def _torchrun_failures(agent_log: str) -> tuple[tuple[int, int] | None, dict[int, int]]:
    """(root cause (rank, exitcode) or None, {rank: exitcode} for every failure) from torchrun's summary."""
    codes = {int(r): int(c) for r, c in _FAILURE.findall(agent_log)}
    root = None
    if "Root Cause" in agent_log:
        match = _FAILURE.search(agent_log.split("Root Cause", 1)[1])
        if match:
            root = (int(match.group(1)), int(match.group(2)))
    return root, codes


_PEER_FAILURE = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|ECONNRESET|EPIPE|Connection refused|DistNetworkError|"
    r"DistBackendError|remote process exited|NCCL communicator was aborted|Socket Timeout|Timed out waiting|"
    r"ProcessGroupNCCL.*(abort|timeout)|torchrun agent \(pid \d+\) is gone",
    re.IGNORECASE,
)
_NO_SPACE = re.compile(r"No space left on device|ENOSPC|\[Errno 28\]|Disk quota exceeded|\[Errno 122\]")
_SIGNALS = {int(s): s.name for s in signal.Signals}


@dataclasses.dataclass
class _Failure:
    rank: int | None
    exitcode: int | None
    error: str | None


def _first_failure(log_dir: Path, agent_log: str, gone_at: Mapping[int, float] | None = None) -> _Failure:
    """The rank that failed first – by an exception or by a signal – and not one that failed because a peer went.

    Evidence: the shim's ``rank<N>.exit.json`` (exception and time), torchrun's failure summary (exit codes, negative
    for a signal), and when the launcher first saw each rank's process gone (``gone_at``). In order: the earliest of
    (a rank whose own error is not a lost peer, a rank killed by a signal other than torchrun's SIGTERM tear-down);
    else the earliest lost-peer error; else a SIGTERMed rank; else torchrun's root cause.
    """
    root, codes = _torchrun_failures(agent_log)
    gone_at = dict(gone_at or {})
    records = {}
    for path in log_dir.glob("rank*.exit.json"):
        try:
            record = json.loads(path.read_text())
            records[int(record["rank"])] = record
        except (OSError, ValueError, KeyError):
            pass
    primary, secondary, terminated = [], [], []
    for rank, record in records.items():
        exitcode = record.get("exitcode")  # the rank's own; torchrun may report a later SIGTERM of its tear-down
        failure = (record.get("time", float("inf")), rank, exitcode if exitcode is not None else codes.get(rank),
                   record.get("error"))  # fmt: skip
        (secondary if _PEER_FAILURE.search(record.get("error") or "") else primary).append(failure)
    for rank, code in codes.items():
        if rank in records or code >= 0:
            continue
        name = _SIGNALS.get(-code, f"signal {-code}")
        failure = (gone_at.get(rank, float("inf")), rank, code, f"killed by {name}")
        (terminated if -code == signal.SIGTERM else primary).append(failure)
    for group in (primary, secondary, terminated):
        if group:
            _, rank, exitcode, error = min(group, key=lambda f: (f[0], f[1]))
            return _Failure(rank, exitcode, error)
    if root is not None:
        return _Failure(root[0], root[1], None)
    return _Failure(None, None, None)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = _SIGNALS.get(-exitcode, f"signal {-exitcode}")
        hint = " – the kernel's out-of-memory killer sends it when RAM runs out" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name} (exit code {exitcode}{hint})"
    return f"exited with code {exitcode}"


def _disk_full_note(run_dir: Path, texts: list[str]) -> str:
    """A line naming ENOSPC when a log says so or the run directory's file system has (almost) no room left."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        free = None
    said = any(_NO_SPACE.search(t) for t in texts)
    if not said and (free is None or free > 1 << 20):
        return ""
    room = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
    return (f"No space left on device (ENOSPC): the file system of {run_dir} is full ({room}); free space or point "
            f"runs_dir elsewhere, then rerun (the job resumes from its last checkpoint)\n")  # fmt: skip


def _failure_message(
    label: str, module: str, returncode: int, log_dir: Path, launch: LaunchConfig,
    gone_at: Mapping[int, float] | None = None,
) -> tuple[str, int | None, int | None, Path | None]:  # fmt: skip
    agent_path = log_dir / "torchrun.log"
    agent_log = agent_path.read_text(errors="replace") if agent_path.exists() else ""
    if returncode < 0 and not direct(launch) and launch.backend != "slurm":
        # The agent itself was killed (kill -9, the OOM killer): that came first. Its ranks then stop on their own,
        # and one of them may die of a collective its peer left before the watchdog stopped it: not the cause.
        failure = _Failure(None, None, None)
    else:
        failure = _first_failure(log_dir, agent_log, gone_at)
    rank, n = failure.rank, launch.log_tail_lines
    rank_log = log_dir / f"rank{rank}.log" if rank is not None else None
    if rank is not None:
        head = f"torchrun job {label!r} (module {module}) failed: rank {rank} {_describe_exit(failure.exitcode)}"
        head += f" ({failure.error})" if failure.error and not failure.error.startswith("killed by") else ""
    elif returncode < 0:
        head = f"torchrun job {label!r} (module {module}) failed: the torchrun agent {_describe_exit(returncode)}"
    else:
        head = f"torchrun job {label!r} (module {module}) failed: torchrun exited with code {returncode}"
    if rank_log is not None and rank_log.exists() and rank_log.stat().st_size:
        body = f"last {n} lines of rank {rank}'s log {rank_log}:\n{_tail(rank_log, n)}"
        texts = [body, failure.error or ""]
    else:
        # No rank to blame, or its log is missing or empty (another node, a full disk): show every log there is.
        where = " (on another node)" if rank is not None and rank_log is not None and not rank_log.exists() else ""
        parts = [f"rank {rank}'s log not found here{where}"] if rank is not None else []
        logs = sorted(log_dir.glob("rank*.log"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
        logs = [p for p in logs if p.stat().st_size] + ([agent_path] if agent_log.strip() else [])
        for path in logs:
            parts.append(f"last {n} lines of {path}:\n{_tail(path, n)}")
        if not logs:
            parts.append(f"every log in {log_dir} is empty")
        body = "\n".join(parts)
        texts = [body]
    texts += [_tail(p, n) for p in log_dir.glob("rank*.log")] + [agent_log[-4000:]]
    note = _disk_full_note(log_dir.parent, texts)
    return f"{head}\n{note}{body}\n(all logs: {log_dir})", rank, failure.exitcode, rank_log


def run_torchrun(
    module: str,
    config: Mapping[str, Any],
    launch: LaunchConfig | Mapping[str, Any],
    run_dir: str | Path,
    *,
    env: Mapping[str, Any] | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Run ``python -m <module> --config <run_dir>/config.json`` under torchrun and return its ``result.json``.

    Args:
        module: the entry point module (``align_pipeline.train.<stage>``).
        config: JSON-serialisable config for the entry point; its ``paths.run_dir`` or ``run_dir`` must match
            ``run_dir`` (``run_dir`` is added when it has neither).
        launch: world layout and launch settings (:class:`~align_pipeline.config.LaunchConfig` or its dict).
        run_dir: directory of the job: ``config.json``, ``result.json``, ``logs/rank<N>.log``, ``logs/torchrun.log``.
        env: extra environment variables for the job (override everything else).
        name: label for log lines and errors (default: the module).

    Returns:
        The dict rank 0 wrote to ``<run_dir>/result.json``.

    Raises:
        LaunchError: a rank failed (message: module, first failing rank, exit code, tail of its log), or the job
            exited 0 without a ``result.json``.
    """
    launch = _as_launch_config(launch)
    run_dir = Path(run_dir).resolve()
    log_dir = run_dir / "logs"
    label = name or module
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        with _RunDirLock(run_dir, label):
            try:
                return _launch_locked(module, config, launch, run_dir, env, label)
            finally:  # the run dir may be deleted after success: the rank logs live on in the node's MLflow run
                log_artifacts_to_active_run(log_dir, f"logs/{_artifact_name(label)}", "*.log")
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise LaunchError(f"torchrun job {label!r} (module {module}) could not start: {exc}\n"
                              f"{_disk_full_note(run_dir, [str(exc)])}", module=module) from exc  # fmt: skip
        raise


def _artifact_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label) or "job"


def _launch_locked(module: str, config: Mapping[str, Any], launch: LaunchConfig, run_dir: Path,
                   env: Mapping[str, Any] | None, label: str) -> dict[str, Any]:  # fmt: skip
    log_dir = run_dir / "logs"
    result_path, config_path = run_dir / "result.json", run_dir / "config.json"
    stale_files = ("rank*.log", "rank*.exit.json", "rank*.pid")
    for stale in [result_path, *(path for pattern in stale_files for path in log_dir.glob(pattern))]:
        stale.unlink(missing_ok=True)

    config = dict(config)
    # A stage's job names its run directory in ``paths.run_dir``; a plain worker config gets ``run_dir`` added.
    holder = config["paths"] if isinstance(config.get("paths"), dict) and "run_dir" in config["paths"] else config
    if "run_dir" in holder and Path(holder["run_dir"]).resolve() != run_dir:
        raise ValueError(f"the config's run_dir {holder['run_dir']!r} differs from run_dir = {str(run_dir)!r}")
    if holder is config:
        config["run_dir"] = str(run_dir)
    config_path.write_text(json.dumps(config, indent=2, default=str))

    on_slurm = launch.backend == "slurm"
    backend = world.job_backend(launch.dist_backend)  # None (auto): each rank decides on its node
    env = {**parallel_env(config), **(env or {})}  # on every node (the workers get it through the board)
    job_env = build_env(launch, backend, env)
    job_env["ALIGN_RUN_LOCK"] = str(run_dir / LOCK_NAME)
    if on_slurm:
        (log_dir / "torchrun.log").unlink(missing_ok=True)  # Slurm appends every node's agent output to it
        script = run_dir / "slurm_job.sh"
        script.write_text(slurm.job_script(module, config_path, launch, log_dir, label, WORKER_MODULE))
        cmd = ["bash", str(script)]
        logger.info("%s: %s, backend %s, logs %s", label, slurm.describe(launch, job_env), backend or "auto", log_dir)
    elif direct(launch):
        cmd, rank_env = build_direct_command(module, config_path, launch, log_dir)
        job_env.update(rank_env)
        logger.info("%s: one process, backend %s, logs %s", label, backend or "auto (nccl with CUDA, else gloo)",
                    log_dir)
    else:
        cmd = build_command(module, config_path, launch, log_dir)
        logger.info("%s: torchrun %d node(s) x %d proc(s), backend %s, logs %s", label, launch.nnodes,
                    launch.nproc_per_node, backend or "auto (nccl with CUDA, else gloo)", log_dir)
    multi = not on_slurm and launch.nnodes > 1
    job_number = multinode.post(launch, module, config_path, env) if multi else None
    stream_rank = 0
    logger.debug("%s: %s", label, shlex.join(cmd))
    follower = _LogFollower(
        log_dir / f"rank{stream_rank}.log",
        # markup off: Kedro's rich handler would otherwise eat "[...]" in the job's lines
        # (a line the job already labelled, "[ppo] iter 3/10 | ...", is not labelled twice)
        lambda line: logger.info("[%s] %s", label, line.removeprefix(f"[{label}] "), extra={"markup": False}),
    )

    watch = _RankWatch(log_dir)
    start = time.monotonic()
    failed: list[dict[str, Any]] = []  # multi-node: the workers' failed statuses
    if on_slurm and not slurm.inside_allocation(job_env):  # sbatch: Slurm runs it; we follow its logs
        job_id = slurm.submit(script, job_env)
        logger.info("%s: submitted Slurm job %s", label, job_id)
        try:
            with _SigtermRaises():
                returncode, ended = slurm.wait(job_id, job_env, launch, label, follower.pump)
        finally:
            follower.pump(final=True)
            follower.close()
        return _job_result(label, module, returncode, launch, run_dir, start, {}, note=ended)
    proc: subprocess.Popen | None = None
    try:
        with _SigtermRaises(), open(log_dir / "torchrun.log", "wb") as agent_log:
            proc = subprocess.Popen(
                cmd,
                env=job_env,
                stdin=subprocess.DEVNULL,
                stdout=agent_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: the terminal's Ctrl-C reaches us, we stop the job
                preexec_fn=_parent_death_signal(),  # noqa: PLW1509 — one prctl call, no locks taken
            )
            next_check = 0.0
            while proc.poll() is None:
                follower.pump()
                watch.poll()
                if multi and time.monotonic() >= next_check:
                    next_check = time.monotonic() + 0.5
                    failed = multinode.worker_failures(launch, job_number)
                    if failed:  # another node's job failed: stop ours, report the failing rank from the logs
                        terminate_tree(proc)
                        break
                time.sleep(_POLL_S)
            follower.pump(final=True)
            if direct(launch) and proc.returncode < 0:  # killed by a signal: say so as torchrun's summary would
                agent_log.write(f"Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n"
                                f"  exitcode  : {proc.returncode}\n".encode())
    except BaseException as exc:
        if multi:
            multinode.finish(launch, job_number, ok=False)
        follower.close()
        if proc is not None and proc.poll() is None:
            logger.warning(
                "%s: %s in the launching process; stopping the torchrun job (pid %d) and its workers",
                label,
                type(exc).__name__,
                proc.pid,
            )
            terminate_tree(proc)
        raise

    note = ""
    if multi:
        ok = proc.returncode == 0 and not failed
        multinode.finish(launch, job_number, ok=ok)
        if ok:  # our ranks finished; did every worker's (e.g. while writing its checkpoint shards)?
            failed = multinode.worker_failures(launch, job_number, wait_s=60.0)
        note = "other node(s): " + "; ".join(f["message"] for f in failed) if failed else ""
    return _job_result(label, module, 1 if failed else proc.returncode, launch, run_dir, start, watch.gone_at,
                       note=note)


def _job_result(label: str, module: str, returncode: int, launch: LaunchConfig, run_dir: Path, start: float,
                gone_at: Mapping[int, float], note: str = "") -> dict[str, Any]:
    """The job's ``result.json`` after it ended with ``returncode``, or the :class:`LaunchError` of its failure
    (``note``: how the scheduler says it ended, put first)."""
    log_dir, result_path = run_dir / "logs", run_dir / "result.json"
    elapsed = time.monotonic() - start
    if returncode != 0:
        message, rank, exitcode, rank_log = _failure_message(label, module, returncode, log_dir, launch, gone_at)
        message = f"{note}\n{message}" if note else message
        raise LaunchError(message, module=module, rank=rank, exitcode=exitcode, log_path=rank_log)
    deadline = time.monotonic() + (5.0 if launch.nnodes > 1 or launch.backend == "slurm" else 0.0)
    while not result_path.exists() and time.monotonic() < deadline:  # a shared filesystem's cache may lag
        time.sleep(0.2)
    if not result_path.exists():
        raise LaunchError(
            f"torchrun job {label!r} (module {module}) exited 0 but rank 0 wrote no {result_path}\n"
            f"last lines of rank 0's log:\n{_tail(log_dir / 'rank0.log', launch.log_tail_lines)}",
            module=module,
        )
    result = json.loads(result_path.read_text())
    if not isinstance(result, dict):
        raise LaunchError(f"{result_path} holds a {type(result).__name__}, expected a JSON object", module=module)
    logger.info("%s: finished in %.1f s", label, elapsed)
    return result


__all__ = [
    "LaunchError",
    "LaunchInterrupted",
    "RunDirBusy",
    "build_command",
    "build_direct_command",
    "build_env",
    "direct",
    "free_port",
    "run_torchrun",
    "terminate_tree",
]
