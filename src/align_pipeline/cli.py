"""Project commands for the ``kedro`` CLI (Kedro loads ``<package>.cli``; commands here replace Kedro's own).

``kedro run`` is Kedro's run with one change: a user error – bad data, a bad parameter, a failed job, a missing
dataset, a busy run directory (:class:`align_pipeline.errors.UserError` and Kedro's ``DatasetError``) – ends with
its message printed once and exit code 2, without a traceback; ``--traceback`` (or ``ALIGN_TRACEBACK=1``) shows it.
Any other exception is a bug and keeps its traceback.

Before Kedro starts a session, the names given to ``--pipelines`` / ``--pipeline``, ``--nodes``, ``--from-nodes``,
``--to-nodes`` and ``--tags`` are checked against the registered pipelines (:func:`check_selection`): a name that
is not there is such a user error, with the closest names, e.g. ``--pipelines: unknown pipeline 'dpoo' (did you
mean 'dpo'?); pipelines: data_prep, dpo, ...`` (Kedro's own errors for them are 40-75-line tracebacks).
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import click
from kedro.framework.cli.project import run as kedro_run
from kedro.io import DatasetError
from kedro.pipeline import Pipeline

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


def _closest(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'dpo'?)`` with up to three close names from ``known``, or ''."""
    matches = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(m) for m in matches)}?)" if matches else ""


def _holders(name: str, registered: Mapping[str, Pipeline], has: str) -> list[str]:
    """The registered pipelines (``__default__`` last) with a node named ``name`` (``has="node"``) or tagged ``name``
    (``has="tag"``)."""
    found = [p for p, pipe in registered.items()
             if any(n.name == name if has == "node" else name in n.tags for n in pipe.nodes)]  # fmt: skip
    return sorted(found, key=lambda p: (p == "__default__", p))


def check_selection(
    registered: Mapping[str, Pipeline],
    pipelines: Iterable[str],
    nodes: Mapping[str, Iterable[str]],
    tags: Iterable[str],
    pipelines_option: str = "--pipelines",
) -> None:
    """Raise a :class:`UserError` for a pipeline name that is not registered, or a node name (``nodes``: option ->
    names, e.g. ``{"--nodes": [...], "--from-nodes": [...]}``) or tag that no node of the selected pipelines (the
    default pipeline when ``pipelines`` is empty) has; the message names the option, the closest names and the ones
    there are."""
    pipelines = list(pipelines)
    for name in pipelines:
        if name not in registered:
            listed = ", ".join(sorted(p for p in registered if p != "__default__"))
            raise UserError(f"{pipelines_option}: unknown pipeline {name!r}{_closest(name, registered)}; pipelines: "
                            f"{listed}")  # fmt: skip
    chosen = pipelines or ["__default__"]
    run = "the default pipeline" if not pipelines else f"pipeline{'s' * (len(chosen) > 1)} {', '.join(chosen)}"
    selected = sum((registered[p] for p in chosen), Pipeline([]))
    for option, names in [*nodes.items(), ("--tags", tags)]:
        has = "tag" if option == "--tags" else "node"
        known = sorted(
            {t for n in selected.nodes for t in n.tags} if has == "tag" else {n.name for n in selected.nodes}
        )
        for name in names:
            if name in known:
                continue
            elsewhere = _holders(name, registered, has)
            if elsewhere:
                raise UserError(f"{option}: no {has} {name!r} in {run}; it is in pipeline{'s' * (len(elsewhere) > 1)} "
                                f"{', '.join(elsewhere)} (add --pipelines {elsewhere[0]})")  # fmt: skip
            raise UserError(f"{option}: unknown {has} {name!r}{_closest(name, known)}; {has}s of {run}: "
                            f"{', '.join(known)}")  # fmt: skip


def _check_run_options(kwargs: dict[str, Any]) -> None:
    """:func:`check_selection` on ``kedro run``'s parsed options (lists, comma-separated values already split by
    Kedro's option callbacks), against the project's registered pipelines."""
    from kedro.framework.project import pipelines as registry

    registered = dict(registry.items())
    if not registered:
        return  # no project configured: Kedro reports that itself
    names = [kwargs["pipeline"]] if kwargs.get("pipeline") else list(kwargs.get("pipelines") or [])
    if kwargs.get("pipeline") and kwargs.get("pipelines"):
        return  # Kedro refuses the pair itself, in one line
    nodes = {option: kwargs.get(key) or [] for option, key in
             (("--nodes", "node_names"), ("--from-nodes", "from_nodes"), ("--to-nodes", "to_nodes"))}  # fmt: skip
    check_selection(
        registered,
        names,
        nodes,
        kwargs.get("tags") or [],
        "--pipeline" if kwargs.get("pipeline") else "--pipelines",
    )


def _run(traceback: bool, **kwargs: Any) -> Any:
    from align_pipeline.kedro.console import plain_logging_when_piped, quiet_parameter_loads

    plain_logging_when_piped()  # before the session's first record (the MLflow hook repeats it for API sessions)
    quiet_parameter_loads()
    traceback = traceback or os.environ.get("ALIGN_TRACEBACK", "") not in ("", "0")
    quiet = _DropNodeErrorLog()
    node_logger = logging.getLogger("kedro.pipeline.node")
    if not traceback:
        node_logger.addFilter(quiet)
    try:
        _check_run_options(kwargs)
        return kedro_run.callback(**kwargs)
    except USER_ERRORS as exc:
        if traceback:
            raise
        where = f" (node {quiet.node})" if quiet.node else ""
        click.secho(f"Error{where}: {_without_streamed_tail(exc)}", fg="red", err=True)
        click.echo("(a problem with the data, the configuration or a job; --traceback shows where it was raised)",
                   err=True)  # fmt: skip
        raise SystemExit(USER_ERROR_EXIT) from None
    finally:
        node_logger.removeFilter(quiet)


def _without_streamed_tail(exc: BaseException) -> str:
    """A failed job's error names the tail of the failing rank's log; rank 0's log was streamed to this console as
    the job ran, so for it the error keeps its first line and names the log instead of printing its end again."""
    from align_pipeline.launch.torchrun import LaunchError

    text = str(exc)
    if isinstance(exc, LaunchError) and exc.rank == 0 and exc.log_path is not None and "\n" in text:
        return f"{text.splitlines()[0]}\n(rank 0's log, streamed above: {exc.log_path})"
    return text


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

__all__ = ["USER_ERRORS", "USER_ERROR_EXIT", "check_selection", "cli", "run"]
