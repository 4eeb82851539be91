from kedro.pipeline import Pipeline, node, pipeline

from .nodes import train_reward_model


def create_pipeline(data: str = "pref", **kwargs) -> Pipeline:
    """The reward model on ``<data>_train`` / ``<data>_val``: preference pairs (``pref``, Bradley-Terry) or SteerLM
    attribute data (``reg``, ``reward_model.loss: regression``). Both write the catalog's ``reward_model``."""
    return pipeline(
        [
            node(
                train_reward_model,
                inputs=["tokenizer", f"{data}_train", f"{data}_val", "sft_policy", "params:model", "params:parallel",
                        "params:launch", "params:reward_model", "reward_model_stored"],
                outputs=["reward_model", "reward_model_metrics"],
                name="train_reward_model" if data == "pref" else "train_regression_reward_model",
            )
        ]
    )
