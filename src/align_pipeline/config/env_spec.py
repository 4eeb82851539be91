"""An environment class named in the parameters (``module:Class``), imported and checked when the parameters are
loaded. The protocol and the environments themselves live in :mod:`align_pipeline.envs`."""

from __future__ import annotations

import inspect

from align_pipeline.config.base import ConfigError
from align_pipeline.config.reward_spec import import_spec


def load_environment_class(spec: str, key: str) -> type:
    """``"module:Class"`` -> the class, checked: importable, a class with callable ``reset`` and ``step``. Any problem
    raises :class:`ConfigError` naming ``key`` (e.g. ``params:reinforce.env.name``)."""
    obj = import_spec(spec, key, "'module:Class', e.g. 'align_pipeline.envs.builtin:Calculator'")
    if not inspect.isclass(obj):
        raise ConfigError(f"{key}={spec!r} is a {type(obj).__name__}, not a class")
    for method in ("reset", "step"):
        if not callable(getattr(obj, method, None)):
            raise ConfigError(f"{key}={spec!r}: the class has no {method}() method (see align_pipeline.envs.base)")
    return obj
