"""A node of a multi-node run other than node 0 (``align-pipeline worker``): it takes each stage's job from node 0's
job board (:mod:`align_pipeline.launch.multinode`: signed posts, an allowlist of entry points) and runs the same
torchrun here, until node 0 says ``shutdown``."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from align_pipeline.config.base import from_dict
from align_pipeline.config.common import LaunchConfig
from align_pipeline.launch import board_auth
from align_pipeline.launch.board_auth import Channel, Refused
from align_pipeline.launch.multinode import HELLO_KEY, POLL_S, _store, rdzv_args
from align_pipeline.launch.torchrun import WORKER_MODULE, build_env, terminate_tree
from align_pipeline.launch.world import job_backend

logger = logging.getLogger("align_pipeline.launch")


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
            env = build_env(launch, job_backend(launch.dist_backend), job_env)
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
