"""The HF path on one GPU (skipped without CUDA): SFT -> an HF export -> SFT and DPO that start from that HF directory
(``init_from: <hf dir>``, as ``-e hf_example`` runs them), bf16 on NCCL. Each job's rank-0 log must be free of the
warnings users reported leaking on this path (``.grad`` of a non-leaf tensor, ``reduce_scatter_tensor`` deprecated),
and training from the HF directory must learn. Every warning line seen is printed (``-s``) for the record."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from jobs import losses, make_pref_data, make_sft_data, run_dpo, run_sft, sft_job

pytestmark = pytest.mark.gpu

REPORTED = re.compile(r"\.grad attribute of a Tensor that is not a leaf|reduce_scatter_tensor is deprecated")
WARNING = re.compile(r"Warning|warn\(", re.IGNORECASE)


def _warnings(run_dir: Path) -> list[str]:
    text = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("rank*.log")))
    return [line for line in text.splitlines() if WARNING.search(line)]


def test_sft_and_dpo_from_an_hf_directory_on_one_gpu_leak_no_reported_warnings(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from align_pipeline.model.hf_export import export_hf

    data = make_sft_data(tmp_path / "data")
    base = run_sft(sft_job(data, tmp_path / "base", training={"train_steps": 20}))
    hf_dir = tmp_path / "base_hf"
    export_hf(base["model_dir"], hf_dir)
    seen: dict[str, list[str]] = {}
    gpu = {"bf16": True, "use_distributed_optimizer": True, "kernels": "auto"}  # conf/gpu's (= hf_example's) settings
    sft = run_sft(sft_job(data, tmp_path / "sft", init_from=str(hf_dir), parallel=gpu, training={"train_steps": 20}))
    seen["sft"] = _warnings(tmp_path / "sft")
    pref = make_pref_data(tmp_path / "pref", data["tokenizer"])
    dpo = run_dpo(pref, data["tokenizer"], str(hf_dir), tmp_path / "dpo", reference_model=str(hf_dir),
                  reference="online", parallel=gpu)
    seen["dpo"] = _warnings(tmp_path / "dpo")
    for stage, lines in seen.items():
        print(f"[{stage}] {len(lines)} warning line(s) in the rank logs:", *lines, sep="\n  ")
    assert losses(sft)[0] < losses(base)[0] - 0.5, (losses(base)[0], losses(sft))  # it starts from the trained model
    assert sft["val_loss"] < losses(sft)[0] and dpo["val_loss"] < 0.6931, (sft["val_loss"], dpo["val_loss"])
    assert not [line for lines in seen.values() for line in lines if "init_process_group" in line]  # device_id given
    reported = {stage: [line for line in lines if REPORTED.search(line)] for stage, lines in seen.items()}
    assert reported == {"sft": [], "dpo": []}, reported
