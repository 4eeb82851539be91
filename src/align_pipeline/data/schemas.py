"""Schemas of the raw jsonl files (NeMo-Aligner compatible) and their validation.

One JSON object per line (blank lines are skipped; line numbers are the file's physical lines):

* SFT, plain: ``{"input": str, "output": str}`` – loss on ``output``.
* SFT, chat:  ``{"system"?: str, "conversations": [{"from": "User"|"Assistant", "value": str}, ...]}`` – loss on
  Assistant turns. NeMo-Aligner's optional chat keys are accepted and ignored: top-level ``"mask"`` (must be
  ``"User"``), ``"type"``, and per-turn ``"label"``.
* Preference: ``{"prompt": str, "chosen_response": str, "rejected_response": str,
  "chosen_reward"?: float, "rejected_reward"?: float}``; or NeMo-Aligner's reward-model format: ``{"text": str}``
  lines, each pair of consecutive lines one (chosen, rejected) pair of complete, already-templated texts. Their
  common prefix (cut back to a whitespace boundary) becomes the prompt, the rest the responses; the texts are
  tokenized verbatim, never passed through a chat template.
* Prompts: ``{"prompt": str, "answer"?: any, ...}`` – any extra field is kept and reaches the reward functions
  (``answer`` is what the built-in checkers compare with); or NeMo-Aligner's PPO format ``{"text": str, ...}``: an
  already-templated prompt, used verbatim (its ``prompt`` is the text).

A file is in one layout or the other (its first record decides). Any other key of SFT and preference records is
rejected, as is a prompt field named ``prompt_ids`` (the tokenized prompt's own field). Every problem raises :class:`DataValidationError` naming the file, the line and the
field, e.g. ``data/01_raw/sft.jsonl line 17: field "output": expected a string, got int``. A string (or key) anywhere
in a record that holds a lone UTF-16 surrogate – a JSON ``"\ud800"`` escape without its pair, which no UTF-8 text and
so no tokenizer can hold – is refused the same way: ``field "output": invalid Unicode (lone surrogate U+D800)``.
Sequence-length checks
need the tokenizer and live in :mod:`align_pipeline.data.tokenize` (same error class, same message shape).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import DataValidationError, display_path, make_error
from .formats import bytes_sha256

Kind = Literal["sft", "preference", "prompts"]
KINDS: tuple[str, ...] = ("sft", "preference", "prompts", "regression")


@dataclass
class RawData:
    """The validated records of one raw jsonl file."""

    kind: str
    """``sft``, ``preference`` or ``prompts``."""
    source: str
    """The file as shown in messages (relative to the working directory when inside it)."""
    sha256: str
    """Full sha256 of the file's bytes."""
    records: list[dict[str, Any]] = field(default_factory=list)
    """One dict per non-blank line, in file order."""
    lines: list[int] = field(default_factory=list)
    """1-based line number of each record."""
    templated: bool = False
    """NeMo-Aligner ``{"text"}`` layout: the texts already carry their chat markup; never apply a template."""

    def __len__(self) -> int:
        return len(self.records)

    def error(self, index: int, fieldname: str | None, problem: str) -> DataValidationError:
        """A :class:`DataValidationError` for record ``index`` (position in :attr:`records`)."""
        return make_error(self.source, self.lines[index], fieldname, problem)


class _FieldError(Exception):
    def __init__(self, fieldname: str | None, problem: str):
        super().__init__(problem)
        self.fieldname = fieldname
        self.problem = problem


_JSON_TYPE_NAMES = {
    str: "string",
    int: "int",
    float: "float",
    bool: "bool",
    list: "list",
    dict: "object",
    type(None): "null",
}


def _type_name(value: Any) -> str:
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _expect_str(obj: dict, key: str, where: str | None = None, required: bool = True) -> None:
    name = where or key
    if key not in obj:
        if required:
            raise _FieldError(name, "missing (required)")
        return
    if not isinstance(obj[key], str):
        raise _FieldError(name, f"expected a string, got {_type_name(obj[key])}")


