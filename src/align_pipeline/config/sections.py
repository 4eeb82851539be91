"""``params:<section>`` -> its dataclass, for the checks that read every section (the parameters hook)."""

from __future__ import annotations

from align_pipeline.config.common import ExportConfig, LaunchConfig, ModelConfig, ParallelConfig
from align_pipeline.config.distill import DistillConfig
from align_pipeline.config.dpo import DPOConfig
from align_pipeline.config.evaluation import EvaluationConfig
from align_pipeline.config.ppo import PPOConfig
from align_pipeline.config.reinforce import ReinforceConfig
from align_pipeline.config.reward_model import RewardModelConfig
from align_pipeline.config.sft import SFTConfig

SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "launch": LaunchConfig,
    "sft": SFTConfig,
    "reward_model": RewardModelConfig,
    "dpo": DPOConfig,
    "ppo": PPOConfig,
    "reinforce": ReinforceConfig,
    "distill": DistillConfig,
    "evaluation": EvaluationConfig,
    "export": ExportConfig,
}
"""``params:<section>`` -> its dataclass (``data_prep``'s is :class:`align_pipeline.data.tokenize.DataPrepConfig`)."""
