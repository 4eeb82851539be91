"""Validate the typed parameter sections before any node runs (a bad ``parameters_*.yml`` costs no GPU time)."""

from __future__ import annotations

import importlib
from typing import Any

from kedro.framework.hooks import hook_impl

from align_pipeline.config import SECTIONS, from_dict

# "params:<section>" -> dataclass (or "module:Class" resolved lazily).
PARAM_SCHEMAS: dict[str, Any] = {**SECTIONS, "data_prep": "align_pipeline.data.tokenize:DataPrepConfig"}


def _schema(entry: Any):
    if isinstance(entry, str):
        module, name = entry.split(":")
        return getattr(importlib.import_module(module), name)
    return entry


def validate_params(parameters: dict[str, Any], sections: set[str]) -> None:
    for section in sorted(sections):
        if section in PARAM_SCHEMAS:
            from_dict(_schema(PARAM_SCHEMAS[section]), parameters.get(section), f"params:{section}")


class ParamsValidationHook:
    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline, catalog) -> None:
        used = {
            name.split(":", 1)[1].split(".", 1)[0]
            for node in pipeline.nodes
            for name in node.inputs
            if name.startswith("params:")
        }
        validate_params(catalog.load("parameters"), used)

