"""Is the MLflow tracking store reachable? One short probe, so that a store that is down costs seconds, not minutes.

MLflow's REST client retries every failed request ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` times (default 7) with an
exponential backoff (``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR`` 2: 2, 4, ..., 128 s, about 4 minutes in all), each attempt
waiting up to ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (default 120 s). That is right for a rate-limited server and wrong for a
server that is not there: the first call of a ``kedro run`` would wait 4 minutes before training starts. So the Kedro
hook (when the context is created) and the job's rank-0 logger (when it attaches) first make *one* request, without
retries or backoff, that waits at most ``PROBE_TIMEOUT_S`` = 3 s (``$ALIGN_MLFLOW_PROBE_TIMEOUT`` for a slow server;
``$MLFLOW_HTTP_REQUEST_TIMEOUT`` when that is shorter);
if it fails, tracking is off for the run and the metrics are kept in ``metrics.jsonl`` (see
:mod:`align_pipeline.tracking.metrics_file`).

What is probed:

* ``http(s)://``: ``GET <uri>/health`` through MLflow's own request code (the same credentials, TLS settings and
  headers the client uses). Any HTTP answer, even 401 or 404, means a server is there.
* a database on the network (``postgresql://``, ``mysql://``, ``mssql://``): a TCP connection to its host and port.
* local stores (``sqlite:///...``, ``file:``, a plain path) and anything else (``databricks``, plugins): not probed,
  reported reachable; a local store's errors surface (as warnings) when it is used.

Nothing here imports Kedro; MLflow is imported only to probe an http(s) store.
"""

from __future__ import annotations

import os
import re
import socket
from urllib.parse import urlsplit

PROBE_TIMEOUT_S = 3.0
"""The longest a probe waits for an answer."""
HEALTH_ENDPOINT = "/health"
"""The MLflow tracking server's liveness endpoint."""
_DB_PORTS = {"postgresql": 5432, "postgres": 5432, "mysql": 3306, "mssql": 1433}
_LOCAL_SCHEMES = {"", "file", "sqlite"}


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return default


def probe_timeout() -> float:
    """``$ALIGN_MLFLOW_PROBE_TIMEOUT`` (default ``PROBE_TIMEOUT_S``), or ``$MLFLOW_HTTP_REQUEST_TIMEOUT`` when that is
    set and shorter."""
    timeout = _env_float("ALIGN_MLFLOW_PROBE_TIMEOUT", PROBE_TIMEOUT_S)
    return max(0.1, min(timeout, _env_float("MLFLOW_HTTP_REQUEST_TIMEOUT", float("inf"))))


def is_probed(uri: str | None) -> bool:
    """True for stores reached over the network that :func:`unreachable` probes (http(s), network databases)."""
    scheme = urlsplit(uri or "").scheme.lower().split("+", 1)[0]
    return scheme in ("http", "https") or scheme in _DB_PORTS


def unreachable(uri: str | None, timeout: float | None = None) -> str | None:
    """Why the tracking store at ``uri`` cannot be reached (one attempt, at most ``timeout`` seconds, default
    :func:`probe_timeout`), or None when it answers or is not probed (local stores: never any network)."""
    if not is_probed(uri):
        return None
    timeout = probe_timeout() if timeout is None else timeout
    parts = urlsplit(uri)
    scheme = parts.scheme.lower().split("+", 1)[0]
    if scheme in _DB_PORTS:
        try:
            port = parts.port or _DB_PORTS[scheme]
            with socket.create_connection((parts.hostname or "localhost", port), timeout=timeout):
                return None
        except (OSError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
    return _http_unreachable(uri, timeout)


def _http_unreachable(uri: str, timeout: float) -> str | None:
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        http_request(
            get_default_host_creds(uri),
            HEALTH_ENDPOINT,
            "GET",
            max_retries=0,
            backoff_factor=0,
            backoff_jitter=0,
            timeout=timeout,
            raise_on_status=False,
        )
    except Exception as exc:  # noqa: BLE001 — connection refused, timeout, DNS, TLS: all mean "not reachable"
        return _short_reason(str(exc), timeout)
    return None


def _short_reason(text: str, timeout: float) -> str:
    """``"[Errno 111] Connection refused"`` out of requests' long message; ``"no answer in 3 s"`` for a timeout."""
    errno = re.search(r"\[Errno -?\d+\] [^'\")\]]+", text)
    if errno:
        return errno.group(0).strip()
    if "timed out" in text.lower() or "timeout" in text.lower():
        return f"no answer in {timeout:g} s"
    return text if len(text) <= 200 else text[:200] + "..."


def unreachable_message(uri: str, reason: str, kept: str, relog_args: str) -> str:
    """The one warning printed when tracking is switched off for a run: ``kept`` says where the metrics are,
    ``relog_args`` are the arguments of the ``mlflow-log`` command that re-logs them."""
    return (
        f"MLflow at {uri} is unreachable ({reason}): tracking off for this run; metrics are kept in {kept}; "
        f"re-log them with `align-pipeline mlflow-log {relog_args}` once it is up"
    )


__all__ = ["HEALTH_ENDPOINT", "PROBE_TIMEOUT_S", "is_probed", "probe_timeout", "unreachable", "unreachable_message"]
