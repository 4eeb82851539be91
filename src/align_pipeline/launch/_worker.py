"""Per-rank shim that torchrun starts in front of an entry point; not meant to be run by hand.

    python -m torch.distributed.run ... -m align_pipeline.launch._worker <log_dir> <module> --config <json>

behaves like ``python -m <module> --config <json>`` with two additions:

- the rank's stdout and stderr (file descriptors 1 and 2, so C/NCCL output too) go, interleaved, to
  ``<log_dir>/rank<RANK>.log``;
- if the entry point raises (or exits non-zero), ``<log_dir>/rank<RANK>.exit.json`` records the rank, exit code,
  exception and a precise time, so the launcher can tell the rank that failed first from the ranks that then failed
  because a peer went away. The exception is also recorded through torchelastic's ``record`` (torchrun's own summary),
  and its traceback is printed without this shim's frames, so a log's tail shows the entry point's own frames;
- ``<log_dir>/rank<RANK>.pid`` names the rank's process, so the launcher can see when it dies (a rank killed by a
  signal writes no exit record);
- the rank dies with its torchrun agent: a watchdog thread sees the agent go (the rank is re-parented) and kills the
  rank's process group – the rank and every child it forked, e.g. a checkpoint writer – so a SIGKILLed agent leaves
  no rank training on;
- a one-process job runs without torchrun (``ALIGN_HOST_STORE=1``, set by the launcher): the shim is then the
  launcher's child, hosts the job's rendezvous store itself on ``MASTER_ADDR`` alone (as
  :mod:`align_pipeline.launch._agent` does for torchrun) and dies with the launcher;
- with ``ALIGN_RUN_LOCK`` set (the launcher sets it), the rank holds a shared ``flock`` on that file for its whole
  life (its forked children inherit it), so the launcher refuses a second job in the same run directory while any
  process of this one lives.
"""

from __future__ import annotations

import fcntl
import json
import os
import runpy
import signal
import sys
import threading
import time
from types import TracebackType

WATCHDOG_INTERVAL_S = 0.2


def _redirect_output(path: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass


def _write_exit(log_dir: str, rank: int, exitcode: int, error: str) -> None:
    path = os.path.join(log_dir, f"rank{rank}.exit.json")
    record = {"rank": rank, "exitcode": exitcode, "time": time.time(), "error": error[-2000:]}
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _hold_run_lock(path: str | None) -> int | None:
    """Take a shared lock on the job's lock file (kept until the process and its forked children are gone)."""
    if not path:
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _write_pid(log_dir: str, rank: int) -> None:
    path = os.path.join(log_dir, f"rank{rank}.pid")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": rank, "pid": os.getpid(), "time": time.time()}, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _die_with_agent(agent_pid: int, interval: float = WATCHDOG_INTERVAL_S) -> None:
    """Start a daemon thread that kills this rank's process group once the agent (our parent) is gone."""

    def watch() -> None:
        while os.getppid() == agent_pid and agent_pid != 1:  # 1: the agent was gone before we looked
            time.sleep(interval)
        try:
            os.write(2, f"torchrun agent (pid {agent_pid}) is gone: stopping this rank and its children\n".encode())
        except OSError:
            pass
        if os.getpgrp() == os.getpid():  # torchrun starts each rank in its own session: the group is the rank's
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="align-die-with-agent", daemon=True).start()


def _stop_what_we_forked() -> None:
    """Kill the processes this rank started and left running (a checkpoint writer, a data worker): they are in its
    process group (torchrun and the direct launch start each rank in a session of its own). Nothing of a job
    outlives its rank, however the rank ends; the agent may already be gone and cannot do it."""
    me = os.getpid()
    if os.getpgrp() != me:  # not a group of our own: it holds our parent too, leave it alone
        return
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for pid in (int(entry) for entry in entries if entry.isdigit()):
        try:
            if pid != me and os.getpgid(pid) == me:
                os.kill(pid, signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours to signal
            continue


def _host_store():
    """The rendezvous store of a one-process job, listening on ``MASTER_ADDR`` only; the rank joins it as a client
    (``TORCHELASTIC_USE_AGENT_STORE``), as torchrun's ranks join their agent's. ``MASTER_PORT=0``: the kernel picks
    the port as the socket is bound (no race with another process for a port chosen earlier); the rank sees it."""
    import datetime
    import socket

    from torch.distributed import TCPStore

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    if port == 0:
        port = listener.getsockname()[1]
        os.environ["MASTER_PORT"] = str(port)
    listener.listen(16)
    return TCPStore(host, port, None, True, datetime.timedelta(seconds=900), wait_for_workers=False,
                    multi_tenant=True, master_listen_fd=listener.detach())  # fmt: skip  (the store owns the fd)


def _without_shim_frames(tb: TracebackType | None, shim_files: set[str]) -> TracebackType | None:
    while tb is not None and tb.tb_frame.f_code.co_filename in shim_files:
        tb = tb.tb_next
    return tb


def main(argv: list[str] | None = None) -> None:
    log_dir, module, *args = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    agent_pid = os.getppid()
    _die_with_agent(agent_pid)
    _hold_run_lock(os.environ.get("ALIGN_RUN_LOCK"))
    _redirect_output(os.path.join(log_dir, f"rank{rank}.log"))
    _write_pid(log_dir, rank)
    store = _host_store() if os.environ.pop("ALIGN_HOST_STORE", "") == "1" else None  # noqa: F841 — kept alive
    sys.argv = [module, *args]

    def run_entry_point() -> None:
        runpy.run_module(module, run_name="__main__", alter_sys=True)

    shim_files = {__file__, runpy.__file__, "<frozen runpy>", run_entry_point.__code__.co_filename}
    try:
        from torch.distributed.elastic.multiprocessing.errors import record

        run = record(run_entry_point)
        shim_files.add(run.__code__.co_filename)
    except ImportError:
        run = run_entry_point
    try:
        run()
    except SystemExit as exc:
        if exc.code not in (None, 0):
            code = exc.code if isinstance(exc.code, int) else 1
            _write_exit(log_dir, rank, code, f"SystemExit: {exc.code}")
        raise
    except Exception as exc:  # noqa: BLE001 — any error of the entry point: record it, print it, exit 1
        _write_exit(log_dir, rank, 1, f"{type(exc).__name__}: {exc}")
        exc = exc.with_traceback(_without_shim_frames(exc.__traceback__, shim_files))  # excepthooks print this one
        sys.excepthook(type(exc), exc, exc.__traceback__)
        sys.stderr.flush()
        sys.exit(1)  # what an uncaught exception exits with
    except BaseException as exc:  # KeyboardInterrupt & co: keep Python's own exit behaviour
        _write_exit(log_dir, rank, 1, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        _stop_what_we_forked()


if __name__ == "__main__":
    main()
