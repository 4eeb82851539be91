"""NeMo-Aligner migration (model/nemo.py): ``.nemo`` archives in NeMo 1.x's layout, written by the tests from tiny
transformers models (tests/nemo_models.py), convert to HF directories whose logits equal the source model's
(torch_dist and zarr weights, GQA, QKV biases, tied and untied heads, padded vocabularies, HF and SentencePiece
tokenizers inside the archive, linear and Llama 3.1 RoPE scaling); what does not map, or is not safe, is refused
naming the key or member."""

from __future__ import annotations

import json
import tarfile

import pytest
import torch
from hf_models import LLAMA3_ROPE, VOCAB, _tiny
from nemo_models import add_member, nemo_tensors, write_nemo

from align_pipeline.model.nemo import NemoConversionError, convert, hf_dir_for, is_nemo


def word_tokenizer(path, size: int = VOCAB):
    """An HF tokenizer of exactly ``size`` tokens (one word per id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(path))
    return path


def spm_model(path):
    import sentencepiece as spm

    words = [f"w{i}" for i in range(200)]
    corpus = [" ".join(words[i: i + 7]) for i in range(0, 190, 3)] * 5
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_prefix=str(path.with_suffix("")),
                                   vocab_size=90, model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                   hard_vocab_limit=False, minloglevel=2)
    return path


def _logits(model, vocab):
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(ids).logits[..., :vocab], ids


def _same_model(source, hf_dir, vocab, rows=None):
    """The converted model has ``rows`` vocabulary rows (default ``vocab``); its logits over the first ``vocab``
    equal the source's."""
    from transformers import AutoModelForCausalLM

    converted = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    want, ids = _logits(source, vocab)
    with torch.no_grad():
        got = converted(ids).logits
    assert got.shape[-1] == (rows or vocab)
    torch.testing.assert_close(got[..., :vocab], want, rtol=0, atol=1e-5)


def test_torch_dist_llama_with_an_hf_tokenizer_inside(tmp_path):
    model = _tiny("llama", rope_theta=50000.0)  # GQA 4 heads / 2 groups, untied head
    tok = word_tokenizer(tmp_path / "tok")
    nemo = write_nemo(tmp_path / "llama.nemo", model, {"library": "huggingface", "type": "nemo:tokenizer"},
                      {"tokenizer": tok})
    assert is_nemo(nemo) and tarfile.is_tarfile(nemo)
    summary = convert(nemo, tmp_path / "hf")
    assert summary["family"] == "llama" and summary["vocab_size"] == VOCAB and summary["tokenizer_note"] is None
    _same_model(model, tmp_path / "hf", VOCAB)  # the 28 junk rows of Megatron's padding are dropped
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf"))("w5 w7")["input_ids"][-2:] == [5, 7]
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_theta"] == 50000.0 and not cfg["tie_word_embeddings"]


def test_zarr_qwen2_tied_with_a_sentencepiece_tokenizer(tmp_path):
    """zarr weights in bf16 (NeMo 1.x's default backend), QKV biases (Qwen2), a tied head, a SentencePiece model
    with fewer pieces than the embedding rows (the rest dropped); an unpacked directory reads the same."""
    import sentencepiece as spm

    model = _tiny("qwen2", tie_word_embeddings=True)
    with torch.no_grad():
        for p in model.parameters():  # exact in bf16 (the RoPE buffers stay fp32)
            p.copy_(p.bfloat16().float())
    sp_file = spm_model(tmp_path / "spm.model")
    size = spm.SentencePieceProcessor(model_file=str(sp_file)).get_piece_size()
    assert size < VOCAB
    section = {"library": "sentencepiece", "type": None, "model": "nemo:tokenizer.model"}
    nemo = write_nemo(tmp_path / "qwen.nemo", model, section, {"tokenizer.model": sp_file}, backend="zarr",
                      dtype=torch.bfloat16)
    summary = convert(nemo, tmp_path / "hf")
    assert summary["family"] == "qwen2" and summary["vocab_size"] == size
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"]
    _same_model(model, tmp_path / "hf", size)
    from tokenizers import Tokenizer

    # tokenizer.json as this project reads it (transformers 5 would rebuild it as a Qwen2Tokenizer in a qwen2 dir)
    hf_tok = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    sp = spm.SentencePieceProcessor(model_file=str(sp_file))
    for text in ("w3 w4 w5", "w100 w17 w2"):
        assert hf_tok.encode(text, add_special_tokens=False).ids == sp.encode(text)
    unpacked = write_nemo(tmp_path / "qwen_dir", model, section, {"tokenizer.model": sp_file}, backend="zarr",
                          dtype=torch.bfloat16, directory=True)
    assert is_nemo(unpacked)
    convert(unpacked, tmp_path / "hf2")
    _same_model(model, tmp_path / "hf2", size)


