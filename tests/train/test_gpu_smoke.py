"""SFT on one GPU with NCCL (skipped without CUDA): the real entry point, bf16, TE if present else SDPA."""

from __future__ import annotations

import pytest
from jobs import losses, make_sft_data, run_sft, sft_job

pytestmark = pytest.mark.gpu


def test_sft_one_gpu_nccl(tmp_path):
    data = make_sft_data(tmp_path / "data")
    job = sft_job(
        data,
        tmp_path / "run",
        model={"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 4,
               "ffn_hidden_size": 704},
        parallel={"bf16": True},
        training={"train_steps": 60, "global_batch_size": 64, "micro_batch_size": 32, "log_interval": 10,
                  "eval_interval": 30, "eval_samples": 256},
    )
    result = run_sft(job, nproc=1)
    history = losses(result)
    print(f"GPU SFT: first loss {history[0]:.4f}, last loss {history[-1]:.4f}, val loss {result['val_loss']:.4f}, "
          f"{result['tokens_per_s']:.0f} tokens/s (60 steps incl. warm-up and one eval)")
    assert history[-1] < history[0] - 0.5
    assert result["val_loss"] < history[0]
