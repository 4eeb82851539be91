from kedro.pipeline import Pipeline, node, pipeline

from .nodes import train_sft


def create_pipeline(**kwargs) -> Pipeline:
    return pipeline(
        [
            node(
                train_sft,
                inputs=[
                    "tokenizer",
                    "sft_train",
                    "sft_val",
                    "params:model",
                    "params:parallel",
                    "params:launch",
                    "params:sft",
                    "sft_policy_stored",
                ],
                outputs=["sft_policy", "sft_metrics"],
                name="train_sft",
            )
        ]
    )
