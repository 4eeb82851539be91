"""Batched generation on a real (briefly trained) Megatron-core GPT under torchrun on gloo.

One SFT run gives the checkpoint; one TP=1 job and one TP=2 job run every generation case (see generate_worker.py) and
the tests compare their results: KV cache == no cache (greedy and sampled), batched (left-padded) == one prompt at a
time, TP=2 == TP=1 (also with sequence parallelism), SDPA == Megatron's local attention, log-probs == a training-style
forward, sampling reproducible, top-k=1 / cold temperature == greedy, EOS and the length cap, samples sharing a
prompt's prefill, finished rows dropped, weights changed in place.
The sampler's filtering and the guards run in a subprocess (Megatron patches torch on CPU, so never in pytest).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from jobs import RAW
from test_megatron_cpu import run_py

from align_pipeline.config import LaunchConfig
from align_pipeline.data.tokenizer import load_tokenizer
from align_pipeline.launch import run_torchrun

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
N = 8  # prompts in the comparison batch; prompts[N:] only serve the throughput case
NEW = 16


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("generate")
    tok = load_tokenizer(tiny_models["tokenizer"])
    texts = [json.loads(line)["prompt"] for line in (RAW / "prompts.jsonl").read_text().splitlines()]
    by_length = {len(t): t for t in texts}  # one prompt of each length first, to vary the padding
    chosen = (list(by_length.values()) + texts)[: N - 1]
    prompts = [[tok.bos_id]] + [[tok.bos_id] + tok.encode(t) for t in chosen]  # + a BOS-only prompt: all padding
    prompts += [[tok.bos_id] + tok.encode(t) for t in texts[:64]]
    assert len(prompts) == N + 64 and len({len(p) for p in prompts[:N]}) >= 3
    return {"tmp": tmp, "tok": tok, "checkpoint": tiny_models["sft"], "prompts": prompts}


def _run(setup, name: str, tp: int, cases: list[dict], variants: list[dict]) -> dict:
    run_dir = setup["tmp"] / name
    run_dir.mkdir()
    # One thread per rank: the tiny model gains nothing from more, and on a busy machine OpenMP threads waiting on
    # descheduled peers made 2-thread runs up to 30x slower (seen: 1.2 s instead of 0.04 s for the 64-prompt case).
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    config = {
        "checkpoint": setup["checkpoint"],
        "parallel": {"tensor_model_parallel_size": tp},
        "vocab_size": setup["tok"].vocab_size,
        "prompts": setup["prompts"],
        "cases": cases,
        "variants": variants,
    }
    return run_torchrun("generate_worker", config, LaunchConfig(nproc_per_node=tp), run_dir, env=env)


def _cases(tok, batch: list[int]) -> tuple[list[dict], list[dict]]:
    """(cases for both TP sizes, cases for TP=1 only)."""
    greedy = {"max_new_tokens": NEW, "eos_id": None, "pad_id": tok.pad_id, "greedy": True}
    sample = {"max_new_tokens": NEW, "eos_id": None, "pad_id": tok.pad_id, "temperature": 1.0, "seed": 5}
    common = [
        {"name": "greedy", "kwargs": greedy, "rows": batch, "score": True},
        {"name": "sample", "kwargs": sample, "rows": batch},
    ]
    tp1 = [
        {"name": "greedy_nocache", "kwargs": {**greedy, "use_cache": False}, "rows": batch},
        {"name": "greedy_one_by_one", "kwargs": greedy, "rows": batch, "one_by_one": True},
        # prompts of several lengths, one generate call each, left-padded to a multiple of 32: one prefill shape
        {"name": "bucketed_one_by_one", "kwargs": {**greedy, "prefill_bucket": 32}, "rows": batch,
         "one_by_one": True},
        {"name": "greedy_eos", "kwargs": {**greedy, "eos_id": tok.eos_id}, "rows": batch},
        {"name": "greedy_eos_generated", "kwargs": greedy, "rows": batch, "eos_from": ["greedy", 1, 3]},
        {"name": "greedy_two_stops", "kwargs": {**greedy, "eos_id": tok.eos_id}, "rows": batch,
         "eos_from": ["greedy", 1, 3]},
        {"name": "greedy_cap", "kwargs": {**greedy, "max_new_tokens": 5}, "rows": batch},
        {"name": "top_k_1", "kwargs": {**sample, "top_k": 1}, "rows": batch},
        {"name": "cold", "kwargs": {**sample, "temperature": 1e-5}, "rows": batch},
        {"name": "sample_again", "kwargs": sample, "rows": batch},
        {"name": "sample_nocache", "kwargs": {**sample, "use_cache": False}, "rows": batch},
        {"name": "sample_other_seed", "kwargs": {**sample, "seed": 6}, "rows": batch},
        {"name": "sample_filtered", "kwargs": {**sample, "temperature": 0.7, "top_k": 8, "top_p": 0.9},
         "rows": batch, "score": True},
        # Several samples per prompt (prefilled once): the same tokens as the reference path, samples differ.
        {"name": "samples_shared", "kwargs": sample, "rows": [1] * 4 + [2] * 4},
        {"name": "samples_shared_nocache", "kwargs": {**sample, "use_cache": False}, "rows": [1] * 4 + [2] * 4},
        # Rows stop at different steps: the batch is compacted to the rows still running.
        {"name": "finish_early", "kwargs": greedy, "rows": batch, "eos_from": ["greedy", 0, 0]},
        {"name": "finish_early_nocache", "kwargs": {**greedy, "use_cache": False}, "rows": batch,
         "eos_from": ["greedy", 0, 0]},
        # Weights changed in place (as by an optimizer step): the kept cache and step see them.
        {"name": "perturbed", "kwargs": greedy, "rows": batch, "perturb": True},
        {"name": "perturbed_nocache", "kwargs": {**greedy, "use_cache": False}, "rows": batch},
        {"name": "bench_64x16", "kwargs": greedy, "rows": list(range(N, N + 64))},
        {"name": "bench_64x16_nocache", "kwargs": {**greedy, "use_cache": False}, "rows": list(range(N, N + 64))},
        # (Last: a KV budget replaces the kept cache by a smaller one.) Continuous batching: responses of different lengths (two generated tokens made stop ids), 8 samples
        # through a KV budget of 3 rows refilled as they end; the same samples as one static batch and as the
        # reference path. max_rows: the samples of static batches of that size, generated in one call.
        {"name": "refill_static", "kwargs": sample, "rows": batch, "eos_from": ["sample", [0, 3], 2]},
        {"name": "refill_budget", "kwargs": sample, "rows": batch, "eos_from": ["sample", [0, 3], 2], "kv_rows": 3,
         "record_finished": True},
        {"name": "refill_nocache", "kwargs": {**sample, "use_cache": False}, "rows": batch,
         "eos_from": ["sample", [0, 3], 2]},
        {"name": "rows_of_3", "kwargs": {**sample, "max_rows": 3}, "rows": batch, "eos_from": ["sample", [0, 3], 2],
         "record_finished": True},
        {"name": "rows_of_3_chunks", "kwargs": sample, "rows": batch, "eos_from": ["sample", [0, 3], 2],
         "chunks": 3},
        # Past 256 columns a step attends over a wider span of the cache (256, then 384): the same tokens as the
        # reference path, also with rows refilled at column 0 while others are past 256.
        {"name": "long", "kwargs": {**greedy, "max_new_tokens": 300}, "rows": batch[:4]},
        {"name": "long_refill", "kwargs": {**sample, "max_new_tokens": 300}, "rows": batch[:5], "kv_rows": 2},
        {"name": "long_nocache", "kwargs": {**greedy, "max_new_tokens": 300, "use_cache": False},
         "rows": batch[:4]},
        {"name": "long_refill_nocache", "kwargs": {**sample, "max_new_tokens": 300, "use_cache": False},
         "rows": batch[:5]},
    ]
    return common, tp1


@pytest.fixture(scope="module")
def tp1(setup):
    common, only_tp1 = _cases(setup["tok"], list(range(N)))
    local = {"prefix": "local_", "model": {"attention_backend": "local"}, "cases": ["greedy", "greedy_nocache"]}
    te_like = {"prefix": "te_like_", "mask_ignoring_core_attention": True, "cases": ["greedy", "greedy_nocache"]}
    compiled = {"prefix": "compiled_", "generate": {"compile_step": True},
                "cases": ["greedy", "sample", "finish_early", "perturbed", "refill_budget", "long"]}
    return _run(setup, "tp1", 1, common + only_tp1, [local, te_like, compiled])


@pytest.fixture(scope="module")
def tp2(setup):
    common, _ = _cases(setup["tok"], list(range(N)))
    return _run(setup, "tp2", 2, common, [{"prefix": "sp_", "parallel": {"sequence_parallel": True}}])


def _close(a: list[list[float]], b: list[list[float]], tol: float) -> None:
    assert [len(x) for x in a] == [len(x) for x in b]
    diff = max((abs(x - y) for xa, xb in zip(a, b) for x, y in zip(xa, xb)), default=0.0)
    assert diff <= tol, diff


def _cut(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def test_kv_cache_equals_full_recompute(tp1):
    assert tp1["greedy"]["tokens"] == tp1["greedy_nocache"]["tokens"]
    assert all(len(t) == NEW for t in tp1["greedy"]["tokens"])
    _close(tp1["greedy"]["logprobs"], tp1["greedy_nocache"]["logprobs"], 1e-5)
    assert tp1["sample"]["tokens"] == tp1["sample_nocache"]["tokens"]


def test_compiled_decode_step_gives_the_same_tokens(tp1):
    """``compile_step``: the decode step through torch.compile (fused elementwise kernels; on a GPU, captured as
    such) against the eager step: the same tokens and log-probs to fp32 rounding, with rows finishing early, weights
    changed in place (the compiled step reads the live ones), rows refilled under a KV budget (a new, smaller cache)
    and a long generation whose span grows past 256 columns; the step compiled at most three times (the first width
    and span static, then once with symbolic sizes)."""
    for case in ("greedy", "sample", "finish_early", "perturbed", "refill_budget", "long"):
        assert tp1["compiled_" + case]["tokens"] == tp1[case]["tokens"], case
        _close(tp1["compiled_" + case]["logprobs"], tp1[case]["logprobs"], 1e-5)
    assert 1 <= tp1["compiled_compiled_graphs"] <= 3


def test_megatron_local_attention_gives_the_same_tokens(tp1):
    """Megatron's unfused core attention honours the same explicit mask, with and without the KV cache."""
    for case in ("greedy", "greedy_nocache"):
        assert tp1["local_" + case]["tokens"] == tp1["greedy"]["tokens"], case
        _close(tp1["local_" + case]["logprobs"], tp1["greedy"]["logprobs"], 1e-5)


