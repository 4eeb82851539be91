"""torchrun worker for tests: load a model checkpoint at some TP and run :func:`generate` on a list of cases.

    {"run_dir": ..., "checkpoint": ..., "parallel": {...}, "vocab_size": V, "prompts": [[...], ...],
     "variants": [{"prefix": "sp_", "parallel": {...}, "model": {...}, "generate": {...},
                   "cases": [name, ...] | null}, ...],
     "cases": [{"name": str, "kwargs": {...generate kwargs...}, "rows": [i, ...] | null, "one_by_one": bool,
                "eos_from": [case_name, row, index] | null, "score": bool}, ...]}
      ->  run_dir/result.json {case_name: {"tokens", "ended_with_eos", "logprobs", "seconds"}, ...,
                               "<prefix>switches_restored": bool}

``rows`` picks prompts (default all); ``one_by_one`` calls generate once per prompt and concatenates the results;
``kv_rows`` sets ``kv_cache_gib`` to what that many rows of the case's length take; ``chunks`` calls generate once per
that many prompts (seed + first index, as static batches); ``record_finished`` lists ``on_finished``'s calls;
``eos_from`` sets ``eos_id`` to the token an earlier case generated at ``index`` in ``row`` (or in each of a list of
rows: several stop ids; with the case's own ``eos_id``: all are stop ids); ``perturb`` scales every layer's MLP output
weight by 1.5 in place before the case (as an optimizer step changes weights; later cases see it too); ``score`` adds ``scored_logprobs``, the generated
tokens' log-probs from a plain training-style forward (one unpadded row, no mask, no cache). Each of ``variants``
runs its cases (default all) again as ``<prefix><name>`` with its ``generate`` kwargs added to every case's (with
``compile_step``: ``<prefix>compiled_graphs``, the graphs torch.compile made) on a model built with those
ParallelConfig / ModelConfig overrides (e.g. sequence parallelism, Megatron's local attention), after :func:`prepare_generation` with the
variant's ``prepare`` kwargs if it has them (its figures: ``<prefix>prepare``); ``mask_ignoring_core_attention``
replaces every layer's core attention by :class:`MaskIgnoringAttention` (Transformer Engine's behaviour under a
causal mask).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from align_pipeline.config import ModelConfig, ParallelConfig, from_dict
from align_pipeline.model import init
from align_pipeline.model.decode import DecodeEngine, kv_bytes_per_row
from align_pipeline.model.generate import generate, prepare_generation
from align_pipeline.model.gpt import build_gpt
from align_pipeline.model.sequences import position_ids
from align_pipeline.train.core.distributed import init_distributed, shutdown


def run_cases(model, cfg: dict, prefix: str, names: list[str] | None) -> dict:
    results: dict = {}
    for case in cfg["cases"]:
        if names is not None and case["name"] not in names:
            continue
        kwargs = {**case["kwargs"], **cfg.get("generate", {})}
        kwargs.setdefault("vocab_size", cfg["vocab_size"])
        if case.get("eos_from"):
            src, rows_from, index = case["eos_from"]
            generated = [results[prefix + src]["tokens"][r][index] for r in
                         (rows_from if isinstance(rows_from, list) else [rows_from])]
            generated = generated[0] if len(generated) == 1 else generated
            if kwargs.get("eos_id") is not None:
                generated = [kwargs["eos_id"], *(generated if isinstance(generated, list) else [generated])]
            kwargs["eos_id"] = generated
        if case.get("perturb"):  # an in-place weight update, as an optimizer step makes (kept for later cases)
            with torch.no_grad():
                for layer in model.decoder.layers:
                    layer.mlp.linear_fc2.weight.mul_(1.5)
        rows = case.get("rows") or list(range(len(cfg["prompts"])))
        prompts = [cfg["prompts"][i] for i in rows]
        model.train()  # generate() must switch to eval and back
        engine = getattr(model, "_align_decode_engine", None)
        if engine is not None:
            engine.prefill_shapes.clear()  # record the prefill shapes of this case alone
        if case.get("kv_rows"):  # a KV budget of exactly that many rows of this case's length
            length = max(len(p) for p in prompts) + kwargs["max_new_tokens"]
            kwargs["kv_cache_gib"] = case["kv_rows"] * kv_bytes_per_row(model, length) / 2**30
        finished: list = []
        if case.get("record_finished"):
            kwargs["on_finished"] = lambda i, tokens, eos, into=finished: into.append([i, tokens, eos])
        t0 = time.perf_counter()
        if case.get("chunks"):  # static batches of that many prompts, batch c seeded seed + c * chunks
            k = case["chunks"]
            parts = [generate(model, prompts[lo : lo + k], **{**kwargs, "seed": kwargs.get("seed", 0) + lo})
                     for lo in range(0, len(prompts), k)]
            out = {key: [x for g in parts for x in getattr(g, key)] for key in ("tokens", "ended_with_eos",
                                                                                "logprobs")}
        elif case.get("one_by_one"):
            parts = [generate(model, [p], **kwargs) for p in prompts]
            out = {
                "tokens": [g.tokens[0] for g in parts],
                "ended_with_eos": [g.ended_with_eos[0] for g in parts],
                "logprobs": [g.logprobs[0] for g in parts],
            }
        else:
            out = dataclasses.asdict(generate(model, prompts, **kwargs))
        out["seconds"] = time.perf_counter() - t0
        out["finished"] = finished
        if case.get("score"):
            out["scored_logprobs"] = [score(model, p, t, cfg["vocab_size"]) for p, t in zip(prompts, out["tokens"])]
        out["eos_id"] = kwargs["eos_id"]
        engine = getattr(model, "_align_decode_engine", None)
        out["engine"] = None if engine is None else {"captures": engine.captures, "compactions": engine.compactions,
                                                      "allocations": DecodeEngine.allocations,
                                                      "prefill_shapes": sorted(engine.prefill_shapes)}
        assert model.training, "generate() did not restore training mode"
        results[prefix + case["name"]] = out
    return results


def score(model, prompt: list[int], new: list[int], vocab_size: int) -> list[float]:
    """log p(new[i] | prompt + new[:i]) from one full forward, as a training step computes it."""
    model.eval()
    # Right-pad to a multiple of TP (sequence parallelism splits the sequence); causal: earlier logits unchanged.
    tp = model.config.tensor_model_parallel_size
    row = prompt + new
    tokens = torch.tensor([row + [0] * (-len(row) % tp)], dtype=torch.long)  # [1, s]
    with torch.no_grad():
        logits = model(tokens, position_ids(tokens), None, runtime_gather_output=True)  # [1, s, V]
    logp = torch.log_softmax(logits[0, :, :vocab_size].float(), dim=-1)  # [s, V]
    targets = torch.tensor(new, dtype=torch.long)  # [n]
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(new))  # [n] position predicting each new token
    model.train()
    return logp[rows, targets].tolist()


class MaskIgnoringAttention(torch.nn.Module):
    """Stands in for Transformer Engine's core attention (not installable here) where it matters to generate(): under
    a causal mask type it applies its own causal mask and ignores ``attention_mask`` (so it cannot left-pad)."""

    def __init__(self, groups: int):
        super().__init__()
        self.groups = groups  # query heads per key/value head

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] == k.shape[2])
        sq, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [sq, b, np * hn]


def install_mask_ignoring_attention(model) -> bool:
    """Replace every layer's core attention by the stand-in; True when it matches SDPA on an unpadded forward."""
    tokens = torch.tensor([[1, 5, 9, 4, 7, 3]])
    model.eval()
    with torch.no_grad():
        before = model(tokens, position_ids(tokens), None, runtime_gather_output=True)
        for layer in model.decoder.layers:
            core = layer.self_attention.core_attention
            groups = core.num_attention_heads_per_partition // core.num_query_groups_per_partition
            layer.self_attention.core_attention = MaskIgnoringAttention(groups)
        after = model(tokens, position_ids(tokens), None, runtime_gather_output=True)
    model.train()
    return bool(torch.allclose(before, after, atol=1e-5))


