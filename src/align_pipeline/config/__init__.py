"""One config family: a dataclass per YAML section, and per stage a job = that section + model/parallel + the paths
the node resolved + lineage.

* :mod:`.base` – :func:`from_dict` (unknown keys and wrong types fail, naming the key), :func:`to_dict`,
  :func:`config_hash`, :class:`ConfigError`;
* :mod:`.common` – sections several stages use (``model``, ``parallel``, ``launch``, ``training``, ``generation``,
  ``reward`` and its ``functions``, ``kl``, ``rl``, ``offload``) and the path groups of the jobs;
* one module per stage: the stage's section (``params:<stage>``) and its job;
* :mod:`.checks` – the rules that span sections (world size vs TP x PP, heads / layers / sequence vs TP and PP,
  PP = 1 for generating stages, batches over data-parallel ranks), applied by the Kedro hook before any node runs
  and by each entry point at its start. A section's own ranges are its ``validate(where)``.

Every field has a docstring; nothing here imports Kedro, Megatron or torch.
"""

from align_pipeline.config.base import ConfigError, config_hash, from_dict, to_dict
from align_pipeline.config.common import (
    ExportConfig,
    GenerationConfig,
    KLConfig,
    LaunchConfig,
    LoRAConfig,
    ModelConfig,
    OffloadConfig,
    OptimizerConfig,
    ParallelConfig,
    RewardConfig,
    RewardFunctionConfig,
    RLLoopConfig,
    RLPaths,
    ScoringConfig,
    SlurmConfig,
    StageRunConfig,
    TrainingConfig,
    TrainPaths,
)
from align_pipeline.config.dpo import (
    REFERENCE_FREE_LOSSES,
    DPOConfig,
    DPOJob,
    DPOPaths,
    PreferenceLossConfig,
    ReferenceLogpsJob,
)
from align_pipeline.config.evaluation import EvaluationConfig, EvaluationJob, EvaluationPaths
from align_pipeline.config.ppo import PPOConfig, PPOJob, PPOLossConfig, PPOPaths
from align_pipeline.config.reinforce import ReinforceConfig, ReinforceJob, ReinforceLossConfig
from align_pipeline.config.reward_model import RewardModelConfig, RewardModelJob
from align_pipeline.config.rl import RLConfig
from align_pipeline.config.sft import SFTConfig, SFTJob

SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "launch": LaunchConfig,
    "sft": SFTConfig,
    "reward_model": RewardModelConfig,
    "dpo": DPOConfig,
    "ppo": PPOConfig,
    "reinforce": ReinforceConfig,
    "evaluation": EvaluationConfig,
    "export": ExportConfig,
}
"""``params:<section>`` -> its dataclass (``data_prep``'s is :class:`align_pipeline.data.tokenize.DataPrepConfig`)."""

__all__ = [
    "REFERENCE_FREE_LOSSES",
    "SECTIONS",
    "ConfigError",
    "DPOConfig",
    "DPOJob",
    "DPOPaths",
    "EvaluationConfig",
    "EvaluationJob",
    "EvaluationPaths",
    "ExportConfig",
    "GenerationConfig",
    "KLConfig",
    "LaunchConfig",
    "LoRAConfig",
    "ModelConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "PPOConfig",
    "PPOJob",
    "PPOLossConfig",
    "PPOPaths",
    "ParallelConfig",
    "PreferenceLossConfig",
    "RLConfig",
    "RLLoopConfig",
    "RLPaths",
    "ReferenceLogpsJob",
    "ReinforceConfig",
    "ReinforceJob",
    "ReinforceLossConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RewardModelConfig",
    "RewardModelJob",
    "SFTConfig",
    "SFTJob",
    "ScoringConfig",
    "SlurmConfig",
    "StageRunConfig",
    "TrainPaths",
    "TrainingConfig",
    "config_hash",
    "from_dict",
    "to_dict",
]