def test_a_core_attention_that_ignores_the_mask_is_swapped_for_generation(tp1):
    """Transformer Engine's core attention ignores an explicit mask under a causal mask type. TE cannot run here, so a
    stand-in with that behaviour (generate_worker.MaskIgnoringAttention) replaces every layer's core attention:
    generate() swaps in SDPA for the call (padded batch, with and without the KV cache: the same tokens and log-probs
    as the SDPA model) and puts the stand-in back afterwards."""
    for case in ("greedy", "greedy_nocache"):
        assert tp1["te_like_" + case]["tokens"] == tp1["greedy"]["tokens"], case
        _close(tp1["te_like_" + case]["logprobs"], tp1["greedy"]["logprobs"], 1e-5)
    assert tp1["te_like_core_attention_restored"] and tp1["te_like_stand_in_is_causal"]


def test_bucketed_prefill_gives_the_same_tokens_with_one_prefill_shape(tp1):
    """``prefill_bucket``: each prompt alone, padded to 32 columns (masked): the tokens and log-probs of the unpadded
    calls, and one prefill shape where the unpadded calls used one per prompt length (what a GPU plans for)."""
    bucketed, plain = tp1["bucketed_one_by_one"], tp1["greedy_one_by_one"]
    assert bucketed["tokens"] == plain["tokens"]
    _close(bucketed["logprobs"], plain["logprobs"], 1e-5)
    assert [tuple(s) for s in bucketed["engine"]["prefill_shapes"]] == [(1, 32, True)]
    assert len(plain["engine"]["prefill_shapes"]) >= 2  # the demo prompts have several lengths


