"""Wiring of ``data_prep``. Intermediates (``data_prep_raw``, ``data_prep_dubious``, ``data_prep_tokenizer``) have
no catalog entry, so they stay in memory; every persisted output comes from the last node, after all validation has
passed, and its outputs are saved all-or-nothing (catalog ``commit_group: data_prep``)."""

from kedro.pipeline import Node, Pipeline

from .nodes import (
    fit_tokenizer,
    tokenize_and_split,
    tokenize_prompts,
    tokenize_regression,
    validate_raw_data,
    validate_raw_prompts,
)


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                validate_raw_data,
                inputs=["raw_sft", "raw_preference", "raw_prompts", "params:data_prep", "params:ppo",
                        "params:reinforce", "params:evaluation"],
                outputs=["data_prep_raw", "data_prep_dubious"],
                name="validate_raw_data",
            ),
            Node(
                fit_tokenizer,
                inputs=["data_prep_raw", "params:data_prep"],
                outputs="data_prep_tokenizer",
                name="fit_tokenizer",
            ),
            Node(
                tokenize_and_split,
                inputs=[
                    "data_prep_raw",
                    "data_prep_tokenizer",
                    "data_prep_dubious",
                    "params:data_prep",
                    "params:model",
                ],
                outputs=[
                    "tokenizer",
                    "sft_train",
                    "sft_val",
                    "pref_train",
                    "pref_val",
                    "prompts_train",
                    "prompts_val",
                    "data_prep_metrics",
                ],
                name="tokenize_and_split",
            ),
        ],
        tags=["data_prep"],
    )


def create_prompts_pipeline(**kwargs) -> Pipeline:
    """``data_prep_prompts``: the prompts alone (``raw_prompts`` -> tokenizer, prompts_train, prompts_val), for RL
    that starts from a model (``reinforce.init_from``) without SFT or preference data; same checks, same outputs
    and commit group as ``data_prep``'s."""
    return Pipeline(
        [
            Node(
                validate_raw_prompts,
                inputs=["raw_prompts", "params:data_prep", "params:ppo", "params:reinforce", "params:evaluation"],
                outputs=["data_prep_raw", "data_prep_dubious"],
                name="validate_raw_prompts",
            ),
            Node(fit_tokenizer, inputs=["data_prep_raw", "params:data_prep"], outputs="data_prep_tokenizer",
                 name="fit_tokenizer"),
            Node(
                tokenize_prompts,
                inputs=["data_prep_raw", "data_prep_tokenizer", "data_prep_dubious", "params:data_prep",
                        "params:model"],
                outputs=["tokenizer", "prompts_train", "prompts_val", "data_prep_metrics"],
                name="tokenize_prompts",
            ),
        ],
        tags=["data_prep"],
    )


def create_regression_pipeline(**kwargs) -> Pipeline:
    """``regression_data``: SteerLM attribute data (``raw_regression``) tokenized with data_prep's tokenizer into
    ``reg_train`` / ``reg_val`` (commit group ``regression_data``), for ``reward_model.loss: regression``."""
    return Pipeline(
        [
            Node(
                tokenize_regression,
                inputs=["raw_regression", "tokenizer", "params:data_prep", "params:model"],
                outputs=["reg_train", "reg_val", "regression_data_metrics"],
                name="tokenize_regression",
            )
        ],
        tags=["regression_data"],
    )
