from kedro.pipeline import Pipeline, node, pipeline

from .nodes import evaluate_policies

# Policies the full report compares (a new policy-training stage adds its output here).
POLICIES = ["sft_policy", "dpo_policy", "ppo_policy", "reinforce_policy"]


def create_pipeline(policies: list[str] | None = None, reward_model: bool = True, **kwargs) -> Pipeline:
    """Evaluate ``policies`` (catalog names); ``reward_model=False`` for flows that train none (RM metrics skipped)."""
    inputs = {"tokenizer": "tokenizer", "prompts_val": "prompts_val", "pref_val": "pref_val", "sft_val": "sft_val",
              "parallel": "params:parallel", "launch": "params:launch", "evaluation": "params:evaluation",
              "stored": "eval_report_stored", **{p: p for p in (policies or POLICIES)}}
    if reward_model:
        inputs["reward_model"] = "reward_model"
    return pipeline([node(evaluate_policies, inputs=inputs, outputs=["eval_report", "evaluation_metrics", "promoted_policy"],
                          name="evaluate_policies")])
