"""Issue 30, item 1: a checkpoint artifact carries the tokenizer it was trained with (``<checkpoint>/tokenizer``,
named by meta.json), and a stage whose data was tokenized with another tokenizer than its input checkpoint stops
before launch with one line naming both fingerprints. The issue's reproduction, in one env: SFT on the demo
tokenizer, then data_prep again with another (HF) tokenizer, then DPO on that SFT policy. A real KedroSession on a temp
copy of the project."""

from __future__ import annotations

import re

import pytest
import yaml
from chat_tokenizers import make_chat_tokenizer_dir
from projects import copy_project, enter_project, run_kedro

from align_pipeline.data.formats import Artifact, check_checkpoint_tokenizers, checkpoint_tokenizer
from align_pipeline.data.schemas import DataValidationError
from align_pipeline.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # launches a KedroSession and a torchrun job

FAST = {
    "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_query_groups": 1,
              "ffn_hidden_size": 64},
    "sft": {"training": {"train_steps": 4, "global_batch_size": 8, "micro_batch_size": 8, "log_interval": 2,
                         "eval_interval": 4, "eval_samples": 16, "save_interval": 4}},
}


def test_a_checkpoint_carries_its_tokenizer_and_a_stage_refuses_data_of_another(tmp_path, monkeypatch):
    root = enter_project(monkeypatch, copy_project(tmp_path / "proj", params={"test/fast": FAST}), "test-own-tok")
    run_kedro(root, "data_prep", "sft")
    (version,) = (root / "data" / "06_models" / "sft_policy").iterdir()
    policy = version / "sft_policy"
    demo = load_tokenizer(root / "data" / "03_primary" / "tokenizer")

    # the artifact's own copy, named relative to it: it survives the move into the catalog and any later data_prep
    own, fingerprint = checkpoint_tokenizer(policy)
    assert own == policy / "tokenizer" and load_tokenizer(own).fingerprint == fingerprint == demo.fingerprint

    # data_prep again, now with another tokenizer: the catalog's tokenizer and data change, the checkpoint's do not
    hf_tok = make_chat_tokenizer_dir(tmp_path / "hf_tok", "chatml")
    (root / "conf" / "test" / "parameters_hf.yml").write_text(yaml.safe_dump(
        {"model": {"seq_length": 256}, "data_prep": {"tokenizer": {"hf_model_dir": str(hf_tok)}}}))
    run_kedro(root, "data_prep")
    other = load_tokenizer(root / "data" / "03_primary" / "tokenizer")
    assert other.fingerprint != demo.fingerprint and load_tokenizer(own).fingerprint == demo.fingerprint

    with pytest.raises(DataValidationError) as info:
        run_kedro(root, "dpo")
    message = str(info.value)
    assert "\n" not in message
    assert re.search(rf"sft_policy \(\S*{version.name}/sft_policy\) was trained with tokenizer {demo.fingerprint}, "
                     rf"but this run's data was tokenized with tokenizer {other.fingerprint} ", message), message
    assert not (root / "data" / "06_models" / "_runs" / "reference_logps").exists()  # nothing launched


def test_checkpoints_without_a_recorded_tokenizer_and_hf_dirs_pass(tmp_path):
    tok = Artifact(path=str(tmp_path / "tok"), fingerprint="aaaa", meta={})
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "meta.json").write_text('{"stage": "sft"}')
    (tmp_path / "same").mkdir()
    (tmp_path / "same" / "meta.json").write_text('{"tokenizer": {"path": "/gone", "fingerprint": "aaaa"}}')
    check_checkpoint_tokenizers(tok, hf=str(tmp_path / "hf"), old=str(tmp_path / "old"), same=str(tmp_path / "same"),
                                none=None)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "meta.json").write_text('{"tokenizer": {"path": "tokenizer", "fingerprint": "bbbb"}}')
    with pytest.raises(DataValidationError, match=r"reward_model \(\S+other\) was trained with tokenizer bbbb, but "
                       r"this run's data was tokenized with tokenizer aaaa"):
        check_checkpoint_tokenizers(tok, sft_policy=str(tmp_path / "same"), reward_model=str(tmp_path / "other"))