def test_left_padded_batch_equals_one_prompt_at_a_time(tp1):
    assert tp1["greedy"]["tokens"] == tp1["greedy_one_by_one"]["tokens"]
    _close(tp1["greedy"]["logprobs"], tp1["greedy_one_by_one"]["logprobs"], 1e-5)


def test_logprobs_are_the_plain_model_logprobs(tp1):
    """Equal to a training-style forward over prompt + generated tokens (no padding, no cache, no mask)."""
    _close(tp1["greedy"]["logprobs"], tp1["greedy"]["scored_logprobs"], 1e-5)
    # sampled with temperature 0.7, top-k and top-p: the reported log-probs are still the plain (untempered) ones
    _close(tp1["sample_filtered"]["logprobs"], tp1["sample_filtered"]["scored_logprobs"], 1e-5)


def test_tp2_equals_tp1(tp1, tp2):
    """Also with sequence parallelism (switched off during generation, restored after: a training-style SP forward
    on the generated sequences then gives the same log-probs)."""
    assert tp2["switches_restored"] and tp2["sp_switches_restored"] and tp1["switches_restored"]
    _close(tp2["sp_greedy"]["scored_logprobs"], tp1["greedy"]["logprobs"], 1e-4)
    for prefix in ("", "sp_"):
        assert tp2[prefix + "greedy"]["tokens"] == tp1["greedy"]["tokens"], prefix
        _close(tp2[prefix + "greedy"]["logprobs"], tp1["greedy"]["logprobs"], 1e-4)
        # Sampling: inverse-CDF with the same seeded uniforms; logits agree to ~1e-6, far from any CDF boundary.
        assert tp2[prefix + "sample"]["tokens"] == tp1["sample"]["tokens"], prefix
        _close(tp2[prefix + "sample"]["logprobs"], tp1["sample"]["logprobs"], 1e-4)


