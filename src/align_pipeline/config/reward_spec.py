"""A reward function named in the parameters (``module:function``), imported and checked when the parameters are
loaded. The functions themselves and the scorer they make live in :mod:`align_pipeline.rewards`."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from align_pipeline.config.base import ConfigError


def import_spec(spec: str, key: str, expected: str) -> Any:
    """The object a ``module:attribute`` spec names (the attribute may be a dotted path); :class:`ConfigError`
    naming ``key`` when the spec is malformed (``expected`` says what it should look like), the module does not
    import, or the attribute is missing."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(f"{key}={spec!r}: expected {expected}")
    module_name, attr = spec.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # any failure to import a user's module is a config error naming the key
        raise ConfigError(f"{key}={spec!r}: cannot import module {module_name!r} ({type(e).__name__}: {e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}={spec!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_reward_function(spec: str, key: str) -> Callable[..., Any]:
    """``"module:function"`` (the function may be a dotted attribute path) -> the function, checked: importable,
    callable with ``(prompt, response, record)``, a well-formed ``required_fields``. Any problem raises
    :class:`ConfigError` naming ``key`` (the parameter that holds the spec, e.g. ``params:ppo.reward.functions[0].name``).
    """
    obj = import_spec(spec, key, "'module:function', e.g. 'align_pipeline.rewards:math_answer'")
    if not callable(obj):
        raise ConfigError(f"{key}={spec!r} is a {type(obj).__name__}, not a function")
    try:
        inspect.signature(obj).bind("prompt", "response", {})
    except TypeError as e:
        raise ConfigError(f"{key}={spec!r} cannot be called as fn(prompt, response, record) ({e})") from e
    except ValueError:
        pass  # no signature to inspect (some builtins): calling it will tell
    fields = getattr(obj, "required_fields", ())
    if isinstance(fields, str) or not isinstance(fields, (tuple, list)) or not all(isinstance(f, str) for f in fields):
        raise ConfigError(f"{key}={spec!r}: its required_fields must be a tuple of field names, got {fields!r}")
    return obj
