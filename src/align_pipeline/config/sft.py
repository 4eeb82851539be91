"""``params:sft`` and the SFT job (``python -m align_pipeline.train.sft --config job.json``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from align_pipeline.config.common import (
    StageJob,
    StageRunConfig,
    TrainingConfig,
    TrainPaths,
)


@dataclass
class SFTConfig(StageRunConfig):
    """``params:sft``: supervised fine-tuning, next-token loss on the response tokens."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    """The optimisation loop."""
    packing: bool = False
    """Pack several samples into each row of ``model.seq_length`` tokens, each attending only to itself (positions
    restart per sample); ``training.global_batch_size`` / ``micro_batch_size`` then count packed rows. Validation
    stays padded (the loss is the same). Needs pipeline_model_parallel_size 1."""


@dataclass(kw_only=True)
class SFTJob(StageJob):
    """What the SFT entry point runs: ``params:sft`` + ``params:model`` + ``params:parallel`` + the paths the node
    resolved + lineage (written by the node, or by hand as JSON)."""

    sft: SFTConfig = field(default_factory=SFTConfig)
    """The stage's section, as in ``parameters_sft.yml``."""
    paths: TrainPaths
    """Data, tokenizer, starting model, run directory."""