def test_sampling_is_reproducible_and_seeded(tp1):
    assert tp1["sample"]["tokens"] == tp1["sample_again"]["tokens"]
    assert tp1["sample"]["logprobs"] == tp1["sample_again"]["logprobs"]
    assert tp1["sample"]["tokens"] != tp1["sample_other_seed"]["tokens"]
    assert tp1["sample"]["tokens"] != tp1["greedy"]["tokens"]


def test_top_k_1_and_cold_temperature_equal_greedy(tp1):
    assert tp1["top_k_1"]["tokens"] == tp1["greedy"]["tokens"]
    assert tp1["cold"]["tokens"] == tp1["greedy"]["tokens"]


def test_eos_stops_and_max_new_tokens_caps(tp1, setup):
    greedy = tp1["greedy"]["tokens"]
    assert not any(tp1["greedy"]["ended_with_eos"])  # eos_id=None: never stops early
    for case in ("greedy_eos", "greedy_eos_generated"):
        out, eos = tp1[case], tp1[case]["eos_id"]
        assert out["tokens"] == [_cut(row, eos) for row in greedy], case
        assert out["ended_with_eos"] == [eos in row for row in greedy], case
        assert [len(x) for x in out["logprobs"]] == [len(t) for t in out["tokens"]]
        _close(out["logprobs"], [lp[: len(t)] for lp, t in zip(tp1["greedy"]["logprobs"], out["tokens"])], 1e-5)
    # Two stop ids (EOS and a chat template's end-of-turn): a row ends at the first of either.
    stops = set(tp1["greedy_two_stops"]["eos_id"])
    cut = [row[: next((j + 1 for j, t in enumerate(row) if t in stops), len(row))] for row in greedy]
    assert tp1["greedy_two_stops"]["tokens"] == cut
    assert tp1["greedy_two_stops"]["ended_with_eos"] == [bool(stops & set(row)) for row in greedy]
    assert tp1["greedy_eos_generated"]["ended_with_eos"][1]  # that row's 4th token was made the EOS
    assert len(tp1["greedy_eos_generated"]["tokens"][1]) <= 4
    assert tp1["greedy_cap"]["tokens"] == [row[:5] for row in greedy]
    assert tp1["greedy_cap"]["ended_with_eos"] == [False] * N
    assert any(tp1["greedy_eos"]["ended_with_eos"]), "the trained model should emit its EOS on some prompt"


def test_samples_of_one_prompt_share_its_prefill(tp1):
    """Rows 4 x prompt 1 + 4 x prompt 2: prefilled once per prompt, the cache rows copied; the same tokens and
    log-probs as the reference path (which recomputes every row), and the samples of a prompt differ."""
    shared, ref = tp1["samples_shared"], tp1["samples_shared_nocache"]
    assert shared["tokens"] == ref["tokens"]
    _close(shared["logprobs"], ref["logprobs"], 1e-5)
    assert len({tuple(t) for t in shared["tokens"][:4]}) > 1 and len({tuple(t) for t in shared["tokens"][4:]}) > 1