def test_a_hub_id_tokenizer_is_noted_and_init_from_converts_once(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGN_PIPELINE_CACHE", str(tmp_path / "cache"))
    model = _tiny("llama", tie_word_embeddings=True)
    nemo = write_nemo(tmp_path / "m.nemo", model, {"library": "huggingface", "type": "meta-llama/Llama-3.2-1B"}, {})
    first = hf_dir_for(nemo)
    assert first.parent == tmp_path / "cache" / "nemo"
    note = json.loads((first / "nemo_source.json").read_text())["tokenizer_note"]
    assert "names no files inside the archive" in note and "data_prep.tokenizer.hf_model_dir" in note
    stamp = (first / "config.json").stat().st_mtime_ns
    assert hf_dir_for(nemo) == first and (first / "config.json").stat().st_mtime_ns == stamp  # reused
    _same_model(model, first, VOCAB, rows=128)  # no tokenizer: every (padded) embedding row is kept


HF_TOK = {"library": "huggingface", "type": "nemo:tokenizer"}


@pytest.mark.parametrize("overrides,words", [
    ({"mcore_gpt": False}, "mcore_gpt: absent or false: a legacy"),
    ({"normalization": "layernorm"}, "normalization: 'layernorm': only rmsnorm maps"),
    ({"activation": "gelu"}, "activation: 'gelu'"),
    ({"bias": True}, "bias: True"),
    ({"position_embedding_type": "learned_absolute"}, "position_embedding_type: 'learned_absolute'"),
    ({"rotary_percentage": 0.5}, "rotary_percentage: 0.5: partial RoPE"),
    ({"num_moe_experts": 8}, "num_moe_experts: 8: mixture-of-experts"),
    ({"tokenizer": {"library": "tiktoken"}}, "tokenizer.library: 'tiktoken' is not supported"),
    ({"num_query_groups": 3}, "num_query_groups: 3 does not divide num_attention_heads = 4"),
    ({"window_size": [16, 0]}, "window_size: [16, 0]: sliding-window attention"),
    # the config and the weights disagree
    ({"qkv_bias": True}, "qkv_bias: True but the weights have no linear_qkv.bias"),
    ({"share_embeddings_and_output_weights": True},
     "share_embeddings_and_output_weights: True but model.output_layer.weight is present"),
    ({"kv_channels": 8}, "linear_qkv.weight has rows (128,), not"),
])
def test_what_does_not_map_is_refused_naming_the_key(tmp_path, overrides, words):
    model = _tiny("llama")
    tok = word_tokenizer(tmp_path / "tok")
    section = overrides.pop("tokenizer", HF_TOK)
    nemo = write_nemo(tmp_path / "m.nemo", model, section, {"tokenizer": tok}, overrides=overrides)
    with pytest.raises(NemoConversionError) as exc:
        convert(nemo, tmp_path / "hf")
    assert f"m.nemo: model_config.yaml {words}" in str(exc.value) or ("m.nemo: model.decoder" in str(exc.value)
                                                                     and words in str(exc.value)), str(exc.value)
    assert not (tmp_path / "hf").exists()


ROPE_CASES = {
    # NeMo's model_config.yaml keys -> the HF rope_parameters the converter writes (and the source model uses)
    "linear": ({"seq_len_interpolation_factor": 4},
               {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama3": ({"scale_positional_embedding": True, "scale_factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "old_context_len": 16}, LLAMA3_ROPE),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_scaling_becomes_the_hf_rope_parameters_with_the_same_logits(tmp_path, case):
    """``seq_len_interpolation_factor`` -> linear RoPE scaling, ``scale_positional_embedding`` (+ its factors) ->
    Llama 3.1's: config.json's ``rope_parameters`` say so, and the converted model's logits equal a transformers model
    built with that RoPE (which differ from the same weights with plain RoPE: the scaling is applied, not ignored)."""
    overrides, rope = ROPE_CASES[case]
    model = _tiny("llama", rope_parameters=dict(rope))
    tok = word_tokenizer(tmp_path / "tok")
    convert(write_nemo(tmp_path / "m.nemo", model, HF_TOK, {"tokenizer": tok}, overrides=overrides), tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: cfg["rope_parameters"].get(k) for k in rope} == rope, cfg["rope_parameters"]
    _same_model(model, tmp_path / "hf", VOCAB)
    plain, _ = _logits(_tiny("llama"), VOCAB)  # the same weights (same seed), unscaled RoPE
    scaled, _ = _logits(model, VOCAB)
    assert (plain - scaled).abs().max() > 1e-2


def test_rope_scaling_defaults_and_conflicts(tmp_path):
    """``scale_positional_embedding`` alone takes NeMo's Llama 3.1 factors (8, 1, 4, 8192); with
    ``seq_len_interpolation_factor`` too it is refused naming the key."""
    model = _tiny("llama")
    tok = word_tokenizer(tmp_path / "tok")
    convert(write_nemo(tmp_path / "d.nemo", model, HF_TOK, {"tokenizer": tok},
                       overrides={"scale_positional_embedding": True}), tmp_path / "hf")
    rope = json.loads((tmp_path / "hf" / "config.json").read_text())["rope_parameters"]
    assert {k: rope.get(k) for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                                     "original_max_position_embeddings")} == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    both = write_nemo(tmp_path / "both.nemo", model, HF_TOK, {"tokenizer": tok},
                      overrides={"scale_positional_embedding": True, "seq_len_interpolation_factor": 2})
    with pytest.raises(NemoConversionError, match=r"both\.nemo: model_config\.yaml scale_positional_embedding: "
                                                  "together with seq_len_interpolation_factor"):
        convert(both, tmp_path / "hf_both")
    assert not (tmp_path / "hf_both").exists()


def test_archives_without_weights_or_with_unsafe_members_are_refused(tmp_path):
    model = _tiny("llama")
    tok = word_tokenizer(tmp_path / "tok")
    tensors = nemo_tensors(model)
    cases = {}
    nowts = write_nemo(tmp_path / "nowts_dir", model, HF_TOK, {"tokenizer": tok}, directory=True)
    import shutil

    shutil.rmtree(nowts / "model_weights")
    cases["no weights"] = (nowts, "no model_weights/ (a .nemo without weights)")
    legacy = write_nemo(tmp_path / "legacy_dir", model, HF_TOK, {"tokenizer": tok}, directory=True)
    shutil.rmtree(legacy / "model_weights")
    (legacy / "model_weights.ckpt").write_bytes(b"not read")
    cases["legacy"] = (legacy, "weights in model_weights.ckpt (a torch pickle per rank")
    missing = write_nemo(tmp_path / "missing.nemo", model, HF_TOK, {"tokenizer": tok},
                         tensors={k: v for k, v in tensors.items() if "linear_fc2" not in k})
    cases["missing"] = (missing, "has no tensor model.decoder.layers.mlp.linear_fc2.weight")
    escape = write_nemo(tmp_path / "escape.nemo", model, HF_TOK, {"tokenizer": tok})
    add_member(escape, "../../outside.txt")
    cases["escape"] = (escape, "member '../../outside.txt' points outside the archive")
    link = write_nemo(tmp_path / "link.nemo", model, HF_TOK, {"tokenizer": tok})
    add_member(link, "model_weights/evil", kind=tarfile.SYMTYPE, link="/etc/passwd")
    cases["link"] = (link, "is a link or device file")
    nemo2 = tmp_path / "nemo2"
    (nemo2 / "context").mkdir(parents=True)
    (nemo2 / "weights").mkdir()
    cases["nemo2"] = (nemo2, "a NeMo 2 checkpoint")
    sep = write_nemo(tmp_path / "sep_dir", model, HF_TOK, {"tokenizer": tok}, directory=True, backend="zarr")
    zarray = sep / "model_weights" / "model.decoder.final_layernorm.weight" / ".zarray"
    zarray.write_text(zarray.read_text().replace('"order"', '"dimension_separator": "/../../", "order"'))
    cases["zarr separator"] = (sep, "do not describe an array")
    (tmp_path / "notatar.nemo").write_bytes(b"hello")
    cases["not a tar"] = (tmp_path / "notatar.nemo", "not a .nemo archive")
    for name, (path, words) in cases.items():
        with pytest.raises(NemoConversionError) as exc:
            convert(path, tmp_path / f"hf_{name.replace(' ', '_')}")
        assert words in str(exc.value), (name, str(exc.value))
    assert not (tmp_path / "outside.txt").exists() and not list(tmp_path.glob("hf_*"))


def test_a_crafted_metadata_pickle_runs_nothing(tmp_path):
    """The DCP index of model_weights/ is read by the restricted unpickler: a pickle that calls os.system is
    refused before anything runs."""
    import os
    import pickle

    from align_pipeline.model.safe_pickle import UnsafeCheckpoint

    model = _tiny("llama")
    tok = word_tokenizer(tmp_path / "tok")
    nemo = write_nemo(tmp_path / "evil_dir", model, HF_TOK, {"tokenizer": tok}, directory=True)
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (nemo / "model_weights" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UnsafeCheckpoint, match="refused to unpickle"):
        convert(nemo, tmp_path / "hf")
    assert not marker.exists()


@pytest.mark.slow
def test_cli_import_of_a_nemo_with_check(tmp_path):
    """`align-pipeline import model.nemo CKPT --tp 2 --check`: the Megatron checkpoint's logits equal transformers' on
    the HF conversion; the checkpoint carries the archive's tokenizer and names the .nemo as its parent."""
    import subprocess
    import sys

    from align_pipeline.data.formats import checkpoint_meta

    model = _tiny("llama", rope_theta=50000.0)
    tok = word_tokenizer(tmp_path / "tok")
    nemo = write_nemo(tmp_path / "llama.nemo", model, HF_TOK, {"tokenizer": tok})
    done = subprocess.run([sys.executable, "-m", "align_pipeline", "import", "--json", str(nemo), str(tmp_path / "ckpt"),
                           "--tp", "2", "--seq-length", "32", "--check"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["family"] == "llama" and summary["vocab_size"] == VOCAB and summary["max_abs_logit_diff"] <= 1e-4
    assert summary["nemo"] == str(nemo)
    meta = checkpoint_meta(tmp_path / "ckpt")
    assert meta["lineage"]["parent"] == {"kind": "nemo", "path": str(nemo)}
    assert (tmp_path / "ckpt" / meta["tokenizer"]["path"] / "tokenizer.json").is_file()
    bad = write_nemo(tmp_path / "bad.nemo", model, HF_TOK, {"tokenizer": tok}, overrides={"normalization": "layernorm"})
    refused = subprocess.run([sys.executable, "-m", "align_pipeline", "import", str(bad), str(tmp_path / "ckpt2")],
                             capture_output=True, text=True, check=False)
    assert refused.returncode == 2 and "model_config.yaml normalization: 'layernorm'" in refused.stderr
    assert not (tmp_path / "ckpt2").exists()
