"""Sequence packing on a real Megatron-core GPT (torchrun, gloo): the same samples give the same per-sample and total
loss packed as padded (fp32, 1e-5), at TP=1 and TP=2; so do preference pairs packed chosen-beside-rejected (DPO's
per-sequence log-probs and token counts, the reward model's mean- and last-pooled rewards); packing itself (rows,
segments, positions, labels) by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from align_pipeline.config import LaunchConfig
from align_pipeline.data.packing import pack, packed_microbatch
from align_pipeline.data.store import Rows, ragged
from align_pipeline.launch import run_torchrun

HERE = Path(__file__).resolve().parent


def test_pack_first_fit_and_the_packed_layout():
    # lengths 5, 3, 4, 2, 6 into rows of 8, in this order: [0 (5), 1 (3)], [2 (4), 3 (2)], [4 (6)]
    assert pack(np.array([5, 3, 4, 2, 6]), np.arange(5), 8) == [[0, 1], [2, 3], [4]]
    assert pack(np.array([5, 3, 4, 2, 6]), np.array([4, 0, 1, 2, 3]), 8) == [[4, 3], [0, 1], [2]]
    with pytest.raises(ValueError, match="9 tokens > seq_length 8"):
        pack(np.array([9]), np.arange(1), 8)

    samples = [([1, 10, 11, 2], [False, False, True, True]), ([1, 20, 2], [False, True, True])]
    rows = Rows(**{k: v for k, v in ragged(samples).items()}, seq_length=8, pad_id=0)
    mb = packed_microbatch([rows], [[0, 1]], 8, pad_id=0)
    assert mb["input_ids"].tolist() == [[1, 10, 11, 2, 1, 20, 2, 0]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]  # restart per sample (and for the padding)
    assert mb["cu_seqlens"].tolist() == [0, 4, 7, 8]  # the padding is a segment of its own
    # labels shifted within each sample; a sample's last token predicts nothing (pad, no loss)
    assert mb["labels"].tolist() == [[10, 11, 2, 0, 20, 2, 0, 0]]
    assert mb["loss_mask"].tolist() == [[0, 1, 1, 0, 1, 1, 0, 0]]
    assert mb["max_seqlen"].tolist() == [4] and mb["num_tokens"].tolist() == [7]
    assert mb["sequence"].tolist() == [[0, 0, 0, 0, 1, 1, 1, -1]] and mb["sample_index"].tolist() == [0, 1]

    # A preference pair: chosen and rejected side by side in one row; sequences numbered chosen 0..k-1, then rejected.
    pair = packed_microbatch([rows, rows], [[1], [0]], 8, pad_id=0)
    assert pair["input_ids"].tolist() == [[1, 20, 2, 1, 20, 2, 0, 0, 1, 10, 11, 2, 1, 10, 11, 2]]
    assert pair["sequence"].tolist() == [[0, 0, 0, 2, 2, 2, -1, -1, 1, 1, 1, 1, 3, 3, 3, 3]]
    assert pair["cu_seqlens"].tolist() == [0, 3, 6, 8, 12, 16] and pair["num_sequences"].tolist() == [4]


@pytest.fixture(scope="module")
def results(tiny_models, tmp_path_factory):
    from align_pipeline.data.store import load_sequences

    tmp = tmp_path_factory.mktemp("packing")
    data = tiny_models["sft_data"]["val"]
    lengths = load_sequences(data).lengths("")
    samples = list(range(24))
    assert len(set(lengths[samples].tolist())) > 3  # varied lengths, several samples per packed row
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    out = {}
    # "2f": TP=2 with sequence parallelism and the fused kernels (model/kernels.py: compiled RoPE, SwiGLU, norms)
    for key, parallel in ((1, {}), (2, {}), ("2f", {"sequence_parallel": True, "kernels": "fused"})):
        tp = 1 if key == 1 else 2
        run_dir = tmp / f"tp{key}"
        run_dir.mkdir()
        config = {"checkpoint": tiny_models["sft"], "parallel": {"tensor_model_parallel_size": tp, **parallel},
                  "data": data, "samples": samples, "pairs": tiny_models["pref"]["val"],
                  "reward_model": tiny_models["rm"]}
        run_torchrun("packing_worker", config, LaunchConfig(nproc_per_node=tp), run_dir, env=env)
        out[key] = json.loads((run_dir / "result.json").read_text())
    return out


@pytest.mark.slow
def test_packed_loss_equals_padded_loss(results):
    r = results[1]
    assert r["segments"] > r["rows"] and r["rows"] < len(r["padded"])  # several samples share a row
    np.testing.assert_allclose(r["packed"], r["padded"], rtol=0, atol=1e-5)
    assert r["packed_loss"][1] == r["padded_loss"][1] == sum(r["tokens"])  # same loss tokens
    assert abs(r["packed_loss"][0] - r["padded_loss"][0]) <= 1e-5 * max(1.0, abs(r["padded_loss"][0]))


@pytest.mark.slow
def test_tp2_equals_tp1_packed(results):
    np.testing.assert_allclose(results[2]["packed"], results[1]["packed"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(results[2]["padded"], results[1]["padded"], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_packed_pairs_equal_padded_pairs_for_dpo_and_the_reward_model(results):
    for tp in (1, 2):
        r = results[tp]
        assert r["pair_rows"] < len(r["pair_logps_padded"]) // 2  # several pairs share a row
        np.testing.assert_allclose(r["pair_logps_packed"], r["pair_logps_padded"], rtol=0, atol=1e-5)
        assert r["pair_tokens_packed"] == r["pair_tokens_padded"]
        for pooling in ("mean", "last"):
            np.testing.assert_allclose(r[f"pair_reward_{pooling}_packed"], r[f"pair_reward_{pooling}_padded"],
                                       rtol=0, atol=1e-5)
    np.testing.assert_allclose(results[2]["pair_logps_packed"], results[1]["pair_logps_packed"], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_fused_kernels_with_sequence_parallel_equal_eager_tp1(results):
    fused, eager = results["2f"], results[1]
    for key in ("padded", "packed", "pair_logps_padded", "pair_logps_packed", "pair_reward_last_packed"):
        np.testing.assert_allclose(fused[key], eager[key], rtol=0, atol=1e-5, err_msg=key)


@pytest.mark.gpu
def test_packed_equals_padded_on_gpu_with_flex_attention(tmp_path):
    """On a GPU the packed path runs FlexAttention with a block mask (fp32 here): same numbers as padded SDPA."""
    from jobs import make_pref_data, make_sft_data, run_rm, run_sft, sft_job

    data = make_sft_data(tmp_path / "data")
    pref = make_pref_data(tmp_path / "data", data["tokenizer"])
    sft = run_sft(sft_job(data, tmp_path / "sft", training={"train_steps": 4}))
    rm = run_rm(pref, data["tokenizer"], sft["model_dir"], tmp_path / "rm")
    run_dir = tmp_path / "check"
    run_dir.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    config = {"checkpoint": sft["model_dir"], "parallel": {}, "data": data["val"], "samples": list(range(24)),
              "pairs": pref["val"], "reward_model": rm["model_dir"]}
    run_torchrun("packing_worker", config, LaunchConfig(nproc_per_node=1), run_dir, env=env)
    r = json.loads((run_dir / "result.json").read_text())
    assert r["flex_attention"] and r["segments"] > r["rows"]
    np.testing.assert_allclose(r["packed"], r["padded"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(r["pair_logps_packed"], r["pair_logps_padded"], rtol=0, atol=1e-4)
    for pooling in ("mean", "last"):
        np.testing.assert_allclose(r[f"pair_reward_{pooling}_packed"], r[f"pair_reward_{pooling}_padded"], rtol=0,
                                   atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 4])
def test_varlen_packed_attention_equals_the_masked_reference_on_gpu(groups):
    """bf16 packed attention through PyTorch's variable-length FlashAttention (the GPU's packed path): output and
    gradients equal causal attention under the block-diagonal mask, computed in fp32 from the same inputs."""
    import torch
    import torch.nn.functional as F

    from align_pipeline.model.attention import _causal_keep_mask, _varlen, segment_ids, varlen_attention_available

    if not varlen_attention_available(required=True):
        pytest.skip("this torch has no torch.nn.attention.varlen with a causal window")
    torch.manual_seed(0)
    lengths = [5, 130, 1, 77, 300, 64]
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], device="cuda", dtype=torch.int32)
    t, heads, dim = int(cu[-1]), 8, 64
    q = torch.randn(t, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(t, heads // groups, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    out = _varlen(q, k, v, cu, max(lengths), dim**-0.5, groups)  # [t, heads, dim]
    grad = torch.randn_like(out)
    out.backward(grad)

    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    segment = segment_ids(cu, t)
    keep = (segment[:, None] == segment[None, :]) & _causal_keep_mask(t, t, q.device)
    ref = F.scaled_dot_product_attention(q32.transpose(0, 1), k32.repeat_interleave(groups, 1).transpose(0, 1),
                                         v32.repeat_interleave(groups, 1).transpose(0, 1), attn_mask=keep,
                                         scale=dim**-0.5).transpose(0, 1)
    ref.backward(grad.float())
    assert (out.float() - ref).abs().max().item() < 2e-2
    for name, mine, theirs in (("q", q, q32), ("k", k, k32), ("v", v, v32)):
        assert (mine.grad.float() - theirs.grad).abs().max().item() < 5e-2, name
