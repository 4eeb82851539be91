"""Validate the parameters before any node runs (a bad ``parameters_*.yml`` costs no GPU time and leaves no run).

Two passes, both in ``before_pipeline_run`` (registered so that it runs before the MLflow hook opens a run):

1. every ``params:<section>`` a node of the pipeline reads is built with :func:`~align_pipeline.config.from_dict`
   (unknown keys, wrong types and each section's own ranges, naming the key);
2. every stage node gets the layout rules of :mod:`align_pipeline.config.checks` for the combination it will launch:
   ``params:model`` / ``params:parallel`` / ``params:launch`` with its stage section, the world size of
   ``params:launch`` and the architectures the job will build (``params:model`` for a random init, else the starting
   model's: a checkpoint's ``meta.json`` or an HF ``config.json``, found through the pipeline or the catalog).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from kedro.framework.hooks import hook_impl

from align_pipeline.config import SECTIONS, LaunchConfig, ModelConfig, ParallelConfig, from_dict
from align_pipeline.config.checks import Arch, Names, check_job_layout, launch_world, path_arch

log = logging.getLogger(__name__)

# "params:<section>" -> dataclass (or "module:Class" resolved lazily).
PARAM_SCHEMAS: dict[str, Any] = {**SECTIONS, "data_prep": "align_pipeline.data.tokenize:DataPrepConfig"}

STAGE_NODES: dict[str, tuple[str, str]] = {
    "train_sft": ("sft", "sft"),
    "train_reward_model": ("reward_model", "reward_model"),
    "compute_reference_logps": ("reference_logps", "dpo"),
    "train_dpo": ("dpo", "dpo"),
    "train_ppo": ("ppo", "ppo"),
    "train_reinforce": ("reinforce", "reinforce"),
    "evaluate_policies": ("evaluation", "evaluation"),
}
"""Node function -> (the stage whose job it launches, the params section it reads with model/parallel/launch)."""

STARTING_FROM_SFT = frozenset({"reward_model", "dpo", "ppo", "reinforce"})
"""Stages whose trained model starts from ``<section>.init_from``, else ``sft_policy``."""


def _schema(entry: Any):
    if isinstance(entry, str):
        module, name = entry.split(":")
        return getattr(importlib.import_module(module), name)
    return entry


def validate_params(parameters: dict[str, Any], sections: set[str]) -> dict[str, Any]:
    """Build each of ``sections`` that has a schema; returns section name -> config."""
    return {
        section: from_dict(_schema(PARAM_SCHEMAS[section]), parameters.get(section), f"params:{section}")
        for section in sorted(sections)
        if section in PARAM_SCHEMAS
    }


def _is_model_input(name: str) -> bool:
    return name == "reward_model" or name.endswith("_policy")


class _Architectures:
    """The architectures the stage nodes of ``pipeline`` will build: a dataset made by a node of this pipeline has
    the architecture that node's stage starts from; any other is read from the catalog's current version."""

    def __init__(self, parameters: dict[str, Any], model: ModelConfig, pipeline, catalog):
        self.parameters, self.model, self.catalog = parameters, model, catalog
        self.producers = {out: node for node in pipeline.nodes for out in node.outputs}
        self._seen: dict[str, list[Arch]] = {}

    def _section(self, name: str):
        return from_dict(SECTIONS[name], self.parameters.get(name), f"params:{name}")

    def start(self, stage: str) -> list[Arch]:
        """What the stage's trained model starts from."""
        if stage == "sft":
            init_from = self._section("sft").init_from
            if init_from is None:
                return [Arch(self.model)]
            return self._path(init_from, "params:sft.init_from")
        init_from = self._section(stage).init_from
        return self._path(init_from, f"params:{stage}.init_from") if init_from else self.dataset("sft_policy")

    def dataset(self, name: str) -> list[Arch]:
        if name not in self._seen:
            self._seen[name] = []  # a cycle cannot happen in a DAG; this also caches
            node = self.producers.get(name)
            stage = STAGE_NODES.get(getattr(node.func, "__name__", ""), (None,))[0] if node else None
            if stage in ("sft", *STARTING_FROM_SFT):
                self._seen[name] = self.start(stage)
            elif node is None:
                self._seen[name] = self._catalog(name)
        return self._seen[name]

    def _catalog(self, name: str) -> list[Arch]:
        try:
            dataset = self.catalog.get(name) if self.catalog is not None else None
            path = dataset.load() if dataset is not None and dataset.exists() else None
        except Exception as e:  # noqa: BLE001 -- unreadable now: the node reports it when it loads the input
            log.debug("layout checks: cannot read %s from the catalog (%s)", name, e)
            return []
        return self._path(path, name) if isinstance(path, str) and path else []

    def _path(self, path: str, label: str) -> list[Arch]:
        arch = path_arch(path, self.model, label)
        return [arch] if arch else []

    def of_node(self, node, stage: str, section) -> list[Arch]:
        """Every model the node's job builds: the trained one's start and, for RL and evaluation, the frozen ones."""
        archs = self.start(stage) if stage in ("sft", *STARTING_FROM_SFT) else []
        if stage in ("ppo", "reinforce", "evaluation", "reference_logps"):
            for name in node.inputs:
                if _is_model_input(name) and not (
                    name == "reward_model" and stage == "reinforce" and not section.reward.reward_model_weight
                ):
                    archs = archs + self.dataset(name)
        unique: dict[str, Arch] = {}
        for arch in archs:
            unique.setdefault(arch.prefix, arch)
        return list(unique.values())


def check_layouts(parameters: dict[str, Any], pipeline, catalog=None, gpus: Callable[[], int] | None = None) -> None:
    """The layout rules (:func:`~align_pipeline.config.checks.check_job_layout`) for every stage node of
    ``pipeline``, with the combination of sections that node launches. ``params:launch.nproc_per_node: gpus`` is
    resolved (``gpus()``, default: the visible GPUs) only when the pipeline has a stage node."""
    nodes = [
        (node, STAGE_NODES[name])
        for node in pipeline.nodes
        if (name := getattr(node.func, "__name__", "")) in STAGE_NODES
    ]
    if not nodes:
        return
    model = from_dict(ModelConfig, parameters.get("model"), "params:model")
    parallel = from_dict(ParallelConfig, parameters.get("parallel"), "params:parallel")
    launch = from_dict(LaunchConfig, parameters.get("launch"), "params:launch")
    world, world_desc = launch_world(launch, gpus)
    archs = _Architectures(parameters, model, pipeline, catalog)
    for node, (stage, section_name) in nodes:
        section = from_dict(SECTIONS[section_name], parameters.get(section_name), f"params:{section_name}")
        check_job_layout(
            stage,
            section,
            parallel,
            world,
            archs.of_node(node, stage, section),
            Names(section=f"params:{section_name}", world=world_desc),
        )


class ParamsValidationHook:
    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline, catalog) -> None:
        used = {
            name.split(":", 1)[1].split(".", 1)[0]
            for node in pipeline.nodes
            for name in node.inputs
            if name.startswith("params:")
        }
        parameters = catalog.load("parameters")
        validate_params(parameters, used)
        check_layouts(parameters, pipeline, catalog)
