"""``params:reward_model`` and the reward-model job (``python -m align_pipeline.train.reward_model``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from align_pipeline.config.base import ConfigError, require_range
from align_pipeline.config.common import (
    StageJob,
    StageRunConfig,
    TrainingConfig,
    TrainPaths,
)


@dataclass
class RewardModelConfig(StageRunConfig):
    """``params:reward_model``: the policy's transformer with a value head, trained on preference pairs."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    """The optimisation loop."""
    packing: bool = False
    """Pack samples into rows of ``model.seq_length`` tokens (a preference pair's chosen and rejected sequences side
    by side in one row), each sequence attending only to itself; batch sizes then count rows. Validation stays
    padded. Needs pipeline_model_parallel_size 1."""
    loss: Literal["bradley_terry", "regression"] = "bradley_terry"
    """bradley_terry: pairwise on preference pairs; regression: SteerLM-style multi-attribute labels (the data is a
    tokenized "regression" file with ``reward_labels`` [N, A]; missing labels are masked)."""
    pooling: Literal["last", "mean"] = "mean"
    """How a sequence's reward is read from the per-token values: last = the value at the final response token
    (EOS); mean = the mean over the response tokens. Stored in meta.json (``reward_head``) for every later user."""
    margin_scale: float = 0.0
    """Bradley-Terry margin = margin_scale * (chosen_reward - rejected_reward) where the data has both (Llama 2)."""

    def validate(self, where: str = "reward_model") -> None:
        require_range(self, where, "margin_scale", 0)


@dataclass(kw_only=True)
class RewardModelJob(StageJob):
    """What the reward-model entry point runs: ``params:reward_model`` + model/parallel + paths + lineage.
    ``paths.init_from`` (required) is usually sft_policy; its LM head is replaced by a fresh value head."""

    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """The stage's section, as in ``parameters_reward_model.yml``."""
    paths: TrainPaths
    """Preference data, tokenizer, starting model, run directory."""

    def validate(self, where: str = "RewardModelJob") -> None:
        if self.paths.init_from is None:
            raise ConfigError(f"{where}.paths.init_from: a reward model starts from a checkpoint or HF dir")
