"""Registered pipelines: one per stage, the compositions, and ``__default__`` = everything."""

from __future__ import annotations

from kedro.framework.project import find_pipelines
from kedro.pipeline import Pipeline

# Compositions of stage pipelines; a stage that does not exist yet is skipped.
COMPOSITIONS = {
    "rlhf": ["data_prep", "sft", "reward_model", "ppo", "evaluation"],
    "dpo_flow": ["data_prep", "sft", "dpo", "evaluation"],
}


def register_pipelines() -> dict[str, Pipeline]:
    pipelines = find_pipelines(raise_errors=True)
    for name, stages in COMPOSITIONS.items():
        present = [pipelines[s] for s in stages if s in pipelines]
        if present:
            pipelines[name] = sum(present, Pipeline([]))
    pipelines["__default__"] = sum(
        (p for n, p in pipelines.items() if n not in COMPOSITIONS), Pipeline([])
    )
    return pipelines
