"""Schemas of the raw records and their validation: NeMo-Aligner's layouts here, TRL / OpenAI / veRL's in
:mod:`.layouts` (normalized into the records below), storage (jsonl, parquet, ``save_to_disk``) in :mod:`.sources`.

One JSON object per line (blank lines are skipped; line numbers are the file's physical lines), or one row of a table
(rows numbered from 1). NeMo-Aligner's layouts, and the records data_prep reads:

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

Beyond these, SFT records may be ``{"messages": [...], "tools"?}``, preference values and prompts may be chat
messages (:mod:`.layouts`). A file is in one layout (its first record decides, or ``data_prep.layouts``); a record in
another is refused. Any other key of SFT and preference records is
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
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import DataValidationError, display_path, make_error
from .formats import bytes_sha256
from .layouts import (
    LAYOUTS,
    VERBATIM,
    LayoutError,
    common_prompt_length,
    detect,
    is_messages,
    key_text,
    normalize,
    texts_of,
    type_name,
)

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
    records: list[dict[str, Any]] | StreamedRecords = field(default_factory=list)
    """One dict per non-blank line, in file order: a list, or (a file, a directory, a catalog table) a
    :class:`StreamedRecords` that reads the source again on each pass."""
    lines: list[int] | array = field(default_factory=list)
    """1-based line number of each record."""
    templated: bool = False
    """The texts are tokenized verbatim, never through a chat template: NeMo-Aligner's ``{"text"}`` layout (the
    texts carry their chat markup) and the string forms of TRL's preference layouts (as TRL does)."""
    layout: str = ""
    """The file's layout (:data:`.layouts.LAYOUTS`)."""
    unit: str = "line"
    """What :attr:`lines` count in messages: ``line`` (jsonl) or ``row`` (parquet, a datasets table)."""

    def __len__(self) -> int:
        return len(self.lines)

    def error(self, index: int, fieldname: str | None, problem: str) -> DataValidationError:
        """A :class:`DataValidationError` for record ``index`` (position in :attr:`records`)."""
        return make_error(self.source, self.lines[index], fieldname, problem, self.unit)


class _FieldError(Exception):
    def __init__(self, fieldname: str | None, problem: str):
        super().__init__(problem)
        self.fieldname = fieldname
        self.problem = problem


def _expect_str(obj: dict, key: str, where: str | None = None, required: bool = True) -> None:
    name = where or key
    if key not in obj:
        if required:
            raise _FieldError(name, "missing (required)")
        return
    if not isinstance(obj[key], str):
        raise _FieldError(name, f"expected a string, got {type_name(obj[key])}")


def _expect_number(obj: dict, key: str) -> None:
    if key in obj:
        v = obj[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _FieldError(key, f"expected a number, got {type_name(v)}")


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
            raise _FieldError("conversations", f"expected a list of turns, got {type_name(convs)}")
        if not convs:
            raise _FieldError("conversations", "empty list (need at least one Assistant turn)")
        for i, turn in enumerate(convs):
            where = f"conversations[{i}]"
            if not isinstance(turn, dict):
                raise _FieldError(where, f'expected an object {{"from", "value"}}, got {type_name(turn)}')
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
            "labels", f"expected a non-empty object {{attribute: number or null}}, got {type_name(labels)}"
        )
    for name, value in labels.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise _FieldError(f"labels.{name}", f"expected a number or null (missing), got {type_name(value)}")


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
_DEFAULT_LAYOUT = {"sft": "nemo", "preference": "nemo", "prompts": "prompt", "regression": "regression"}
"""The layout whose checks name the missing field of a first record that matches no layout."""
_NEMO_LAYOUTS = {"nemo", "prompt", "nemo_text", "regression"}


