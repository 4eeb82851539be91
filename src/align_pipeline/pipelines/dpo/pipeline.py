from kedro.pipeline import Pipeline, node, pipeline

from .nodes import compute_reference_logps, train_dpo


def create_pipeline(**kwargs) -> Pipeline:
    return pipeline(
        [
            node(
                compute_reference_logps,
                inputs=["sft_policy", "tokenizer", "pref_train", "pref_val", "params:parallel", "params:launch",
                        "params:dpo"],
                outputs="dpo_reference_logps",
                name="compute_reference_logps",
            ),
            node(
                train_dpo,
                inputs=["tokenizer", "pref_train", "pref_val", "sft_policy", "dpo_reference_logps", "params:model",
                        "params:parallel", "params:launch", "params:dpo", "dpo_policy_stored"],
                outputs=["dpo_policy", "dpo_metrics"],
                name="train_dpo",
            ),
        ]
    )
