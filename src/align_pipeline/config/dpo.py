"""``params:dpo``, the DPO job and the reference log-probs job."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from align_pipeline.config.base import ConfigError, require_at_least, require_range
from align_pipeline.config.common import (
    ParallelConfig,
    StageJob,
    StageRunConfig,
    TrainingConfig,
    TrainPaths,
)

REFERENCE_FREE_LOSSES: frozenset[str] = frozenset({"simpo"})
"""Preference losses that never read reference log-probs (the DPO job may then run without them)."""


def _number(low: float, high: float = math.inf, low_open: bool = False) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        ok_type = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return ok_type and (value > low if low_open else value >= low) and value <= high
    return check


PREFERENCE_OPTIONS: dict[str, dict[str, tuple[bool, Callable[[Any], bool], str]]] = {
    "dpo": {"label_smoothing": (False, _number(0.0, 0.5), "a number in [0, 0.5]")},
    "ipo": {"length_normalized": (False, lambda v: isinstance(v, bool), "true or false")},
    "rpo": {"eta": (True, _number(0.0, low_open=True), "a number > 0"),
            "distance": (False, lambda v: v in ("bwd_kl", "sq"), "'bwd_kl' or 'sq'")},
    "simpo": {"gamma": (True, _number(0.0), "a number >= 0")},
    "hinge": {},
}
"""Each preference loss's keyword options (``loss.options``, the keyword arguments of its function in
:mod:`align_pipeline.losses.preference`): name -> (required, check, the rule the error states)."""


@dataclass
class PreferenceLossConfig:
    """Which preference loss (a function in ``align_pipeline.losses.preference``) and its hyper-parameters."""

    name: Literal["dpo", "ipo", "rpo", "simpo", "hinge"] = "dpo"
    """The loss function (the registry key); each cites its paper."""
    beta: float = 0.1
    """beta of the paper (KL strength / reward scale)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of that loss, e.g. label_smoothing (dpo), eta (rpo), gamma (simpo)."""
    sft_weight: float = 0.0
    """Weight of the SFT (mean NLL of the chosen response) term added to the preference loss; 0 = off."""

    def validate(self, where: str = "loss") -> None:
        require_range(self, where, "beta", 0, low_open=True)
        require_range(self, where, "sft_weight", 0)
        known = PREFERENCE_OPTIONS[self.name]
        unknown = sorted(set(self.options) - set(known))
        if unknown:
            raise ConfigError(f"{where}.options: {unknown} not an option of the {self.name!r} loss; its options: "
                              f"{sorted(known) or 'none'}")
        for key, (required, check, rule) in known.items():
            if key not in self.options:
                if required:
                    raise ConfigError(f"{where}.options.{key}: required by the {self.name!r} loss ({rule})")
                continue
            if not check(self.options[key]):
                raise ConfigError(f"{where}.options.{key}={self.options[key]!r} must be {rule}")


@dataclass
class DPOConfig(StageRunConfig):
    """``params:dpo``: DPO-family training of the policy against cached reference log-probs."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    """The optimisation loop."""
    packing: bool = False
    """Pack samples into rows of ``model.seq_length`` tokens (a preference pair's chosen and rejected sequences side
    by side in one row), each sequence attending only to itself; batch sizes then count rows. Validation stays
    padded. Needs pipeline_model_parallel_size 1."""
    loss: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)
    """The preference loss."""
    reference: Literal["cached", "online"] = "cached"
    """Where the reference log-probs come from. ``cached``: computed once by the reference_logps job (per reference
    version, preference data and tokenizer) and reused; no reference model in the DPO job. ``online``: computed in
    the DPO job for every micro-batch: with ``lora.rank`` > 0 by the policy itself with its adapters off (the
    reference is the policy's start; no second copy of the weights), else by a frozen copy of the reference held
    beside the policy (TRL's default). Needs pipeline_model_parallel_size 1."""
    reference_cache_dir: str = "data/07_model_output/reference_logps"
    """Cached reference log-probs, one file per (reference checkpoint, preference data, tokenizer)."""
    reference_micro_batch_size: int = 32
    """Pairs per forward when computing reference log-probs."""

    def validate(self, where: str = "dpo") -> None:
        require_at_least(self, where, 1, "reference_micro_batch_size")


@dataclass(kw_only=True)
class DPOPaths(TrainPaths):
    """A DPO job's files: the preference data, the policy's start (``init_from``, required) and the cache."""

    reference_logps: str | None = None
    """Cached reference log-probs (.npz from the reference_logps job); None for reference-free losses and for
    ``dpo.reference: online``."""
    reference: str | None = None
    """The reference model of ``dpo.reference: online`` (None: ``init_from``). With LoRA and the reference being
    ``init_from``, the policy with its adapters off is the reference."""


@dataclass(kw_only=True)
class DPOJob(StageJob):
    """What the DPO entry point runs: ``params:dpo`` + model/parallel + paths + lineage."""

    dpo: DPOConfig = field(default_factory=DPOConfig)
    """The stage's section, as in ``parameters_dpo.yml``."""
    paths: DPOPaths
    """Preference data, tokenizer, starting policy, reference log-probs, run directory."""

    def validate(self, where: str = "DPOJob") -> None:
        if self.paths.init_from is None:
            raise ConfigError(f"{where}.paths.init_from: the policy starts from a checkpoint or HF dir")
        if (self.paths.reference_logps is None and self.dpo.reference == "cached"
                and self.dpo.loss.name not in REFERENCE_FREE_LOSSES):
            raise ConfigError(f"{where}: loss {self.dpo.loss.name!r} needs paths.reference_logps "
                              "(or dpo.reference: online)")
        if self.dpo.reference == "online" and self.parallel.pipeline_model_parallel_size > 1:
            raise ConfigError(f"{where}: dpo.reference: online needs pipeline_model_parallel_size 1 (got "
                              f"{self.parallel.pipeline_model_parallel_size}); use dpo.reference: cached")


@dataclass(kw_only=True)
class ReferenceLogpsJob:
    """``python -m align_pipeline.train.reference_logps``: sequence log-probs of a frozen model on preference data."""

    run_dir: str
    """Working directory: config, logs, result.json."""
    checkpoint: str
    """The reference model (normally sft_policy)."""
    data: dict[str, str]
    """split name -> preference .npz (e.g. {"train": ..., "val": ...})."""
    output: str
    """Where rank 0 writes the .npz: <split>_chosen_logps, <split>_rejected_logps, <split>_*_tokens."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP of the forward passes."""
    micro_batch_size: int = 32
    """Sequence pairs per forward (``params:dpo.reference_micro_batch_size``)."""

    def validate(self, where: str = "ReferenceLogpsJob") -> None:
        require_at_least(self, where, 1, "micro_batch_size")