def _expect_number(obj: dict, key: str) -> None:
    if key in obj:
        v = obj[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _FieldError(key, f"expected a number, got {_type_name(v)}")


def _reject_extra(obj: dict, allowed: set[str], prefix: str = "") -> None:
    extra = [k for k in obj if k not in allowed]
    if extra:
        raise _FieldError(f"{prefix}{extra[0]}", f"unknown field (allowed: {', '.join(sorted(allowed))})")


SFT_PLAIN_FIELDS = {"input", "output"}
SFT_CHAT_FIELDS = {"system", "conversations", "mask", "type"}
TURN_FIELDS = {"from", "value", "label"}
PREFERENCE_FIELDS = {"prompt", "chosen_response", "rejected_response", "chosen_reward", "rejected_reward"}
RESERVED_PROMPT_FIELDS = {"prompt_ids"}
TEXT_FIELD = "text"
REGRESSION_FIELDS = {"prompt", "response", "labels"}
ROLES = ("User", "Assistant")


def _check_sft(obj: dict) -> None:
    if "conversations" in obj:
        _reject_extra(obj, SFT_CHAT_FIELDS)
        _expect_str(obj, "system", required=False)
        if "mask" in obj and obj["mask"] != "User":
            raise _FieldError("mask", f'only "User" is supported (loss on Assistant turns), got {obj["mask"]!r}')
        convs = obj["conversations"]
        if not isinstance(convs, list):
            raise _FieldError("conversations", f"expected a list of turns, got {_type_name(convs)}")
        if not convs:
            raise _FieldError("conversations", "empty list (need at least one Assistant turn)")
        for i, turn in enumerate(convs):
            where = f"conversations[{i}]"
            if not isinstance(turn, dict):
                raise _FieldError(where, f'expected an object {{"from", "value"}}, got {_type_name(turn)}')
            _reject_extra(turn, TURN_FIELDS, prefix=f"{where}.")
            _expect_str(turn, "from", f"{where}.from")
            if turn["from"] not in ROLES:
                raise _FieldError(f"{where}.from", f'expected "User" or "Assistant", got {turn["from"]!r}')
            _expect_str(turn, "value", f"{where}.value")
            if turn.get("label") is not None:
                _expect_str(turn, "label", f"{where}.label")
        if not any(t["from"] == "Assistant" for t in convs):
            raise _FieldError("conversations", "no Assistant turn (nothing to train on)")
        return
    if "input" not in obj and "output" not in obj:
        raise _FieldError("input", 'missing (required): expected {"input", "output"} or chat {"conversations": [...]}')
    _reject_extra(obj, SFT_PLAIN_FIELDS)
    _expect_str(obj, "input")
    _expect_str(obj, "output")


def _check_preference(obj: dict) -> None:
    _reject_extra(obj, PREFERENCE_FIELDS)
    for key in ("prompt", "chosen_response", "rejected_response"):
        _expect_str(obj, key)
    _expect_number(obj, "chosen_reward")
    _expect_number(obj, "rejected_reward")


def _check_prompts(obj: dict) -> None:
    reserved = RESERVED_PROMPT_FIELDS & obj.keys()
    if reserved:
        raise _FieldError(reserved.pop(), "reserved for the tokenized prompt; rename the field")
    _expect_str(obj, "prompt" if "prompt" in obj or TEXT_FIELD not in obj else TEXT_FIELD)


def _check_text(obj: dict) -> None:
    """NeMo-Aligner's ``{"text"}`` reward-model line."""
    _reject_extra(obj, {TEXT_FIELD})
    _expect_str(obj, TEXT_FIELD)


def _check_regression(obj: dict) -> None:
    """SteerLM-style multi-attribute data: ``{"prompt", "response", "labels": {attribute: number | null}}``."""
    _reject_extra(obj, REGRESSION_FIELDS)
    _expect_str(obj, "prompt")
    _expect_str(obj, "response")
    if "labels" not in obj:
        raise _FieldError("labels", "missing (required): expected an object {attribute: number or null}")
    labels = obj["labels"]
    if not isinstance(labels, dict) or not labels:
        raise _FieldError(
            "labels", f"expected a non-empty object {{attribute: number or null}}, got {_type_name(labels)}"
        )
    for name, value in labels.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise _FieldError(f"labels.{name}", f"expected a number or null (missing), got {_type_name(value)}")


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how one is written in a line (or a literal "\\ud8..": walked)


def _check_surrogates(value: Any, where: str | None = None) -> None:
    """Raise ``_FieldError`` naming the first string of ``value`` (keys included; nested objects and lists walked)
    that holds a lone surrogate. ``json.loads`` joins a valid pair into one character, so any left is lone."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        if found:
            raise _FieldError(where, f"invalid Unicode (lone surrogate U+{ord(found.group()):04X})")
    elif isinstance(value, dict):
        for key, item in value.items():
            name = key if where is None else f"{where}.{key}"
            _check_surrogates(key, name.encode("utf-8", "backslashreplace").decode())
            _check_surrogates(item, name)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_surrogates(item, f"{where}[{i}]")


_CHECKS = {
    "sft": _check_sft,
    "preference": _check_preference,
    "prompts": _check_prompts,
    "regression": _check_regression,
}


def validate_record(obj: Any, kind: str) -> None:
    """Raise ``_FieldError`` (internal) when ``obj`` is not a valid record of ``kind``."""
    if not isinstance(obj, dict):
        raise _FieldError(None, f"expected a JSON object, got {_type_name(obj)}")
    _CHECKS[kind](obj)


def _is_text_layout(obj: Any, kind: str) -> bool:
    """A NeMo-Aligner ``{"text"}`` record (preference: only ``text``; prompts: ``text`` and no ``prompt``)."""
    if not isinstance(obj, dict) or TEXT_FIELD not in obj:
        return False
    return "prompt" not in obj if kind == "prompts" else kind == "preference" and set(obj) == {TEXT_FIELD}


def parse_jsonl_bytes(blob: bytes, kind: str, source: str) -> RawData:
    """Validate the bytes of a raw jsonl file of ``kind``; ``source`` is the name used in error messages."""
    if kind not in _CHECKS:
        raise ValueError(f"unknown data kind {kind!r}; expected one of {KINDS}")
    data = RawData(kind=kind, source=source, sha256=bytes_sha256(blob))
    layout: bool | None = None  # True = NeMo {"text"} layout, decided by the first record
    for lineno, raw in enumerate(blob.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise make_error(source, lineno, None, f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise make_error(source, lineno, None, f"invalid JSON ({exc.msg} at column {exc.colno})") from None
        text_layout = _is_text_layout(obj, kind)
        if layout is None:
            layout = text_layout
        elif text_layout != layout:
            first = 'NeMo-Aligner {"text"}' if layout else "field"
            raise make_error(source, lineno, None, f"mixes layouts: the file's first record is in the {first} layout")
        try:
            _check_text(obj) if text_layout and kind == "preference" else validate_record(obj, kind)
            if _SURROGATE_ESCAPE.search(raw):
                _check_surrogates(obj)
        except _FieldError as exc:
            raise make_error(source, lineno, exc.fieldname, exc.problem) from None
        if text_layout and kind == "prompts":
            obj = {**obj, "prompt": obj[TEXT_FIELD]}
        data.records.append(obj)
        data.lines.append(lineno)
    if not data.records:
        raise make_error(source, None, None, f"file is empty: expected one {kind} JSON object per line")
    data.templated = bool(layout)
    if layout and kind == "preference":
        _pair_text_lines(data)
    return data


def _pair_text_lines(data: RawData) -> None:
    """NeMo-Aligner RM layout: consecutive ``{"text"}`` lines -> one preference record per (chosen, rejected) pair,
    the common prefix (cut back to whitespace) as the prompt."""
    if len(data.records) % 2:
        raise make_error(data.source, data.lines[-1], TEXT_FIELD,
                         "chosen text without its rejected line: NeMo-Aligner's reward-model layout pairs "
                         "consecutive lines (chosen, then rejected)")
    records, lines = [], []
    for i in range(0, len(data.records), 2):
        chosen, rejected = data.records[i][TEXT_FIELD], data.records[i + 1][TEXT_FIELD]
        cut = common_prompt_length(chosen, rejected)
        records.append({"prompt": chosen[:cut], "chosen_response": chosen[cut:], "rejected_response": rejected[cut:]})
        lines.append(data.lines[i])
    data.records, data.lines = records, lines


def common_prompt_length(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, cut back to just after a whitespace character (so
    no word is split between prompt and response); 0 when there is none."""
    n = 0
    limit = min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    if n == len(a) == len(b):
        return 0  # identical texts: nothing tells a prompt from a response (flagged as chosen == rejected)
    while n > 0 and not a[n - 1].isspace():
        n -= 1
    return n


def read_raw_jsonl(path: str | os.PathLike, kind: str, source: str | None = None) -> RawData:
    """Read and validate a raw jsonl file; every problem raises :class:`DataValidationError`."""
    source = source or display_path(path)
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        raise make_error(source, None, None, "file not found") from None
    return parse_jsonl_bytes(blob, kind, source)


# ---------------------------------------------------------------------------------------------------------------
# Record views used by tokenization
# ---------------------------------------------------------------------------------------------------------------


def sft_segments(record: dict[str, Any]) -> list[tuple[str, bool]]:
    """The text of an SFT record as ``(text, is_response)`` segments, in order.

    Plain ``{"input", "output"}`` is one User turn and one Assistant turn. Chat: the optional system text followed
    by a newline, then the turns' values verbatim (no role markup is added: put any template in the text), a turn's
    SteerLM ``label`` (+ newline) before its value. Each Assistant segment is followed by ``<eos>`` when tokenized.
    """
    if "conversations" in record:
        segs: list[tuple[str, bool]] = []
        if record.get("system"):
            segs.append((record["system"] + "\n", False))
        for turn in record["conversations"]:
            if turn.get("label") is not None:  # SteerLM's attribute string conditions the turn: context, no loss
                segs.append((turn["label"] + "\n", False))
            segs.append((turn["value"], turn["from"] == "Assistant"))
        return segs
    return [(record["input"], False), (record["output"], True)]


def sft_prompt_text(record: dict[str, Any]) -> str:
    """The non-response text leading up to the first response (used as the split key)."""
    out = []
    for text, is_response in sft_segments(record):
        if is_response:
            break
        out.append(text)
    return "".join(out)


def record_texts(record: dict[str, Any]) -> list[str]:
    """Every string a tokenizer should be trained on in a record."""
    if "conversations" in record:
        return [record.get("system", "")] + [t[k] for t in record["conversations"] for k in ("label", "value")
                                             if isinstance(t.get(k), str)]
    return [record[k] for k in TEXT_FIELDS if isinstance(record.get(k), str)]


TEXT_FIELDS = ("input", "output", "prompt", "chosen_response", "rejected_response", "response", "answer")
"""The fields whose text is modelled (a prompt's extra fields, e.g. ``category``, are not)."""


__all__ = [
    "KINDS",
    "DataValidationError",
    "RawData",
    "display_path",
    "make_error",
    "parse_jsonl_bytes",
    "read_raw_jsonl",
    "record_texts",
    "sft_prompt_text",
    "sft_segments",
    "validate_record",
]