def test_finished_rows_are_dropped_from_the_step(tp1):
    """Row 0's first token made the stop id: rows stop at different steps, and once half of them have, the cached path
    compacts the batch to the rows still running; it gives what the reference path gives (tokens, stop flags,
    log-probs)."""
    early, ref = tp1["finish_early"], tp1["finish_early_nocache"]
    assert early["tokens"] == ref["tokens"] and early["ended_with_eos"] == ref["ended_with_eos"]
    _close(early["logprobs"], ref["logprobs"], 1e-5)
    lengths = sorted(len(t) for t in early["tokens"])
    assert lengths[0] == 1 and lengths[N // 2] < lengths[-1], lengths  # half done while some still run
    assert early["engine"]["compactions"] > tp1["greedy_cap"]["engine"]["compactions"]


def test_refilled_rows_give_the_samples_of_one_static_batch(tp1):
    """8 sampled responses of different lengths through a KV cache bounded to 3 rows: as a response ends, its row
    takes the next pending sample (prefilled into that row while the others keep going). Every sample reads its own
    uniforms, so the tokens are those of one static batch of 8 and of the reference path; the responses are reported
    as they end, each once, with their final tokens."""
    static, budget, ref = tp1["refill_static"], tp1["refill_budget"], tp1["refill_nocache"]
    assert len({len(t) for t in static["tokens"]}) >= 3, static["tokens"]  # lengths vary
    assert budget["tokens"] == static["tokens"] == ref["tokens"]
    assert budget["ended_with_eos"] == static["ended_with_eos"]
    _close(budget["logprobs"], static["logprobs"], 1e-5)
    assert (budget["slots"], static["slots"]) == (3, N)
    assert budget["admissions"] >= 3  # at least ceil(8 / 3) - 1 refills after the first prefill
    finished = budget["finished"]
    assert sorted(i for i, _, _ in finished) == list(range(N))
    assert all(tokens == budget["tokens"][i] and eos == budget["ended_with_eos"][i] for i, tokens, eos in finished)
    assert [i for i, _, _ in finished] != list(range(N))  # reported as they end, not in prompt order


def test_max_rows_gives_the_samples_of_static_batches_of_that_size(tp1):
    """``max_rows=3`` in one call == three generate calls of 3, 3 and 2 prompts seeded seed, seed + 3, seed + 6 (what
    rollouts did before continuous batching: the default run's samples are unchanged)."""
    one_call, chunks = tp1["rows_of_3"], tp1["rows_of_3_chunks"]
    assert one_call["tokens"] == chunks["tokens"] and one_call["ended_with_eos"] == chunks["ended_with_eos"]
    _close(one_call["logprobs"], chunks["logprobs"], 1e-5)
    assert one_call["slots"] == 3 and one_call["tokens"] != tp1["refill_static"]["tokens"]


def test_steps_past_256_columns_attend_over_a_wider_span(tp1):
    """300 new tokens: the decode steps attend over the first 256 cache columns, then 384 (DecodeEngine.spans); the
    tokens are those of the full-recompute reference, also when a KV budget of 2 rows refills a row at its first
    columns while the other is past column 256."""
    for name in ("long", "long_refill"):
        ours, ref = tp1[name], tp1[name + "_nocache"]
        assert [len(t) for t in ours["tokens"]] == [300] * len(ours["tokens"]), name
        assert ours["tokens"] == ref["tokens"], name
        _close(ours["logprobs"], ref["logprobs"], 1e-4)
    assert tp1["long_refill"]["slots"] == 2 and tp1["long_refill"]["admissions"] >= 2


def test_the_kept_cache_sees_weights_changed_in_place(tp1):
    """The engine (cache, buffers) is built once per model and kept across calls; a weight update in place reaches
    it without a rebuild."""
    assert tp1["perturbed"]["tokens"] == tp1["perturbed_nocache"]["tokens"]
    _close(tp1["perturbed"]["logprobs"], tp1["perturbed_nocache"]["logprobs"], 1e-5)
    assert tp1["perturbed"]["tokens"] != tp1["greedy"]["tokens"]
    assert tp1["greedy"]["engine"]["allocations"] == tp1["perturbed"]["engine"]["allocations"]


def test_decode_rope_is_megatrons_rope_bit_for_bit():
    """The cached attention's RoPE (cos/sin tables made once, query and key in one tensor) gives exactly what
    Megatron's own application gives, in bf16 and fp32, for a prefill and for one decode column."""
    import types

    import torch
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from align_pipeline.model.decode import DecodeEngine

    torch.manual_seed(0)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))  # head_dim 16
    freqs = torch.outer(torch.arange(40).float(), inv)
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [S, 1, 1, 16], Megatron's layout
    for dtype in (torch.bfloat16, torch.float32):
        cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
        sin_signed = torch.cat((-sin[..., :8], sin[..., 8:]), dim=-1)
        for cols in (slice(0, 40), slice(23, 24)):  # prefill; the decode step at column 23
            sq = cols.stop - cols.start
            q, k = torch.randn(sq, 3, 4, 16, dtype=dtype), torch.randn(sq, 3, 2, 16, dtype=dtype)  # [sq, b, heads, hn]
            engine = types.SimpleNamespace(rope_cos=cos[cols], rope_sin=sin_signed[cols])
            ours_q, ours_k = DecodeEngine.apply_rope(engine, q, k)
            assert torch.equal(ours_q, _apply_rotary_pos_emb_bshd(q, freqs[cols])), dtype
            assert torch.equal(ours_k, _apply_rotary_pos_emb_bshd(k, freqs[cols])), dtype


