"""An MoE model through `kedro run`: data_prep (the HF model's tokenizer) -> sft -> dpo -> reinforce at expert
parallelism 2 (two gloo ranks) from a tiny Qwen3-MoE HF directory, then `--pipelines export`: the exports load in
`transformers` as Qwen3-MoE and generate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from projects import copy_project, enter_project, run_kedro

pytestmark = pytest.mark.slow

STAGE = {"training": {"train_steps": 4, "global_batch_size": 8, "micro_batch_size": 4, "log_interval": 1,
                      "eval_interval": 0, "eval_samples": 16, "save_interval": 0}}
RL = {"rl": {"iterations": 2, "prompts_per_iteration": 8, "epochs": 1, "minibatches": 1, "micro_batch_size": 4,
             "log_interval": 1, "eval_interval": 0, "eval_prompts": 8, "save_interval": 0},
      "generation": {"max_new_tokens": 8}}


def _qwen3_moe_dir(path: Path) -> None:
    """A tiny Qwen3-MoE (4 experts, top 2, the last of 2 layers dense) with a tokenizer that covers the demo data and a
    chat template, made here with `transformers` / `tokenizers`."""
    import torch
    from hf_models import demo_hf_tokenizer
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = demo_hf_tokenizer(path)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                            norm_topk_prob=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
    Qwen3MoeForCausalLM(config).save_pretrained(str(path))


@pytest.fixture
def project(tmp_path, monkeypatch):
    root = copy_project(tmp_path / "proj")
    return enter_project(monkeypatch, root, "test-moe")


def test_moe_model_through_data_prep_sft_dpo_reinforce_at_ep2_then_export(project):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from align_pipeline.data.formats import checkpoint_meta

    hf_dir = project / "hf_moe"
    _qwen3_moe_dir(hf_dir)
    params = {"model": {"seq_length": 64}, "parallel": {"expert_model_parallel_size": 2},
              "launch": {"nproc_per_node": 2},
              "data_prep": {"tokenizer": {"hf_model_dir": str(hf_dir)}},
              "sft": {**STAGE, "init_from": str(hf_dir)}, "dpo": STAGE, "reinforce": RL}
    (project / "conf" / "test" / "parameters_moe.yml").write_text(yaml.safe_dump(params))
    outputs = run_kedro(project, "data_prep", "sft", "dpo", "reinforce")
    for stage in ("sft", "dpo", "reinforce"):
        (version,) = (project / "data" / "06_models" / f"{stage}_policy").iterdir()
        meta = checkpoint_meta(version / f"{stage}_policy")
        assert meta["model"]["moe"]["num_experts"] == 4 and meta["model"]["moe"]["layers"] == [1, 0], stage
    sft_metrics = outputs["sft_metrics"].load()
    assert sft_metrics["first_train_loss"] > 0

    run_kedro(project, "export")
    exported = project / "data" / "07_model_output"
    for name in ("sft_policy_hf", "dpo_policy_hf", "reinforce_policy_hf"):
        (version,) = (exported / name).iterdir()
        out = version / name
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["mlp_only_layers"] == [1], name
        tok = AutoTokenizer.from_pretrained(str(out))
        model = AutoModelForCausalLM.from_pretrained(str(out))
        prompt = tok.apply_chat_template([{"role": "user", "content": "add: 1+2"}], tokenize=False)
        ids = torch.tensor([[tok.bos_token_id, *tok.encode(prompt, add_special_tokens=False)]])
        new = model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:]
        assert 1 <= len(new) <= 4, name
