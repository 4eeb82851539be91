"""Run a training entry point as a torchrun job from a Kedro node, stream its progress, report its failures.

    result = run_torchrun("align_pipeline.train.sft", config, LaunchConfig(nproc_per_node=2), run_dir)

starts, in its own session (process group),

    python -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --node-rank 0 \\
        --master-addr 127.0.0.1 --master-port <free> --max-restarts 0 \\
        -m align_pipeline.launch._worker <run_dir>/logs align_pipeline.train.sft --config <run_dir>/config.json

``launch._worker`` is a thin shim: it sends the rank's stdout+stderr to ``<run_dir>/logs/rank<N>.log`` and then runs
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
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from align_pipeline.config import LaunchConfig, from_dict
from align_pipeline.tracking.mlflow_logger import child_run_env

logger = logging.getLogger("align_pipeline.launch")

WORKER_MODULE = "align_pipeline.launch._worker"
TERMINATE_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL when the parent stops the job."""
_POLL_S = 0.1


class LaunchInterrupted(SystemExit):
    """The parent got SIGTERM while a job ran; the job was stopped. Exits the process with 128 + 15 if uncaught."""


class LaunchError(RuntimeError):
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


def resolve_backend(backend: str) -> str:
    """``auto`` → ``nccl`` when CUDA is available, else ``gloo``; ``nccl``/``gloo`` unchanged."""
    if backend in ("nccl", "gloo"):
        return backend
    if backend != "auto":
        raise ValueError(f"backend must be auto, nccl or gloo, got {backend!r}")
    try:
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
    except ImportError:
        return "gloo"


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


