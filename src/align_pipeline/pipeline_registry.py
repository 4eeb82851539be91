"""Registered pipelines: one per stage, the compositions, ``export`` (HF directories of the trained models) and
``__default__`` = every training stage.

The stages are listed explicitly rather than discovered with ``find_pipelines()``: Kedro 1.7 loads pipelines lazily
and, asked for ``--pipeline dpo_flow``, looks for a package named ``dpo_flow`` and fails on compositions.
"""

from __future__ import annotations

from kedro.pipeline import Pipeline

from align_pipeline.pipelines import data_prep, distill, dpo, evaluation, export, ppo, reinforce, reward_model, sft


def register_pipelines() -> dict[str, Pipeline]:
    # Every node is tagged with its stage (kedro-viz filters by tag; `kedro run --tags dpo`).
    stages = {
        "data_prep": data_prep.create_pipeline().tag("data_prep"),
        "sft": sft.create_pipeline().tag("sft"),
        "reward_model": reward_model.create_pipeline().tag("reward_model"),
        "dpo": dpo.create_pipeline().tag("dpo"),
        "ppo": ppo.create_pipeline().tag("ppo"),
        "reinforce": reinforce.create_pipeline().tag("reinforce"),
        "evaluation": evaluation.create_pipeline().tag("evaluation"),
    }
    # Each composition evaluates the policies it trains and uses a reward model only if it trains one.
    compositions = {
        "rlhf": stages["data_prep"] + stages["sft"] + stages["reward_model"] + stages["ppo"]
        + evaluation.create_pipeline(policies=["sft_policy", "ppo_policy"], reward_model=True).tag("evaluation"),
        "dpo_flow": stages["data_prep"] + stages["sft"] + stages["dpo"]
        + evaluation.create_pipeline(policies=["sft_policy", "dpo_policy"], reward_model=False).tag("evaluation"),
        # DPO on the existing sft_policy, then its evaluation against it: one sweep point
        # (`align-pipeline sweep --pipelines dpo_evaluation --grid dpo.loss.beta=0.03,0.1,0.3`)
        "dpo_evaluation": stages["dpo"]
        + evaluation.create_pipeline(policies=["sft_policy", "dpo_policy"], reward_model=False).tag("evaluation"),
    }
    # regression_data + steerlm_reward_model: SteerLM attribute data (data/01_raw/regression.jsonl, not shipped) ->
    # a multi-attribute regression reward model in the catalog's reward_model (reward_model.loss: regression).
    regression = data_prep.create_regression_pipeline().tag("data_prep")
    extra = {
        "regression_data": regression,
        "steerlm_reward_model": regression + reward_model.create_pipeline(data="reg").tag("reward_model"),
        # the reinforce stage with the catalog's reward model wired in (reward.reward_model_weight > 0)
        "reinforce_rm": reinforce.create_pipeline(reward_model=True).tag("reinforce"),
        # RL from a model (reinforce.init_from: an HF directory or a checkpoint), no SFT or preference data: the
        # prompts' data_prep, then REINFORCE whose KL reference is its start (conf/reasoning_example)
        "data_prep_prompts": data_prep.create_prompts_pipeline().tag("data_prep"),
        "reasoning": data_prep.create_prompts_pipeline().tag("data_prep")
        + reinforce.create_pipeline(sft_policy=False).tag("reinforce"),
        # on-policy distillation of the catalog's reinforce_policy (the teacher) into the sft_policy (the student);
        # distill_from_path: the teacher is params:distill.teacher (a checkpoint or an HF model directory)
        "distill": distill.create_pipeline().tag("distill"),
        "distill_from_path": distill.create_pipeline(teacher=None).tag("distill"),
        "distill_evaluation": distill.create_pipeline().tag("distill")
        + evaluation.create_pipeline(policies=["sft_policy", "reinforce_policy", "distill_policy"],
                                     reward_model=False).tag("evaluation"),
        # run after training (`kedro run --pipelines export`); not part of __default__, which trains
        "export": export.create_pipeline().tag("export"),
    }
    return {**stages, **compositions, **extra, "__default__": sum(stages.values(), Pipeline([]))}