def _attend_reference(q, k, v, keep, scale):
    """Decode attention by hand: query head h reads key/value head h // (heads / groups), over the kept columns."""
    import torch

    b, heads, _, d = q.shape
    group = heads // k.shape[1]
    out = torch.empty(b, heads, 1, d, dtype=torch.float64)
    for i in range(b):
        cols = keep[i, 0, 0].nonzero().flatten()
        for h in range(heads):
            kh, vh = k[i, h // group, cols].double(), v[i, h // group, cols].double()
            weights = torch.softmax((kh @ q[i, h, 0].double()) * scale, dim=0)
            out[i, h, 0] = weights @ vh
    return out


@pytest.mark.parametrize("heads,groups", [(8, 2), (12, 4), (4, 4), (6, 1)])
def test_decode_attention_over_the_cache(heads, groups):
    """The decode step's attention over the cache (model/decode.attend_cache) equals attention computed by hand, for
    GQA and MHA, rows keeping different numbers of columns."""
    import torch

    from align_pipeline.model.decode import attend_cache

    g = torch.Generator().manual_seed(heads * 10 + groups)
    b, span, d = 5, 37, 16
    q = torch.randn(1, b, heads, d, generator=g).permute(1, 2, 0, 3)  # as the engine permutes [sq, b, np, hn]
    k, v = torch.randn(b, groups, span, d, generator=g), torch.randn(b, groups, span, d, generator=g)
    filled = torch.tensor([1, 5, 17, 36, 37])
    keep = (torch.arange(span)[None, :] < filled[:, None])[:, None, None, :]
    expected = _attend_reference(q, k, v, keep, 0.25)
    out = attend_cache(q, k, v, keep, 0.25)
    assert out.shape == (b, heads, 1, d)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-6)


@pytest.mark.gpu
def test_decode_attention_over_the_cache_on_a_gpu():
    """On a GPU (cuDNN's GQA kernel), fp32 and bf16 against attention computed by hand."""
    import torch

    from align_pipeline.model.decode import attend_cache

    g = torch.Generator().manual_seed(0)
    b, heads, groups, span, d = 64, 32, 8, 300, 64
    q = torch.randn(b, heads, 1, d, generator=g)
    k, v = torch.randn(b, groups, span, d, generator=g), torch.randn(b, groups, span, d, generator=g)
    keep = (torch.arange(span)[None, :] < torch.randint(1, span + 1, (b,), generator=g)[:, None])[:, None, None, :]
    expected = _attend_reference(q, k, v, keep, d**-0.5)
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        args = [x.to("cuda", dtype) for x in (q, k, v)]
        out = attend_cache(*args, keep.cuda(), d**-0.5)
        torch.testing.assert_close(out.double().cpu(), expected, rtol=0, atol=atol)


