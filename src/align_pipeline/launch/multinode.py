"""Multi-node jobs without Slurm: node 0 runs ``kedro run``, every other node runs ``align-pipeline worker``.

    node 0:   kedro run --params "launch.nnodes=2,launch.nproc_per_node=8,launch.master_addr=node0,launch.master_port=29500"
    node k:   align-pipeline worker --master-addr node0 --master-port 29500

Node 0's launcher hosts a job board (a ``torch.distributed.TCPStore`` on ``master_addr:master_port``) for the whole
``kedro run``. For each stage it posts the job (module, config path, launch settings, extra environment) and starts
its own torchrun; each worker takes the job from the board and starts the same torchrun. The torchruns meet in a
c10d rendezvous on ``master_addr:master_port + 1`` whose id is derived from the stage's run directory, so the ranks
of one job never meet another's.

The run directory must be on a filesystem every node sees (the checkpoints already require it: every rank writes
its shards into one directory): the config, the rank logs and rank 0's ``result.json`` are read there, whichever
node rank 0 landed on (c10d numbers the nodes itself). Node 0's Kedro node returns that result, as for one node.

A worker reports each job's end on the board (``status/<job>/<host:pid>``); node 0 watches those while its own
torchrun runs, stops it when a worker's job failed and raises the failing rank's error (read from the shared logs).
Node 0 posts ``done/<job>`` when its torchrun ended (a worker still running stops its own), and ``shutdown`` when
the ``kedro run`` ends (success or failure); each worker then exits: 0, or 1 after a job of its failed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from align_pipeline.config import LaunchConfig, from_dict, to_dict

logger = logging.getLogger("align_pipeline.launch")

_BOARDS: dict[tuple[str, int], list] = {}  # node 0's job boards: (addr, port) -> [TCPStore, jobs posted]
POLL_S = 0.2


def _store(addr: str, port: int, host: bool, timeout_s: float = 300.0):
    from torch.distributed import TCPStore

    return TCPStore(addr, port, is_master=host, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                    use_libuv=True)


def board(launch: LaunchConfig):
    """Node 0's job board (started on first use, on ``master_addr:master_port``, until :func:`shutdown`)."""
    key = (launch.master_addr, launch.master_port)
    if key not in _BOARDS:
        _BOARDS[key] = [_store(launch.master_addr, launch.master_port, host=True), 0]
        logger.info("multi-node: job board on %s:%d for %d node(s); start the others with `align-pipeline worker "
                    "--master-addr %s --master-port %d`", launch.master_addr, launch.master_port, launch.nnodes,
                    launch.master_addr, launch.master_port)
    return _BOARDS[key][0]


def rdzv_args(launch: LaunchConfig, run_dir: Path, run_id: str | None = None) -> list[str]:
    """torchrun's c10d rendezvous arguments of a multi-node job (``run_id``: as node 0 computed it)."""
    from align_pipeline.launch.slurm import rdzv_id

    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{launch.master_addr}:{launch.master_port + 1}",
            "--rdzv-id", run_id or rdzv_id(run_dir)]


def post(launch: LaunchConfig, module: str, config_path: Path, env: dict[str, str] | None) -> int:
    """Put a job on the board (with the active MLflow run, so rank 0 logs into it on whichever node it lands, and
    the rendezvous id); returns its number."""
    from align_pipeline.launch.slurm import rdzv_id
    from align_pipeline.tracking.mlflow_logger import child_run_env

    store = board(launch)
    entry = _BOARDS[(launch.master_addr, launch.master_port)]
    n, entry[1] = entry[1], entry[1] + 1
    job_env = {**child_run_env(), **{k: str(v) for k, v in (env or {}).items()}}
    store.set(f"job/{n}", json.dumps({"module": module, "config": str(config_path), "launch": to_dict(launch),
                                      "env": job_env, "rdzv_id": rdzv_id(config_path.parent)}))
    return n


def worker_failures(launch: LaunchConfig, n: int, wait_s: float = 0.0) -> list[dict[str, Any]]:
    """The failed statuses workers posted for job ``n``: those posted so far, or, with ``wait_s``, after waiting
    up to that long for every worker's (``nnodes - 1``)."""
    store = board(launch)
    deadline = time.monotonic() + wait_s
    keys = _status_keys(store, n)
    while len(keys) < launch.nnodes - 1 and time.monotonic() < deadline:
        time.sleep(POLL_S)
        keys = _status_keys(store, n)
    if wait_s and len(keys) < launch.nnodes - 1:
        logger.warning("job %d: %d of %d worker node(s) reported within %.0f s", n, len(keys), launch.nnodes - 1,
                       wait_s)
    return [status for status in (json.loads(store.get(key)) for key in keys) if not status["ok"]]


