"""The error of a data file that does not match its schema, and how files are named in messages (a leaf module:
:mod:`.formats` and :mod:`.schemas` both raise it)."""

from __future__ import annotations

import os

from align_pipeline.errors import UserError


class DataValidationError(UserError, ValueError):
    """A raw data file does not match its schema; the message names the file, line and field."""


def display_path(path: str | os.PathLike) -> str:
    """``path`` relative to the working directory when it lies inside it (as a user typed it), else absolute."""
    path = os.path.abspath(path)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def make_error(source: str, line: int | None, fieldname: str | None, problem: str, unit: str = "line"
               ) -> DataValidationError:
    """``<source> <unit> <line>: field "<fieldname>": <problem>`` (``unit``: ``line`` of a jsonl file, ``row`` of a
    table)."""
    where = source if line is None else f"{source} {unit} {line}"
    what = f'field "{fieldname}": ' if fieldname else ""
    return DataValidationError(f"{where}: {what}{problem}")
