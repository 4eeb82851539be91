"""What makes node 0's multi-node job board safe to read: signed messages, the run's secret, what a worker runs.

Anyone who reaches the board's port can read and write its keys (a ``TCPStore`` has no access control), so every
message on it is sealed by :class:`Channel`: JSON ``{"key", "from", "nonce", "time", "body", "mac"}`` where ``mac`` is
HMAC-SHA256, under the run's secret, of the rest. A reader refuses, naming why, a message that is unsigned, signed
with another key, signed for another key of the board (a copy: a replay), whose nonce it has seen before (a replay),
or more than :data:`MAX_AGE_S` old.

The secret is 32 random bytes that node 0 generates for each ``kedro run`` and writes (hex, mode 0600) to
``$ALIGN_BOARD_SECRET_FILE``, by default ``~/.align-pipeline/board-<master_port>.key``: a file that the workers see
too (a shared home or project filesystem) or that is copied to them. It never goes on the board.

A worker runs only a stage entry point of this package (``align_pipeline.train.<stage>``), plus the modules its own
operator names in ``$ALIGN_WORKER_MODULES`` (comma-separated), and passes on only the job environment keys in
:data:`JOB_ENV_KEYS` (the MLflow run to log into and the project's own settings), never e.g. ``PYTHONPATH``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pkgutil
import re
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SECRET_FILE_ENV = "ALIGN_BOARD_SECRET_FILE"
"""Environment variable naming the file of the run's board secret (node 0 writes it, the workers read it)."""
WORKER_MODULES_ENV = "ALIGN_WORKER_MODULES"
"""Environment variable of a worker: extra modules (comma-separated) it may run besides the stage entry points."""
SECRET_BYTES = 32
MAX_AGE_S = 1800.0
"""Messages older than this (or this far in the future: the nodes' clocks must agree within it) are refused."""
JOB_ENV_KEYS = frozenset({
    "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "ALIGN_MLFLOW_PROBE_TIMEOUT",
    "CUDA_DEVICE_MAX_CONNECTIONS", "ALIGN_PLAIN_LOGS", "ALIGN_TRACEBACK", "ALIGN_SWEEP", "ALIGN_SWEEP_POINT", "ALIGN_PROFILE_DIR",
    "ALIGN_PROFILE_STEP",
})  # fmt: skip
"""The environment keys a posted job may set on a worker: those the launcher and the entry points use."""
_ENTRY_POINT = re.compile(r"align_pipeline\.train\.[a-z][a-z0-9_]*")


class Refused(ValueError):
    """A message on the board that is not to be trusted; the text says why."""


def secret_path(master_port: int) -> Path:
    """Where node 0 writes, and the workers read, the board secret of the run on ``master_port``."""
    named = os.environ.get(SECRET_FILE_ENV)
    return Path(named).expanduser() if named else Path.home() / ".align-pipeline" / f"board-{master_port}.key"


def write_secret(path: Path) -> bytes:
    """A new secret, written to ``path`` (mode 0600, replacing any old one in one rename)."""
    secret = secrets.token_bytes(SECRET_BYTES)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secret.hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return secret


def read_secret(path: Path) -> bytes | None:
    """The secret in ``path``; None while there is none (node 0 has not written it yet, or it is not one)."""
    try:
        text = path.read_text().strip()
        secret = bytes.fromhex(text)
    except (OSError, ValueError):
        return None
    return secret if len(secret) >= SECRET_BYTES else None


class Channel:
    """Seals this side's messages and opens the other side's, with the run's secret.

    ``open`` of the message it accepted last for a key (the same post, polled again) returns it again; any other
    message is checked in full, and its nonce remembered, so a copy of an accepted message is a replay.
    """

    def __init__(self, secret: bytes, sender: str) -> None:
        self._secret, self.sender = secret, sender
        self._seen: set[str] = set()
        self._accepted: dict[str, tuple[bytes, Any]] = {}

    def _mac(self, fields: Mapping[str, Any]) -> str:
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self._secret, canonical, hashlib.sha256).hexdigest()

    def seal(self, key: str, body: Any) -> str:
        fields = {"key": key, "from": self.sender, "nonce": secrets.token_hex(16), "time": time.time(), "body": body}
        return json.dumps({**fields, "mac": self._mac(fields)})

    def open(self, key: str, raw: bytes | str, max_age_s: float | None = MAX_AGE_S) -> Any:
        """The body of the message ``raw`` read from ``key``; :class:`Refused` (saying why) if it is not genuine
        (``max_age_s``: None = any age)."""
        raw = raw.encode() if isinstance(raw, str) else bytes(raw)
        if key in self._accepted and self._accepted[key][0] == raw:
            return self._accepted[key][1]
        try:
            message = json.loads(raw)
        except ValueError:
            message = None
        if not isinstance(message, dict) or not isinstance(message.get("mac"), str):
            raise Refused("unsigned (not a sealed message)")
        fields = {k: v for k, v in message.items() if k != "mac"}
        if set(fields) != {"key", "from", "nonce", "time", "body"} or not isinstance(fields["time"], (int, float)):
            raise Refused("malformed sealed message")
        if not hmac.compare_digest(self._mac(fields), message["mac"]):
            raise Refused("bad signature (not signed with this run's board secret)")
        if fields["key"] != key:
            raise Refused(f"replayed: signed for {fields['key']!r}")
        if fields["nonce"] in self._seen:
            raise Refused("replayed: its nonce was used before")
        age = time.time() - fields["time"]
        if max_age_s is not None and not -max_age_s <= age <= max_age_s:
            raise Refused(f"stale: signed {age:.0f} s ago (limit {max_age_s:.0f} s)")
        self._seen.add(fields["nonce"])
        self._accepted[key] = (raw, fields["body"])
        return fields["body"]


def entry_points() -> list[str]:
    """The stage entry points of this package (``align_pipeline.train.<stage>``)."""
    train = Path(__file__).resolve().parent.parent / "train"
    return sorted(f"align_pipeline.train.{m.name}" for m in pkgutil.iter_modules([str(train)])
                  if not m.ispkg and not m.name.startswith("_"))  # fmt: skip


def module_refusal(module: Any) -> str | None:
    """Why a worker refuses to run ``module`` (None: it may)."""
    extra = [m.strip() for m in os.environ.get(WORKER_MODULES_ENV, "").split(",") if m.strip()]
    if isinstance(module, str) and (module in extra or (_ENTRY_POINT.fullmatch(module) and module in entry_points())):
        return None
    return (f"module {module!r} is not a stage entry point of align_pipeline ({', '.join(entry_points())}) nor in "
            f"this worker's ${WORKER_MODULES_ENV}")


def job_env(env: Any) -> tuple[dict[str, str], list[str]]:
    """The keys of a posted job's environment a worker passes on, and those it drops."""
    if not isinstance(env, dict):
        return {}, ["<not a mapping>"]
    kept = {k: str(v) for k, v in env.items() if k in JOB_ENV_KEYS}
    return kept, sorted(str(k) for k in env if k not in kept)
