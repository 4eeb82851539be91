"""A training stage with LoRA adapters (``sft.lora``), real Megatron-core SFT jobs on gloo: starting from a trained
base, only the adapters train (the held-out loss falls), the stored model is the adapters alone, merged into the base
by every reader (or stored merged), TP=2 reproduces TP=1, and an interrupted run resumes bit-exactly (its checkpoints hold the adapters).
DPO with LoRA and the reference being the policy with its adapters off equals DPO against a frozen copy of the
reference in memory."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from jobs import assert_close, losses, make_pref_data, make_sft_data, run_dpo, run_sft, sft_job

from align_pipeline.config import LaunchConfig
from align_pipeline.data.store import load_rows
from align_pipeline.launch import run_torchrun

pytestmark = pytest.mark.slow
LORA = {"rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_sft_data(tmp_path_factory.mktemp("lora_data"))


@pytest.fixture(scope="module")
def base(data, tmp_path_factory):
    """A fully fine-tuned tiny policy: the adapters' base."""
    return run_sft(sft_job(data, tmp_path_factory.mktemp("base") / "run"), nproc=1)


@pytest.fixture(scope="module")
def straight(data, base, tmp_path_factory):
    return run_sft(sft_job(data, tmp_path_factory.mktemp("lora") / "run", init_from=base["model_dir"], lora=LORA))


def _logits(checkpoint: str, run_dir: Path, tokens, tp: int = 1) -> np.ndarray:
    run_dir.mkdir(parents=True)
    result = run_torchrun("align_pipeline.train.jobs.logits",
                          {"checkpoint": checkpoint, "parallel": {"tensor_model_parallel_size": tp}, "tokens": tokens},
                          LaunchConfig(nproc_per_node=tp), run_dir)
    return np.asarray(result["logits"])


def test_lora_sft_trains_the_adapters_and_stores_them_alone(data, base, straight, tmp_path):
    """The stored model is the adapters and the base's path (small); every reader merges them into the base on load:
    the same logits as the stage stored merged (``lora.store: merged``), at TP=1 and TP=2 (the adapters sliced like
    the weights, a gated fc1's [gate; up] rows too)."""
    assert len(losses(straight)) == 6
    assert straight["val_loss"] < base["val_loss"] - 0.02  # the adapters improve on their base (3.37 vs 3.40)
    meta = json.loads((Path(straight["model_dir"]) / "meta.json").read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "merged": False, "storage": "adapters",
                            "adapters": "adapters", "base": base["model_dir"],
                            "target_modules": ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]}
    size = sum(f.stat().st_size for f in Path(straight["model_dir"]).rglob("*") if f.is_file())
    base_size = sum(f.stat().st_size for f in Path(base["model_dir"]).rglob("*") if f.is_file())
    assert size < base_size / 2  # tiny model: rank 4 is a large share of it; the 1B figures are in docs/benchmarks.md
    merged_run = run_sft(sft_job(data, tmp_path / "merged_run", init_from=base["model_dir"],
                                 lora={**LORA, "store": "merged"}))
    assert losses(merged_run) == losses(straight)
    assert json.loads((Path(merged_run["model_dir"]) / "meta.json").read_text())["lora"]["storage"] == "merged"
    tokens = load_rows(data["val"])["input_ids"][:2].tolist()
    stored_merged = _logits(merged_run["model_dir"], tmp_path / "l_merged", tokens)
    for tp in (1, 2):
        on_load = _logits(straight["model_dir"], tmp_path / f"l_adapters_tp{tp}", tokens, tp=tp)
        assert np.abs(on_load - stored_merged).max() < 1e-5, tp
    before = _logits(base["model_dir"], tmp_path / "base", tokens)
    assert np.abs(stored_merged - before).max() > 1e-3  # and it is not the base any more


def test_lora_tp2_equals_tp1(data, base, straight, tmp_path):
    tp2 = run_sft(sft_job(data, tmp_path / "tp2", init_from=base["model_dir"], lora=LORA,
                          parallel={"tensor_model_parallel_size": 2, "sequence_parallel": True}), nproc=2)
    assert_close(losses(tp2), losses(straight), tol=2e-5)
    assert abs(tp2["val_loss"] - straight["val_loss"]) < 2e-5
    # the adapters saved at TP=2 are the TP=1 ones, in the same (whole-tensor) layout: gated fc1's B too; and the HF
    # exports (base + adapters merged layer by layer while writing) are the same model
    from safetensors.numpy import load_file

    from align_pipeline.model.hf_export import export_hf, export_peft

    for export, name, filename in ((export_peft, "peft", "adapter_model.safetensors"),
                                   (export_hf, "hf", "model.safetensors")):
        tensors = {}
        for layout, run in (("tp1", straight), ("tp2", tp2)):
            export(run["model_dir"], tmp_path / f"{name}_{layout}")
            tensors[layout] = load_file(str(tmp_path / f"{name}_{layout}" / filename))
        assert tensors["tp1"].keys() == tensors["tp2"].keys(), name
        for key, value in tensors["tp1"].items():
            assert np.abs(value - tensors["tp2"][key]).max() < 1e-4, (name, key)


