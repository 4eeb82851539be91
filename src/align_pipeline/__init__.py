"""align-pipeline: LLM alignment as a Kedro DAG of Megatron-core jobs."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` (PEP 562) re-exporting ``names`` (name -> submodule) lazily: the
    submodule is imported the first time the name is read, so importing a package costs only what is used from it.
    Code of the project imports from the submodules themselves; the package names are for users and tests."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{names[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
