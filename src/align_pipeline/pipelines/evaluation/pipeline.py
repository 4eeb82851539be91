from kedro.pipeline import Pipeline, node, pipeline

from .nodes import evaluate_policies

# Policies the report compares; a stage added later (ppo, reinforce) adds its output here.
POLICIES = ["sft_policy", "dpo_policy"]


def create_pipeline(**kwargs) -> Pipeline:
    return pipeline(
        [
            node(
                evaluate_policies,
                inputs={"tokenizer": "tokenizer", "prompts_val": "prompts_val", "pref_val": "pref_val",
                        "sft_val": "sft_val", "reward_model": "reward_model", "parallel": "params:parallel",
                        "launch": "params:launch", "evaluation": "params:evaluation",
                        **{p: p for p in POLICIES}},
                outputs=["eval_report", "evaluation_metrics"],
                name="evaluate_policies",
            )
        ]
    )
