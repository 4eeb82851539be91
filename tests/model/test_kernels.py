"""The fused kernels (model/kernels.py) against Megatron's eager code, on CPU in fp32 (torch.compile's C++ backend):
RoPE (padded and packed rows, partial rotary width), a whole GPT (GQA, QK norm, SwiGLU, RMSNorm): the same outputs
and the same gradients of every parameter; the fused LM loss. The fused fp32 weight-gradient accumulation is CUDA-only:
``test_fused_training_equals_eager_on_a_gpu``. TP=2 with sequence parallelism: tests/model/test_packing.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_megatron_cpu import run_py

from align_pipeline.model import kernels


def test_auto_is_eager_on_cpu_and_te_keeps_its_own():
    assert not kernels.use_fused("auto", "sdpa")  # no CUDA here
    assert kernels.use_fused("fused", "sdpa") and kernels.use_fused("fused", "local")
    assert not kernels.use_fused("fused", "te") and not kernels.use_fused("eager", "sdpa")
    assert kernels.config_overrides(False, True, False) == {}
    assert kernels.config_overrides(True, True, False) == {  # no CUDA: no fused gradient accumulation
        "apply_rope_fusion": True, "gradient_accumulation_fusion": False, "use_te_activation_func": True,
        "bias_activation_fusion": False}
    assert kernels.config_overrides(True, False, True)["bias_activation_fusion"]  # a GeLU with a bias: Megatron's
    kernels.config_overrides(False, True, False)  # back to eager for this process


def test_thd_positions_restart_at_every_sample():
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    assert kernels.thd_positions(cu, 9).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("rot", [16, 8])  # the whole head, and half of it (the rest passes through)
def test_fused_rope_equals_megatrons(rot):
    from megatron.core.models.common.embeddings import rope_utils

    torch.manual_seed(0)
    s, b, h, d = 11, 2, 3, 16
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    freqs = torch.outer(torch.arange(s).float(), inv)
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, 1, 1, rot], Megatron's layout
    t = torch.randn(s, b, h, d, requires_grad=True)
    g = torch.randn(s, b, h, d)
    expect = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
    (grad_expect,) = torch.autograd.grad(expect, t, g)
    got = kernels.rope_bshd(t, freqs)
    (grad_got,) = torch.autograd.grad(got, t, g)
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_got, grad_expect, rtol=0, atol=1e-6)

    # packed: three samples of 4, 2 and 5 tokens; positions restart per sample (freqs: the longest sample's rows)
    cu = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    packed = torch.randn(11, h, d, requires_grad=True)
    one = SimpleNamespace(size=lambda: 1, rank=lambda: 0)  # a context-parallel group of one
    expect = rope_utils._apply_rotary_pos_emb_thd(packed, cu, freqs[:5], cp_group=one)
    got = kernels.rope_thd(packed, cu, freqs[:5])
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-6)
    gp = torch.randn(11, h, d)
    torch.testing.assert_close(torch.autograd.grad(got, packed, gp)[0], torch.autograd.grad(expect, packed, gp)[0],
                               rtol=0, atol=1e-6)
    # freqs with one row per packed token: Megatron reads them by absolute index, so does the fused path
    expect = rope_utils._apply_rotary_pos_emb_thd(packed, cu, freqs, cp_group=one)
    torch.testing.assert_close(kernels.rope_thd(packed, cu, freqs), expect, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_fused_gpt_equals_eager_gpt_outputs_and_gradients():
    out = run_py(
        """
        import torch
        from align_pipeline.config import ModelConfig, ParallelConfig
        from align_pipeline.model.gpt import build_gpt
        from align_pipeline.model.kernels import FusedRMSNorm, FusedSwiGLU
        from align_pipeline.train.core.distributed import init_distributed, shutdown
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.process_groups_config import ProcessGroupCollection

        init_distributed(ParallelConfig(), seed=0)
        pg = ProcessGroupCollection.use_mpu_process_groups()
        for qk_norm in (False, True):  # Llama-style GQA; Qwen3-style QK norm
            model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=96, seq_length=32, qk_layernorm=qk_norm)
            eager = build_gpt(model, ParallelConfig(kernels="eager"), 100, pg)
            fused = build_gpt(model, ParallelConfig(kernels="fused"), 100, pg)
            assert not eager.config.apply_rope_fusion and fused.config.apply_rope_fusion
            assert isinstance(fused.decoder.final_layernorm, FusedRMSNorm)
            assert isinstance(fused.decoder.layers[0].mlp.activation_func, FusedSwiGLU)
            assert fused.state_dict().keys() == eager.state_dict().keys()
            fused.load_state_dict(eager.state_dict())
            torch.manual_seed(1)
            ids = torch.randint(0, 100, (3, 20))
            pos = torch.arange(20).expand(3, 20)
            cu = torch.tensor([0, 7, 12, 20], dtype=torch.int32)
            packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8,
                                     max_seqlen_kv=8)
            packed_pos = torch.cat([torch.arange(7), torch.arange(5), torch.arange(8)])[None]
            target = torch.randn(3, 20, eager.vocab_size)
            results = []
            for gpt in (eager, fused):
                gpt.zero_grad()
                logits = gpt(ids, pos, None)  # [3, 20, V]
                packed_logits = gpt(ids[:1], packed_pos, None, packed_seq_params=packed)
                ((logits * target).sum() + packed_logits.square().mean()).backward()
                results.append((logits.detach(), packed_logits.detach(),
                                {n: p.grad.clone() for n, p in gpt.named_parameters()}))
            (l0, p0, g0), (l1, p1, g1) = results
            torch.testing.assert_close(l1, l0, rtol=0, atol=1e-5)
            torch.testing.assert_close(p1, p0, rtol=0, atol=1e-5)
            for name in g0:
                torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
            print("grads", len(g0), "max", max(float((g1[n] - g0[n]).abs().max()) for n in g0))

        # the LM loss: fused cross-entropy == Megatron's vocab-parallel one, over the real vocabulary (the 4 padded
        # columns excluded), values and logit gradients
        from align_pipeline.model import kernels
        from align_pipeline.model.logprobs import token_nll
        z = torch.randn(3, 20, 104) * 3
        labels = torch.randint(0, 100, (3, 20))
        weights = torch.rand(3, 20)
        out = {}
        for fused_loss in (False, True):
            kernels._ACTIVE = fused_loss
            zz = z.clone().requires_grad_()
            nll = token_nll(zz, labels, 100, 0)
            (nll * weights).sum().backward()
            out[fused_loss] = (nll.detach(), zz.grad)
        torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-5)
        torch.testing.assert_close(out[True][1], out[False][1], rtol=0, atol=1e-6)
        assert float(out[True][1][..., 100:].abs().max()) == 0.0  # no gradient into padded columns
        shutdown()
        print("OK")
        """
    )
    assert "OK" in out, out


@pytest.mark.gpu
def test_fused_weight_gradient_accumulation_on_a_gpu():
    """bf16 inputs, fp32 accumulator: one GEMM adds its fp32 result (Megatron's wgrad_gemm_accum_fp32 contract)."""
    assert kernels.install_grad_accumulation()
    torch.manual_seed(0)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)  # total_input [tokens, in]
    g = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)  # grad_output [tokens, out]
    main_grad = torch.randn(128, 256, device="cuda")
    expect = main_grad + g.float().t() @ x.float()
    kernels._WeightGradAccumulation.wgrad_gemm_accum_fp32(x, g, main_grad)
    torch.testing.assert_close(main_grad, expect, rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16_optimizer"])
def test_fused_training_equals_eager_on_a_gpu(tmp_path, precision):
    """The SFT job on a GPU with every fused kernel (fused gradient accumulation included) against the eager path:
    the same loss curve over 30 steps, to 1e-4 in fp32 and to bf16 tolerance in bf16. ``bf16_optimizer``:
    ``parallel.optimizer_precision: bf16`` (eager and compiled stochastic-rounding AdamW) against fp32 main weights."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    variants = ["eager:none:2", "fused:none:2"]
    if precision == "bf16_optimizer":
        variants = ["eager:none:2", "eager:none:2:0:bf16", "fused:none:2:0:bf16"]
    cmd = [sys.executable, str(root / "benchmarks" / "train_kernels.py"), "--preset", "tiny", "--ours",
           *variants, "--hf", "--steps", "30", "--warmup", "2", "--global-batch", "8",
           "--out", str(tmp_path), "--loss-tol", "1e-4" if precision == "fp32" else "2e-2"]
    proc = subprocess.run(cmd + (["--fp32"] if precision == "fp32" else []), capture_output=True, text=True,
                          check=False, env={**os.environ, "KEDRO_DISABLE_TELEMETRY": "true"}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == variants
    for row in rows[1:]:
        assert row["max_loss_diff"] <= (1e-4 if precision == "fp32" else 2e-2)


@pytest.mark.slow
def test_chunked_lm_loss_equals_whole_logits_for_sft_and_dpo():
    """parallel.logits_chunk_tokens: the loss from hidden states, 7 tokens' logits at a time (chunks that do not
    divide the tokens), equals the whole-logits loss, values and every parameter's gradient (fp32), with separate and
    tied output weights and a padded vocabulary (100 real tokens of 128 rows); the DPO loss too."""
    out = run_py(
        """
        import torch
        from align_pipeline.config import ModelConfig, ParallelConfig, PreferenceLossConfig
        from align_pipeline.model.gpt import build_gpt
        from align_pipeline.train.core.distributed import init_distributed, shutdown
        from align_pipeline.train.dpo import preference_loss
        from align_pipeline.train.sft import sft_loss
        from megatron.core.process_groups_config import ProcessGroupCollection

        init_distributed(ParallelConfig(), seed=0)
        pg = ProcessGroupCollection.use_mpu_process_groups()
        torch.manual_seed(0)
        b, s, V = 3, 12, 100
        sft_batch = {"input_ids": torch.randint(0, V, (b, s)), "labels": torch.randint(0, V, (b, s)),
                     "loss_mask": (torch.rand(b, s) > 0.3).float()}
        pairs = {f"{side}_{k}": v.clone() for side in ("chosen", "rejected") for k, v in sft_batch.items()}
        pairs["rejected_labels"] = torch.randint(0, V, (b, s))
        pairs.update(ref_chosen_logps=torch.randn(b) - 30, ref_rejected_logps=torch.randn(b) - 30,
                     chosen_reward=torch.full((b,), float("nan")), rejected_reward=torch.full((b,), float("nan")))
        for tied in (False, True):
            model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=64, seq_length=16, share_embeddings_and_output_weights=tied)
            gpt = build_gpt(model, ParallelConfig(), V, pg)
            assert gpt.output_layer.weight is None if tied else gpt.output_layer.weight.shape[0] == 128
            for name, make, batch in (("sft", lambda c: sft_loss(V, 0, c), sft_batch),
                                      ("dpo", lambda c: preference_loss(PreferenceLossConfig(), V, 0, c), pairs)):
                results = []
                for chunk in (0, 7):
                    gpt.zero_grad()
                    output, loss_fn = make(chunk)(gpt, batch)
                    assert output.shape[-1] == (128 if chunk == 0 else 32)  # logits, or hidden states
                    total = loss_fn(output)[0]
                    total.backward()
                    results.append((total.detach(), {n: p.grad.clone() for n, p in gpt.named_parameters()}))
                (l0, g0), (l1, g1) = results
                torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-5)
                for n in g0:
                    torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6,
                                               msg=lambda m, n=n: f"{name} {n}: {m}")
                print(name, "tied" if tied else "untied", float(l0))
        shutdown()
        print("OK")
        """
    )
    assert "OK" in out, out


def test_fused_optimizer_step_equals_megatrons_fallback():
    """torch's fused AdamW and the foreach gradient norm / clipping (the fused path's optimizer step) against
    Megatron's fallbacks (foreach AdamW, per-tensor norm and scale): the same parameters after three clipped steps
    of the same gradients, fp32 on CPU."""
    out = run_py(
        """
        import dataclasses
        import torch
        from align_pipeline.config import ModelConfig, ParallelConfig, TrainingConfig
        from align_pipeline.model import kernels
        from align_pipeline.model.init import resolve
        from align_pipeline.model.sequences import position_ids
        from align_pipeline.train.core.distributed import init_distributed, shutdown
        from align_pipeline.train.core.optimizer import build_trainable, train_step
        from align_pipeline.losses.sft import masked_token_loss
        from megatron.core import utils
        from megatron.core.optimizer import clip_grads

        dist = init_distributed(ParallelConfig(), seed=1)
        source = resolve(None, ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8), 64)
        opt = dataclasses.replace(TrainingConfig().optimizer, clip_grad=0.05, lr=1e-2, warmup_steps=0)
        torch.manual_seed(3)
        batches = [{"input_ids": (ids := torch.randint(0, 64, (2, 8))), "labels": ids.roll(-1, 1),
                    "loss_mask": torch.ones(2, 8)} for _ in range(3)]
        def fl(m, b):
            out = m(b["input_ids"], position_ids(b["input_ids"]), None, labels=b["labels"])
            return out, lambda t: masked_token_loss(t, b["loss_mask"])
        results = []
        for fused in (False, True):
            torch.manual_seed(0)
            t = build_trainable(source, ParallelConfig(), opt, 3, dist)
            if fused:
                kernels.install_optimizer_kernels()
                assert clip_grads.l2_norm_impl is kernels._foreach_l2_norm
                assert kernels.fuse_adamw(t.optimizer) >= 1
            else:
                assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
            norms = [train_step(t, [b], fl, ["lm_loss"], dist, 8)["grad_norm"] for b in batches]
            results.append((norms, {n: p.detach().clone() for n, p in t.model.named_parameters()}))
        (n0, p0), (n1, p1) = results
        assert min(n0) > 0.05  # every step was clipped
        torch.testing.assert_close(torch.tensor(n1), torch.tensor(n0), rtol=1e-5, atol=0)
        for name in p0:
            torch.testing.assert_close(p1[name], p0[name], rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        print("OK", n0)
        shutdown()
        """
    )
    assert "OK" in out, out
