"""LoRA adapters on Megatron's column/row-parallel linears (model/lora.py), real Megatron-core GPTs on gloo: fresh
adapters leave the base model's logits unchanged; only adapters get gradients; TP=2 (with and without sequence
parallelism) gives the same logits, loss and adapter gradients as TP=1 and starts from the same adapters; the adapters
merged into the base weights give a plain model with the same logits."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from align_pipeline.config import ConfigError, LaunchConfig, LoRAConfig
from align_pipeline.launch import run_torchrun

HERE = Path(__file__).resolve().parent


def test_lora_config_is_checked():
    LoRAConfig().validate()  # rank 0: off
    LoRAConfig(rank=8, target_modules=["linear_qkv"]).validate()
    for bad in (LoRAConfig(rank=-1), LoRAConfig(rank=4, alpha=0), LoRAConfig(rank=4, dropout=1.0),
                LoRAConfig(rank=4, target_modules=["q_proj"]), LoRAConfig(rank=4, target_modules=[])):
        with pytest.raises(ConfigError):
            bad.validate("sft.lora")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    out = {}
    for key, parallel in (("tp1", {}), ("tp2", {"tensor_model_parallel_size": 2}),
                          ("tp2_sp", {"tensor_model_parallel_size": 2, "sequence_parallel": True})):
        run_dir = tmp / key
        run_dir.mkdir()
        nproc = parallel.get("tensor_model_parallel_size", 1)
        run_torchrun("lora_worker", {"run_dir": str(run_dir), "parallel": parallel}, LaunchConfig(nproc_per_node=nproc),
                     run_dir, env=env)
        out[key] = json.loads((run_dir / "result.json").read_text())
    return out


@pytest.mark.slow
def test_fresh_adapters_leave_the_base_model_unchanged_and_only_adapters_train(results):
    for key, r in results.items():
        assert r["step0_max_diff"] == 0.0, key  # B = 0: base + 0, exactly
        assert r["merge_max_diff"] < 1e-5, key  # merged into W, a plain model computes the same
        assert r["base_grads"] == [], key  # every base weight frozen
        assert len(r["grads"]) == 2 * 4 * 2  # A and B of 4 linears in 2 layers
        assert all(np.abs(np.asarray(g)).max() > 0 for g in r["grads"].values()), key


@pytest.mark.slow
@pytest.mark.parametrize("key", ["tp2", "tp2_sp"])
def test_tp2_equals_tp1(results, key):
    one, two = results["tp1"], results[key]
    for name in one["init_A"]:  # the same adapters at the start
        np.testing.assert_allclose(two["init_A"][name], one["init_A"][name], rtol=0, atol=0, err_msg=name)
    np.testing.assert_allclose(two["logits"], one["logits"], rtol=0, atol=1e-5)
    assert abs(two["loss"] - one["loss"]) <= 1e-4 * abs(one["loss"])
    for name in one["grads"]:
        np.testing.assert_allclose(two["grads"][name], one["grads"][name], rtol=1e-4, atol=1e-5, err_msg=name)
