"""torchrun worker for tests/model/test_lora.py: one tiny GPT with adapters at the given TP / SP.

    {"run_dir": ..., "parallel": {...}}  ->  run_dir/result.json (rank 0) with
      "step0_max_diff": max |logits with fresh adapters - base logits|,
      "merge_max_diff": max |logits of the plain model holding W + (alpha/r) B A - logits with the adapters|,
      "init_A": {module: whole A as initialised}, "logits": whole-vocabulary logits with set adapters,
      "loss": token NLL sum, "grads": {module.lora_X: whole gradient}, "base_grads": base params with a gradient,
      "trainable": adapter parameter count

Adapters are set from seeded whole tensors cut the way Megatron shards each linear (fc1 of SwiGLU: gate and up
halves separately), and gradients are gathered back the same way, so every TP size reports the same layout.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import torch
import torch.distributed as tdist

from align_pipeline.config import LoRAConfig, ModelConfig, ParallelConfig, from_dict
from align_pipeline.model import lora
from align_pipeline.model.gpt import build_gpt
from align_pipeline.model.logprobs import token_nll
from align_pipeline.train.core.distributed import init_distributed, shutdown

V = 96


def row_blocks(name: str, rows: int, t: int) -> list[list[int]]:
    """Rows of the whole [rows, ...] tensor that each of t TP ranks holds (fc1: its gate and up halves' blocks)."""
    if name.endswith("linear_fc1"):
        half = rows // 2
        return [list(range(r * half // t, (r + 1) * half // t)) + list(range(half + r * half // t,
                                                                             half + (r + 1) * half // t))
                for r in range(t)]
    return [list(range(r * rows // t, (r + 1) * rows // t)) for r in range(t)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    parallel = from_dict(ParallelConfig, cfg["parallel"], "parallel")
    dist = init_distributed(parallel, seed=0)
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    pg = ProcessGroupCollection.use_mpu_process_groups()
    t, r = dist.tp_size, dist.tp_rank
    tp_group = pg.tp
    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                        seq_length=16)
    torch.manual_seed(0)
    base = build_gpt(model, parallel, V, pg)
    torch.manual_seed(1)
    adapted = build_gpt(model, parallel, V, pg, lora=LoRAConfig(rank=4, alpha=8.0))
    missing, unexpected = adapted.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all(lora.is_adapter(k) for k in missing), (missing, unexpected)
    trainable = lora.freeze_base(adapted)

    torch.manual_seed(2)
    ids = torch.randint(0, V, (3, 12))
    labels = torch.randint(0, V, (3, 12))
    pos = torch.arange(12).expand(3, 12)
    with torch.no_grad():
        step0 = float((adapted(ids, pos, None) - base(ids, pos, None)).abs().max())

    def whole(name: str, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        """This rank's shard of an adapter tensor -> the whole tensor (all-gather over TP)."""
        if t == 1:
            return tensor.detach()
        sharded_rows = kind == "B" and isinstance(module_of[name], lora.LoRAColumnParallelLinear)
        sharded_cols = kind == "A" and isinstance(module_of[name], lora.LoRARowParallelLinear)
        if not (sharded_rows or sharded_cols):
            return tensor.detach()
        parts = [torch.empty_like(tensor) for _ in range(t)]
        tdist.all_gather(parts, tensor.detach().contiguous(), group=tp_group)
        if sharded_cols:
            return torch.cat(parts, dim=1)
        rows = sum(p.shape[0] for p in parts)
        out = torch.empty(rows, tensor.shape[1], dtype=tensor.dtype)
        for rank, block in enumerate(row_blocks(name, rows, t)):
            out[block] = parts[rank]
        return out

    module_of = {n: m for n, m in adapted.named_modules() if isinstance(m, (lora.LoRAColumnParallelLinear,
                                                                           lora.LoRARowParallelLinear))}
    init_a = {n: whole(n, m.lora_A, "A").tolist() for n, m in module_of.items()}

    # the same function at every TP size: every base weight from a seeded whole tensor, cut like Megatron shards it
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if lora.is_adapter(name):
                continue
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight",
                              "linear_fc1.weight")):
                rows = p.shape[0] * t
                w = torch.randn(rows, p.shape[1], generator=gen) * 0.2
                p.copy_(w[row_blocks(name.removesuffix(".weight"), rows, t)[r]])
            elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                cols = p.shape[1]
                w = torch.randn(p.shape[0], cols * t, generator=gen) * 0.2
                p.copy_(w[:, r * cols:(r + 1) * cols])
            else:  # norms: whole on every rank
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))

    # set every adapter from seeded whole tensors, cut like the base weight
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, m in module_of.items():
            column = isinstance(m, lora.LoRAColumnParallelLinear)
            a_cols = m.input_size if column else m.input_size_per_partition * t
            b_rows = m.output_size_per_partition * t if column else m.output_size
            a_whole = torch.randn(m.lora_rank, a_cols, generator=gen) * 0.2
            b_whole = torch.randn(b_rows, m.lora_rank, generator=gen) * 0.2
            m.lora_A.copy_(a_whole if column else a_whole[:, r * m.input_size_per_partition:
                                                           (r + 1) * m.input_size_per_partition])
            m.lora_B.copy_(b_whole[row_blocks(name, b_rows, t)[r]] if column else b_whole)

    # merged into the base weights (what a LoRA stage stores), a plain model computes the same logits
    with torch.no_grad():
        merged = {k: v for k, v in adapted.state_dict().items() if not lora.is_adapter(k)}
        merged.update({f"{n}.weight": lora.merged_weight(m) for n, m in module_of.items()})
        base.load_state_dict(merged, strict=True)
        merge_max_diff = float((base(ids, pos, None) - adapted(ids, pos, None)).abs().max())

    logits = adapted(ids, pos, None)  # [b, s, V/t]
    loss = token_nll(logits, labels, V, r).sum()
    loss.backward()
    full_logits = gather_from_tensor_model_parallel_region(logits.detach(), group=tp_group) if t > 1 else logits
    grads = {}
    for name, m in module_of.items():
        grads[f"{name}.lora_A"] = whole(name, m.lora_A.grad, "A").tolist()
        grads[f"{name}.lora_B"] = whole(name, m.lora_B.grad, "B").tolist()
    base_grads = [n for n, p in adapted.named_parameters() if p.grad is not None and not lora.is_adapter(n)]
    if dist.rank == 0:
        (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps({
            "step0_max_diff": step0, "merge_max_diff": merge_max_diff, "init_A": init_a, "logits": full_logits[..., :V].tolist(),
            "loss": float(loss), "grads": grads, "base_grads": base_grads, "trainable": trainable}))
    shutdown()


if __name__ == "__main__":
    main()
