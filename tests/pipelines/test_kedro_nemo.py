"""A NeMo-Aligner user's first run: ``init_from`` and ``data_prep.tokenizer.hf_model_dir`` name a ``.nemo`` (its
tokenizer a SentencePiece model inside the archive); data_prep and SFT run through a real KedroSession, the policy
starts from the archive's weights and its lineage names the archive."""

from __future__ import annotations

import json

import pytest
import yaml
from hf_models import _tiny
from nemo_models import write_nemo
from projects import copy_project, enter_project, run_kedro

pytestmark = pytest.mark.slow


@pytest.fixture
def project(tmp_path, monkeypatch):
    import sentencepiece as spm

    root = copy_project(tmp_path / "proj", raw=False)
    raw = root / "data" / "01_raw"
    raw.mkdir(parents=True)
    words = [f"w{i}" for i in range(40)]
    sft = [{"input": " ".join(words[i % 30: i % 30 + 4]), "output": " ".join(words[i % 30 + 4: i % 30 + 6])}
           for i in range(64)]
    (raw / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    pref = [{"prompt": r["input"], "chosen_response": r["output"], "rejected_response": "w1"} for r in sft]
    (raw / "preference.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pref))
    (raw / "prompts.jsonl").write_text("".join(json.dumps({"prompt": r["input"], "answer": r["output"]}) + "\n"
                                               for r in sft[:16]))
    corpus = [" ".join(words[i: i + 6]) for i in range(34)] * 4
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_prefix=str(tmp_path / "spm"),
                                   vocab_size=90, model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                   hard_vocab_limit=False, minloglevel=2)
    model = _tiny("llama", tie_word_embeddings=True)
    nemo = write_nemo(tmp_path / "policy.nemo", model,
                      {"library": "sentencepiece", "type": None, "model": "nemo:tokenizer.model"},
                      {"tokenizer.model": tmp_path / "spm.model"}, dtype=__import__("torch").bfloat16)
    monkeypatch.setenv("ALIGN_PIPELINE_CACHE", str(tmp_path / "cache"))
    params = {
        "model": {"seq_length": 32},
        "data_prep": {"tokenizer": {"hf_model_dir": str(nemo)}},
        "sft": {"init_from": str(nemo), "training": {"train_steps": 2, "global_batch_size": 8, "micro_batch_size": 4,
                                                     "log_interval": 1, "eval_interval": 0, "eval_samples": 8,
                                                     "save_interval": 0}},
    }
    (root / "conf" / "test" / "parameters_nemo.yml").write_text(yaml.safe_dump(params))
    return enter_project(monkeypatch, root, "test-nemo"), nemo


def test_sft_from_a_nemo_with_its_sentencepiece_tokenizer(project):
    from align_pipeline.data.formats import checkpoint_meta
    from align_pipeline.data.tokenizer import load_tokenizer

    root, nemo = project
    outputs = run_kedro(root, "data_prep", "sft")
    tok = load_tokenizer(root / "data" / "03_primary" / "tokenizer")
    assert tok.encode("w3 w4") and tok.bos_id == 1 and tok.eos_id == 2  # the archive's SentencePiece model
    (version,) = sorted((root / "data" / "06_models" / "sft_policy").iterdir())
    meta = checkpoint_meta(version / "sft_policy")
    parent = meta["lineage"]["parent"]
    assert parent["kind"] == "nemo" and parent["path"] == str(nemo) and meta["step"] == 2
    assert meta["model"]["num_layers"] == 2 and meta["model"]["num_query_groups"] == 2
    assert outputs["sft_metrics"].load()["first_train_loss"] > 0
