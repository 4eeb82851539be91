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
from jobs import make_pref_data, make_sft_data, run_rm, run_sft, sft_job

from align_pipeline.config import ParallelConfig
from align_pipeline.model.hf_export import HFExportError, export_hf

pytestmark = pytest.mark.slow  # launches torchrun jobs

TOKENS = [[1, 18, 21, 21, 17, 5, 9, 9, 6, 15, 16, 4, 12, 2], [1, 7, 7, 3, 30, 31, 8, 2, 5, 5, 11, 12, 13, 14]]
TOL = 1e-4


def _megatron_logits(checkpoint: str, run_dir: Path, tokens: list | None = None) -> np.ndarray:
    import subprocess
    import sys

    run_dir.mkdir(parents=True)
    cfg = {"run_dir": str(run_dir), "checkpoint": checkpoint, "parallel": {}, "tokens": tokens or TOKENS}
    (run_dir / "config.json").write_text(json.dumps(cfg))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "-m",
                    "align_pipeline.train.jobs.logits", "--config",
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


def test_refusals(trained):
    root, _, checkpoints = trained
    (root / "exists").mkdir()
    with pytest.raises(HFExportError, match="exists; export into a new directory"):
        export_hf(checkpoints["llama"], root / "exists")
    with pytest.raises(HFExportError, match="dtype must be"):
        export_hf(checkpoints["llama"], root / "x", dtype="int8")


def _rewards_both_ways(checkpoint: str, hf_dir: Path, pref_val: str, pooling: str, run_dir: Path):
    """(project rewards, HF rewards) on 8 chosen + 8 rejected right-padded validation rows: ours from the Megatron
    per-token values pooled by model.sequences.sequence_rewards; HF's from the exported model as its note says."""
    from transformers import AutoModelForSequenceClassification

    from align_pipeline.data.store import load_rows
    from align_pipeline.model.sequences import sequence_rewards

    arrays = load_rows(pref_val)
    ids = np.concatenate([arrays["chosen_input_ids"][:8], arrays["rejected_input_ids"][:8]])  # [16, S]
    mask = torch.tensor(np.concatenate([arrays["chosen_loss_mask"][:8], arrays["rejected_loss_mask"][:8]]))
    values = torch.tensor(_megatron_logits(checkpoint, run_dir, tokens=ids.tolist()), dtype=torch.float32)
    ours = sequence_rewards(values, mask, pooling)  # [16]
    model = AutoModelForSequenceClassification.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        if pooling == "last":  # HF's own pooling: the last non-pad token
            theirs = model(torch.tensor(ids)).logits[:, 0]
        else:  # the note's recipe: score every position, average over the response
            hidden = model.model(torch.tensor(ids)).last_hidden_state
            theirs = sequence_rewards(model.score(hidden), mask, "mean")
    return ours, theirs


