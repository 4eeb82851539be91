"""``params:sft`` and the SFT job (``python -m align_pipeline.train.sft --config job.json``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from align_pipeline.config.common import ModelConfig, ParallelConfig, StageRunConfig, TrainingConfig, TrainPaths


@dataclass
class SFTConfig(StageRunConfig):
    """``params:sft``: supervised fine-tuning, next-token loss on the response tokens."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    """The optimisation loop."""


@dataclass(kw_only=True)
class SFTJob:
    """What the SFT entry point runs: ``params:sft`` + ``params:model`` + ``params:parallel`` + the paths the node
    resolved + lineage (written by the node, or by hand as JSON)."""

    sft: SFTConfig = field(default_factory=SFTConfig)
    """The stage's section, as in ``parameters_sft.yml``."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture for random init (a checkpoint / HF ``paths.init_from`` brings its own)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP / sequence parallel / distributed optimizer / bf16."""
    paths: TrainPaths
    """Data, tokenizer, starting model, run directory."""
    lineage: dict[str, Any] = field(default_factory=dict)
    """Recorded into the output checkpoint's meta.json (data fingerprints, parent checkpoint, ...)."""
    stop_after: int | None = None
    """Exit cleanly after this many steps of *this* invocation (an interruption, for resume tests)."""