def sequence_parallel_switches(model) -> list:
    """Every sequence-parallel flag of the model (generate() turns them off and must restore them)."""
    attrs = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")
    flags = [getattr(m, a) for m in model.modules() for a in attrs if hasattr(m, a)]
    return [model.config.sequence_parallel, *flags]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = json.loads(Path(parser.parse_args().config).read_text())
    parallel = from_dict(ParallelConfig, cfg["parallel"])
    dist = init_distributed(parallel, seed=0)
    source = init.resolve(cfg["checkpoint"], ModelConfig(attention_backend="sdpa"), tokenizer_vocab_size=0)

    results: dict = {}
    for variant in [{"prefix": ""}] + cfg.get("variants", []):
        par = dataclasses.replace(parallel, **variant.get("parallel", {}))
        model = build_gpt(dataclasses.replace(source.model, **variant.get("model", {})), par, source.vocab_size,
                          dist.pgs)
        source.load(model)
        if variant.get("mask_ignoring_core_attention"):
            results[variant["prefix"] + "stand_in_is_causal"] = install_mask_ignoring_attention(model)
        if variant.get("prepare"):  # the one-off set-up a rollout job runs first
            results[variant["prefix"] + "prepare"] = prepare_generation(model, vocab_size=cfg["vocab_size"],
                                                                        **variant["prepare"])
        before = sequence_parallel_switches(model)
        cores = [type(layer.self_attention.core_attention) for layer in model.decoder.layers]
        results.update(run_cases(model, {**cfg, "generate": variant.get("generate", {})}, variant["prefix"],
                                 variant.get("cases")))
        if variant.get("generate", {}).get("compile_step"):
            from torch._dynamo.utils import counters

            results[variant["prefix"] + "compiled_graphs"] = counters["stats"]["unique_graphs"]
        results[variant["prefix"] + "switches_restored"] = sequence_parallel_switches(model) == before
        results[variant["prefix"] + "core_attention_restored"] = cores == [
            type(layer.self_attention.core_attention) for layer in model.decoder.layers]
    if dist.rank == 0:
        (Path(cfg["run_dir"]) / "result.json").write_text(json.dumps(results))
    shutdown()


if __name__ == "__main__":
    main()
