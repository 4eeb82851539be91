"""Project commands for the ``kedro`` CLI (Kedro loads ``<package>.cli``; commands here replace Kedro's own).

``kedro run`` is Kedro's run with one change: a user error – bad data, a bad parameter, a failed job, a missing
dataset, a busy run directory (:class:`align_pipeline.errors.UserError` and Kedro's ``DatasetError``) – ends with
its message printed once and exit code 2, without a traceback; ``--traceback`` (or ``ALIGN_TRACEBACK=1``) shows it.
Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import click
from kedro.framework.cli.project import run as kedro_run
from kedro.io import DatasetError

from align_pipeline.errors import UserError

# Kedro 1.7's own config loader calls OmegaConf's deprecated API: two 16-line warnings per run that a user can't act on.
warnings.filterwarnings("ignore", message=r"register_new_resolver\(\) is deprecated", category=UserWarning)

USER_ERRORS = (UserError, DatasetError)
USER_ERROR_EXIT = 2


class _DropNodeErrorLog(logging.Filter):
    """Drops Kedro's "Node ... failed with error: <message>" record while a user error propagates (the message is
    printed once at the end instead) and remembers the node's name."""

    def __init__(self) -> None:
        super().__init__()
        self.node: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Node %s failed") and isinstance(sys.exc_info()[1], USER_ERRORS):
            self.node = str(record.args[0]).split(":", 1)[0] if record.args else None
            return False
        return True


def _run(traceback: bool, **kwargs: Any) -> Any:
    traceback = traceback or os.environ.get("ALIGN_TRACEBACK", "") not in ("", "0")
    quiet = _DropNodeErrorLog()
    node_logger = logging.getLogger("kedro.pipeline.node")
    if not traceback:
        node_logger.addFilter(quiet)
    try:
        return kedro_run.callback(**kwargs)
    except USER_ERRORS as exc:
        if traceback:
            raise
        where = f" (node {quiet.node})" if quiet.node else ""
        click.secho(f"Error{where}: {exc}", fg="red", err=True)
        click.echo("(a problem with the data, the configuration or a job; --traceback shows where it was raised)",
                   err=True)  # fmt: skip
        raise SystemExit(USER_ERROR_EXIT) from None
    finally:
        node_logger.removeFilter(quiet)


run = click.Command(
    name="run",
    callback=_run,
    params=[
        *kedro_run.params,
        click.Option(["--traceback"], is_flag=True, default=False, help="Show a user error's traceback too."),
    ],
    help=kedro_run.help,
    short_help=kedro_run.short_help,
)


@click.group(name="align_pipeline")
def cli() -> None:
    """Project commands of align-pipeline."""


cli.add_command(run)

__all__ = ["USER_ERRORS", "USER_ERROR_EXIT", "cli", "run"]
