"""What ``kedro run`` prints: one plain log record per line when the output is not a terminal, and no line per
parameter Kedro hands a node.

:func:`quiet_parameter_loads` drops Kedro's ``Loading data from params:... (MemoryDataset)...`` records (about 40 % of
a default run's console; loads of datasets stay). ``conf/logging.yml`` (Kedro reads it for any run in the project
directory) is Kedro's rich configuration with its "Using ... as logging configuration" line kept out: Kedro admits
only its own and the ``logging`` module's handler classes there, so the plain switch below stays in the hook.

Kedro's default logging handler (rich) lays records out for a terminal; writing to a file or a pipe it still wraps
them at 80 columns, so ``grep "iter 170/300" run.log`` misses lines and a traceback is cut into pieces. When the
handler's console is not a terminal, :func:`plain_logging_when_piped` replaces it by a plain stream handler on the
same stream: ``2026-12-04 11:05:18 INFO align_pipeline.launch.torchrun: [sft] step 20/300 | loss 1.2340 | ...``, one
record per line, nothing wrapped. A terminal keeps rich. The MLflow hook calls it when Kedro has created the context
(after Kedro configured logging); ``ALIGN_PLAIN_LOGS=1`` forces it, ``=0`` never.
"""

from __future__ import annotations

import contextlib
import logging
import os

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def plain_logging_when_piped(logger: logging.Logger | None = None) -> int:
    """Replace every rich handler of ``logger`` (default: the root logger) whose console is not a terminal by a plain
    one-line-per-record stream handler (same stream, level and filters); returns how many were replaced."""
    force = os.environ.get("ALIGN_PLAIN_LOGS", "")
    if force == "0":
        return 0
    logger = logger or logging.getLogger()
    replaced = 0
    for handler in list(logger.handlers):
        console = getattr(handler, "console", None)  # rich.logging.RichHandler (Kedro's subclass)
        if console is None or (console.is_terminal and force != "1"):
            continue
        plain = logging.StreamHandler(console.file)
        plain.setLevel(handler.level)
        plain.setFormatter(logging.Formatter(PLAIN_FORMAT, DATE_FORMAT))
        for f in handler.filters:
            plain.addFilter(f)
        logger.removeHandler(handler)
        logger.addHandler(plain)
        replaced += 1
    return replaced


class ParameterLoads(logging.Filter):
    """Drops Kedro's ``Loading data from params:<name> (MemoryDataset)...`` records; loads of datasets stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "kedro.io.data_catalog" or not str(record.msg).startswith("Loading data from"):
            return True
        name = str(record.args[0]) if record.args else ""
        return not (name.startswith("params:") or name == "parameters")


@contextlib.contextmanager
def catalog_quiet():
    """Kedro's catalog logs no "Loading data from ..." line inside (a hook reading the catalog for itself, not a node's
    input the user should see)."""
    catalog = logging.getLogger("kedro.io.data_catalog")
    level = catalog.level
    catalog.setLevel(logging.WARNING)
    try:
        yield
    finally:
        catalog.setLevel(level)


def quiet_parameter_loads() -> None:
    """Install :class:`ParameterLoads` on Kedro's catalog logger (once)."""
    catalog = logging.getLogger("kedro.io.data_catalog")
    if not any(isinstance(f, ParameterLoads) for f in catalog.filters):
        catalog.addFilter(ParameterLoads())


__all__ = ["ParameterLoads", "catalog_quiet", "plain_logging_when_piped", "quiet_parameter_loads"]
