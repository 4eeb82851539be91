"""Validate the parameters before any node runs (a bad ``parameters_*.yml`` costs no GPU time and leaves no run).

Three passes, all in ``before_pipeline_run`` (registered so that it runs before the MLflow hook opens a run):

1. every ``params:<section>`` a node of the pipeline reads is built with :func:`~align_pipeline.config.from_dict`
   (unknown keys, wrong types and each section's own ranges, naming the key);
2. every stage node gets the layout rules of :mod:`align_pipeline.config.checks` for the combination it will launch:
   ``params:model`` / ``params:parallel`` / ``params:launch`` with its stage section, the world size of
   ``params:launch`` and the architectures the job will build (``params:model`` for a random init, else the starting
   model's: a checkpoint's ``meta.json`` or an HF ``config.json``, found through the pipeline or the catalog). A
   ``<stage>.init_from`` must be a checkpoint or an HF directory of a supported family, and an HF model needs as many
   embedding rows as the tokenizer has tokens (data_prep's ``tokenizer.hf_model_dir`` when this run makes the
   tokenizer, else the catalog's);
3. every prompt record has the fields the configured reward functions need (their ``required_fields``): the raw
   prompts data_prep will tokenize, against the functions of the stages data_prep is wired to (``params:ppo``,
   ``params:reinforce``, ``params:evaluation``), and the tokenized prompts a scoring stage reads from the catalog,
   against that stage's functions.

So a bad starting model, tokenizer or prompt file stops the run before data_prep replaces its outputs.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kedro.framework.hooks import hook_impl

from align_pipeline.config.base import ConfigError, from_dict
from align_pipeline.config.checks import (
    Arch,
    Names,
    check_job_layout,
    check_vocab,
    path_arch,
    start_arch,
)
from align_pipeline.config.common import LaunchConfig, ModelConfig, ParallelConfig
from align_pipeline.config.sections import SECTIONS
from align_pipeline.errors import UserError
from align_pipeline.launch.world import world_size

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
    "train_distill": ("distill", "distill"),
    "evaluate_policies": ("evaluation", "evaluation"),
}
"""Node function -> (the stage whose job it launches, the params section it reads with model/parallel/launch)."""

STARTING_FROM_SFT = frozenset({"reward_model", "dpo", "ppo", "reinforce", "distill"})
"""Stages whose trained model starts from ``<section>.init_from``, else ``sft_policy``."""

SCORING_STAGES = frozenset({"ppo", "reinforce", "distill", "evaluation"})
"""Stages that score responses with the reward functions of ``params:<stage>.reward``."""

PROMPT_INPUTS = ("prompts_train", "prompts_val")
"""The tokenized prompt datasets a scoring stage reads."""


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
        init_from = self._section(stage).init_from
        if init_from is None:
            return [Arch(self.model)] if stage == "sft" else self.dataset("sft_policy")
        key = f"params:{stage}.init_from"
        arch = start_arch(str(nemo_resolved(init_from, key)), self.model, key)
        return [arch] if arch else []

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
        if stage in ("ppo", "reinforce", "distill", "evaluation", "reference_logps"):
            for name in node.inputs:
                if _is_model_input(name) and not (
                    name == "reward_model" and stage == "reinforce" and not section.reward.reward_model_weight
                ):
                    archs = archs + self.dataset(name)
        unique: dict[str, Arch] = {}
        for arch in archs:
            unique.setdefault(arch.prefix, arch)
        return list(unique.values())


def pipeline_tokenizer(parameters: dict[str, Any], pipeline, catalog=None) -> tuple[int, str] | None:
    """(tokens, how a message names it) of the tokenizer the stage nodes of ``pipeline`` read: the one of
    ``params:data_prep.tokenizer.hf_model_dir`` when data_prep is part of the run (loaded here, so a directory without
    a usable tokenizer fails now), else the catalog's ``tokenizer``. None where it is not known before data_prep runs
    (a tokenizer data_prep trains) or not there yet (the node that reads it reports that)."""
    if any("tokenizer" in node.outputs for node in pipeline.nodes):
        from align_pipeline.data.tokenize import DataPrepConfig

        data_prep = from_dict(DataPrepConfig, parameters.get("data_prep"), "params:data_prep")
        directory = data_prep.tokenizer.hf_model_dir
        return None if directory is None else hf_tokenizer_size(directory, "params:data_prep.tokenizer.hf_model_dir")
    try:
        dataset = catalog.get("tokenizer") if catalog is not None else None
        artifact = dataset.load() if dataset is not None and dataset.exists() else None
        meta = getattr(artifact, "meta", None)
        return (int(meta["vocab_size"]), f"{artifact.path} (the catalog's tokenizer)") if meta else None
    except Exception as e:  # noqa: BLE001 -- unreadable now: the node reports it when it loads the input
        log.debug("vocabulary check: cannot read the tokenizer from the catalog (%s)", e)
        return None


def nemo_resolved(path: str, key: str) -> Path:
    """``path``, or for a NeMo ``.nemo`` its HF conversion (made once per content by a job; the stage's ranks then
    find it cached). A ``.nemo`` that does not convert: a :class:`ConfigError` naming ``key`` and the reason."""
    from align_pipeline.launch.model_jobs import nemo_hf_dir
    from align_pipeline.launch.torchrun import LaunchError
    from align_pipeline.model.nemo import is_nemo

    if not is_nemo(path):
        return Path(path)
    try:
        return nemo_hf_dir(path)
    except (LaunchError, UserError) as e:  # a refused archive's message names it: not twice
        raise ConfigError(f"{key}={path}: {str(e).removeprefix(f'{Path(path).resolve()}: ')}") from None


def hf_tokenizer_size(directory: str, key: str) -> tuple[int, str]:
    """(tokens, name) of the tokenizer data_prep loads from the HF directory ``directory`` (``key``): its size with
    the added tokens, as data_prep and the job count it. Not loadable: a :class:`ConfigError` naming ``key``."""
    from align_pipeline.data.tokenizer import load_hf_tokenizer

    directory = str(nemo_resolved(directory, key))
    if not Path(directory).is_dir():
        raise ConfigError(
            f"{key}={directory!r}: no such directory (a Hugging Face model directory with tokenizer files)"
        )
    try:
        tokens = load_hf_tokenizer(directory).vocab_size
    except UserError:
        raise  # names its file (e.g. a chat template that does not compile)
    except Exception as e:  # noqa: BLE001 -- any other failure to load it is this key's problem
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{key}={directory}: no tokenizer can be loaded from it ({why})") from None
    return tokens, f"{directory} ({key})"


def check_layouts(
    parameters: dict[str, Any],
    pipeline,
    catalog=None,
    gpus: Callable[[], int] | None = None,
    tokenizer: tuple[int, str] | None = None,
) -> None:
    """The layout rules (:func:`~align_pipeline.config.checks.check_job_layout`) for every stage node of
    ``pipeline``, with the combination of sections that node launches, and ``tokenizer`` (:func:`pipeline_tokenizer`)
    against the embedding rows of every HF model those jobs build (:func:`~align_pipeline.config.checks.check_vocab`).
    ``params:launch.nproc_per_node: gpus`` is resolved (``gpus()``, default: the visible GPUs) only when the
    pipeline has a stage node."""
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
    world, world_desc = world_size(launch, gpus)
    archs = _Architectures(parameters, model, pipeline, catalog)
    for node, (stage, section_name) in nodes:
        section = from_dict(SECTIONS[section_name], parameters.get(section_name), f"params:{section_name}")
        models = archs.of_node(node, stage, section)
        check_job_layout(
            stage,
            section,
            parallel,
            world,
            models,
            Names(section=f"params:{section_name}", world=world_desc),
        )
        for arch in models if tokenizer is not None else ():
            check_vocab(*tokenizer, arch)


def check_prompt_fields(parameters: dict[str, Any], pipeline, catalog) -> None:
    """Every prompt record a reward function will score has the fields the function declares (``required_fields``):

    * the raw prompts data_prep's validation node reads (``raw_prompts``), against the functions of every scoring
      stage whose parameters that node is wired to (:func:`align_pipeline.rewards.check_prompts`, the node's own
      check);
    * the tokenized prompts (``prompts_train`` / ``prompts_val``) a scoring stage of ``pipeline`` reads from the
      catalog (not made by this run), against that stage's functions (:func:`align_pipeline.rewards.check_records`,
      the job's own check).

    A file that is not there is left to the node that reads it."""
    from align_pipeline.data.formats import load_jsonl
    from align_pipeline.data.schemas import display_path
    from align_pipeline.data.sources import read_raw
    from align_pipeline.rewards.check import check_prompts, check_records, stage_reward_functions

    def current(name: str):
        dataset = catalog.get(name) if catalog is not None else None
        return dataset.load() if dataset is not None and dataset.exists() else None

    made_here = {name for node in pipeline.nodes for name in node.outputs}
    for node in pipeline.nodes:
        if "raw_prompts" in node.inputs:
            stages = [s for name in node.inputs if (s := name.removeprefix("params:")) in SCORING_STAGES]
            if stages and (raw := current("raw_prompts")) is not None:
                layout = ((parameters.get("data_prep") or {}).get("layouts") or {}).get("prompts", "auto")
                data = read_raw(raw, "prompts", layout, name="raw_prompts")
                check_prompts(data.records, data.lines, data.source, {s: parameters.get(s) for s in stages},
                              unit=data.unit)
            continue
        stage = STAGE_NODES.get(getattr(node.func, "__name__", ""), (None, None))[1]
        if stage not in SCORING_STAGES:
            continue
        (functions,) = stage_reward_functions({stage: parameters.get(stage)})
        for name in PROMPT_INPUTS:
            if name in node.inputs and name not in made_here and (prompts := current(name)) is not None:
                try:
                    records = load_jsonl(prompts.path)
                except (OSError, ValueError) as e:  # unreadable: the node reports it when it loads the input
                    log.debug("prompt fields: cannot read %s (%s)", prompts.path, e)
                    continue
                check_records(records, display_path(prompts.path), functions)


def used_sections(pipeline) -> set[str]:
    """The parameter sections the pipeline's nodes read (``params:dpo.loss`` -> ``dpo``)."""
    return {name.split(":", 1)[1].split(".", 1)[0] for node in pipeline.nodes for name in node.inputs
            if name.startswith("params:")}  # fmt: skip


class ParamsValidationHook:
    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline, catalog) -> None:
        parameters = catalog.load("parameters")
        validate_params(parameters, used_sections(pipeline))
        check_layouts(parameters, pipeline, catalog, tokenizer=pipeline_tokenizer(parameters, pipeline, catalog))
        check_prompt_fields(parameters, pipeline, catalog)
