"""Reward functions ``module:function(prompt, response, record) -> float``, named in the parameters.

Built-ins (``align_pipeline.rewards:<name>``):

* :func:`demo_task` – the embedded demo task (reverse a word / add two numbers): 1.0 when solved;
* :func:`exact_match` – 1.0 when the response (cut at EOS, stripped) equals ``record["answer"]``;
* :func:`math_answer` – 1.0 when the response's final answer (last ``\\boxed{}``, else ``#### n``, else the last
  number) equals the record's answer (a number, a GSM8K solution ending in ``#### n`` or a ``\\boxed{}``),
  numerically when both are numbers.

A stage weighs several of them (``reward.functions: [{name, weight}]``) and names one, the accuracy function, whose
value >= 1 marks a response correct (:class:`align_pipeline.config.common.ScoringConfig`). See :mod:`.base` for the
contract (``required_fields``, purity) and :mod:`.check` for the data checks.
"""

from align_pipeline.rewards.base import (
    RewardFunction,
    RewardFunctions,
    Term,
    load_reward_function,
    metric_key,
    required_fields,
)
from align_pipeline.rewards.builtin import demo_task, exact_match
from align_pipeline.rewards.check import check_prompts, check_records, stage_reward_functions
from align_pipeline.rewards.math_answers import final_answer, math_answer, reference_answer

__all__ = [
    "RewardFunction",
    "RewardFunctions",
    "Term",
    "check_prompts",
    "check_records",
    "demo_task",
    "exact_match",
    "final_answer",
    "load_reward_function",
    "math_answer",
    "metric_key",
    "reference_answer",
    "required_fields",
    "stage_reward_functions",
]
