"""A NeMo-Aligner user's first run: ``init_from`` and ``data_prep.tokenizer.hf_model_dir`` name a ``.nemo`` (its
tokenizer a SentencePiece model inside the archive); data_prep and SFT run through a real KedroSession, the policy
starts from the archive's weights and its lineage names the archive. A ``.nemo`` the conversion refuses (no weights)
is one line naming the file and the problem, through a KedroSession and the ``kedro`` CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

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


def test_a_nemo_without_weights_is_refused_in_one_line(tmp_path, monkeypatch):
    """``params:sft.init_from`` names a ``.nemo`` tar without ``model_weights/``: the conversion job's own message
    (file, what is wrong) and its log, one line, as the session's ConfigError and as the CLI's one ``Error`` line
    (exit code 2), with no traceback (the job's nor Python's) and nothing trained."""
    import shutil

    from align_pipeline.config import ConfigError

    hub_tokenizer = {"library": "huggingface", "type": "meta-llama/Llama-3.2-1B"}  # no files: noted, not refused
    stage = write_nemo(tmp_path / "stage", _tiny("llama"), hub_tokenizer, {}, directory=True)
    shutil.rmtree(stage / "model_weights")
    nemo = tmp_path / "noweights.nemo"
    with tarfile.open(nemo, "w:") as tar:
        tar.add(stage, arcname=".")
    root = copy_project(tmp_path / "proj", params={"test/nemo": {"sft": {"init_from": str(nemo)}}})
    monkeypatch.setenv("ALIGN_PIPELINE_CACHE", str(tmp_path / "cache"))
    enter_project(monkeypatch, root, "test-nemo-refused")
    want = f"params:sft.init_from={nemo}: no model_weights/ (a .nemo without weights) (conversion log: "

    with pytest.raises(ConfigError) as excinfo:
        run_kedro(root, "sft")
    message = str(excinfo.value)
    assert message.startswith(want) and message.endswith("/job/logs/rank0.log)") and "\n" not in message, message
    log = Path(message[len(want):-1])
    assert log.read_text().strip() == f"NemoConversionError: {nemo}: no model_weights/ (a .nemo without weights)"
    assert not (root / "data" / "06_models").exists()

    env = {**os.environ, "COLUMNS": "200"}
    env.pop("ALIGN_TRACEBACK", None)
    done = subprocess.run([sys.executable, "-c", "from kedro.framework.cli import main; main()", "run", "--env",
                           "test", "--pipelines", "sft"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    out = done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error")]
    assert done.returncode == 2 and len(errors) == 1 and want in errors[0], out
    assert "Traceback" not in out and "╭" not in out, out
