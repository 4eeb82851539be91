"""Reward functions ``module:function(prompt, response, record) -> float``, named in the parameters.

Built-ins (``align_pipeline.rewards:<name>``):

* :func:`demo_task` – the embedded demo task (reverse a word / add two numbers): 1.0 when solved;
* :func:`exact_match` – 1.0 when the response (cut at EOS, stripped) equals ``record["answer"]``;
* :func:`math_answer` – 1.0 when the response's final answer (last ``\boxed{}``, else ``#### n``, else the last
  number) equals the record's answer (a number, a GSM8K solution ending in ``#### n`` or a ``\boxed{}``),
  numerically when both are numbers;
* :func:`math_verify` – 1.0 when Hugging Face's ``math-verify`` finds the response's answer mathematically equivalent
  to the record's (LaTeX, expressions, sets; the optional extra ``math``).

A stage weighs several of them (``reward.functions: [{name, weight}]``) and names one, the accuracy function, whose
value >= 1 marks a response correct (:class:`align_pipeline.config.common.ScoringConfig`). See :mod:`.base` for the
contract (``required_fields``, purity) and :mod:`.check` for the data checks.
"""

from align_pipeline import lazy_exports

_EXPORTS = {
    "RewardFunction": "base",
    "RewardFunctions": "base",
    "Term": "base",
    "check_prompts": "check",
    "check_records": "check",
    "demo_task": "builtin",
    "exact_match": "builtin",
    "final_answer": "math_answers",
    "load_reward_function": "base",
    "math_answer": "math_answers",
    "math_verify": "verified_math",
    "metric_key": "base",
    "reference_answer": "math_answers",
    "required_fields": "base",
    "stage_reward_functions": "check",
}
"""Re-exported name -> the submodule that defines it (imported when the name is first read; sorted)."""

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
