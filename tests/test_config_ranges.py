"""Every stage's ranges are its sections' ``validate()``: checked by :func:`~align_pipeline.config.from_dict` (so by
ParamsValidationHook, before any node runs) with one line naming the key, not first inside the torchrun job. And the
RL math defaults: REINFORCE's KL estimator is k3 and k1 is refused as a loss term; GRPO's std epsilon is a field."""

from __future__ import annotations

import pytest

from align_pipeline.config import (
    SECTIONS,
    ConfigError,
    DPOConfig,
    EvaluationConfig,
    PPOConfig,
    ReinforceConfig,
    RewardModelConfig,
    SFTConfig,
    from_dict,
)

RL = ("ppo", "reinforce")
REINFORCE_OK = {"generation": {"samples_per_prompt": 4}}

# (section, the bad override, the message it fails with); each override applied alone to the section's defaults
BAD = [
    # PPO's objective (was first checked inside the job by losses.ppo / rl.advantages)
    ("ppo", {"loss": {"clip_eps": -1}}, r"params:ppo\.loss\.clip_eps=-1\.0 must be in \(0, 1\)"),
    ("ppo", {"loss": {"clip_eps": 0}}, r"params:ppo\.loss\.clip_eps=0\.0 must be in \(0, 1\)"),
    ("ppo", {"loss": {"clip_eps": 1.5}}, r"params:ppo\.loss\.clip_eps=1\.5 must be in \(0, 1\)"),
    ("ppo", {"loss": {"value_clip_eps": 0.0}}, r"params:ppo\.loss\.value_clip_eps=0\.0 must be > 0"),
    ("ppo", {"loss": {"gamma": 1.1}}, r"params:ppo\.loss\.gamma=1\.1 must be in \[0, 1\]"),
    ("ppo", {"loss": {"lam": -0.1}}, r"params:ppo\.loss\.lam=-0\.1 must be in \[0, 1\]"),
    ("ppo", {"loss": {"entropy_coef": -0.01}}, r"params:ppo\.loss\.entropy_coef=-0\.01 must be >= 0"),
    # the KL term and its controller
    *[(s, {"kl": {"beta": -0.05}}, rf"params:{s}\.kl\.beta=-0\.05 must be >= 0") for s in RL],
    ("ppo", {"kl": {"target": 0}}, r"params:ppo\.kl\.target=0\.0 must be > 0"),
    ("ppo", {"kl": {"horizon": -5}}, r"params:ppo\.kl\.horizon=-5\.0 must be > 0"),
    ("ppo", {"kl": {"adaptive": True, "beta": 0}}, r"params:ppo\.kl\.beta=0 with params:ppo\.kl\.adaptive"),
    # REINFORCE's loss
    ("reinforce", {"loss": {"clip_eps": 0}}, r"params:reinforce\.loss\.clip_eps=0\.0 must be in \(0, 1\)"),
    ("reinforce", {"loss": {"std_eps": 0}}, r"params:reinforce\.loss\.std_eps=0\.0 must be > 0"),
    ("reinforce", {"loss": {"std_eps": -1e-4}}, r"params:reinforce\.loss\.std_eps=-0\.0001 must be > 0"),
    # learning rates and the rest of AdamW, in every optimizer of every stage
    *[(s, {"optimizer": {"lr": 0}}, rf"params:{s}\.optimizer\.lr=0\.0 must be > 0") for s in RL],
    ("ppo", {"critic_optimizer": {"lr": -1e-4}}, r"params:ppo\.critic_optimizer\.lr=-0\.0001 must be > 0"),
    *[(s, {"training": {"optimizer": {"lr": -1}}}, rf"params:{s}\.training\.optimizer\.lr=-1\.0 must be > 0")
      for s in ("sft", "reward_model", "dpo")],
    ("sft", {"training": {"optimizer": {"min_lr": 1.0}}}, r"params:sft\.training\.optimizer: need 0 <= min_lr"),
    ("sft", {"training": {"optimizer": {"weight_decay": -0.1}}},
     r"params:sft\.training\.optimizer\.weight_decay=-0\.1 must be >= 0"),
    ("dpo", {"training": {"optimizer": {"adam_beta1": 1.0}}},
     r"params:dpo\.training\.optimizer\.adam_beta1=1\.0 must be in \[0, 1\)"),
    ("reward_model", {"training": {"optimizer": {"adam_beta2": -0.5}}},
     r"params:reward_model\.training\.optimizer\.adam_beta2=-0\.5 must be in \[0, 1\)"),
    ("sft", {"training": {"optimizer": {"adam_eps": 0}}}, r"params:sft\.training\.optimizer\.adam_eps=0\.0 must be > 0"),
    ("sft", {"training": {"optimizer": {"clip_grad": -1}}},
     r"params:sft\.training\.optimizer\.clip_grad=-1\.0 must be >= 0"),
    ("ppo", {"optimizer": {"warmup_steps": -1}}, r"params:ppo\.optimizer\.warmup_steps=-1 must be >= 0"),
    # sampling, in every stage that generates
    *[(s, {"generation": {"temperature": -1}}, rf"params:{s}\.generation: need temperature >= 0")
      for s in (*RL, "evaluation")],
    *[(s, {"generation": {"top_p": 1.5}}, rf"params:{s}\.generation: need .* 0 < top_p <= 1 \(got 1\.5\)")
      for s in (*RL, "evaluation")],
    *[(s, {"generation": {"top_k": -1}}, rf"params:{s}\.generation\.top_k=-1 must be >= 0") for s in RL],
    *[(s, {"generation": {"max_new_tokens": 0}}, rf"params:{s}\.generation\.max_new_tokens=0 must be >= 1")
      for s in (*RL, "evaluation")],
    ("ppo", {"generation": {"batch_size": 0}}, r"params:ppo\.generation\.batch_size=0 must be >= 1"),
    ("ppo", {"generation": {"seed": -1}}, r"params:ppo\.generation\.seed=-1 must be >= 0"),
    ("reinforce", {"generation": {"samples_per_prompt": 1}},
     r"params:reinforce\.generation\.samples_per_prompt=1: group baselines need"),
    # batch sizes, loops, seeds
    ("ppo", {"rl": {"micro_batch_size": 0}}, r"params:ppo\.rl\.micro_batch_size=0 must be >= 1"),
    ("reinforce", {"rl": {"prompts_per_iteration": 0}}, r"params:reinforce\.rl\.prompts_per_iteration=0 must be >= 1"),
    ("reinforce", {"rl": {"seed": -3}}, r"params:reinforce\.rl\.seed=-3 must be >= 0"),
    ("sft", {"training": {"seed": -1}}, r"params:sft\.training\.seed=-1 must be >= 0"),
    ("ppo", {"critic_warmup_iterations": -1}, r"params:ppo\.critic_warmup_iterations must be in \[0, rl\.iterations"),
    # rewards and gates
    ("ppo", {"reward": {"missing_eos_penalty": -1}}, r"params:ppo\.reward\.missing_eos_penalty=-1\.0 must be >= 0"),
    ("ppo", {"gate": {"min_reward_model_accuracy": 1.5}},
     r"params:ppo\.gate\.min_reward_model_accuracy=1\.5 must be in \[0, 1\]"),
    ("evaluation", {"gate": {"max_kl_to_reference": -1}},
     r"params:evaluation\.gate\.max_kl_to_reference=-1\.0 must be >= 0"),
    # LoRA
    ("ppo", {"lora": {"rank": 4, "alpha": 0}}, r"params:ppo\.lora\.alpha must be > 0"),
    ("sft", {"lora": {"dropout": 1.0}}, r"params:sft\.lora\.dropout must be in \[0, 1\)"),
    # DPO family: beta, sft weight, each loss's options
    ("dpo", {"loss": {"beta": 0}}, r"params:dpo\.loss\.beta=0\.0 must be > 0"),
    ("dpo", {"loss": {"beta": -0.1}}, r"params:dpo\.loss\.beta=-0\.1 must be > 0"),
    ("dpo", {"loss": {"sft_weight": -1}}, r"params:dpo\.loss\.sft_weight=-1\.0 must be >= 0"),
    ("dpo", {"loss": {"options": {"label_smoothing": 0.7}}},
     r"params:dpo\.loss\.options\.label_smoothing=0\.7 must be a number in \[0, 0\.5\]"),
    ("dpo", {"loss": {"options": {"label_smoothin": 0.1}}},
     (r"params:dpo\.loss\.options: \['label_smoothin'\] not an option of the 'dpo' loss; its options: "
      r"\['label_smoothing'\]")),
    ("dpo", {"loss": {"name": "rpo"}}, r"params:dpo\.loss\.options\.eta: required by the 'rpo' loss \(a number > 0\)"),
    ("dpo", {"loss": {"name": "rpo", "options": {"eta": 1.0, "distance": "l2"}}},
     r"params:dpo\.loss\.options\.distance='l2' must be 'bwd_kl' or 'sq'"),
    ("dpo", {"loss": {"name": "simpo", "options": {"gamma": -0.5}}},
     r"params:dpo\.loss\.options\.gamma=-0\.5 must be a number >= 0"),
    ("dpo", {"loss": {"name": "hinge", "options": {"label_smoothing": 0.1}}},
     r"not an option of the 'hinge' loss; its options: none"),
    ("reward_model", {"margin_scale": -1}, r"params:reward_model\.margin_scale=-1\.0 must be >= 0"),
    # a NaN or an infinity is no setting anywhere (YAML .nan / .inf)
    ("ppo", {"loss": {"clip_eps": float("nan")}}, r"params:ppo\.loss\.clip_eps: expected a finite number, got nan"),
    ("sft", {"training": {"optimizer": {"lr": float("inf")}}},
     r"params:sft\.training\.optimizer\.lr: expected a finite number, got inf"),
    ("reinforce", {"kl": {"beta": float("nan")}}, r"params:reinforce\.kl\.beta: expected a finite number, got nan"),
]


