"""How the ``align-pipeline`` commands print their result: a two-column table for people, one JSON line with
``--json`` for scripts (the same keys)."""

from __future__ import annotations

import json
from typing import Any

JSON_HELP = "print the result as one JSON line (for scripts) instead of a table"


def add_json_flag(parser) -> None:
    """The ``--json`` option of a command that prints a result."""
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def _rows(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    if isinstance(value, dict) and value:
        return [row for key, item in value.items() for row in _rows(item, f"{prefix}.{key}" if prefix else str(key))]
    if isinstance(value, (list, tuple)):
        text = ", ".join(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value) or "-"
    elif isinstance(value, float):
        text = f"{value:.6g}"
    else:
        text = "-" if value is None or value == {} else str(value)
    return [(prefix, text)]


def result_table(summary: dict[str, Any]) -> str:
    """``key  value`` lines, keys aligned; nested dicts as dotted keys, lists comma-separated, None as ``-``."""
    rows = _rows(summary)
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{key:<{width}}  {text}" for key, text in rows)


def print_result(summary: dict[str, Any], as_json: bool) -> None:
    """Print a command's result (stdout): a table, or one JSON line with ``--json``."""
    print(json.dumps(summary) if as_json else result_table(summary), flush=True)


__all__ = ["add_json_flag", "print_result", "result_table"]
