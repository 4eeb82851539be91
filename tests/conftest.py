"""Shared test set-up: no telemetry, GPU tests skipped without CUDA, helpers to run torchrun jobs."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """One tiny SFT policy and reward model (real torchrun jobs on the demo data), shared by the test files that need
    trained checkpoints: {"tokenizer", "sft_data", "pref", "prompts", "sft", "rm"}."""
    from jobs import make_pref_data, make_prompts, make_sft_data, run_rm, run_sft, sft_job

    root = tmp_path_factory.mktemp("tiny_models")
    data = make_sft_data(root / "data")
    pref = make_pref_data(root / "data", data["tokenizer"])
    prompts = make_prompts(root / "data", data["tokenizer"])
    sft = run_sft(sft_job(data, root / "sft", training={"train_steps": 30, "global_batch_size": 16}))
    rm = run_rm(pref, data["tokenizer"], sft["model_dir"], root / "rm")
    return {"tokenizer": data["tokenizer"], "sft_data": data, "pref": pref, "prompts": prompts,
            "sft": sft["model_dir"], "rm": rm["model_dir"]}
