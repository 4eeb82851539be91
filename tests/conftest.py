"""Shared test set-up: no telemetry, GPU tests skipped without CUDA, helpers to run torchrun jobs."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")
# The suite runs two pytest workers (pyproject: -n 2) whose jobs share the cores: the launcher's jobs already wait
# passively (OMP_WAIT_POLICY=PASSIVE, launch/torchrun.py build_env); this process and what it runs without the
# launcher do too. It changes no result, only who burns the CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HEAVY_FIRST = ("pipelines/test_default_run.py", "pipelines/test_kedro_sft.py", "train/test_sft_parallel.py",
               "train/test_rl_stages.py", "model/test_hf_export.py", "pipelines/test_reuse.py")
"""The longest test files (``--durations``), started first so that the two workers end together (``--dist
loadfile`` hands out files in collection order)."""


def pytest_collection_modifyitems(config, items):
    import torch

    def weight(item) -> int:
        path = item.path.as_posix()
        return next((i for i, name in enumerate(HEAVY_FIRST) if path.endswith(name)), len(HEAVY_FIRST))

    items.sort(key=weight)  # stable: the order within a file and among the others is kept
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
    import json

    from filelock import FileLock
    from jobs import make_pref_data, make_prompts, make_sft_data, run_rm, run_sft, sft_job

    # made once for the whole run: under pytest-xdist the workers share the parent of their base temp dirs
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    root, done = shared / "tiny_models", shared / "tiny_models.json"
    with FileLock(str(shared / "tiny_models.lock")):
        if done.is_file():
            return json.loads(done.read_text())
        data = make_sft_data(root / "data")
        pref = make_pref_data(root / "data", data["tokenizer"])
        prompts = make_prompts(root / "data", data["tokenizer"])
        sft = run_sft(sft_job(data, root / "sft", training={"train_steps": 30, "global_batch_size": 16}))
        rm = run_rm(pref, data["tokenizer"], sft["model_dir"], root / "rm")
        models = {"tokenizer": data["tokenizer"], "sft_data": data, "pref": pref, "prompts": prompts,
                  "sft": sft["model_dir"], "rm": rm["model_dir"]}
        done.write_text(json.dumps(models, default=str))
        return json.loads(done.read_text())
