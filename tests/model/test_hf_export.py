"""Trained checkpoints leave as HF directories that `transformers` loads with the same logits as our Megatron GPT.

Real SFT jobs (gloo, CPU) train tiny models: a Llama-style one at TP=2 x PP=2 (four ranks) and a Qwen2-style one
(QKV biases, tied embeddings) on one rank. Each is exported by ``export_hf`` in this process (no Megatron model, no
process group); the Megatron logits come from a torchrun worker loading the same checkpoint at TP=1.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from jobs import make_sft_data, run_sft, sft_job

from align_pipeline.model.hf_export import HFExportError, export_hf

pytestmark = pytest.mark.slow  # launches torchrun jobs

TOKENS = [[1, 18, 21, 21, 17, 5, 9, 9, 6, 15, 16, 4, 12, 2], [1, 7, 7, 3, 30, 31, 8, 2, 5, 5, 11, 12, 13, 14]]
TOL = 1e-4


def _megatron_logits(checkpoint: str, run_dir: Path) -> np.ndarray:
    import subprocess
    import sys

    run_dir.mkdir(parents=True)
    cfg = {"run_dir": str(run_dir), "checkpoint": checkpoint, "parallel": {}, "tokens": TOKENS}
    (run_dir / "config.json").write_text(json.dumps(cfg))
    worker = Path(__file__).with_name("logits_worker.py")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", str(worker), "--config",
                    str(run_dir / "config.json")], check=True, capture_output=True)
    return np.asarray(json.loads((run_dir / "result.json").read_text())["logits"])


def _hf_logits(hf_dir: Path) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    data = make_sft_data(root / "data")
    llama = run_sft(sft_job(data, root / "llama_tp2pp2",
                            parallel={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}), nproc=4)
    qwen = run_sft(sft_job(data, root / "qwen2_tied",
                           model={"add_qkv_bias": True, "share_embeddings_and_output_weights": True}))
    return root, data, {"llama": llama["model_dir"], "qwen2": qwen["model_dir"]}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_exported_logits_equal_megatron_logits(trained, family):
    root, _, checkpoints = trained
    out = root / f"hf_{family}"
    summary = export_hf(checkpoints[family], out, max_shard_bytes=20_000)  # several shards + index
    assert summary["family"] == family and summary["files"] > 1 and summary["tokenizer"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family and config["architectures"] == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]]
    assert config["tie_word_embeddings"] == (family == "qwen2")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == summary["files"]
    meta = json.loads((out / "align_pipeline_meta.json").read_text())
    assert meta["stage"] == "sft" and meta["lineage"]["parent"]["kind"] == "random"

    ours = _megatron_logits(checkpoints[family], root / f"logits_{family}")
    theirs = _hf_logits(out)
    assert theirs.shape == ours.shape  # real vocabulary only: Megatron's padding rows are not exported
    np.testing.assert_allclose(theirs, ours, atol=TOL, rtol=0)


def test_exported_policy_generates_with_its_tokenizer(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _, checkpoints = trained
    out = root / "hf_generate"
    export_hf(checkpoints["llama"], out, dtype="bfloat16")
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.dtype == torch.bfloat16
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_token_id and tok.eos_token == "<eos>"
    ids = torch.tensor([[tok.bos_token_id, *tok.encode("add: 12+34\n", add_special_tokens=False)]])
    new = model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1]:]
    assert 1 <= len(new) <= 5 and isinstance(tok.decode(new), str)


def test_refusals(trained, tiny_models):
    root, _, checkpoints = trained
    with pytest.raises(HFExportError, match="'value' head .*ForSequenceClassification is not supported yet"):
        export_hf(tiny_models["rm"], root / "rm_hf")
    (root / "exists").mkdir()
    with pytest.raises(HFExportError, match="exists; export into a new directory"):
        export_hf(checkpoints["llama"], root / "exists")
    with pytest.raises(HFExportError, match="dtype must be"):
        export_hf(checkpoints["llama"], root / "x", dtype="int8")


def test_cli_export(trained, tiny_models):
    """`align-pipeline export` (here `python -m align_pipeline export`): a summary line, or exit 2 with the reason."""
    import subprocess
    import sys

    root, _, checkpoints = trained
    out = root / "hf_cli"
    done = subprocess.run([sys.executable, "-m", "align_pipeline", "export", checkpoints["qwen2"], str(out),
                           "--dtype", "bfloat16"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["family"] == "qwen2" and summary["out_dir"] == str(out) and summary["files"] == 1
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # --check: Megatron (torchrun, one rank) vs transformers on fixed tokens; fp32 must agree to 1e-4
    checked = subprocess.run([sys.executable, "-m", "align_pipeline", "export", checkpoints["llama"],
                              str(root / "hf_checked"), "--check"], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stderr
    summary = json.loads(checked.stdout.strip().splitlines()[-1])
    assert summary["max_abs_logit_diff"] <= 1e-4 == summary["tolerance"]
    assert "max |dlogit| = " in checked.stderr
    strict = subprocess.run([sys.executable, "-m", "align_pipeline", "export", checkpoints["llama"],
                             str(root / "hf_bf16_checked"), "--dtype", "bfloat16", "--check", "--tol", "1e-9"],
                            capture_output=True, text=True, check=False)
    assert strict.returncode == 1, strict.stderr  # bf16 weights cannot match fp32 logits to 1e-9
    assert json.loads(strict.stdout.strip().splitlines()[-1])["max_abs_logit_diff"] > 1e-9
    refused = subprocess.run([sys.executable, "-m", "align_pipeline", "export", tiny_models["rm"], str(root / "no")],
                             capture_output=True, text=True, check=False)
    assert refused.returncode == 2 and "not supported yet" in refused.stderr and not (root / "no").exists()
