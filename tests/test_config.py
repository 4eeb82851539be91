"""The config family: parsing errors name the key; every field of every section and job has a docstring."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
from pathlib import Path

import pytest

from align_pipeline import config
from align_pipeline.config import ConfigError, PPOConfig, ReinforceConfig, SFTJob, from_dict

REPO = Path(__file__).resolve().parents[1]

CLASSES = [getattr(config, name) for name in config.__all__
           if dataclasses.is_dataclass(getattr(config, name, None))]


def _documented_fields(cls) -> set[str]:
    """Fields of ``cls`` (and its dataclass bases) followed by a string literal in the class body."""
    names = set()
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for stmt, nxt in itertools.pairwise(body):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                names.add(stmt.target.id)
    return names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls):
    missing = {f.name for f in dataclasses.fields(cls)} - _documented_fields(cls)
    assert not missing, f"{cls.__name__}: fields without a docstring: {sorted(missing)}"


def test_unknown_key_names_the_section_and_the_allowed_keys():
    with pytest.raises(ConfigError, match=r"params:ppo.kl: unknown key\(s\) \['coef'\]; allowed: .*'beta'"):
        from_dict(PPOConfig, {"kl": {"coef": 0.1}}, "params:ppo")


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"params:ppo.rl.iterations: expected an integer, got 'ten'"):
        from_dict(PPOConfig, {"rl": {"iterations": "ten"}}, "params:ppo")
    with pytest.raises(ConfigError, match=r"params:ppo.kl.estimator: 'k9' is not one of"):
        from_dict(PPOConfig, {"kl": {"estimator": "k9"}}, "params:ppo")


def test_missing_required_key_and_cross_field_checks():
    with pytest.raises(ConfigError, match=r"SFTJob.paths: required key is missing"):
        from_dict(SFTJob, {})
    with pytest.raises(ConfigError, match="samples_per_prompt >= 2"):
        from_dict(ReinforceConfig, {"generation": {"samples_per_prompt": 1}})
    with pytest.raises(ConfigError, match="kl.adaptive"):
        from_dict(ReinforceConfig, {"generation": {"samples_per_prompt": 4}, "kl": {"adaptive": True}})
    with pytest.raises(ConfigError, match="min_lr"):
        from_dict(PPOConfig, {"optimizer": {"lr": 1e-4, "min_lr": 1e-3}})
    with pytest.raises(ConfigError, match=r"critic_warmup_iterations must be in \[0, rl.iterations = 10\), got 10"):
        from_dict(PPOConfig, {"rl": {"iterations": 10}, "critic_warmup_iterations": 10})


def test_a_job_round_trips_through_json():
    job = from_dict(SFTJob, {"paths": {"run_dir": "r", "train_data": "t", "val_data": "v", "tokenizer": "k"},
                             "sft": {"training": {"train_steps": 5}}})
    assert from_dict(SFTJob, config.to_dict(job)) == job
    assert job.sft.training.train_steps == 5 and job.paths.init_from is None


@pytest.mark.parametrize("env", ["gpu", "hf_example"])
def test_shipped_environments_load_and_validate(env):
    """conf/gpu and conf/hf_example merge over conf/base (soft) and every section validates; hf_example takes the
    model directory from `--params hf_model_dir=...` for both the tokenizer and SFT's starting weights."""
    from kedro.config import OmegaConfigLoader

    from align_pipeline.settings import CONFIG_LOADER_ARGS
    from align_pipeline.validation import PARAM_SCHEMAS, validate_params

    loader = OmegaConfigLoader(str(REPO / "conf"), env=env, runtime_params={"hf_model_dir": "/models/x"},
                               **{k: v for k, v in CONFIG_LOADER_ARGS.items()})
    params = loader["parameters"]
    validate_params(params, set(PARAM_SCHEMAS))
    assert params["parallel"]["bf16"] is True and params["launch"]["nproc_per_node"] == "gpus"
    assert params["sft"]["training"]["train_steps"] == 600  # base keys kept under the env's overrides
    if env == "hf_example":
        assert params["sft"]["init_from"] == params["data_prep"]["tokenizer"]["hf_model_dir"] == "/models/x"
