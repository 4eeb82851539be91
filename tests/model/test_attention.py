"""SDPAttention equals Megatron's unfused DotProductAttention (MHA and GQA, full and KV-cache-shaped queries)."""

from test_megatron_cpu import run_py


def test_sdpa_matches_megatron_unfused_attention():
    out = run_py(
        """
        import torch
        from align_pipeline.config import ParallelConfig, ModelConfig
        from align_pipeline.train.core.distributed import init_distributed, shutdown
        from align_pipeline.model.attention import SDPAttention
        from align_pipeline.model.gpt import transformer_config
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType
        init_distributed(ParallelConfig(), seed=0)
        for heads, groups in ((4, 4), (4, 2), (4, 1)):
            cfg = transformer_config(ModelConfig(hidden_size=32, num_attention_heads=heads, num_query_groups=groups),
                                     ParallelConfig())
            kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
            ref, sdpa = DotProductAttention(**kw), SDPAttention(**kw)
            s, b, hn = 10, 3, 32 // heads
            q = torch.randn(s, b, heads, hn); k = torch.randn(s, b, groups, hn); v = torch.randn(s, b, groups, hn)
            expect = ref(q, k, v, None, AttnMaskType.causal)        # [s, b, heads*hn]
            got = sdpa(q, k, v, None, AttnMaskType.causal)
            assert got.shape == expect.shape == (s, b, heads * hn)
            assert torch.allclose(got, expect, atol=1e-5), (got - expect).abs().max()
            # the last 3 queries against all 10 keys (decoding with a KV cache) == the last 3 rows of full attention
            tail = sdpa(q[-3:], k, v, None, AttnMaskType.causal)
            assert torch.allclose(tail, expect[-3:], atol=1e-5)
            # an explicit Megatron mask (True = masked) that equals causal gives the same result
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
            assert torch.allclose(sdpa(q, k, v, mask, AttnMaskType.padding), expect, atol=1e-5)
        shutdown()
        print("OK")
        """
    )
    assert "OK" in out
