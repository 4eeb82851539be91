"""conf/calculator_demo through a real KedroSession on the CPU: `kedro run -e calculator_demo --pipelines
data_prep,sft,reinforce` - the tiny demo model learns the calculator's plain call format from SFT conversations (40 %
of them plausibly wrong), then REINFORCE in the built-in calculator environment raises its accuracy over the SFT
policy's on the same held-out prompts (validated before the first iteration and at the end). The SFT and RL
lengths are cut down here; the shipped ones: README "Environments"."""

from __future__ import annotations

import json

import pytest
from projects import copy_project, enter_project

pytestmark = pytest.mark.slow  # a KedroSession that launches torchrun jobs

SHORTER = {"sft": {"training": {"train_steps": 300}}, "reinforce": {"rl": {"iterations": 20, "eval_interval": 0}}}
# Sampled accuracy in the environment, RL over SFT (the shipped lengths: 0.593 -> 0.987; these: 0.580 -> 0.960).
RL_OVER_SFT_MIN = 0.2


def test_rl_in_the_calculator_environment_beats_the_sft_policy_on_the_demo(tmp_path, monkeypatch):
    import mlflow
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project
    from mlflow import MlflowClient

    root = enter_project(monkeypatch, copy_project(tmp_path / "project"), "calculator-demo")
    bootstrap_project(root)
    with KedroSession.create(project_path=root, env="calculator_demo", runtime_params=SHORTER) as session:
        session.run(pipeline_names=["data_prep", "sft", "reinforce"])

    (version,) = (root / "data" / "calculator_demo" / "06_models" / "reinforce_policy").iterdir()
    final = json.loads((version / "reinforce_policy" / "meta.json").read_text())["metrics"]
    # nearly every episode: a call, then the answer (measured 1.99 turns per episode)
    assert 1.8 <= final["env/turns"] <= 3.0 and final["env/timeouts"] == 0
    # val/accuracy at step 0 is the SFT policy's (validated before the first iteration), at the last step the
    # trained policy's: the same held-out prompts
    client = MlflowClient(tracking_uri=mlflow.get_tracking_uri())
    exp = client.get_experiment_by_name("calculator-demo")
    (run,) = client.search_runs([exp.experiment_id], filter_string="tags.`kedro.node` = 'train_reinforce'")
    history = sorted(client.get_metric_history(run.info.run_id, "val/accuracy"), key=lambda x: x.step)
    before, after = history[0], history[-1]
    assert (before.step, after.step) == (0, 20), history
    assert after.value >= before.value + RL_OVER_SFT_MIN, (before.value, after.value)
    assert final["val/accuracy"] == pytest.approx(after.value)