def visible_gpus() -> int:
    """GPUs this process may use, without importing torch: ``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi -L``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


def _as_launch_config(launch: LaunchConfig | Mapping[str, Any]) -> LaunchConfig:
    launch = launch if isinstance(launch, LaunchConfig) else from_dict(LaunchConfig, dict(launch))
    if launch.nproc_per_node == "gpus":
        gpus = visible_gpus()
        if gpus == 0:
            raise ValueError("launch.nproc_per_node=gpus but no GPU is visible (CUDA_VISIBLE_DEVICES / nvidia-smi)")
        launch = dataclasses.replace(launch, nproc_per_node=gpus)
    if launch.nproc_per_node < 1 or launch.nnodes < 1:
        raise ValueError(f"nproc_per_node and nnodes must be >= 1, got {launch.nproc_per_node}, {launch.nnodes}")
    if not 0 <= launch.node_rank < launch.nnodes:
        raise ValueError(f"node_rank must be in [0, {launch.nnodes}), got {launch.node_rank}")
    if launch.nnodes > 1 and launch.master_port == 0:
        raise ValueError("multi-node jobs need an explicit master_port (0 = pick a free one works on one node only)")
    return launch


def build_command(module: str, config_path: str | Path, launch: LaunchConfig, log_dir: str | Path) -> list[str]:
    """The torchrun command line (``master_port`` 0 is replaced by a free port)."""
    port = launch.master_port or free_port(launch.master_addr)
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(launch.nnodes),
        "--nproc-per-node", str(launch.nproc_per_node),
        "--node-rank", str(launch.node_rank),
        "--master-addr", launch.master_addr,
        "--master-port", str(port),
        "--max-restarts", "0",
        "-m", WORKER_MODULE, str(log_dir),
        module, "--config", str(config_path),
    ]  # fmt: skip


def build_env(launch: LaunchConfig, backend: str, env: Mapping[str, Any] | None = None) -> dict[str, str]:
    """os.environ + job settings + the active MLflow run (:func:`child_run_env`), then ``env`` overrides."""
    out = dict(os.environ)
    out["PYTHONUNBUFFERED"] = "1"
    out.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
    out.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off: shared-GPU safety rule
    threads = launch.threads_per_process or max(1, _cpu_count() // launch.nproc_per_node)
    out["OMP_NUM_THREADS"] = str(threads)
    out["ALIGN_BACKEND"] = backend
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
    """SIGTERM ``proc`` and all its descendants, wait up to ``grace`` s, SIGKILL whatever is left; reap ``proc``."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    if procs:
        _signal_tree(procs, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=grace)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if alive:
            for p in list(alive):
                try:
                    alive.extend(p.children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
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


def _first_failure(log_dir: Path, agent_log: str) -> tuple[int | None, int | None, str | None]:
    """(rank, exitcode, error) of the rank that failed first; (None, None, None) when it cannot be told."""
    root, codes = _torchrun_failures(agent_log)
    exits = []
    for path in log_dir.glob("rank*.exit.json"):
        try:
            exits.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    if exits:
        first = min(exits, key=lambda e: e.get("time", float("inf")))
        rank = int(first["rank"])
        # The code the rank itself exited with; torchrun may report a later SIGTERM (-15) if it tore the rank down
        # while it was still exiting.
        exitcode = first.get("exitcode")
        return rank, exitcode if exitcode is not None else codes.get(rank), first.get("error")
    if root is not None:
        return root[0], root[1], None
    return None, None, None


def _failure_message(
    label: str, module: str, returncode: int, log_dir: Path, launch: LaunchConfig
) -> tuple[str, int | None, int | None, Path | None]:
    agent_path = log_dir / "torchrun.log"
    agent_log = agent_path.read_text(errors="replace") if agent_path.exists() else ""
    rank, exitcode, error = _first_failure(log_dir, agent_log)
    n = launch.log_tail_lines
    rank_log = log_dir / f"rank{rank}.log" if rank is not None else None
    if rank is not None:
        head = f"torchrun job {label!r} (module {module}) failed: rank {rank} exited with code {exitcode}"
        head += f" ({error})" if error else ""
    else:
        head = f"torchrun job {label!r} (module {module}) failed: torchrun exited with code {returncode}"
    if rank_log is not None and rank_log.exists():
        body = f"last {n} lines of rank {rank}'s log {rank_log}:\n{_tail(rank_log, n)}"
    else:
        where = " (on another node)" if rank is not None else ""
        body = f"rank log not found here{where}; last {n} lines of the torchrun log {agent_path}:\n"
        body += _tail(agent_path, n)
    return f"{head}\n{body}\n(all logs: {log_dir})", rank, exitcode, rank_log


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
    log_dir.mkdir(parents=True, exist_ok=True)
    result_path, config_path = run_dir / "result.json", run_dir / "config.json"
    for stale in [result_path, *log_dir.glob("rank*.log"), *log_dir.glob("rank*.exit.json")]:
        stale.unlink(missing_ok=True)

    config = dict(config)
    # A stage's job names its run directory in ``paths.run_dir``; a plain worker config gets ``run_dir`` added.
    holder = config["paths"] if isinstance(config.get("paths"), dict) and "run_dir" in config["paths"] else config
    if "run_dir" in holder and Path(holder["run_dir"]).resolve() != run_dir:
        raise ValueError(f"the config's run_dir {holder['run_dir']!r} differs from run_dir = {str(run_dir)!r}")
    if holder is config:
        config["run_dir"] = str(run_dir)
    config_path.write_text(json.dumps(config, indent=2, default=str))

    backend = resolve_backend(launch.backend)
    cmd = build_command(module, config_path, launch, log_dir)
    job_env = build_env(launch, backend, env)
    label = name or module
    stream_rank = launch.node_rank * launch.nproc_per_node
    logger.info(
        "%s: torchrun %d node(s) x %d proc(s), backend %s, logs %s",
        label,
        launch.nnodes,
        launch.nproc_per_node,
        backend,
        log_dir,
    )
    logger.debug("%s: %s", label, shlex.join(cmd))
    follower = _LogFollower(
        log_dir / f"rank{stream_rank}.log",
        # markup off: Kedro's rich handler would otherwise eat "[...]" in the job's lines
        lambda line: logger.info("[%s] %s", label, line, extra={"markup": False}),
    )

    start = time.monotonic()
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
            while proc.poll() is None:
                follower.pump()
                time.sleep(_POLL_S)
            follower.pump(final=True)
    except BaseException as exc:
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

    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        message, rank, exitcode, rank_log = _failure_message(label, module, proc.returncode, log_dir, launch)
        raise LaunchError(message, module=module, rank=rank, exitcode=exitcode, log_path=rank_log)
    if not result_path.exists():
        if launch.node_rank != 0:  # rank 0 (and its result.json) lives on the master node
            logger.info("%s: finished in %.1f s (node %d; the result is on node 0)", label, elapsed, launch.node_rank)
            return {}
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
    "build_command",
    "build_env",
    "free_port",
    "resolve_backend",
    "run_torchrun",
    "terminate_tree",
]
