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


class BoardLost(RuntimeError):
    """Node 0's job board went away without saying ``shutdown`` (node 0 died)."""


class _Reader:
    """A worker's view of the board: genuine messages only; each refused post is logged once, naming why."""

    def __init__(self, store, channel: Channel, me: str) -> None:
        self.store, self.channel, self.me = store, channel, me
        self.refused: dict[str, bytes] = {}

    def read(self, key: str) -> Any | None:
        """The body of the genuine message on ``key``; None while there is none."""
        try:
            if not self.store.check([key]):
                return None
            raw = self.store.get(key)
        except Exception as exc:
            raise BoardLost(f"lost node 0's job board: {exc}") from exc
        try:
            return self.channel.open(key, raw)
        except Refused as exc:
            if self.refused.get(key) != raw:
                self.refused[key] = raw
                logger.warning("worker %s: refused %s on the job board: %s", self.me, key, exc)
            return None

    def wait(self, keys: list[str]) -> tuple[str, Any]:
        """The first of ``keys`` with a genuine message, and its body (polling)."""
        while True:
            for key in keys:
                body = self.read(key)
                if body is not None:
                    return key, body
            time.sleep(POLL_S)

    def post(self, key: str, body: Any) -> None:
        self.store.set(key, self.channel.seal(key, body))


def _join(store, master_port: int, me: str, timeout_s: float) -> Channel | None:
    """This run's channel, once node 0's hello opens with the secret in the secret file (node 0 writes it when its
    board starts; a copy may come later); None when that takes longer than ``timeout_s``."""
    path = board_auth.secret_path(master_port)
    deadline, said = time.monotonic() + timeout_s, ""
    while True:
        secret, why = board_auth.read_secret(path), f"no board secret in {path} yet"
        if secret is not None:
            channel = Channel(secret, me)
            try:
                raw = store.get(HELLO_KEY) if store.check([HELLO_KEY]) else None
            except Exception as exc:  # node 0 died meanwhile
                raise BoardLost(f"lost node 0's job board: {exc}") from exc
            try:
                if raw is not None:
                    channel.open(HELLO_KEY, raw, max_age_s=None)  # the board lives as long as the kedro run
                    return channel
                why = "no hello from node 0 yet"
            except Refused as exc:
                why = f"node 0's hello does not open with the secret in {path}: {exc}"
        if why != said:
            logger.info("worker %s: waiting for this run's board secret (%s)", me, why)
            said = why
        if time.monotonic() >= deadline:
            logger.error("worker %s: %s after %.0f s: node 0 writes its secret there when its board starts; give the "
                         "workers that file (a shared filesystem, or a copy) and name it in $%s", me, why, timeout_s,
                         board_auth.SECRET_FILE_ENV)
            return None
        time.sleep(POLL_S)


def _job_refusal(job: Any) -> str | None:
    """Why a worker refuses a genuine job (None: it runs it)."""
    if not (isinstance(job, dict) and isinstance(job.get("config"), str) and isinstance(job.get("launch"), dict)
            and isinstance(job.get("rdzv_id"), str)):
        return "malformed job"
    return board_auth.module_refusal(job.get("module"))


def run_worker(master_addr: str, master_port: int, connect_timeout_s: float = 600.0) -> int:
    """Take jobs from node 0's board until it says ``shutdown``; returns the process exit code (1 when a job of
    this node failed or was refused, 2 without this run's board secret)."""
    from align_pipeline.launch.torchrun import WORKER_MODULE, build_env, resolve_backend, terminate_tree

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    def stop(signum, frame):  # kill / a scheduler's stop: raise, so the running torchrun is stopped too
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    started = time.monotonic()
    store = _store(master_addr, master_port, host=False, timeout_s=connect_timeout_s)
    me = f"{socket.gethostname()}:{os.getpid()}"
    try:
        channel = _join(store, master_port, me, max(0.0, connect_timeout_s - (time.monotonic() - started)))
    except BoardLost as exc:
        logger.error("worker %s: %s; exiting", me, exc)
        return 1
    if channel is None:
        return 2
    reader = _Reader(store, channel, me)
    logger.info("worker %s: joined the job board at %s:%d", me, master_addr, master_port)
    failed, n = False, 0
    while True:
        try:
            key, job = reader.wait([f"job/{n}", "shutdown"])
        except BoardLost as exc:
            logger.error("worker %s: %s; exiting", me, exc)
            return 1
        if key == "shutdown":
            logger.info("worker %s: node 0 finished; exiting (%s)", me, "a job failed" if failed else "ok")
            return 1 if failed else 0
        refusal = _job_refusal(job)
        config_path = Path(job["config"]) if refusal is None else Path()
        if refusal is not None:  # a genuine job that this worker does not run: node 0 hears why
            message = f"worker {me} refused job {n}: {refusal}"
            logger.error("worker %s: refused job %d: %s", me, n, refusal)
            ok = False
        elif not config_path.is_file():
            message = (f"{config_path} is not visible on this node: the run directory must be on a filesystem "
                       "every node shares")
            ok = False
        else:
            # the rendezvous host is node 0 as this worker reaches it (node 0's own config may say 127.0.0.1)
            launch = dataclasses.replace(from_dict(LaunchConfig, job["launch"], "job launch"),
                                         master_addr=master_addr)
            log_dir = config_path.parent / "logs"
            job_env, dropped = board_auth.job_env(job.get("env"))
            if dropped:
                logger.warning("worker %s: job %d: dropped environment key(s) %s (not job settings)", me, n,
                               ", ".join(dropped))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(launch.nnodes),
                   "--nproc-per-node", str(launch.nproc_per_node),
                   *rdzv_args(launch, config_path.parent, job["rdzv_id"]),
                   "--max-restarts", "0", "-m", WORKER_MODULE, str(log_dir), job["module"], "--config",
                   str(config_path)]
            env = build_env(launch, resolve_backend(launch.dist_backend), job_env)
            logger.info("worker %s: job %d: %s", me, n, job["module"])
            with open(log_dir / f"torchrun-{socket.gethostname()}-{os.getpid()}.log", "wb") as agent_log:
                proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=agent_log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    while proc.poll() is None:
                        done = reader.read(f"done/{n}")
                        if isinstance(done, dict) and done.get("ok") is False:
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
            reader.post(f"status/{n}/{i}", {"ok": ok, "node": me, "message": message})
        except Exception as exc:  # noqa: BLE001 - node 0 already ended its run (and closed the board)
            logger.info("worker %s: job %d %s; node 0's board is gone (%s); exiting", me, n,
                        "finished" if ok else "failed", exc)
            return 1 if failed else 0
        if refusal is None:
            logger.info("worker %s: job %d %s", me, n, "finished" if ok else f"failed: {message}")
        n += 1
