"""Dubious records: schema-valid lines that are most likely mistakes in the data.

* ``duplicates`` – a line whose record is exactly an earlier line's (same keys and values; key order and JSON
  spacing do not matter). Counted once per repeat: three equal lines are two duplicates.
* ``empty_answers`` – the trained-on text is empty or whitespace: SFT ``output``, an Assistant turn's ``value`` or an
  assistant message's ``content`` (one that calls no tool),
  preference ``chosen_response`` or ``rejected_response``, a prompt's ``answer`` when given, regression ``response``.
* ``chosen_equals_rejected`` (preference) – ``chosen_response == rejected_response``: a pair with nothing to learn.

A line can count under several reasons. ``data_prep.dubious`` says what happens to them (:func:`handle_dubious`):
``warn`` (default) keeps them and logs one warning per file with the counts and a few line numbers, ``refuse`` raises
:class:`~align_pipeline.data.schemas.DataValidationError` naming file, lines and reason, ``ignore`` keeps them
silently. The counts go into data_prep's metrics in every mode (:meth:`Dubious.metrics`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from .layouts import blank_response
from .schemas import DataValidationError, RawData

logger = logging.getLogger(__name__)

REASONS: dict[str, tuple[str, ...]] = {
    "sft": ("duplicates", "empty_answers"),
    "preference": ("duplicates", "empty_answers", "chosen_equals_rejected"),
    "prompts": ("duplicates", "empty_answers"),
    "regression": ("duplicates", "empty_answers"),
}
"""The reasons checked per kind (each gets a metric, zero included)."""

DESCRIPTIONS = {
    "duplicates": "exact duplicate of an earlier line",
    "empty_answers": "empty or whitespace-only answer (output / chosen / rejected / Assistant turn / answer)",
    "chosen_equals_rejected": "chosen_response is identical to rejected_response",
}
EXAMPLES = 5
"""Line numbers shown per reason in a warning."""
REFUSE_LINES = 20
"""Line numbers listed per reason in a refusal (then ``+N more``)."""


@dataclass
class Dubious:
    """The dubious lines of one raw file."""

    kind: str
    source: str
    lines: dict[str, list[int]] = field(default_factory=dict)
    """Reason -> 1-based line numbers, in file order (every reason of :data:`REASONS` for the kind is a key)."""
    duplicate_of: dict[int, int] = field(default_factory=dict)
    """Line of a duplicate -> line of its first occurrence."""

    def count(self, reason: str) -> int:
        return len(self.lines.get(reason, ()))

    @property
    def total(self) -> int:
        """Number of distinct dubious lines."""
        return len({line for lines in self.lines.values() for line in lines})

    def metrics(self) -> dict[str, int]:
        """``{<kind>_dubious_<reason>: count}`` for every reason checked, zeros included."""
        return {f"{self.kind}_dubious_{reason}": len(lines) for reason, lines in self.lines.items()}

    def _line(self, reason: str, line: int) -> str:
        return f"{line} (= line {self.duplicate_of[line]})" if reason == "duplicates" else str(line)

    def summary(self) -> str:
        """One line per file: the counts and a few example lines of each reason found."""
        parts = []
        for reason, lines in self.lines.items():
            if lines:
                shown = ", ".join(self._line(reason, n) for n in lines[:EXAMPLES])
                more = ", ..." if len(lines) > EXAMPLES else ""
                parts.append(f"{reason}: {len(lines)} ({DESCRIPTIONS[reason]}; e.g. lines {shown}{more})")
        return f"{self.source}: {self.total} dubious record{'s' if self.total != 1 else ''} – " + "; ".join(parts)

    def refusals(self) -> list[str]:
        """One ``<file> lines a, b, c (+N more): <reason>`` line per reason found."""
        out = []
        for reason, lines in self.lines.items():
            if lines:
                shown = ", ".join(self._line(reason, n) for n in lines[:REFUSE_LINES])
                more = f" (+{len(lines) - REFUSE_LINES} more)" if len(lines) > REFUSE_LINES else ""
                word = "line" if len(lines) == 1 else "lines"
                out.append(f"{self.source} {word} {shown}{more}: {DESCRIPTIONS[reason]}")
        return out


def _blank(value: Any) -> bool:
    return isinstance(value, str) and not value.strip()


def _empty_answer(record: dict[str, Any], kind: str) -> bool:
    if kind == "sft":
        if "messages" in record:
            return blank_response(record["messages"])
        if "conversations" in record:
            return any(t["from"] == "Assistant" and _blank(t["value"]) for t in record["conversations"])
        return _blank(record["output"])
    if kind == "preference":
        return blank_response(record["chosen_response"]) or blank_response(record["rejected_response"])
    if kind == "prompts":
        return _blank(record.get("answer"))
    return _blank(record.get("response"))


def find_dubious(raw: RawData) -> Dubious:
    """The dubious lines of a validated raw file (see the module docstring)."""
    reasons = REASONS.get(raw.kind, ("duplicates", "empty_answers"))
    found = Dubious(kind=raw.kind, source=raw.source, lines={r: [] for r in reasons})
    first: dict[bytes, int] = {}  # a 16-byte digest per distinct record, not the record
    for record, line in zip(raw.records, raw.lines):
        key = hashlib.blake2b(json.dumps(record, sort_keys=True, ensure_ascii=False).encode(),
                              digest_size=16).digest()
        if key in first:
            found.lines["duplicates"].append(line)
            found.duplicate_of[line] = first[key]
        else:
            first[key] = line
        if _empty_answer(record, raw.kind):
            found.lines["empty_answers"].append(line)
        if raw.kind == "preference" and record["chosen_response"] == record["rejected_response"]:
            found.lines["chosen_equals_rejected"].append(line)
    return found


def handle_dubious(found: list[Dubious], mode: str) -> None:
    """``warn``: one warning per file with dubious lines; ``refuse``: one :class:`DataValidationError` listing every
    file, lines and reason; ``ignore``: nothing."""
    flagged = [d for d in found if d.total]
    if not flagged or mode == "ignore":
        return
    if mode == "refuse":
        lines = [line for d in flagged for line in d.refusals()]
        raise DataValidationError(
            "dubious records (data_prep.dubious: refuse):\n  "
            + "\n  ".join(lines)
            + "\nfix or remove these lines, or set data_prep.dubious to warn (keep them) or ignore"
        )
    if mode != "warn":
        raise ValueError(f"data_prep.dubious must be warn, refuse or ignore, got {mode!r}")
    for d in flagged:
        logger.warning(
            "%s. They are used as they are (data_prep.dubious: warn; refuse stops on them, ignore silences this)",
            d.summary(),
        )


__all__ = ["DESCRIPTIONS", "REASONS", "Dubious", "find_dubious", "handle_dubious"]
