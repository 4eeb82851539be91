"""SteerLM-style regression reward model: multi-attribute labels with missing values, through the real entry point."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from jobs import RAW, TINY_MODEL

from align_pipeline.config import LaunchConfig, RewardModelConfig, RewardModelJob, TrainingConfig, TrainPaths, to_dict
from align_pipeline.data import demo_task
from align_pipeline.data.formats import save_npz
from align_pipeline.data.schemas import DataValidationError, read_raw_jsonl
from align_pipeline.data.tokenize import DataPrepConfig, encode, split_encoded
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.launch import run_torchrun

pytestmark = pytest.mark.slow


def _steerlm_records(n: int) -> list[dict]:
    rng = random.Random(0)
    sft = [json.loads(line) for line in (RAW / "sft.jsonl").read_text().splitlines()][:n]
    out = []
    for rec in sft:
        labels = {"correctness": float(demo_task.check(rec["input"], rec["output"])),
                  "length": len(rec["output"]) / 6.0}
        if rng.random() < 0.3:
            labels[rng.choice(sorted(labels))] = None  # a missing label: masked out of the loss
        out.append({"prompt": rec["input"], "response": rec["output"], "labels": labels})
    return out


def test_bad_regression_label_names_file_line_and_field(tmp_path):
    path = tmp_path / "rm.jsonl"
    path.write_text(json.dumps({"prompt": "p", "response": "r", "labels": {"helpfulness": "high"}}) + "\n")
    with pytest.raises(DataValidationError, match=r'rm.jsonl line 1: field "labels.helpfulness": expected a number'):
        read_raw_jsonl(path, "regression")


def test_regression_reward_model_learns_with_missing_labels(tiny_models, tmp_path):
    data, policy = tiny_models["sft_data"], tiny_models["sft"]
    raw_path = tmp_path / "regression.jsonl"
    raw_path.write_text("".join(json.dumps(r) + "\n" for r in _steerlm_records(1200)))
    raw = read_raw_jsonl(raw_path, "regression")
    tok = load_tokenizer(data["tokenizer"])
    enc = encode(raw, tok, TINY_MODEL.seq_length)
    assert enc.attributes == ["correctness", "length"] and np.isnan(enc.arrays["reward_labels"]).any()
    paths = {}
    for split, bundle in split_encoded(enc, raw, tok, DataPrepConfig(), TINY_MODEL.seq_length).items():
        paths[split] = str(tmp_path / f"rm_{split}.npz")
        save_npz(paths[split], bundle.arrays, bundle.meta)
    run_dir = tmp_path / "rm_run"
    run_dir.mkdir()
    job = RewardModelJob(
        reward_model=RewardModelConfig(
            loss="regression", pooling="mean",
            training=TrainingConfig(train_steps=60, global_batch_size=16, micro_batch_size=16, log_interval=10,
                                    eval_interval=0, save_interval=0)),
        model=TINY_MODEL, paths=TrainPaths(run_dir=str(run_dir), train_data=paths["train"], val_data=paths["val"],
                                           tokenizer=data["tokenizer"], init_from=policy),
    )
    result = run_torchrun("align_pipeline.train.reward_model", to_dict(job), LaunchConfig(), run_dir)
    first = result["history"][0]["loss"]
    assert result["val_loss"] < 0.7 * first, (first, result["val_loss"])  # seen: 0.269 -> 0.139
    meta = json.loads((Path(result["model_dir"]) / "meta.json").read_text())
    assert meta["head"] == "value" and meta["num_outputs"] == 2 and meta["reward_head"]["loss"] == "regression"
