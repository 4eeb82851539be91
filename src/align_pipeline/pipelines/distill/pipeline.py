from kedro.pipeline import Pipeline, node, pipeline

from .nodes import train_distill


def create_pipeline(teacher: str | None = "reinforce_policy", **kwargs) -> Pipeline:
    """The student (sft_policy, or ``distill.init_from``) distilled from the catalog's ``teacher`` (a policy
    artifact); ``teacher=None``: no teacher input - ``params:distill.teacher`` names it (a checkpoint or an HF model
    directory: the ``distill_from_path`` pipeline)."""
    inputs = {"tokenizer": "tokenizer", "prompts_train": "prompts_train", "prompts_val": "prompts_val",
              "sft_policy": "sft_policy", "model": "params:model", "parallel": "params:parallel",
              "launch": "params:launch", "distill": "params:distill", "stored": "distill_policy_stored"}
    if teacher is not None:
        inputs["teacher"] = teacher
    return pipeline([node(train_distill, inputs=inputs, outputs=["distill_policy", "distill_metrics"],
                          name="train_distill")])