def _build(section: str, override: dict):
    base = REINFORCE_OK if section == "reinforce" else {}
    merged = {**base, **override}
    if section == "reinforce" and "generation" in override:
        merged["generation"] = {**REINFORCE_OK["generation"], **override["generation"]}
    return from_dict(SECTIONS[section], merged, f"params:{section}")


@pytest.mark.parametrize(("section", "override", "message"), BAD,
                         ids=[f"{b[0]}-{b[1]}" for b in BAD])
def test_a_bad_value_fails_in_its_section_naming_the_key(section, override, message):
    with pytest.raises(ConfigError, match=message) as info:
        _build(section, override)
    assert "\n" not in str(info.value)  # one line


@pytest.mark.parametrize("section", ["sft", "reward_model", "dpo", "ppo", "reinforce", "evaluation", "export"])
def test_the_defaults_pass(section):
    _build(section, {})


GOOD = [
    ("ppo", {"loss": {"clip_eps": 0.1, "value_clip_eps": None, "gamma": 0.0, "lam": 1.0, "entropy_coef": 0.01}}),
    ("ppo", {"kl": {"beta": 0.0}}),
    ("ppo", {"kl": {"adaptive": True, "beta": 0.02, "target": 1.0, "horizon": 100}}),
    ("reinforce", {"loss": {"estimator": "grpo", "std_eps": 1e-4}}),
    ("reinforce", {"kl": {"estimator": "k1", "beta": 0.0}}),  # k1 only reported, not a loss term
    ("reinforce", {"kl": {"estimator": "k2"}}),
    ("sft", {"training": {"optimizer": {"lr": 1e-5, "min_lr": 0.0, "weight_decay": 0.0, "clip_grad": 0.0}}}),
    ("dpo", {"loss": {"name": "rpo", "options": {"eta": 2.0, "distance": "sq"}}}),
    ("dpo", {"loss": {"name": "simpo", "options": {"gamma": 0.5}}}),
    ("dpo", {"loss": {"name": "ipo", "options": {"length_normalized": False}}}),
    ("dpo", {"loss": {"options": {"label_smoothing": 0.5}}}),
    ("evaluation", {"generation": {"temperature": 0.0, "max_new_tokens": 1}}),
]