def test_lora_resume_is_exact(data, base, straight, tmp_path):
    run_dir = tmp_path / "interrupted"
    first = run_sft(sft_job(data, run_dir, init_from=base["model_dir"], lora=LORA, stop_after=3))
    assert first["stopped_at_step"] == 3 and losses(first) == losses(straight)[:3]
    ckpt = json.loads((run_dir / "checkpoints" / "iter_0000003" / "meta.json").read_text())
    assert ckpt["lora"]["merged"] is False  # the training checkpoint keeps base and adapters apart
    resumed = run_sft(sft_job(data, run_dir, init_from=base["model_dir"], lora=LORA))
    assert [h["step"] for h in resumed["history"]] == [4, 5, 6]
    assert losses(resumed) == losses(straight)[3:]  # bit-exact
    assert resumed["val_loss"] == straight["val_loss"]


def test_lora_at_dp2_loads_its_base_and_equals_dp1(data, base, straight, tmp_path):
    """Two data-parallel ranks load the base into adapted linears (each adapter's sharded tensors count the DP group
    in their replica ids: before, both ranks claimed the main replica and the load was refused) and train as one."""
    dp2 = run_sft(sft_job(data, tmp_path / "dp2", init_from=base["model_dir"], lora=LORA), nproc=2)
    assert_close(losses(dp2), losses(straight), tol=1e-5)


def test_lora_dpo_reference_with_adapters_off_equals_a_frozen_copy(data, base, tmp_path):
    """``dpo.reference: online`` with adapters: the reference is the policy itself with its adapters off (no second
    model); the same base copied elsewhere is loaded as a separate frozen reference. Same losses and accuracies at
    every step; at step 1 the adapters are zero, so policy == reference and the DPO loss is -log sigmoid(0) = ln 2."""
    pref = make_pref_data(tmp_path / "pref", data["tokenizer"])
    copy = tmp_path / "reference_copy"
    shutil.copytree(base["model_dir"], copy)
    off = run_dpo(pref, data["tokenizer"], base["model_dir"], tmp_path / "off", lora=LORA, reference="online")
    frozen = run_dpo(pref, data["tokenizer"], base["model_dir"], tmp_path / "frozen", lora=LORA, reference="online",
                     reference_model=str(copy))
    assert "adapters off" in (tmp_path / "off" / "logs" / "rank0.log").read_text()
    assert "a frozen copy" in (tmp_path / "frozen" / "logs" / "rank0.log").read_text()
    assert abs(off["history"][0]["loss"] - math.log(2)) < 1e-6
    assert_close(losses(off), losses(frozen), tol=1e-5)
    for key in ("val_loss", "val_rewards/accuracies", "val_rewards/margins"):
        assert abs(off[key] - frozen[key]) < 1e-6, key
    assert off["val_loss"] < math.log(2) and off["val_rewards/margins"] > 0  # the adapters moved off the reference


def test_peft_export_of_the_adapters_loads_onto_the_exported_base(data, base, straight, tmp_path):
    """The stage's adapters (``adapters/`` beside the merged model) as a PEFT adapter: ``peft`` loads it onto the HF
    export of the base, and that model's logits equal our merged checkpoint's (fp32, 1e-4)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from align_pipeline.model.hf_export import export_hf, export_peft

    export_hf(base["model_dir"], tmp_path / "base_hf")
    summary = export_peft(straight["model_dir"], tmp_path / "peft", base_model=tmp_path / "base_hf")
    assert sorted(summary["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                 "v_proj"]
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base_hf",
                                                                        dtype=torch.float32), tmp_path / "peft")
    tokens = load_rows(data["val"])["input_ids"][:2].tolist()
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    ours = _logits(straight["model_dir"], tmp_path / "ours", tokens)[..., : theirs.shape[-1]]
    assert np.abs(ours - theirs).max() < 1e-4
    plain = _logits(base["model_dir"], tmp_path / "plain", tokens)[..., : theirs.shape[-1]]
    assert np.abs(plain - theirs).max() > 1e-3  # the adapters are applied, not ignored
    # the artifact as a merged HF directory (materialised first: base + adapters) gives the same logits
    export_hf(straight["model_dir"], tmp_path / "merged_hf")
    merged_hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged_hf", dtype=torch.float32)
    with torch.no_grad():
        assert np.abs(merged_hf(torch.tensor(tokens)).logits.numpy() - ours).max() < 1e-4
