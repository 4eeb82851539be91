"""conf/reasoning_example through a real KedroSession on the CPU: ``--pipelines reasoning`` (the prompts' data_prep
with an HF model's tokenizer and chat template, then REINFORCE from that model with DAPO's settings: math-verify
rewards in worker processes, overlong shaping, dynamic sampling, clip-higher, TIS) on a tiny Llama-style HF
directory (ChatML template) made here, the shapes cut down by the test's own parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_tokenizers import make_chat_tokenizer_dir
from projects import copy_project, enter_project

pytestmark = pytest.mark.slow  # a KedroSession that launches a torchrun job

TINY = {
    "model": {"seq_length": 320},
    "parallel": {"bf16": False},
    "launch": {"nproc_per_node": 1},
    "reinforce": {
        "rl": {"iterations": 2, "prompts_per_iteration": 4, "minibatches": 2, "micro_batch_size": 4,
               "eval_interval": 0, "eval_prompts": 4, "save_interval": 0},
        "generation": {"max_new_tokens": 16, "samples_per_prompt": 4, "batch_size": 16},
        "reward": {"overlong_buffer": 4, "workers": 2},
    },
}


def _tiny_llama(path: Path, style: str = "chatml") -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    make_chat_tokenizer_dir(path, style)
    tok = AutoTokenizer.from_pretrained(str(path))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return path


def test_reasoning_env_trains_an_hf_model_with_dapo_settings(tmp_path, monkeypatch):
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    root = enter_project(monkeypatch, copy_project(tmp_path / "project"), "reasoning")
    hf = _tiny_llama(tmp_path / "Tiny-Instruct")
    bootstrap_project(root)
    with KedroSession.create(project_path=root, env="reasoning_example",
                             runtime_params={"hf_model_dir": str(hf), **TINY}) as session:
        session.run(pipeline_names=["reasoning"])

    data = root / "data" / "reasoning_example"
    assert not (data / "05_model_input" / "sft_train.npz").exists()  # the prompts alone were prepared
    first = json.loads((data / "05_model_input" / "prompts_train.jsonl").read_text().splitlines()[0])
    template_start = json.loads((hf / "tokenizer.json").read_text())["added_tokens"]
    assert first["prompt_ids"][0] == next(t["id"] for t in template_start if t["content"] == "<|im_start|>")
    (version,) = (data / "06_models" / "reinforce_policy").iterdir()
    policy = version / "reinforce_policy"
    meta = json.loads((policy / "meta.json").read_text())
    assert meta["lineage"]["parent_checkpoint"] == str(hf)  # RL from the model
    assert meta["lineage"]["reference"] is None and "train/kl" not in meta["metrics"]  # kl.beta 0: no reference
    m = meta["metrics"]
    assert m["rollout/dynamic_sampling/rounds"] >= 1 and m["rollout/reward_timeouts"] == 0
    # dropped groups fill the batch only when the rounds ran out: then they are the groups without signal
    assert m["rollout/fraction_of_groups_without_signal"] == m["rollout/dynamic_sampling/padded_groups"] / 4
    assert "rollout/overlong_shaping" in m and "train/clip_fraction" in m and "train/is_weight" in m
    assert json.loads((policy / "hf" / "align_export_check.json").read_text())["status"] == "passed"

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(policy / "hf"))
    assert model.config.vocab_size == json.loads((hf / "config.json").read_text())["vocab_size"]
