"""Every call to a remote MLflow store runs against a deadline: a store that dies mid-run costs seconds, once per
process, then tracking is off for that process with one warning; training and the catalog go on.

Why: MLflow's REST client (3.17, ``mlflow/utils/rest_utils.py``) retries a failed request
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` times (default 7) with an exponential backoff
(``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR`` 2, ``..._BACKOFF_JITTER`` 1: 2, 4, ..., 120 s, about 4 minutes), each attempt
waiting up to ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (120 s). It reads them at every request; they are right for a
rate-limited server and wrong for one that is gone: a server killed mid-run froze training for 4 minutes, then every
later call of the Kedro process waited as long again. Rather than overriding the user's settings, :func:`call` runs
the MLflow call in a daemon thread and waits for it:

1. up to ``PATIENCE_S`` (2 s); no answer yet: one probe of the store (:func:`~align_pipeline.tracking.probe.unreachable`,
   one request without retries, at most 3 s). No answer to the probe either: the store is gone;
2. otherwise up to ``CALL_TIMEOUT_S`` (10 s, ``$ALIGN_MLFLOW_CALL_TIMEOUT`` for a slow server) in all; a call still
   unanswered then counts as a store that is gone too;
3. a call that raises is followed by the same probe: an error from a store that no longer answers switches tracking
   off; any other error is the caller's to report (as a warning: tracking never fails training).

Once a store is gone, tracking is off for it in this process: one warning (:func:`describe_kept` sets where the
metrics are kept and how to re-log them), and every later :func:`call` raises :class:`TrackingOff` at once, without
touching the network. An abandoned call goes on retrying in its daemon thread, which never holds up the process's
exit; urllib3's "Retrying ..." warnings of these threads are logged at DEBUG, so that the one warning is the only
line a user sees. Local stores (sqlite, ``file:``, a path) are called directly: there is nobody to wait for.

Nothing here imports Kedro or MLflow.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from align_pipeline.tracking.probe import probe_timeout, unreachable, unreachable_message

logger = logging.getLogger(__name__)

T = TypeVar("T")

CALL_TIMEOUT_S = 10.0
"""The longest one tracking call may take before the store counts as gone (``$ALIGN_MLFLOW_CALL_TIMEOUT``)."""
PATIENCE_S = 2.0
"""How long a call may go unanswered before the store is probed."""
_LOCAL_SCHEMES = {"", "file", "sqlite"}

_lock = threading.Lock()
_off: dict[str, str] = {}  # tracking uri -> why tracking is off for it in this process
_kept = ("<run dir>/metrics.jsonl", "<run dir>")  # (where the metrics are kept, the arguments of mlflow-log)
_THREAD_PREFIX = "mlflow-call:"


class _RetriesAtDebug(logging.Filter):
    """urllib3's per-retry warnings, from the threads of :func:`call`, at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.threadName.startswith(_THREAD_PREFIX) and record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


_RETRY_FILTER = _RetriesAtDebug()


class TrackingOff(RuntimeError):
    """Tracking is off for this store in this process (it stopped answering): nothing was sent."""


def call_timeout() -> float:
    """``$ALIGN_MLFLOW_CALL_TIMEOUT`` (default ``CALL_TIMEOUT_S``), at least 1 s."""
    try:
        return max(1.0, float(os.environ["ALIGN_MLFLOW_CALL_TIMEOUT"]))
    except (KeyError, ValueError):
        return CALL_TIMEOUT_S


def is_local(uri: str | None) -> bool:
    """True for stores on this machine's filesystem (sqlite, ``file:``, a plain path), which are called directly;
    False for a server or a database elsewhere, and for the scheme-less ``databricks`` / ``uc`` remotes."""
    scheme = urlsplit(uri or "").scheme.lower().split("+", 1)[0]
    return scheme in _LOCAL_SCHEMES and not (uri or "").lower().startswith(("databricks", "uc"))


def describe_kept(kept: str, relog_args: str) -> None:
    """What the warning of this process says when tracking goes off: where the metrics are kept, and the arguments
    of the ``align-pipeline mlflow-log`` command that re-logs them."""
    global _kept
    _kept = (kept, relog_args)


def off_reason(uri: str | None) -> str | None:
    """Why tracking is off for ``uri`` in this process, or None while it is on."""
    with _lock:
        return _off.get(uri or "")


def switch_off(uri: str | None, reason: str) -> bool:
    """Tracking is off for ``uri`` in this process; the first time, one warning. True when this call switched it."""
    with _lock:
        if (uri or "") in _off:
            return False
        _off[uri or ""] = reason
    logger.warning(unreachable_message(uri or "", reason, *_kept))
    return True


def reset(uri: str | None = None) -> None:
    """Tracking on again for ``uri`` (every store when None): a new ``kedro run`` in this process probes afresh."""
    with _lock:
        if uri is None:
            _off.clear()
        else:
            _off.pop(uri, None)


def call(uri: str | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` (an MLflow call against the store ``uri``), bounded as the module docstring says.

    Raises:
        TrackingOff: tracking is (now) off for ``uri``; the warning is already logged.
        Exception: whatever ``fn`` raised while the store still answers.
    """
    reason = off_reason(uri)
    if reason is not None:
        raise TrackingOff(reason)
    if is_local(uri):
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 — handed to the caller's thread
            box["error"] = exc
        finally:
            done.set()

    retries = logging.getLogger("urllib3.connectionpool")
    if _RETRY_FILTER not in retries.filters:
        retries.addFilter(_RETRY_FILTER)
    threading.Thread(target=run, name=_THREAD_PREFIX + getattr(fn, "__name__", "call"), daemon=True).start()
    start, limit = time.monotonic(), call_timeout()
    if not done.wait(min(PATIENCE_S, limit)):
        left = limit - (time.monotonic() - start)
        reason = unreachable(uri, timeout=max(0.1, min(probe_timeout(), left))) if left > 0 else None
        if reason is None:
            done.wait(max(0.0, limit - (time.monotonic() - start)))
        if not done.is_set():
            reason = reason or f"no answer in {limit:g} s"
            switch_off(uri, reason)
            raise TrackingOff(reason)
    if "error" in box:
        error = box["error"]
        reason = unreachable(uri)
        if reason is not None:
            switch_off(uri, reason)
            raise TrackingOff(reason) from error
        raise error
    return box["value"]


class BoundedClient:
    """An ``MlflowClient`` whose every method call goes through :func:`call` (for code that takes a client)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.tracking_uri = client.tracking_uri

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if not callable(method):
            return method
        return lambda *args, **kwargs: call(self.tracking_uri, method, *args, **kwargs)


__all__ = [
    "CALL_TIMEOUT_S",
    "PATIENCE_S",
    "BoundedClient",
    "TrackingOff",
    "call",
    "call_timeout",
    "describe_kept",
    "is_local",
    "off_reason",
    "reset",
    "switch_off",
]
