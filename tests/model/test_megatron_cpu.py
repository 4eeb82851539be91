"""The CPU redirection module: each kind of call it redirects, and that it stays inactive when CUDA exists.

Activation patches torch globally, so each check runs in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_py(code: str, env_extra: dict[str, str] | None = None) -> str:
    import os

    env = {**os.environ, **(env_extra or {})}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_redirections_behave_like_their_cuda_counterparts():
    out = run_py(
        """
        import torch
        from align_pipeline.train.core import megatron_cpu
        assert not torch.cuda.is_available()
        assert megatron_cpu.activate() is True and megatron_cpu.is_active()
        assert megatron_cpu.activate() is True  # idempotent

        # 1. CUDA RNG -> the CPU generator (a real stream switch, not a silent no-op)
        torch.cuda.manual_seed(5); a = torch.rand(3)
        torch.manual_seed(5); b = torch.rand(3)
        assert torch.equal(a, b)
        state = torch.cuda.get_rng_state(); x = torch.rand(2); torch.cuda.set_rng_state(state); y = torch.rand(2)
        assert torch.equal(x, y)

        # 2. devices / streams / events
        assert torch.cuda.current_device() == "cpu"
        s = torch.cuda.current_stream(); s.wait_stream(torch.cuda.default_stream()); torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); e1.record(); assert e0.elapsed_time(e1) >= 0
        with torch.cuda.stream(torch.cuda.Stream()):
            pass

        # 3. literal device="cuda" factories and Tensor.cuda()
        for t in (torch.zeros(2, device="cuda"), torch.tensor([1.0], device="cuda", pin_memory=True),
                  torch.empty(1, device=torch.device("cuda")), torch.ones(1, device=0),
                  torch.full((1,), 3.0, device="cuda:0"), torch.arange(3, device="cuda")):
            assert t.device.type == "cpu"
        t = torch.ones(2); assert t.cuda() is t

        # 4. type names as megatron checks them; typed conversion still works
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.ones(1).type(torch.float64).dtype == torch.float64
        print("OK")
        """
    )
    assert "OK" in out


def test_tensor_parallel_ranks_get_distinct_dropout_streams():
    # Megatron's tracker seeds the model-parallel stream with seed + 2718 + tp_rank; with the redirection the fork
    # really switches the CPU generator, so two TP ranks draw different numbers and the default stream is restored.
    out = run_py(
        """
        import torch
        from align_pipeline.train.core import megatron_cpu
        megatron_cpu.activate()
        from megatron.core import tensor_parallel
        draws = []
        for tp_rank in (0, 1):
            tensor_parallel.model_parallel_cuda_manual_seed(1234, tp_rank=tp_rank, ep_rank=0, etp_rank=0,
                                                            force_reset_rng=True)
            before = torch.get_rng_state()
            with tensor_parallel.get_cuda_rng_tracker().fork():
                draws.append(torch.rand(4))
            assert torch.equal(before, torch.get_rng_state())
        assert not torch.equal(draws[0], draws[1])
        print("OK")
        """
    )
    assert "OK" in out


def test_megatron_call_sites_are_traced_during_a_training_step():
    out = run_py(
        """
        import torch, os
        from align_pipeline.config import ModelConfig, ParallelConfig, TrainingConfig
        from align_pipeline.train.core.distributed import init_distributed, shutdown
        from align_pipeline.model.sequences import position_ids
        from align_pipeline.train.core.optimizer import build_trainable, train_step
        from align_pipeline.losses.sft import masked_token_loss
        from align_pipeline.train.core import megatron_cpu
        dist = init_distributed(ParallelConfig(), seed=1)
        from align_pipeline.model.init import resolve
        source = resolve(None, ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8), 32)
        t = build_trainable(source, ParallelConfig(), TrainingConfig().optimizer, 2, dist)
        ids = torch.randint(0, 32, (2, 8))
        batch = {"input_ids": ids, "labels": ids, "loss_mask": torch.ones(2, 8)}
        def fl(m, b):
            out = m(b["input_ids"], position_ids(b["input_ids"]), None, labels=b["labels"])
            return out, lambda t: masked_token_loss(t, b["loss_mask"])
        m = train_step(t, [batch], fl, ["lm_loss"], dist, 8)
        assert m["update_skipped"] == 0 and m["grad_norm"] > 0
        sites = megatron_cpu.call_sites()
        kinds = {k.split(" from ")[0] for k in sites}
        print(sorted(kinds))
        assert any("megatron/core" in k for k in sites)
        shutdown()
        """,
        {"ALIGN_MEGATRON_CPU_TRACE": "1"},
    )
    assert "torch.cuda.current_device" in out
    assert "Tensor.type() cuda-name" in out


def test_inactive_when_cuda_is_available():
    out = run_py(
        """
        import torch
        torch.cuda.is_available = lambda: True
        from align_pipeline.train.core import megatron_cpu
        original = torch.zeros
        assert megatron_cpu.activate() is False and not megatron_cpu.is_active()
        assert torch.zeros is original and torch.Tensor.type(torch.ones(1)) == "torch.FloatTensor"
        print("OK")
        """
    )
    assert "OK" in out


def test_a_transformers_model_loaded_while_active_has_its_buffers(tmp_path):
    """The export job checks an export with transformers in the process that built our model: the default-device
    mode transformers loads under must still see the factories, or rotary inv_freq stays uninitialised memory."""
    out = run_py(
        f"""
        import torch
        from align_pipeline.train.core import megatron_cpu
        assert megatron_cpu.activate()  # first: before anything has used a default-device mode
        with torch.device("meta"):
            assert torch.tensor([]).device.type == "meta" and torch.zeros(1).device.type == "meta"

        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
        built = LlamaForCausalLM(config).eval()  # built directly: its buffers computed in __init__
        built.save_pretrained({str(tmp_path)!r})
        ids = torch.tensor([[1, 5, 7, 9, 30, 2]])
        with torch.no_grad():
            loaded = LlamaForCausalLM.from_pretrained({str(tmp_path)!r})  # built on meta, then filled
            expected, got = built.model.rotary_emb.inv_freq, loaded.model.rotary_emb.inv_freq
            assert torch.isfinite(expected).all() and torch.equal(expected, got), got
            assert torch.equal(built(ids).logits, loaded(ids).logits)
        print("OK")
        """
    )
    assert "OK" in out
