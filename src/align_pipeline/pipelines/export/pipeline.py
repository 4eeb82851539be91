from functools import partial, update_wrapper

from kedro.pipeline import Pipeline, node, pipeline

from .nodes import export_artifact

EXPORTED = ("sft_policy", "dpo_policy", "ppo_policy", "reinforce_policy", "distill_policy", "reward_model",
            "ppo_critic")
"""The model artifacts the export pipeline writes as HF directories (those present in the catalog)."""


def create_pipeline(**kwargs) -> Pipeline:
    """One node per artifact: ``<artifact>@export`` (the same versions, loaded as "" when absent) -> ``<artifact>_hf``
    and ``<artifact>_export_metrics``."""
    nodes = []
    for name in EXPORTED:
        func = update_wrapper(partial(export_artifact, name=name), export_artifact)
        nodes.append(node(func, inputs=[f"{name}@export", "params:export"],
                          outputs=[f"{name}_hf", f"{name}_export_metrics"], name=f"export_{name}"))
    return pipeline(nodes)