def test_reward_models_export_as_sequence_classification_and_score_the_same(trained, tiny_models, tmp_path):
    """A last-token reward model trained at PP=2 from the tied Qwen2-style policy (value head on tied embeddings)
    -> Qwen2ForSequenceClassification scoring exactly as the project; the demo's mean-pooled one -> a note that
    says how to score it, and scoring so gives the project's rewards."""
    root, data, checkpoints = trained
    pref = make_pref_data(root / "pref", data["tokenizer"])
    last_rm = run_rm(pref, data["tokenizer"], checkpoints["qwen2"], tmp_path / "rm_last", pooling="last",
                     parallel=ParallelConfig(pipeline_model_parallel_size=2), nproc=2)["model_dir"]
    cases = {"last": (last_rm, pref["val"], "Qwen2ForSequenceClassification"),
             "mean": (tiny_models["rm"], tiny_models["pref"]["val"], "LlamaForSequenceClassification")}
    for pooling, (checkpoint, pref_val, arch) in cases.items():
        out = tmp_path / f"rm_{pooling}_hf"
        assert export_hf(checkpoint, out)["architecture"] == arch
        config = json.loads((out / "config.json").read_text())
        assert len(config["id2label"]) == 1 and config["pad_token_id"] is not None  # num_labels = 1
        note = config["align_pipeline"]
        assert (note["pooling"], note["head"]) == (pooling, "value")
        # HF's score layer has no bias; ours (a constant offset under Bradley-Terry) travels in the note
        bias = note["score_bias"] or [0.0]
        assert len(bias) == 1 and "How to score" in (out / "README.md").read_text()
        ours, theirs = _rewards_both_ways(checkpoint, out, pref_val, pooling, tmp_path / f"values_{pooling}")
        theirs = theirs + bias[0]
        torch.testing.assert_close(theirs, ours, atol=TOL, rtol=0, msg=pooling)
        assert (ours[:8] - ours[8:]).abs().max() > 1e-3, pooling  # trained: chosen and rejected scores differ


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Every tiny HF family, saved with save_pretrained and imported at a different TP/PP layout by import_hf."""
    from hf_models import tiny_family_models

    from align_pipeline.launch.model_jobs import import_hf

    root = tmp_path_factory.mktemp("import")
    layouts = {"llama3": (2, 1), "qwen3": (1, 2), "mistral": (2, 1), "qwen2": (1, 1)}
    models = tiny_family_models()
    out = {}
    for name, (tp, pp) in layouts.items():
        if name == "mistral":  # a bf16 source (exported back in bf16 by the round-trip test)
            models[name] = models[name].to(torch.bfloat16)
        models[name].save_pretrained(root / "hf" / name)
        result = import_hf(root / "hf" / name, root / "ckpt" / name, tp=tp, pp=pp, seq_length=32)
        assert result["model"]["hf_family"] == ("llama" if name == "llama3" else name)
        out[name] = (root / "hf" / name, root / "ckpt" / name)
    return root, out


@pytest.mark.parametrize("name", ["llama3", "qwen3", "mistral", "qwen2"])
def test_import_then_export_gives_the_source_tensors_and_config(imported, name):
    from safetensors.torch import load_file

    root, dirs = imported
    source, ckpt = dirs[name]
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["stage"] == "import" and meta["lineage"]["parent"] == {"kind": "hf", "path": str(source.resolve())}
    out = root / f"export_{name}"
    export_hf(ckpt, out, dtype="bfloat16" if name == "mistral" else "float32")
    theirs, ours = load_file(str(source / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (source, out))
    for key in ("model_type", "architectures", "head_dim", "rope_parameters", "tie_word_embeddings", "sliding_window",
                "max_position_embeddings", "num_key_value_heads", "attention_bias", "rms_norm_eps"):
        assert out_cfg.get(key) == src_cfg.get(key), key
    # transformers 4.x spellings too (vLLM releases read them): the same RoPE
    rope = src_cfg["rope_parameters"]
    assert out_cfg["rope_theta"] == rope["rope_theta"] and out_cfg["torch_dtype"] == str(out_cfg["dtype"])
    assert out_cfg.get("rope_scaling") == ({k: v for k, v in rope.items() if k != "rope_theta"}
                                           if rope["rope_type"] != "default" else None)


def test_cli_import_with_check(imported, tmp_path):
    """`align-pipeline import HF CKPT --tp 2 --check`: a Qwen3 model (QK norm, head_dim != hidden/heads, tied)."""
    import subprocess
    import sys

    _, dirs = imported
    source, _ = dirs["qwen3"]
    done = subprocess.run([sys.executable, "-m", "align_pipeline", "import", "--json", str(source), str(tmp_path / "ckpt"),
                           "--tp", "2", "--seq-length", "32", "--check"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["family"] == "qwen3" and summary["tp"] == 2 and summary["max_abs_logit_diff"] <= 1e-4
    assert "max |dlogit| = " in done.stderr
    refused = subprocess.run([sys.executable, "-m", "align_pipeline", "import", str(source), str(tmp_path / "ckpt")],
                             capture_output=True, text=True, check=False)
    assert refused.returncode == 2 and "exists; import into a new directory" in refused.stderr


def test_cli_export(trained):
    """`align-pipeline export` (here `python -m align_pipeline export`): a summary line, or exit 2 with the reason."""
    import subprocess
    import sys

    root, _, checkpoints = trained
    out = root / "hf_cli"
    done = subprocess.run([sys.executable, "-m", "align_pipeline", "export", checkpoints["qwen2"], str(out),
                           "--dtype", "bfloat16"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    table = dict(line.split(None, 1) for line in done.stdout.strip().splitlines())  # a table for people
    assert table["family"] == "qwen2" and table["out_dir"] == str(out) and table["files"] == "1", done.stdout
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # --check: Megatron (torchrun, one rank) vs transformers on fixed tokens; fp32 must agree to 1e-4
    checked = subprocess.run([sys.executable, "-m", "align_pipeline", "export", "--json", checkpoints["llama"],
                              str(root / "hf_checked"), "--check"], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stderr
    summary = json.loads(checked.stdout.strip().splitlines()[-1])
    assert summary["max_abs_logit_diff"] <= 1e-4 == summary["tolerance"]
    assert "max |dlogit| = " in checked.stderr
    strict = subprocess.run([sys.executable, "-m", "align_pipeline", "export", "--json", checkpoints["llama"],
                             str(root / "hf_bf16_checked"), "--dtype", "bfloat16", "--check", "--tol", "1e-9"],
                            capture_output=True, text=True, check=False)
    assert strict.returncode == 1, strict.stderr  # bf16 weights cannot match fp32 logits to 1e-9
    assert json.loads(strict.stdout.strip().splitlines()[-1])["max_abs_logit_diff"] > 1e-9
    refused = subprocess.run([sys.executable, "-m", "align_pipeline", "export", "--json", checkpoints["llama"], str(out)],
                             capture_output=True, text=True, check=False)
    assert refused.returncode == 2 and "exists; export into a new directory" in refused.stderr
    assert "--overwrite" in refused.stderr
    # --overwrite: the float32 export takes the bfloat16 one's place, nothing left beside it
    replaced = subprocess.run([sys.executable, "-m", "align_pipeline", "export", "--json", checkpoints["qwen2"], str(out),
                               "--overwrite"], capture_output=True, text=True, check=False)
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads(replaced.stdout.strip().splitlines()[-1])["out_dir"] == str(out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []
    # ... but never over a directory that is not an export
    (root / "notes").mkdir()
    (root / "notes" / "todo.txt").write_text("mine")
    kept = subprocess.run([sys.executable, "-m", "align_pipeline", "export", "--json", checkpoints["qwen2"], str(root / "notes"),
                           "--overwrite"], capture_output=True, text=True, check=False)
    assert kept.returncode == 2 and "is not a Hugging Face export" in kept.stderr
    assert (root / "notes" / "todo.txt").read_text() == "mine"


def test_checkpoints_use_transformer_engine_tensor_names(trained, imported):
    """Megatron's local spec saves its separate norms under Transformer Engine's fused names (its
    sharded_state_dict_keys_map), so a checkpoint written under either spec holds the same tensors: TE's
    TELayerNormColumnParallelLinear (weight + layer_norm_weight), TERowParallelLinear (weight), TENorm (q/k norms,
    final norm). TE itself cannot run here; this pins the names both specs must agree on."""
    from align_pipeline.model.hf_export import CheckpointTensors

    _, _, checkpoints = trained
    _, dirs = imported
    te_layer = {"self_attention.linear_qkv.weight", "self_attention.linear_qkv.layer_norm_weight",
                "self_attention.linear_proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc1.layer_norm_weight",
                "mlp.linear_fc2.weight"}
    common = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    llama = set(CheckpointTensors(checkpoints["llama"]).shapes)  # TP=2 x PP=2, untied
    assert llama == common | {"output_layer.weight"} | {f"decoder.layers.{k}" for k in te_layer}
    qwen3 = set(CheckpointTensors(dirs["qwen3"][1]).shapes)  # tied, QK norm
    assert qwen3 == common | {f"decoder.layers.{k}" for k in te_layer | {
        "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}}
