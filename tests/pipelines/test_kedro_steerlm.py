"""The SteerLM regression reward model from Kedro: raw attribute data -> ``regression_data`` (tokenized with
data_prep's tokenizer) -> ``steerlm_reward_model`` (``reward_model.loss: regression``) -> REINFORCE scoring with the
model's attributes weighted (``reward.reward_model_attribute_weights``), through a real KedroSession."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from projects import copy_project, enter_project, run_kedro

pytestmark = pytest.mark.slow

TINY = {"training": {"train_steps": 4, "global_batch_size": 8, "micro_batch_size": 8, "log_interval": 2,
                     "eval_interval": 0, "eval_samples": 16, "save_interval": 0}}


def _regression_lines(n: int) -> list[dict]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 44), rng.randint(10, 44)
        right = rng.random() < 0.5
        response = str(a + b if right else a + b + rng.choice([-1, 1]))
        labels = {"correctness": 4.0 if right else 0.0, "verbosity": None if rng.random() < 0.3 else 1.0}
        out.append({"prompt": f"add: {a}+{b}\n", "response": response, "labels": labels})
    return out


@pytest.fixture
def project(tmp_path, monkeypatch):
    params = {
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
                  "ffn_hidden_size": 64},
        "sft": TINY,
        "reward_model": {**TINY, "loss": "regression", "packing": True},
        "reinforce": {"rl": {"iterations": 2, "prompts_per_iteration": 8, "epochs": 1, "minibatches": 2,
                             "micro_batch_size": 4, "log_interval": 1, "eval_interval": 0, "eval_prompts": 8,
                             "save_interval": 0},
                      "generation": {"max_new_tokens": 8, "samples_per_prompt": 4},
                      "reward": {"reward_model_weight": 1.0, "reward_model_attribute_weights": [1.0, -0.5]}},
    }
    root = copy_project(tmp_path / "proj", params={"test/steerlm": params})
    lines = _regression_lines(120)
    (root / "data" / "01_raw" / "regression.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return enter_project(monkeypatch, root, "test-steerlm")


def _run(root: Path, *pipelines: str):
    return run_kedro(root, *pipelines)


def test_regression_reward_model_from_kedro_then_weighted_attributes_in_reinforce(project):
    from align_pipeline.data.formats import checkpoint_meta, read_meta
    from align_pipeline.data.store import load_rows

    outputs = _run(project, "data_prep", "sft", "steerlm_reward_model")
    data = project / "data" / "05_model_input"
    meta = read_meta(data / "reg_train.npz")
    assert meta["kind"] == "regression" and meta["attributes"] == ["correctness", "verbosity"]
    tokenizer = json.loads((project / "data" / "03_primary" / "tokenizer" / "align_tokenizer.json").read_text())
    assert meta["tokenizer_fingerprint"] == tokenizer["fingerprint"]  # data_prep's tokenizer
    labels = load_rows(data / "reg_train.npz")["reward_labels"]
    assert labels.shape[1] == 2 and (labels[:, 1] != labels[:, 1]).any()  # NaN = a missing label, kept missing
    metrics = outputs["regression_data_metrics"].load()
    assert metrics["regression_train_samples"] + metrics["regression_val_samples"] == 120
    (version,) = (project / "data" / "06_models" / "reward_model").iterdir()
    rm = checkpoint_meta(version / "reward_model")
    assert rm["reward_head"]["loss"] == "regression" and rm["stage"] == "reward_model"

    out = _run(project, "reinforce_rm")  # scored by the 2-attribute RM with weights [1, -0.5]
    assert out["reinforce_metrics"].load()["iterations"] == 2.0


def test_loss_and_data_kind_must_agree(project):
    from align_pipeline.config import ConfigError

    params = project / "conf" / "test" / "parameters_steerlm.yml"
    values = yaml.safe_load(params.read_text())
    values["reward_model"]["loss"] = "bradley_terry"
    params.write_text(yaml.safe_dump(values))
    _run(project, "data_prep", "sft", "regression_data")
    with pytest.raises(ConfigError, match="is 'bradley_terry' but its training data .*reg_train.npz is 'regression'"):
        _run(project, "steerlm_reward_model")
