"""conf/tool_env_example through a real KedroSession on the CPU: ``--pipelines reasoning`` (the prompts' data_prep
with an HF model's tokenizer and its tool-calling chat template, then REINFORCE from that model with episodes in the
built-in calculator environment, run in worker processes) on a tiny Llama-style HF directory made here, the shapes
cut down by the test's own parameters. The random model makes no good tool calls; what is checked is the plumbing:
episodes ran, their metrics and the lineage arrived, the export loads."""

from __future__ import annotations

import json

import pytest
from projects import copy_project, enter_project
from test_reasoning_example import _tiny_llama

pytestmark = pytest.mark.slow  # a KedroSession that launches a torchrun job

TINY = {
    "model": {"seq_length": 384},
    "parallel": {"bf16": False},
    "launch": {"nproc_per_node": 1},
    "reinforce": {
        "rl": {"iterations": 1, "prompts_per_iteration": 4, "minibatches": 1, "micro_batch_size": 4,
               "eval_interval": 0, "eval_prompts": 4, "save_interval": 0},
        "generation": {"max_new_tokens": 12, "samples_per_prompt": 2, "batch_size": 16},
        "env": {"max_tokens": 96, "workers": 2, "max_turns": 2},
    },
}


def test_tool_env_trains_an_hf_model_in_the_calculator_environment(tmp_path, monkeypatch):
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    root = enter_project(monkeypatch, copy_project(tmp_path / "project"), "tool-env")
    hf = _tiny_llama(tmp_path / "Tiny-Tools", style="chatml_tools")
    bootstrap_project(root)
    with KedroSession.create(project_path=root, env="tool_env_example",
                             runtime_params={"hf_model_dir": str(hf), **TINY}) as session:
        session.run(pipeline_names=["reasoning"])

    data = root / "data" / "tool_env_example"
    (version,) = (data / "06_models" / "reinforce_policy").iterdir()
    policy = version / "reinforce_policy"
    meta = json.loads((policy / "meta.json").read_text())
    assert meta["lineage"]["parent_checkpoint"] == str(hf)
    m = meta["metrics"]
    assert 1.0 <= m["env/turns"] <= 2.0 and m["env/timeouts"] == 0 and m["env/policy_tokens"] > 0
    assert "val/accuracy" in m  # episodes graded by the environment's check
    assert json.loads((policy / "hf" / "align_export_check.json").read_text())["status"] == "passed"
