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
from hf_models import LLAMA3_ROPE, VOCAB, tiny_family_models

from align_pipeline.config import LaunchConfig, ModelConfig
from align_pipeline.launch import run_torchrun
from align_pipeline.model import hf

pytestmark = pytest.mark.slow  # launches torchrun jobs or a KedroSession

TESTS = Path(__file__).resolve().parents[1]
SEQ = 12
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, SEQ)).tolist()
TOL = 1e-4


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    models = tiny_family_models()
    dirs = {name: root / name for name in models}
    for name, model in models.items():
        # the Llama-2 style one as sharded safetensors + index json
        model.save_pretrained(dirs[name], **({"max_shard_size": "40KB"} if name == "llama" else {}))
    dirs["llama_bin"] = root / "llama_bin"
    dirs["llama_bin"].mkdir()
    shutil.copy(dirs["llama"] / "config.json", dirs["llama_bin"])
    torch.save({k: v.contiguous() for k, v in models["llama"].state_dict().items()},
               dirs["llama_bin"] / "pytorch_model.bin")
    logits = {name: _hf_logits(model) for name, model in models.items()}
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


def test_every_family_matches_transformers_at_world_size_1(hf_dirs, ws1):
    _, expected = hf_dirs
    result, _ = ws1
    assert sorted(result["logits"]) == sorted(expected)
    for name in expected:
        ours = np.asarray(result["logits"][name])
        assert ours.shape == expected[name].shape == (2, SEQ, VOCAB), name
        np.testing.assert_allclose(ours, expected[name], atol=TOL, rtol=0, err_msg=name)


def test_tp2_logits_and_pp2_parameters_match(hf_dirs, ws1, tmp_path):
    dirs, expected = hf_dirs
    models = {name: d for name, d in dirs.items() if name != "llama_bin"}
    layouts = {"tp2": {"tensor_model_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2}}
    result = _run(tmp_path / "run", 2, layouts, models)
    for name in models:
        np.testing.assert_allclose(np.asarray(result["tp2"]["logits"][name]), expected[name], atol=TOL, rtol=0,
                                   err_msg=name)

    # PP=2: one layer per stage; with tied embeddings the last stage holds its own copy of the embedding.
    _, ws1_dir = ws1
    for name in models:
        ref, pp = _params(ws1_dir, name), _params(tmp_path / "run" / "pp2", name)
        if json.loads((Path(models[name]) / "config.json").read_text())["tie_word_embeddings"]:
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
    llama3, _ = hf.model_config_from_hf(dirs["llama3"], base)
    assert (llama3.rope_scaling, llama3.rope_scaling_factor, llama3.rope_low_freq_factor, llama3.rope_high_freq_factor,
            llama3.rope_original_max_position, llama3.hf_family) == ("llama3", 4.0, 1.0, 4.0, 16, "llama")
    qwen3, _ = hf.model_config_from_hf(dirs["qwen3"], base)
    assert (qwen3.kv_channels, qwen3.qk_layernorm, qwen3.add_qkv_bias, qwen3.hf_family) == (32, True, False, "qwen3")
    mistral, _ = hf.model_config_from_hf(dirs["mistral"], ModelConfig(seq_length=64))
    assert (mistral.kv_channels, mistral.sliding_window, mistral.qk_layernorm) == (32, 64, False)


def test_llama3_inverse_frequencies_equal_transformers():
    """Our RoPE frequencies (model.rope) against transformers' own init functions, for the real Llama 3.1 constants
    and for the short-context test ones."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from align_pipeline.model import rope

    real = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for params, context in ((real, 131072), (LLAMA3_ROPE, 64), ({"rope_type": "linear", "rope_theta": 1e4,
                                                                  "factor": 2.0}, 64)):
        config = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_parameters=dict(params),
                             max_position_embeddings=context)
        theirs, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
        ours_cfg = ModelConfig(hidden_size=2048, num_attention_heads=32, rotary_base=params["rope_theta"],
                               rope_scaling=params["rope_type"], rope_scaling_factor=params["factor"],
                               **({} if params["rope_type"] == "linear" else {
                                   "rope_low_freq_factor": params["low_freq_factor"],
                                   "rope_high_freq_factor": params["high_freq_factor"],
                                   "rope_original_max_position": params["original_max_position_embeddings"]}))
        torch.testing.assert_close(rope.inv_freq(ours_cfg), theirs.float(), rtol=1e-6, atol=0)
    # the scaling changes something: low frequencies / factor, high ones kept
    plain = rope.inv_freq(ModelConfig(hidden_size=2048, num_attention_heads=32, rotary_base=500000.0))
    scaled = rope.inv_freq(ModelConfig(hidden_size=2048, num_attention_heads=32, rotary_base=500000.0,
                                       rope_scaling="llama3", rope_scaling_factor=8.0))
    assert scaled[0] == plain[0] and torch.isclose(scaled[-1], plain[-1] / 8)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"model_type": "gemma"}, "model_type 'gemma' is not supported; supported: llama, qwen2, qwen3, mistral"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}}, "RoPE scaling 'yarn'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
         "RoPE scaling 'llama3' needs 'low_freq_factor'"),
        ({"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
         "RoPE scaling 'dynamic'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"attention_bias": True}, "attention_bias=True with mlp_bias=False"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "mistral", "sliding_window": 16}, "sliding_window=16 is shorter than model.seq_length=64"),
    ],
    ids=["model_type", "rope_yarn", "rope_llama3_incomplete", "rope_dynamic", "partial_rotary", "attention_bias",
         "act", "short_window"],
)
def test_unsupported_configs_are_rejected(hf_dirs, tmp_path, edit, message):
    dirs, _ = hf_dirs
    cfg = json.loads((Path(dirs["llama"]) / "config.json").read_text())
    cfg.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf.HFConversionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hf.model_config_from_hf(tmp_path, ModelConfig())


def test_qwen2_sliding_window_shorter_than_seq_length_is_rejected(hf_dirs, tmp_path):
    dirs, _ = hf_dirs
    cfg = json.loads((Path(dirs["qwen2"]) / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf.HFConversionError, match="sliding_window=16 is shorter"):
        hf.model_config_from_hf(tmp_path, ModelConfig())
    assert hf.model_config_from_hf(tmp_path, ModelConfig(seq_length=16))[0].sliding_window == 16
