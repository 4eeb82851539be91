"""``params:evaluation`` and the evaluation job (``python -m align_pipeline.train.evaluate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from align_pipeline.config.base import require_at_least, require_range
from align_pipeline.config.checks import check_reward_model
from align_pipeline.config.common import GenerationConfig, ParallelConfig, ScoringConfig


@dataclass
class PromotionGateConfig:
    """``evaluation.gate``: what a policy must reach to be promoted (:mod:`align_pipeline.evaluation.gates`); the best policy
    passing every gate is the ``promoted_policy`` catalog entry. None = that gate is off."""

    min_gain_over_sft: float | None = None
    """Sampled accuracy minus the SFT policy's must be at least this (e.g. 0.0: no worse than SFT)."""
    max_kl_to_reference: float | None = None
    """The policy's KL to the reference (per sequence, the report's ``kl_to_reference``) must be at most this."""

    def validate(self, where: str = "gate") -> None:
        require_range(self, where, "min_gain_over_sft", -1, 1)
        require_range(self, where, "max_kl_to_reference", 0)


@dataclass
class EvaluationConfig:
    """``params:evaluation``: every policy against the SFT reference on the held-out prompts."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampling of the responses that are scored."""
    greedy: bool = True
    """Also report greedy-decoding accuracy."""
    reward: ScoringConfig = field(default_factory=ScoringConfig)
    """The reward functions (the same list as the RL stages' ``reward.functions``: per policy, ``function_reward`` =
    the mean of their weighted sum, and ``reward_<function>`` per function when there are several), the accuracy
    function (``accuracy``, ``greedy_accuracy``; none without functions) and the reward model's attribute weights
    (``reward_model_score`` and the RM accuracy on held-out pairs)."""
    group_by: str | None = None
    """A prompt-record field (e.g. ``category``) whose values split ``accuracy`` and ``reward_model_score`` into
    ``accuracy_<value>`` / ``reward_model_score_<value>``; records without it form the group ``ungrouped``, and when
    no record has it there is no breakdown (the job logs that). None = the overall numbers only."""
    micro_batch_size: int = 64
    """Rows per scoring forward."""
    runs_dir: str = "data/06_models/_runs"
    """Where the evaluation's run directory (logs, result.json) lives."""
    reuse: bool = True
    """Reuse a stored eval_report made from the same policies, data, config and code instead of evaluating again
    (:mod:`align_pipeline.pipelines.reuse`); false = always evaluate."""
    gate: PromotionGateConfig = field(default_factory=PromotionGateConfig)
    """Promotion gates per policy (gain over SFT, KL to the reference)."""

    def validate(self, where: str = "evaluation") -> None:
        require_at_least(self, where, 1, "micro_batch_size")


@dataclass(kw_only=True)
class EvaluationPaths:
    """The files an evaluation job reads and where it writes (absolute paths, resolved by the node)."""

    run_dir: str
    """Working directory: config, logs, result.json."""
    output_dir: str
    """Where rank 0 writes report.json, report.md, the plots and meta.json."""
    tokenizer: str
    """Tokenizer directory."""
    prompts: str
    """Held-out prompts .jsonl (prompt, prompt_ids, answer)."""
    policies: dict[str, str]
    """name -> policy checkpoint."""
    reference: str | None = None
    """KL reference checkpoint (None = the policy named "sft", else the first one)."""
    reward_model: str | None = None
    """Reward-model checkpoint (value head) to score responses and measure RM accuracy; None = skip."""
    preference_data: str | None = None
    """Held-out preference pairs .npz for RM accuracy."""
    sft_data: str | None = None
    """Held-out SFT .npz for validation perplexity."""


@dataclass(kw_only=True)
class EvaluationJob:
    """What the evaluation entry point runs: ``params:evaluation`` + parallel + paths + lineage."""

    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    """The stage's section, as in ``parameters_evaluation.yml``."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / DP of the evaluation job."""
    paths: EvaluationPaths
    """Policies, reference, reward model, held-out data, output directory."""
    lineage: dict[str, Any] = field(default_factory=dict)
    """Recorded into the report's meta.json."""

    def validate(self, where: str = "EvaluationJob") -> None:
        check_reward_model(self.evaluation.reward, self.paths.reward_model, f"{where}.evaluation.reward")
