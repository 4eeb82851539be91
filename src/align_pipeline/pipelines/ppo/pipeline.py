from kedro.pipeline import Pipeline, node, pipeline

from .nodes import train_ppo


def create_pipeline(**kwargs) -> Pipeline:
    return pipeline(
        [
            node(
                train_ppo,
                inputs=["tokenizer", "prompts_train", "prompts_val", "sft_policy", "reward_model", "params:model",
                        "params:parallel", "params:launch", "params:ppo", "ppo_policy_stored", "ppo_critic_stored"],
                outputs=["ppo_policy", "ppo_critic", "ppo_metrics"],
                name="train_ppo",
            )
        ]
    )
