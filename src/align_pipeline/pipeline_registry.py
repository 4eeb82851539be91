"""Registered pipelines: one per stage, the compositions, ``export`` (HF directories of the trained models) and
``__default__`` = every training stage.

The stages are listed explicitly rather than discovered with ``find_pipelines()``: Kedro 1.7 loads pipelines lazily
and, asked for ``--pipeline dpo_flow``, looks for a package named ``dpo_flow`` and fails on compositions.
"""

from __future__ import annotations

from kedro.pipeline import Pipeline

from align_pipeline.pipelines import data_prep, dpo, evaluation, export, ppo, reinforce, reward_model, sft


def register_pipelines() -> dict[str, Pipeline]:
    stages = {
        "data_prep": data_prep.create_pipeline(),
        "sft": sft.create_pipeline(),
        "reward_model": reward_model.create_pipeline(),
        "dpo": dpo.create_pipeline(),
        "ppo": ppo.create_pipeline(),
        "reinforce": reinforce.create_pipeline(),
        "evaluation": evaluation.create_pipeline(),
    }
    # Each composition evaluates the policies it trains and uses a reward model only if it trains one.
    compositions = {
        "rlhf": stages["data_prep"] + stages["sft"] + stages["reward_model"] + stages["ppo"]
        + evaluation.create_pipeline(policies=["sft_policy", "ppo_policy"], reward_model=True),
        "dpo_flow": stages["data_prep"] + stages["sft"] + stages["dpo"]
        + evaluation.create_pipeline(policies=["sft_policy", "dpo_policy"], reward_model=False),
    }
    # regression_data + steerlm_reward_model: SteerLM attribute data (data/01_raw/regression.jsonl, not shipped) ->
    # a multi-attribute regression reward model in the catalog's reward_model (reward_model.loss: regression).
    regression = data_prep.create_regression_pipeline()
    extra = {
        "regression_data": regression,
        "steerlm_reward_model": regression + reward_model.create_pipeline(data="reg"),
        # the reinforce stage with the catalog's reward model wired in (reward.reward_model_weight > 0)
        "reinforce_rm": reinforce.create_pipeline(reward_model=True),
        # run after training (`kedro run --pipelines export`); not part of __default__, which trains
        "export": export.create_pipeline(),
    }
    return {**stages, **compositions, **extra, "__default__": sum(stages.values(), Pipeline([]))}