def test_throughput_64_prompts(tp1):
    """Reported, not asserted: tokens/s for 64 prompts x 16 new tokens (printed with -s)."""
    for case in ("bench_64x16", "bench_64x16_nocache"):
        out = tp1[case]
        n = sum(len(t) for t in out["tokens"])
        assert n == 64 * NEW
        print(f"{case}: {n} tokens in {out['seconds']:.2f} s = {n / out['seconds']:.0f} tokens/s")


def test_sampler_filters_and_guards():
    out = run_py(
        """
        import types, torch
        from align_pipeline.train.core import megatron_cpu
        megatron_cpu.activate()
        from align_pipeline.model.generate import generate, sample_next_token

        probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
        logits = probs.log().expand(4000, 4)  # [4000, 4]
        draw = lambda seed, **kw: sample_next_token(logits, generator=torch.Generator().manual_seed(seed), **kw)
        freq = torch.bincount(draw(0), minlength=4) / 4000.0
        assert torch.allclose(freq, probs, atol=0.03), freq
        assert torch.equal(draw(1), draw(1)) and not torch.equal(draw(1), draw(2))
        assert set(draw(0, top_k=2).tolist()) == {0, 1}
        assert set(draw(0, top_p=0.7).tolist()) == {0, 1}     # 0.5 < 0.7, then 0.8 >= 0.7: {0, 1}
        assert set(draw(0, top_p=0.5).tolist()) == {0}        # the top token alone reaches 0.5
        assert set(draw(0, top_p=0.85).tolist()) == {0, 1, 2}
        t = draw(0, temperature=0.5); f = torch.bincount(t, minlength=4) / 4000.0
        sharp = probs ** 2 / (probs ** 2).sum()
        assert torch.allclose(f, sharp, atol=0.03), f
        assert torch.equal(draw(0, greedy=True), torch.zeros(4000, dtype=torch.long))
        assert torch.equal(draw(0, temperature=0.0), torch.zeros(4000, dtype=torch.long))

        class Fake(torch.nn.Module):
            # A 'GPTModel' whose padded vocab rows (ids >= 5 of 8) have by far the largest logits.
            def __init__(self, pp=1, core_attention=None):
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros(1))
                attn = types.SimpleNamespace(core_attention=core_attention)
                layers = [types.SimpleNamespace(self_attention=attn)] if core_attention else []
                self.decoder = types.SimpleNamespace(layers=layers)
                self.config = types.SimpleNamespace(pipeline_model_parallel_size=pp, sequence_parallel=False)
                self.pre_process = self.post_process = True
                self.vocab_size = 8
                self.pg_collection = types.SimpleNamespace(tp=None)
            def forward(self, tokens, positions, mask, inference_context=None, runtime_gather_output=None):
                assert inference_context is None and runtime_gather_output
                b, s = tokens.shape
                return torch.tensor([0.0, 1.0, 2.0, 0.5, 0.1, 50.0, 60.0, 70.0]).expand(b, s, 8)
        kw = dict(max_new_tokens=6, eos_id=None, pad_id=0, vocab_size=5, use_cache=False)
        g = generate(Fake(), [[1, 2], [3]], greedy=True, **kw)
        assert g.tokens == [[2] * 6, [2] * 6], g.tokens
        s = generate(Fake(), [[1, 2], [3]], temperature=100.0, **kw)
        assert all(0 <= t < 5 for row in s.tokens for t in row), s.tokens
        lp = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0, 0.5, 0.1]), -1)
        assert all(abs(x - lp[t].item()) < 1e-6 for row, lps in zip(s.tokens, s.logprobs) for t, x in zip(row, lps))
        try:
            generate(Fake(pp=2), [[1]], greedy=True, **kw)
            raise AssertionError("accepted")
        except NotImplementedError as e:
            assert "pipeline" in str(e), e
        print("OK")
        """
    )
    assert "OK" in out