def validate_record(obj: Any, kind: str, layout: str | None = None) -> dict[str, Any]:
    """The record as data_prep reads it (a TRL / OpenAI / veRL record normalized, :mod:`.layouts`); raises
    ``_FieldError`` / :class:`~.layouts.LayoutError` (internal) when ``obj`` is not a valid record of ``kind`` in
    ``layout`` (default: the one its keys name)."""
    if not isinstance(obj, dict):
        raise _FieldError(None, f"expected a JSON object, got {type_name(obj)}")
    layout = layout or detect(obj, kind) or _DEFAULT_LAYOUT[kind]
    if layout == "nemo_text" and kind == "preference":
        _check_text(obj)
        return obj
    if layout in _NEMO_LAYOUTS:
        _CHECKS[kind](obj)
        record = {**obj, "prompt": obj[TEXT_FIELD]} if layout == "nemo_text" else obj
    else:
        if kind == "prompts":
            _check_reserved(obj)
        record = normalize(obj, kind, layout)
    if kind == "prompts" and record.get("answer") is None and record.get("ground_truth") is not None:
        record = {**record, "answer": record["ground_truth"]}
    return record


def _check_reserved(obj: dict) -> None:
    reserved = RESERVED_PROMPT_FIELDS & obj.keys()
    if reserved:
        raise _FieldError(reserved.pop(), "reserved for the tokenized prompt; rename the field")


Row = tuple[int, Any, bool]
"""(1-based line or row number, the decoded record, whether its strings may hold lone surrogates)."""


def _jsonl_rows(blob: bytes, source: str, first: int = 1) -> Iterator[Row]:
    for lineno, raw in enumerate(blob.split(b"\n"), start=first):
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
        except RecursionError:
            raise make_error(source, lineno, None, "JSON nested too deeply") from None
        yield lineno, obj, bool(_SURROGATE_ESCAPE.search(raw))


