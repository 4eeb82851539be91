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

The board is not trusted beyond that (:mod:`align_pipeline.launch.board_auth`): it listens on ``master_addr`` only;
every message on it, both ways, is sealed with the run's secret (HMAC-SHA256 over key, sender, nonce, time, body),
which node 0 generates and writes to a file the workers read (never onto the board); a worker ignores, with a log
line naming why, what is unsigned, signed with another key, replayed or stale, and runs only the package's stage
entry points with the job environment keys the project uses; node 0 ignores statuses it cannot open.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from align_pipeline.config.base import to_dict
from align_pipeline.config.common import LaunchConfig
from align_pipeline.errors import UserError
from align_pipeline.launch import board_auth
from align_pipeline.launch.board_auth import Channel, Refused

logger = logging.getLogger("align_pipeline.launch")

POLL_S = 0.2
HELLO_KEY = "board"
"""Node 0's first message: a worker that opens it holds this run's secret."""
NODE0 = "node0"
MAX_STATUSES = 4096
"""Statuses of one job node 0 looks at (anyone can bump the count)."""


@dataclasses.dataclass
class _Board:
    """Node 0's job board of one ``(master_addr, master_port)``."""

    store: Any
    """The ``TCPStore`` master, listening on ``master_addr`` only."""
    channel: Channel
    """Seals node 0's posts, opens the workers' statuses."""
    secret_file: Path
    """Where the workers read the secret (removed at :func:`shutdown`)."""
    jobs: int = 0
    """Jobs posted so far (the next one's number)."""
    refused: dict[str, bytes] = dataclasses.field(default_factory=dict)
    """Key -> the refused message last logged for it (each is logged once)."""


_BOARDS: dict[tuple[str, int], _Board] = {}


def _store(addr: str, port: int, host: bool, timeout_s: float = 300.0):
    """The board's ``TCPStore``: node 0's master listens on ``addr`` alone (torch's own would take every interface),
    through a socket bound here and handed over (as :mod:`align_pipeline.launch._agent` does for torchrun)."""
    from torch.distributed import TCPStore

    listen_fd = _listen(addr, port) if host else None
    return TCPStore(addr, port, is_master=host, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                    master_listen_fd=listen_fd, use_libuv=True)


def _listen(addr: str, port: int) -> int:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(sockaddr)
        listener.listen(4096)
    except OSError as exc:
        listener.close()
        raise UserError(f"launch.master_addr={addr}, launch.master_port={port}: node 0 cannot host the multi-node "
                        f"job board there ({exc.strerror or exc}); give an address of this machine and a free port")\
            from None
    return listener.detach()  # the store owns the socket from here


def _board(launch: LaunchConfig) -> _Board:
    """Node 0's job board (started on first use, on ``master_addr:master_port``, until :func:`shutdown`), with a new
    secret written for the workers."""
    key = (launch.master_addr, launch.master_port)
    if key not in _BOARDS:
        secret_file = board_auth.secret_path(launch.master_port)
        channel = Channel(board_auth.write_secret(secret_file), NODE0)
        try:
            store = _store(launch.master_addr, launch.master_port, host=True)
        except BaseException:
            secret_file.unlink(missing_ok=True)
            raise
        store.set(HELLO_KEY, channel.seal(HELLO_KEY, {"nnodes": launch.nnodes}))
        _BOARDS[key] = _Board(store, channel, secret_file)
        logger.info("multi-node: job board on %s:%d (that address only) for %d node(s), its secret in %s; start the "
                    "others with `align-pipeline worker --master-addr %s --master-port %d` where they read that file "
                    "(or set $%s to their copy)", launch.master_addr, launch.master_port, launch.nnodes, secret_file,
                    launch.master_addr, launch.master_port, board_auth.SECRET_FILE_ENV)
    return _BOARDS[key]


def board(launch: LaunchConfig):
    """Node 0's job board's ``TCPStore`` (see :func:`_board`)."""
    return _board(launch).store


