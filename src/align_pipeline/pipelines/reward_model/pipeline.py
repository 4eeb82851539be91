from kedro.pipeline import Pipeline, node, pipeline

from .nodes import train_reward_model


def create_pipeline(**kwargs) -> Pipeline:
    return pipeline(
        [
            node(
                train_reward_model,
                inputs=["tokenizer", "pref_train", "pref_val", "sft_policy", "params:model", "params:parallel",
                        "params:launch", "params:reward_model"],
                outputs=["reward_model", "reward_model_metrics"],
                name="train_reward_model",
            )
        ]
    )
