"""HF Llama / Qwen2 directories load into our Megatron GPT with the same logits as `transformers`, at TP=1 and TP=2.

Tiny random models (every weight perturbed, so norms and biases are not the identity) are saved with
``save_pretrained``; real torchrun jobs (gloo, CPU) build our GPT from them via ``init.resolve`` and write logits.
Megatron runs only in those jobs, never in the pytest process.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from align_pipeline.config import LaunchConfig, ModelConfig
from align_pipeline.launch import run_torchrun
from align_pipeline.model import hf

pytestmark = pytest.mark.slow  # launches torchrun jobs or a KedroSession

TESTS = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 100, 12
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, SEQ)).tolist()
TOL = 1e-4


def _tiny(model_type: str, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
        model_type]
    kwargs = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
              **overrides}
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs))
    with torch.no_grad():  # make every weight matter: norms != 1, biases != 0, larger embeddings
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model.eval()


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    llama = _tiny("llama", rope_theta=50000.0)
    qwen = _tiny("qwen2", tie_word_embeddings=True)
    dirs = {"llama": root / "llama", "qwen2": root / "qwen2", "llama_bin": root / "llama_bin"}
    llama.save_pretrained(dirs["llama"], max_shard_size="40KB")  # sharded safetensors + index json
    qwen.save_pretrained(dirs["qwen2"])
    dirs["llama_bin"].mkdir()
    shutil.copy(dirs["llama"] / "config.json", dirs["llama_bin"])
    torch.save({k: v.contiguous() for k, v in llama.state_dict().items()}, dirs["llama_bin"] / "pytorch_model.bin")
    logits = {"llama": _hf_logits(llama), "qwen2": _hf_logits(qwen)}
    logits["llama_bin"] = logits["llama"]
    return {k: str(v) for k, v in dirs.items()}, logits


def _bad_dir(src: str, dst: Path, edit) -> str:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    shutil.copy(Path(src) / "config.json", dst)
    state = load_file(str(Path(src) / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return str(dst)


def _run(tmp: Path, nproc: int, layouts: dict, models: dict, bad_dirs: dict | None = None) -> dict:
    tmp.mkdir(parents=True)
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS / "model"), os.environ.get("PYTHONPATH", "")])}
    config = {"layouts": layouts, "seq_length": 32, "tokens": TOKENS, "models": models, "bad_dirs": bad_dirs or {}}
    return run_torchrun("hf_worker", config, LaunchConfig(nproc_per_node=nproc), tmp, env=env)


def _params(layout_dir: Path, name: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(layout_dir.glob(f"params_{name}_rank*.pt")):
        out.update(torch.load(f, weights_only=True))
    return out


@pytest.fixture(scope="module")
def ws1(hf_dirs, tmp_path_factory):
    """World size 1: every model dir, plus corrupted copies of the qwen2 dir."""
    dirs, _ = hf_dirs
    tmp = tmp_path_factory.mktemp("ws1")
    bad = {
        "missing": _bad_dir(dirs["qwen2"], tmp / "missing", lambda s: s.pop("model.layers.1.mlp.up_proj.weight")),
        "unexpected": _bad_dir(dirs["qwen2"], tmp / "unexpected",
                               lambda s: s.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)})),
        "shape": _bad_dir(dirs["qwen2"], tmp / "shape", lambda s: s.update(
            {"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 100)})),
    }
    return _run(tmp / "run", 1, {"ws1": {}}, dirs, bad)["ws1"], tmp / "run" / "ws1"


def test_llama_and_qwen2_logits_match_transformers_at_world_size_1(hf_dirs, ws1):
    _, expected = hf_dirs
    result, _ = ws1
    for name in ("llama", "llama_bin", "qwen2"):
        ours = np.asarray(result["logits"][name])
        assert ours.shape == expected[name].shape == (2, SEQ, VOCAB), name
        np.testing.assert_allclose(ours, expected[name], atol=TOL, rtol=0, err_msg=name)


def test_tp2_logits_and_pp2_parameters_match(hf_dirs, ws1, tmp_path):
    dirs, expected = hf_dirs
    models = {"llama": dirs["llama"], "qwen2": dirs["qwen2"]}
    layouts = {"tp2": {"tensor_model_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2}}
    result = _run(tmp_path / "run", 2, layouts, models)
    for name in models:
        np.testing.assert_allclose(np.asarray(result["tp2"]["logits"][name]), expected[name], atol=TOL, rtol=0,
                                   err_msg=name)

    # PP=2: one layer per stage; qwen2 is tied, so the last stage holds its own copy of the embedding.
    _, ws1_dir = ws1
    for name in models:
        ref, pp = _params(ws1_dir, name), _params(tmp_path / "run" / "pp2", name)
        if name == "qwen2":
            assert "output_layer.weight" not in ref
            torch.testing.assert_close(pp.pop("output_layer.weight"), ref["embedding.word_embeddings.weight"])
        assert sorted(pp) == sorted(ref), name
        for key in ref:
            torch.testing.assert_close(pp[key], ref[key], rtol=0, atol=0, msg=f"{name}: {key}")


def test_bad_weights_give_clear_errors(ws1):
    errors = ws1[0]["errors"]
    assert "HFConversionError" in errors["missing"] and "missing HF tensors" in errors["missing"]
    assert "layers.1.mlp.up_proj.weight" in errors["missing"]
    assert "unexpected HF tensors" in errors["unexpected"]
    assert "model.layers.0.self_attn.extra.weight" in errors["unexpected"]
    assert "model.layers.0.mlp.down_proj.weight has shape (64, 100), expected (64, 128)" in errors["shape"]


def test_config_conversion(hf_dirs):
    dirs, _ = hf_dirs
    base = ModelConfig(seq_length=256, attention_backend="local", make_vocab_size_divisible_by=64)
    llama, vocab = hf.model_config_from_hf(dirs["llama"], base)
    assert vocab == VOCAB == llama.vocab_size
    assert (llama.num_layers, llama.hidden_size, llama.num_attention_heads, llama.num_query_groups,
            llama.ffn_hidden_size) == (2, 64, 4, 2, 128)
    assert (llama.rotary_base, llama.norm_epsilon, llama.seq_length, llama.attention_backend) == (
        50000.0, 1e-6, 256, "local")
    assert not llama.add_qkv_bias and not llama.add_bias_linear and not llama.share_embeddings_and_output_weights
    assert llama.make_vocab_size_divisible_by == 64
    qwen, _ = hf.model_config_from_hf(dirs["qwen2"], base)
    assert qwen.add_qkv_bias and not qwen.add_bias_linear and qwen.share_embeddings_and_output_weights


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported; supported: llama, qwen2"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
         "RoPE scaling 'llama3'"),
        ({"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
         "RoPE scaling 'linear'"),
        ({"head_dim": 32}, "head_dim=32"),
        ({"attention_bias": True}, "attention_bias=True with mlp_bias=False"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
    ids=["model_type", "rope_llama3", "rope_linear", "head_dim", "attention_bias", "act"],
)
def test_unsupported_configs_are_rejected(hf_dirs, tmp_path, edit, message):
    dirs, _ = hf_dirs
    cfg = json.loads((Path(dirs["llama"]) / "config.json").read_text())
    cfg.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf.HFConversionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hf.model_config_from_hf(tmp_path, ModelConfig())


def test_qwen2_sliding_window_is_rejected(hf_dirs, tmp_path):
    dirs, _ = hf_dirs
    cfg = json.loads((Path(dirs["qwen2"]) / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf.HFConversionError, match="sliding-window"):
        hf.model_config_from_hf(tmp_path, ModelConfig())