def jsonl_file_rows(path: str | os.PathLike, source: str) -> Iterator[Row]:
    """The rows of a jsonl file, read a line at a time (the same lines and numbers as :func:`parse_jsonl_bytes`)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            yield from _jsonl_rows(raw.removesuffix(b"\n"), source, lineno)


def validate_rows(rows: Iterable[Row], data: RawData, layout: str = "auto",
                  reread: Callable[[], Iterable[Row]] | None = None) -> RawData:
    """Validate and normalize every row into ``data`` (its ``kind``, ``source`` and ``unit`` name the rows in
    messages). The file's layout is ``layout`` when forced, else its first record's; a record whose keys name
    another layout, or that holds messages where the first held strings (or the reverse), is refused naming its
    line: a file does not mix layouts.

    ``reread``: a function giving the same rows again. With it the records are not kept: ``data.records`` becomes
    a :class:`StreamedRecords` over ``reread`` (a large file is never held in memory), ``data.lines`` a compact
    array."""
    kind, unit = data.kind, data.unit
    if kind not in _CHECKS:
        raise ValueError(f"unknown data kind {kind!r}; expected one of {KINDS}")
    if layout != "auto" and layout not in LAYOUTS[kind]:
        raise make_error(data.source, None, None, f"data_prep.layouts.{kind} = {layout!r} is not a {kind} layout; "
                                                  f"expected auto or one of {', '.join(LAYOUTS[kind])}")
    file_layout = None if layout == "auto" else layout
    first: tuple[int, str] | None = None  # (line, form) of the first record
    if reread is not None:
        data.records, data.lines = [], array("q")
    for number, obj, surrogates in rows:
        found = detect(obj, kind)
        if file_layout is None:
            file_layout = found or _DEFAULT_LAYOUT[kind]
        elif found is not None and found != file_layout:
            if layout != "auto":
                problem = f"is in the {found} layout, but data_prep.layouts.{kind} is {layout}"
            else:
                problem = (f"mixes layouts: this record is in the {found} layout, the file's first record "
                           f"({unit} {first[0] if first else '?'}) in the {file_layout} layout")
            raise make_error(data.source, number, None, problem, unit)
        try:
            record = validate_record(obj, kind, file_layout)
            if surrogates:
                _check_surrogates(obj)
        except (_FieldError, LayoutError) as exc:
            raise make_error(data.source, number, exc.fieldname, exc.problem, unit) from None
        except RecursionError:
            raise make_error(data.source, number, None, "nested too deeply", unit) from None
        form = _form(record, kind)
        if first is None:
            first = (number, form)
        elif form != first[1]:
            raise make_error(data.source, number, _FORM_FIELD[kind],
                             f"mixes layouts: chat messages and plain strings (this record: {form}; the file's first "
                             f"record, {unit} {first[0]}: {first[1]})", unit)
        if reread is None:
            data.records.append(record)
        data.lines.append(number)
    if not data.lines:
        what = "file is empty" if unit == "line" else "no rows"
        raise make_error(data.source, None, None, f"{what}: expected one {kind} record per {unit}", unit)
    data.layout = file_layout or _DEFAULT_LAYOUT[kind]
    data.templated = data.layout == "nemo_text" or (data.layout in VERBATIM and first is not None
                                                   and first[1] == "text")
    pairs = data.layout == "nemo_text" and kind == "preference"
    if pairs and len(data.lines) % 2:
        raise make_error(data.source, data.lines[-1], TEXT_FIELD,
                         f"chosen text without its rejected {data.unit}: NeMo-Aligner's reward-model layout pairs "
                         f"consecutive {data.unit}s (chosen, then rejected)", data.unit)
    if reread is not None:
        data.records = StreamedRecords(reread, kind, data.layout, data.source, unit, len(data.lines), pairs)
    if pairs:
        data.lines = data.lines[::2]
        if reread is None:
            data.records = [_text_pair(data.records[i][TEXT_FIELD], data.records[i + 1][TEXT_FIELD])
                            for i in range(0, len(data.records), 2)]
    return data


class StreamedRecords:
    """The validated records of a source that is read again on each pass (a file, a ``save_to_disk`` directory, a
    catalog table), normalized again on the way: data_prep never holds a large file's records all at once.

    Iterating gives the records in order (NeMo-Aligner's ``{"text"}`` pairs joined as :func:`validate_rows` joins
    them); a source that changed since it was validated is refused. ``len`` is the record count; ``[i]`` reads up to
    record ``i`` (for messages and tests, not for loops). Copies share the source (it is read, never written)."""

    def __init__(self, rows: Callable[[], Iterable[Row]], kind: str, layout: str, source: str, unit: str, rows_n: int,
                 pairs: bool = False):
        self._rows, self.kind, self.layout, self.source, self.unit = rows, kind, layout, source, unit
        self._rows_n, self._pairs = rows_n, pairs

    def __len__(self) -> int:
        return self._rows_n // 2 if self._pairs else self._rows_n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        n, chosen = 0, None
        for number, obj, _ in self._rows():
            try:
                record = validate_record(obj, self.kind, self.layout)
            except (_FieldError, LayoutError) as exc:
                raise make_error(self.source, number, exc.fieldname, f"{exc.problem} (the data changed after "
                                 "data_prep validated it)", self.unit) from None
            n += 1
            if not self._pairs:
                yield record
            elif chosen is None:
                chosen = record[TEXT_FIELD]
            else:
                yield _text_pair(chosen, record[TEXT_FIELD])
                chosen = None
        if n != self._rows_n:
            raise make_error(self.source, None, None, f"changed while data_prep read it: {n} records now, "
                             f"{self._rows_n} when it was validated", self.unit)

    def __getitem__(self, key):
        import itertools

        if isinstance(key, slice):
            return [self[i] for i in range(*key.indices(len(self)))]
        if not -len(self) <= key < len(self):
            raise IndexError(key)
        return next(itertools.islice(iter(self), key % len(self), None))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (list, StreamedRecords)) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __copy__(self) -> StreamedRecords:
        return self

    def __deepcopy__(self, memo: dict) -> StreamedRecords:  # Kedro's MemoryDataset deep-copies node outputs
        return self

    def __repr__(self) -> str:
        return f"StreamedRecords({self.source}: {len(self)} {self.kind} records)"


_FORM_FIELD = {"sft": "messages", "preference": "chosen_response", "prompts": "prompt", "regression": "prompt"}


def _form(record: dict[str, Any], kind: str) -> str:
    """``messages`` or ``text``: whether the record's conversation is chat messages (a file holds one or the other)."""
    if kind == "sft":
        return "messages" if "messages" in record else "text"
    return "messages" if is_messages(record.get(_FORM_FIELD[kind])) else "text"


