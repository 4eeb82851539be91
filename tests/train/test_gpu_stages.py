"""SFT -> reward model -> reference log-probs -> DPO -> evaluation on one GPU with NCCL (skipped without CUDA).

The same entry points and node functions `kedro run` uses, without Kedro (the GPU image needs no Kedro/MLflow).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from jobs import RAW, TINY_MODEL, make_pref_data, make_sft_data, run_sft, sft_job

from align_pipeline.config import (
    DPOConfig,
    DPOJob,
    DPOPaths,
    LaunchConfig,
    OptimizerConfig,
    ParallelConfig,
    PreferenceLossConfig,
    RewardModelConfig,
    RewardModelJob,
    TrainingConfig,
    TrainPaths,
    to_dict,
)
from align_pipeline.data.formats import Artifact, load_artifact, save_jsonl
from align_pipeline.data.schemas import read_raw_jsonl
from align_pipeline.data.tokenize import encode
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.launch import run_torchrun
from align_pipeline.pipelines.dpo.nodes import compute_reference_logps
from align_pipeline.pipelines.evaluation.nodes import evaluate_policies

pytestmark = pytest.mark.gpu


def test_all_stages_one_gpu(tmp_path):
    timings = {}
    t = time.perf_counter()
    data = make_sft_data(tmp_path / "sft_data")
    pref = make_pref_data(tmp_path / "pref", data["tokenizer"])
    parallel = ParallelConfig(bf16=True)
    training = TrainingConfig(train_steps=40, global_batch_size=64, micro_batch_size=64, log_interval=10,
                              eval_interval=0, eval_samples=128, save_interval=0,
                              optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=5))
    sft = run_sft(sft_job(data, tmp_path / "sft", parallel={"bf16": True}, training={
        "train_steps": 200, "global_batch_size": 64, "micro_batch_size": 64, "log_interval": 50, "eval_interval": 0}))
    timings["sft_s"] = time.perf_counter() - t

    t = time.perf_counter()
    rm_dir = tmp_path / "rm"
    rm_dir.mkdir()
    rm = run_torchrun("align_pipeline.train.reward_model", to_dict(RewardModelJob(
        reward_model=RewardModelConfig(training=training), model=TINY_MODEL, parallel=parallel,
        paths=TrainPaths(run_dir=str(rm_dir), train_data=pref["train"], val_data=pref["val"],
                         tokenizer=data["tokenizer"], init_from=sft["model_dir"]))), LaunchConfig(), rm_dir)
    timings["reward_model_s"] = time.perf_counter() - t

    t = time.perf_counter()
    tok = Artifact(data["tokenizer"], load_tokenizer(data["tokenizer"]).fingerprint)
    ref = compute_reference_logps(sft["model_dir"], tok, load_artifact(pref["train"]), load_artifact(pref["val"]),
                                  parallel={"bf16": True}, launch={},
                                  dpo={"reference_cache_dir": str(tmp_path / "cache"), "runs_dir": str(tmp_path)})
    timings["reference_logps_s"] = time.perf_counter() - t

    t = time.perf_counter()
    dpo_dir = tmp_path / "dpo"
    dpo_dir.mkdir()
    dpo = run_torchrun("align_pipeline.train.dpo", to_dict(DPOJob(
        dpo=DPOConfig(training=training, loss=PreferenceLossConfig(sft_weight=1.0)), model=TINY_MODEL,
        parallel=parallel, paths=DPOPaths(run_dir=str(dpo_dir), train_data=pref["train"], val_data=pref["val"],
                                          tokenizer=data["tokenizer"], init_from=sft["model_dir"],
                                          reference_logps=ref.path))), LaunchConfig(), dpo_dir)
    timings["dpo_s"] = time.perf_counter() - t

    t = time.perf_counter()
    prompts = tmp_path / "prompts_val.jsonl"


    enc = encode(read_raw_jsonl(RAW / "prompts.jsonl", "prompts"), load_tokenizer(data["tokenizer"]), 48)
    save_jsonl(prompts, enc.records[:200], {"source": "test"})
    report_dir, metrics = evaluate_policies(
        tok, load_artifact(prompts), load_artifact(pref["val"]), load_artifact(data["val"]),
        parallel={}, launch={}, evaluation={"runs_dir": str(tmp_path), "generation": {"samples_per_prompt": 2},
                                            "reward": {"functions": [{"name": "align_pipeline.rewards:demo_task"}]}},
        reward_model=rm["model_dir"], sft_policy=sft["model_dir"], dpo_policy=dpo["model_dir"])
    timings["evaluation_s"] = time.perf_counter() - t
    print("GPU stages:", json.dumps({**timings, **{k: round(v, 4) for k, v in metrics.items()
                                                   if k.endswith(("accuracy", "kl_to_reference"))}}))
    assert (Path(report_dir) / "report.json").is_file()
    assert metrics["sft/kl_to_reference"] == pytest.approx(0.0, abs=1e-3)
    assert 0.0 <= metrics["reward_model/accuracy"] <= 1.0 and "dpo/accuracy" in metrics