def _status_keys(store, n: int) -> list[str]:
    count = int(store.add(f"status_count/{n}", 0))
    return [f"status/{n}/{i}" for i in range(count) if store.check([f"status/{n}/{i}"])]


def finish(launch: LaunchConfig, n: int, ok: bool) -> None:
    board(launch).set(f"done/{n}", json.dumps({"ok": ok}))


def shutdown() -> None:
    """End of the ``kedro run``: the workers exit (they poll the board a few times a second; it then closes)."""
    if not _BOARDS:
        return
    for store, _ in _BOARDS.values():
        store.set("shutdown", "1")
    time.sleep(5 * POLL_S)
    _BOARDS.clear()


# ---------------------------------------------------------------------------------------------------------------------
# the worker side
# ---------------------------------------------------------------------------------------------------------------------


class BoardLost(RuntimeError):
    """Node 0's job board went away without saying ``shutdown`` (node 0 died)."""


def _check(store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception as exc:
        raise BoardLost(f"lost node 0's job board: {exc}") from exc


def _wait_for(store, keys: list[str]) -> str:
    """The first of ``keys`` set on the board (polling)."""
    while True:
        for key in keys:
            if _check(store, key):
                return key
        time.sleep(POLL_S)


def run_worker(master_addr: str, master_port: int, connect_timeout_s: float = 600.0) -> int:
    """Take jobs from node 0's board until it says ``shutdown``; returns the process exit code (1 when a job of
    this node failed)."""
    from align_pipeline.launch.torchrun import WORKER_MODULE, build_env, resolve_backend, terminate_tree

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    def stop(signum, frame):  # kill / a scheduler's stop: raise, so the running torchrun is stopped too
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    store = _store(master_addr, master_port, host=False, timeout_s=connect_timeout_s)
    me = f"{socket.gethostname()}:{os.getpid()}"
    logger.info("worker %s: joined the job board at %s:%d", me, master_addr, master_port)
    failed, n = False, 0
    while True:
        try:
            key = _wait_for(store, [f"job/{n}", "shutdown"])
        except BoardLost as exc:
            logger.error("worker %s: %s; exiting", me, exc)
            return 1
        if key == "shutdown":
            logger.info("worker %s: node 0 finished; exiting (%s)", me, "a job failed" if failed else "ok")
            return 1 if failed else 0
        job = json.loads(store.get(key))
        # the rendezvous host is node 0 as this worker reaches it (node 0's own config may say 127.0.0.1)
        launch = dataclasses.replace(from_dict(LaunchConfig, job["launch"], "job launch"), master_addr=master_addr)
        config_path = Path(job["config"])
        log_dir = config_path.parent / "logs"
        if not config_path.is_file():
            message = (f"{config_path} is not visible on this node: the run directory must be on a filesystem "
                       "every node shares")
            ok = False
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(launch.nnodes),
                   "--nproc-per-node", str(launch.nproc_per_node),
                   *rdzv_args(launch, config_path.parent, job.get("rdzv_id")),
                   "--max-restarts", "0", "-m", WORKER_MODULE, str(log_dir), job["module"], "--config",
                   str(config_path)]
            env = build_env(launch, resolve_backend(launch.dist_backend), job["env"])
            logger.info("worker %s: job %d: %s", me, n, job["module"])
            with open(log_dir / f"torchrun-{socket.gethostname()}-{os.getpid()}.log", "wb") as agent_log:
                proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=agent_log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    while proc.poll() is None:
                        if _check(store, f"done/{n}") and not json.loads(store.get(f"done/{n}"))["ok"]:
                            terminate_tree(proc)  # node 0's job failed: stop ours, which may wait on dead peers
                            break
                        time.sleep(POLL_S)
                except BaseException:  # Ctrl-C here, or node 0 gone: no torchrun left behind
                    terminate_tree(proc)
                    raise
            ok = proc.returncode == 0
            message = "" if ok else f"torchrun on {me} exited with code {proc.returncode} (logs: {log_dir})"
        failed |= not ok
        try:
            i = int(store.add(f"status_count/{n}", 1)) - 1
            store.set(f"status/{n}/{i}", json.dumps({"ok": ok, "node": me, "message": message}))
        except Exception as exc:  # noqa: BLE001 - node 0 already ended its run (and closed the board)
            logger.info("worker %s: job %d %s; node 0's board is gone (%s); exiting", me, n,
                        "finished" if ok else "failed", exc)
            return 1 if failed else 0
        logger.info("worker %s: job %d %s", me, n, "finished" if ok else f"failed: {message}")
        n += 1