def parse_jsonl_bytes(blob: bytes, kind: str, source: str, layout: str = "auto") -> RawData:
    """Validate the bytes of a raw jsonl file of ``kind``; ``source`` is the name used in error messages."""
    if kind not in _CHECKS:
        raise ValueError(f"unknown data kind {kind!r}; expected one of {KINDS}")
    data = RawData(kind=kind, source=source, sha256=bytes_sha256(blob))
    return validate_rows(_jsonl_rows(blob, source), data, layout)


def _text_pair(chosen: str, rejected: str) -> dict[str, str]:
    """NeMo-Aligner RM layout: a (chosen, rejected) pair of complete texts -> one preference record, their common
    prefix (cut back to whitespace) as the prompt."""
    cut = common_prompt_length(chosen, rejected)
    return {"prompt": chosen[:cut], "chosen_response": chosen[cut:], "rejected_response": rejected[cut:]}


def read_raw_jsonl(path: str | os.PathLike, kind: str, source: str | None = None, layout: str = "auto") -> RawData:
    """Read and validate a raw jsonl file; every problem raises :class:`DataValidationError`."""
    source = source or display_path(path)
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        raise make_error(source, None, None, "file not found") from None
    return parse_jsonl_bytes(blob, kind, source, layout)


# ---------------------------------------------------------------------------------------------------------------
# Record views used by tokenization
# ---------------------------------------------------------------------------------------------------------------


def sft_segments(record: dict[str, Any]) -> list[tuple[str, bool]]:
    """The text of an SFT record as ``(text, is_response)`` segments, in order.

    Plain ``{"input", "output"}`` is one User turn and one Assistant turn. Chat: the optional system text followed
    by a newline, then the turns' values verbatim (no role markup is added: put any template in the text), a turn's
    SteerLM ``label`` (+ newline) before its value. Each Assistant segment is followed by ``<eos>`` when tokenized.
    Chat messages: the same (a system content + newline, then the contents), the assistant turns as responses;
    tool calls have no plain rendering (:class:`~.chat.ChatTemplateError`: they need the model's chat template).
    """
    if "messages" in record:
        return message_segments(record["messages"])
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


def message_segments(messages: list[dict[str, Any]], responses: bool = True) -> list[tuple[str, bool]]:
    """Chat messages in the plain layout: ``(content, is_response)`` per message (a system content followed by a
    newline); assistant turns are responses when ``responses``."""
    from .chat import ChatTemplateError

    segs = []
    for m in messages:
        if m.get("tool_calls") or m["role"] == "tool":
            raise ChatTemplateError("tool calls and tool messages need a chat template (the plain layout of a "
                                    "tokenizer without one has no rendering for them)")
        text = m.get("content") or ""
        segs.append((text + "\n" if m["role"] == "system" else text, responses and m["role"] == "assistant"))
    return segs


def sft_prompt_text(record: dict[str, Any]) -> str:
    """The non-response text leading up to the first response (used as the split key; chat messages: the canonical
    JSON of the messages before the first assistant turn)."""
    if "messages" in record:
        messages = record["messages"]
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        return key_text(messages[:first])
    out = []
    for text, is_response in sft_segments(record):
        if is_response:
            break
        out.append(text)
    return "".join(out)


def record_texts(record: dict[str, Any]) -> list[str]:
    """Every string a tokenizer should be trained on in a record."""
    if "messages" in record:
        return texts_of(record["messages"])
    if "conversations" in record:
        return [record.get("system", "")] + [t[k] for t in record["conversations"] for k in ("label", "value")
                                             if isinstance(t.get(k), str)]
    out = []
    for key in TEXT_FIELDS:
        value = record.get(key)
        if isinstance(value, str):
            out.append(value)
        elif key != "answer" and is_messages(value):
            out += texts_of(value)
    return out


TEXT_FIELDS = ("input", "output", "prompt", "chosen_response", "rejected_response", "response", "answer")
"""The fields whose text is modelled (a prompt's extra fields, e.g. ``category``, are not)."""


__all__ = [
    "KINDS",
    "DataValidationError",
    "RawData",
    "StreamedRecords",
    "display_path",
    "jsonl_file_rows",
    "make_error",
    "parse_jsonl_bytes",
    "read_raw_jsonl",
    "record_texts",
    "sft_prompt_text",
    "sft_segments",
    "validate_record",
]
