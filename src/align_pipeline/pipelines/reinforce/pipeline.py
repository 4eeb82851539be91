from kedro.pipeline import Pipeline, node, pipeline

from .nodes import train_reinforce


def create_pipeline(reward_model: bool = False, sft_policy: bool = True, **kwargs) -> Pipeline:
    """``reward_model=True`` wires the catalog's reward_model in (for ``reward.reward_model_weight`` > 0);
    ``sft_policy=False``: no SFT policy - the policy and its KL reference both start from ``reinforce.init_from``
    (an HF model directory or a checkpoint: the ``reasoning`` pipeline)."""
    inputs = {"tokenizer": "tokenizer", "prompts_train": "prompts_train", "prompts_val": "prompts_val",
              "model": "params:model", "parallel": "params:parallel",
              "launch": "params:launch", "reinforce": "params:reinforce", "stored": "reinforce_policy_stored"}
    if sft_policy:
        inputs["sft_policy"] = "sft_policy"
    if reward_model:
        inputs["reward_model"] = "reward_model"
    return pipeline([node(train_reinforce, inputs=inputs, outputs=["reinforce_policy", "reinforce_metrics"],
                          name="train_reinforce")])