def rdzv_args(launch: LaunchConfig, run_dir: Path, run_id: str | None = None) -> list[str]:
    """torchrun's c10d rendezvous arguments of a multi-node job (``run_id``: as node 0 computed it)."""
    from align_pipeline.launch.slurm import rdzv_id

    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{launch.master_addr}:{launch.master_port + 1}",
            "--rdzv-id", run_id or rdzv_id(run_dir)]


def post(launch: LaunchConfig, module: str, config_path: Path, env: dict[str, str] | None) -> int:
    """Put a job on the board, sealed (with the active MLflow run, so rank 0 logs into it on whichever node it lands,
    and the rendezvous id); returns its number."""
    from align_pipeline.launch.slurm import rdzv_id
    from align_pipeline.tracking.mlflow_logger import child_run_env

    entry = _board(launch)
    n, entry.jobs = entry.jobs, entry.jobs + 1
    job_env = {**child_run_env(), **{k: str(v) for k, v in (env or {}).items()}}
    key = f"job/{n}"
    entry.store.set(key, entry.channel.seal(key, {"module": module, "config": str(config_path),
                                                  "launch": to_dict(launch), "env": job_env,
                                                  "rdzv_id": rdzv_id(config_path.parent)}))
    return n


def worker_failures(launch: LaunchConfig, n: int, wait_s: float = 0.0) -> list[dict[str, Any]]:
    """The failed statuses workers posted for job ``n``: those posted so far, or, with ``wait_s``, after waiting
    up to that long for every worker's (``nnodes - 1``). Statuses that are not genuine are ignored (logged once)."""
    entry = _board(launch)
    deadline = time.monotonic() + wait_s
    statuses = _statuses(entry, n)
    while len(statuses) < launch.nnodes - 1 and time.monotonic() < deadline:
        time.sleep(POLL_S)
        statuses = _statuses(entry, n)
    if wait_s and len(statuses) < launch.nnodes - 1:
        logger.warning("job %d: %d of %d worker node(s) reported within %.0f s", n, len(statuses), launch.nnodes - 1,
                       wait_s)
    return [status for status in statuses.values() if not status["ok"]]


def _statuses(entry: _Board, n: int) -> dict[str, dict[str, Any]]:
    """The genuine statuses of job ``n`` by worker node."""
    store, out = entry.store, {}
    count = min(int(store.add(f"status_count/{n}", 0)), MAX_STATUSES)  # anyone can add: bounded
    for key in (f"status/{n}/{i}" for i in range(count)):
        if not store.check([key]):
            continue
        raw = store.get(key)
        try:
            status = entry.channel.open(key, raw)
            if not (isinstance(status, dict) and isinstance(status.get("ok"), bool)
                    and isinstance(status.get("node"), str) and isinstance(status.get("message"), str)):
                raise Refused("malformed status")
        except Refused as exc:
            if entry.refused.get(key) != raw:
                entry.refused[key] = raw
                logger.warning("multi-node: ignored %s on the job board: %s", key, exc)
            continue
        out[status["node"]] = status
    return out


def finish(launch: LaunchConfig, n: int, ok: bool) -> None:
    entry = _board(launch)
    entry.store.set(f"done/{n}", entry.channel.seal(f"done/{n}", {"ok": ok}))


def shutdown() -> None:
    """End of the ``kedro run``: the workers exit (they poll the board a few times a second; it then closes), the
    secret file goes."""
    if not _BOARDS:
        return
    for entry in _BOARDS.values():
        entry.store.set("shutdown", entry.channel.seal("shutdown", {}))
    time.sleep(5 * POLL_S)
    for entry in _BOARDS.values():
        entry.secret_file.unlink(missing_ok=True)
    _BOARDS.clear()


# ---------------------------------------------------------------------------------------------------------------------
# the worker side
# ---------------------------------------------------------------------------------------------------------------------