@pytest.mark.parametrize(("section", "override"), GOOD, ids=[f"{g[0]}-{g[1]}" for g in GOOD])
def test_values_inside_the_ranges_pass(section, override):
    _build(section, override)


# ---- RL math defaults ----


def test_reinforce_kl_defaults_to_k3_and_ppo_keeps_k1_as_its_reward_penalty():
    assert ReinforceConfig().kl.estimator == "k3"
    assert from_dict(ReinforceConfig, REINFORCE_OK).kl.estimator == "k3"  # a config that omits the field
    assert PPOConfig().kl.estimator == "k1"  # subtracted from the rewards: k1 is InstructGPT's penalty


def test_k1_as_reinforce_loss_term_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"^params:reinforce\.kl\.estimator=k1: REINFORCE adds beta x KL to the "
                                          r"loss, and k1's gradient is zero in expectation as a loss term; use k3 "
                                          r"\(or k2\)$"):
        from_dict(ReinforceConfig, {**REINFORCE_OK, "kl": {"estimator": "k1", "beta": 0.05}}, "params:reinforce")


def test_k1_is_fine_as_ppo_reward_penalty():
    assert from_dict(PPOConfig, {"kl": {"estimator": "k1", "beta": 0.05}}, "params:ppo").kl.estimator == "k1"


def test_grpo_std_eps_is_a_field_with_the_historic_default():
    assert ReinforceConfig().loss.std_eps == 1e-6
    cfg = from_dict(ReinforceConfig, {**REINFORCE_OK, "loss": {"estimator": "grpo", "std_eps": 1e-4}})
    assert cfg.loss.std_eps == 1e-4


def test_every_stage_section_is_covered():
    assert {b[0] for b in BAD} >= {"sft", "reward_model", "dpo", "ppo", "reinforce", "evaluation"}
    for cls in (SFTConfig, RewardModelConfig, DPOConfig, PPOConfig, ReinforceConfig, EvaluationConfig):
        assert cls in SECTIONS.values()