@pytest.mark.gpu
def test_cuda_graph_decode_on_a_gpu(setup):
    """On a GPU (fp32): the captured decode step gives bit for bit what the same step gives eagerly (64 rows stopping
    at EOS at different steps, greedy, sampled, shared prefills, weights changed in place), and the tokens of the
    full-recompute reference. The cache is allocated once; graphs are captured at the first call that needs a width
    and replayed after, also after the weights change in place; finished rows are dropped to smaller graphs. Then
    the same after the one-off set-up a rollout job runs first: every width captured before the first call, none
    during any call. And the compiled step (``compile_step``), captured: the same tokens, log-probs to 1e-4."""
    tok = setup["tok"]
    greedy = {"max_new_tokens": NEW, "eos_id": None, "pad_id": tok.pad_id, "greedy": True}
    sample = {"max_new_tokens": NEW, "eos_id": None, "pad_id": tok.pad_id, "temperature": 1.0, "seed": 5}
    rows64 = list(range(N, N + 64))
    specs = [
        ("rows64", {**greedy, "max_new_tokens": 40, "eos_id": tok.eos_id}, rows64, {}),  # first: allocates the cache
        ("greedy", greedy, list(range(N)), {}),
        ("sample", sample, list(range(N)), {}),
        ("samples_shared", sample, [1] * 4 + [2] * 4, {}),
        ("perturbed", greedy, list(range(N)), {"perturb": True}),
    ]
    cases = []
    for name, kwargs, rows, extra in specs:
        cases.append({"name": name, "kwargs": kwargs, "rows": rows, **extra})
        cases.append({"name": name + "_eager", "kwargs": {**kwargs, "cuda_graphs": False}, "rows": rows})
        cases.append({"name": name + "_nocache", "kwargs": {**kwargs, "use_cache": False}, "rows": rows})
    longest = max(len(setup["prompts"][i]) for _, _, rows, _ in specs for i in rows)
    prepared = {"prefix": "prepared_", "prepare": {"batch": 64, "length": longest + 40, "prompt_len": longest,
                                                        "pad_id": tok.pad_id}}
    # the decode step through torch.compile, captured the same way (generation.compile_step)
    compiled = {"prefix": "compiled_", "generate": {"compile_step": True},
                "cases": ["rows64", "greedy", "sample", "samples_shared", "perturbed"]}
    out = _run(setup, "gpu", 1, cases, [prepared, compiled])
    for name in compiled["cases"]:
        assert out["compiled_" + name]["tokens"] == out[name]["tokens"], name
        _close(out["compiled_" + name]["logprobs"], out[name]["logprobs"], 1e-4)
    # a fresh model prepared: every width of a 64-row batch captured up front, no capture or allocation afterwards
    assert out["prepared_prepare"]["capture_s"] > 0, out["prepared_prepare"]
    after = [out["prepared_" + c["name"]]["engine"] for c in cases]
    assert {(e["captures"], e["allocations"]) for e in after} == {(4, after[0]["allocations"])}, after  # 64..8
    for c in cases:
        assert out["prepared_" + c["name"]]["tokens"] == out[c["name"]]["tokens"], c["name"]
    for name, *_ in specs:
        graphs, eager, ref = out[name], out[name + "_eager"], out[name + "_nocache"]
        assert graphs["tokens"] == eager["tokens"] and graphs["logprobs"] == eager["logprobs"], name
        assert graphs["tokens"] == ref["tokens"], name
        _close(graphs["logprobs"], ref["logprobs"], 1e-4)
    engine = {c["name"]: out[c["name"]]["engine"] for c in cases}
    assert len({e["allocations"] for e in engine.values()}) == 1  # one cache for every call
    # Rows are checked every 8 steps and compacted when the running ones fit a graph of half the width.
    width = lambda rows: min(64, max(8, 1 << (rows - 1).bit_length()))
    lengths, n, expected = [len(t) for t in out["rows64"]["tokens"]], 64, 0
    for step in range(8, 41, 8):
        left = sum(length > step for length in lengths)
        if left == 0:
            break
        if width(left) <= width(n) // 2:
            expected, n = expected + 1, left
    assert engine["rows64"]["compactions"] == expected, (lengths, engine["rows64"])
    assert engine["rows64"]["captures"] >= 1 + expected
    assert out["perturbed"]["tokens"] != out["greedy"]["tokens"]
    assert engine["perturbed"]["captures"] == engine["samples_shared_nocache"]["captures"]  # no capture for new weights
    print({name: (e["captures"], e["compactions"]) for name, e in engine.items()}, lengths)
