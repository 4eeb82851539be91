"""Parsing and hashing of the config dataclasses: :func:`from_dict` builds one from a plain dict (Kedro parameters
or a job's JSON), rejects unknown keys and wrong types and names the offending key. Nothing here imports Kedro,
Megatron or torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import types
import typing
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from align_pipeline.errors import UserError

T = TypeVar("T")


class ConfigError(UserError, ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} is not {_type_name(tp)}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item_tp, *_) = get_args(tp) or (Any,)
        return [_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        _, val_tp = get_args(tp) or (Any, Any)
        return {k: _convert(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):  # YAML's .nan / .inf: no setting means either (None is "off" where allowed)
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    return value


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str | None = None) -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise :class:`ConfigError`."""
    where = where or cls.__name__
    data = dict(data or {})
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}.{name}: required key is missing")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        # A validate(where) names the keys it checks as they are spelled here ("params:sft.training.micro_batch_size").
        validate(where) if inspect.signature(validate).parameters else validate()
    return obj


def require_at_least(obj: Any, where: str, minimum: int, *names: str) -> None:
    """Each named field of ``obj`` (unless None) must be >= ``minimum``; the error names the first that is not."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < minimum:
            raise ConfigError(f"{where}.{name}={value} must be >= {minimum}")


_CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x00": "a NUL byte"}


def control_character(text: str) -> str | None:
    """How to name the first control character (< 0x20, or DEL 0x7f) of ``text``, or None when it has none."""
    for ch in text:
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            return _CONTROL_NAMES.get(ch, f"the control character {ch!r}")
    return None


def require_one_line(value: str | None, key: str, what: str) -> None:
    """``value`` (unless None) must be one line of printable text: a newline, carriage return, tab, NUL or any other
    control character fails naming ``key`` (``what`` says which fields must be one line, e.g. "Slurm fields")."""
    found = control_character(value) if value is not None else None
    if found:
        raise ConfigError(f"{key} contains {found}; {what} must be one line")


def require_range(obj: Any, where: str, name: str, low: float | None = None, high: float | None = None,
                  low_open: bool = False, high_open: bool = False) -> None:
    """Field ``name`` of ``obj`` (unless None) must lie in the interval from ``low`` to ``high`` (None = unbounded;
    ``*_open`` = that end excluded); the error names the key and the interval, e.g.
    ``params:ppo.loss.clip_eps=-1.0 must be in (0, 1)``."""
    value = getattr(obj, name)
    if value is None:
        return
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if not below and not above:
        return
    if high is None:
        rule = f"> {low:g}" if low_open else f">= {low:g}"
    elif low is None:
        rule = f"< {high:g}" if high_open else f"<= {high:g}"
    else:
        rule = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    raise ConfigError(f"{where}.{name}={value} must be {rule}")


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain-dict view of a config dataclass (JSON-serialisable)."""
    return dataclasses.asdict(obj)


def config_hash(obj: Any) -> str:
    """Stable short hash of a config (dataclass or dict), used in lineage and run-directory names."""
    data = to_dict(obj) if dataclasses.is_dataclass(obj) else obj
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
