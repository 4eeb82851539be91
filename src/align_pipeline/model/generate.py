"""Batched autoregressive generation for a Megatron-core ``GPTModel`` (rollouts for RL, samples for evaluation).

    gen = generate(model, [tok.start_ids() + tok.encode("add: 23+45\\n"), ...], max_new_tokens=16,
                   eos_id=tok.stop_ids, pad_id=tok.pad_id, vocab_size=tok.vocab_size, greedy=True)
    gen.tokens[0], gen.ended_with_eos[0], gen.logprobs[0]

How it works:

* **Left padding + explicit mask.** Prompts are left-padded to the longest one, so every row's last prompt token sits
  in the same column and each step appends one column. Pad keys are masked with an explicit boolean attention mask
  (Megatron convention: True = masked out), built here with the causal part included so the core attention needs
  no mask type of its own (without padding no mask is passed at all). A pad *query* may attend to itself only, so no
  softmax row is fully masked (that would give NaN, which then leaks through ``0 * NaN`` in later layers). Position
  ids count real tokens only, which matters for learned absolute positions; Megatron applies RoPE by column index,
  and a per-row constant shift does not change RoPE attention scores (they are relative), so left padding leaves
  the result unchanged (tested: batched == one prompt at a time).
* **KV cache, continuous batching.** A static cache kept on the model (:mod:`~align_pipeline.model.decode`) of
  ``slots`` rows: ``max_rows`` (default all prompts), fewer when ``kv_cache_gib`` bounds its memory. Samples enter
  the slots in order; identical prompts (several samples per prompt) entering together are prefilled once; each step
  feeds one token per slot (on a GPU, a captured CUDA graph). Every few steps the slots whose response has ended
  (a stop id, or ``max_new_tokens``) are handed to the next pending samples (prefilled into those rows while the
  others keep their state), so a long response no longer holds a whole batch back; once nothing is pending, the
  step runs on a smaller graph when half of the rows are done. ``on_finished`` hears of each response as it ends
  (e.g. to score it while the rest are generated). ``use_cache=False`` recomputes the full sequence every step (the
  reference path for tests).
* **Sampling** gives every sample its own uniforms, one per token: sample ``i`` of static batch ``c`` (``max_rows``
  consecutive prompts) reads column ``i`` of a table drawn, step-major, from a generator seeded ``seed + c *
  max_rows``. So a sample's tokens depend neither on which slot it runs in, nor on when it entered, nor on which
  other rows were running: refilled, compacted, cached or recomputed, the same samples.
* **Tensor parallelism.** Logits are gathered over TP (``runtime_gather_output=True``), so every TP rank holds the same
  full-vocab logits and the same seeded generator; the chosen tokens are still broadcast from TP rank 0 so ranks can
  never drift apart. Pipeline parallelism is not supported.
* **Attention backends.** The cached path swaps every layer's core attention for the cache's own (SDPA) during the
  call. The reference path needs a core attention that honours an explicit mask: ``sdpa`` (:class:`SDPAttention`)
  or Megatron's ``local`` one; Transformer Engine's ignores the mask under a causal mask type, so under TE's layer
  spec it is swapped for :class:`SDPAttention` for the call (TE's fused linear layers and norms keep running).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from align_pipeline.model.attention import SDPAttention
from align_pipeline.model.decode import decode_engine, kv_bytes_per_row
from align_pipeline.model.gpt import unwrap


@dataclass
class Generation:
    """What :func:`generate` produced, one entry per prompt (prompt order)."""

    tokens: list[list[int]]
    """New tokens only (the prompt is not repeated); cut after the first EOS, which is included."""
    ended_with_eos: list[bool]
    """True when the row emitted a stop id (``eos_id``); False when it stopped at ``max_new_tokens``."""
    logprobs: list[list[float]]
    """``log p(token | prefix)`` of each token in ``tokens`` under the model's plain distribution: float32
    ``log_softmax`` of the logits over the tokenizer's ``vocab_size`` (padded rows dropped), *before* temperature,
    top-k and top-p. This is the policy log-prob RL needs (the same number a training forward computes), not the
    log-prob under the tempered/truncated distribution that was actually sampled from."""
    slots: int = 0
    """Rows the cached path decoded at once (``max_rows``, or fewer under ``kv_cache_gib``); 0 without the cache."""
    admissions: int = 0
    """Prefills that gave free slots new samples after the first (continuous batching's refills)."""


def generate(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int | Sequence[int] | None,
    pad_id: int,
    vocab_size: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    seed: int = 0,
    use_cache: bool = True,
    cuda_graphs: bool = True,
    tp_group=None,
    prefill_bucket: int = 1,
    max_rows: int | None = None,
    kv_cache_gib: float = 0.0,
    on_finished: Callable[[int, list[int], bool], None] | None = None,
    compile_step: bool = False,
) -> Generation:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    Args:
        model: a ``GPTModel`` (PP=1), or a wrapper of one with ``.module`` (Megatron DDP / Float16Module). Put in eval
            mode and run under ``torch.no_grad()``; its training mode is restored afterwards. With sequence
            parallelism it is switched off for the call and back on after.
        prompts: token ids per prompt (e.g. ``tok.start_ids() + tok.encode(text)``), any lengths >= 1, same on every
            TP rank.
        max_new_tokens: cap on new tokens per prompt.
        eos_id: a row stops after emitting it, or any of several stop ids (EOS and a chat template's end-of-turn
            token: ``tok.stop_ids``); None: never stop early. Generation ends when every row has stopped.
        pad_id: the id used for left padding (never attended to, so any valid id works).
        vocab_size: the tokenizer's vocabulary size; logits of the padded embedding rows beyond it are dropped, so
            those ids are never sampled and do not enter ``logprobs``.
        temperature: logits are divided by it before sampling; 0 means greedy.
        top_k: sample among the k most likely tokens only (0 = off).
        top_p: nucleus sampling: the smallest set of most likely tokens whose probability reaches ``top_p`` (1 = off).
        greedy: argmax instead of sampling (ignores temperature/top-k/top-p).
        seed: seeds the ``torch.Generator`` of the sampler; the same seed gives the same tokens. Give data-parallel
            ranks different seeds if they should sample independently.
        use_cache: static KV cache (:mod:`~align_pipeline.model.decode`, kept on the model between calls); False
            recomputes the whole sequence every step (the reference path).
        cuda_graphs: on a GPU, replay each decode step as a captured CUDA graph (captured at the first call that
            needs a given width, reused after); False runs the same step eagerly. Ignored on the CPU.
        tp_group: the tensor-parallel group (default: the model's ``pg_collection.tp``); tokens are broadcast from
            its rank 0.
        prefill_bucket: left-pad the prompts to a multiple of this many tokens (masked: the same tokens), so the
            prefill's shapes - what attention kernels plan for - come from a few buckets instead of every longest
            prompt length (``generation.prefill_bucket``; 1 = to the longest prompt).
        max_rows: rows decoded at once (``generation.batch_size``; default: every prompt). The samples are those of
            generating static batches of ``max_rows`` consecutive prompts, batch ``c`` seeded ``seed + c *
            max_rows``, whatever the slots and refills.
        kv_cache_gib: bound on the KV cache's memory (GiB, 0 = none): the slots are as many rows of ``longest
            prompt (bucketed) + max_new_tokens`` columns as fit, at most ``max_rows``; pending samples wait for a
            free slot. The samples do not change.
        on_finished: ``on_finished(i, tokens, ended_with_eos)`` for prompt ``i`` as soon as its response has ended
            (with the cache: in the order they end, while the others are still being generated; every prompt once,
            before generate returns), e.g. to start scoring it.
        compile_step: run the KV-cache decode step through ``torch.compile`` (and capture that in the CUDA graphs):
            fewer, fused kernels per layer (``generation.compile_step``; dense models at TP=1, else ignored). The
            first call compiles it (seconds to a minute).

    Returns:
        :class:`Generation` (see its fields for the exact meaning of ``logprobs``).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("need at least one prompt, and every prompt needs at least one token (e.g. BOS)")
    if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"invalid sampling settings: temperature={temperature}, top_k={top_k}, top_p={top_p}")
    gpt = unwrap(model)  # Megatron DDP / Float16Module -> GPTModel
    if gpt.config.pipeline_model_parallel_size > 1:
        raise NotImplementedError("generate() supports pipeline_model_parallel_size == 1 only")
    if not (gpt.pre_process and gpt.post_process):
        raise NotImplementedError("generate() needs the whole model on this rank (pre_process and post_process)")
    if vocab_size > gpt.vocab_size:
        raise ValueError(f"vocab_size {vocab_size} exceeds the model's embedding rows {gpt.vocab_size}")
    n = len(prompts)
    max_rows = n if max_rows is None else max_rows
    if prefill_bucket < 1 or max_rows < 1 or kv_cache_gib < 0:
        raise ValueError(f"need prefill_bucket >= 1, max_rows >= 1 and kv_cache_gib >= 0, got {prefill_bucket}, "
                         f"{max_rows}, {kv_cache_gib}")
    if tp_group is None:
        tp_group = gpt.pg_collection.tp
    broadcast_src = tdist.get_global_rank(tp_group, 0) if tp_group is not None and tp_group.size() > 1 else None
    device = next(gpt.parameters()).device
    stop = torch.tensor(sorted({eos_id} if isinstance(eos_id, int) else set(eos_id or ())), dtype=torch.long,
                        device=device)  # [k] stop ids
    sampling = not (greedy or temperature == 0.0)
    sampler = _Sampler(vocab_size, temperature, top_k, top_p, greedy, broadcast_src, tp_group,
                       _uniforms(n, max_new_tokens, max_rows, seed, device) if sampling and max_new_tokens else None)
    out = _Output.empty(n, max_new_tokens, stop, pad_id, sampler, device)
    slots = admissions = 0
    with _inference_mode(model, gpt):
        if max_new_tokens == 0:
            pass
        elif use_cache:
            slots, admissions = _decode_continuous(gpt, prompts, out, max_new_tokens, cuda_graphs, prefill_bucket,
                                                   min(n, max_rows), kv_cache_gib, on_finished, compile_step)
        else:
            if _ExpertLockstep.of(gpt) is not None:
                raise NotImplementedError("generation without the KV cache (use_cache: false) does not run MoE "
                                          "models at expert_model_parallel_size > 1")
            with _mask_honouring_attention(gpt):
                _decode_recompute(gpt, prompts, out, max_new_tokens, prefill_bucket)
    gen = out.generation()
    gen.slots, gen.admissions = slots, admissions
    if on_finished is not None and not use_cache:
        for i in range(n):
            on_finished(i, gen.tokens[i], gen.ended_with_eos[i])
    return gen


def expert_peers_generating(model, generating: bool) -> bool:
    """Whether any rank of this rank's expert-parallel group has prompts for a generation call (``generating``: this
    rank has). Loops whose number of :func:`generate` calls differs per rank (the turns of multi-turn episodes) go
    on while this is true, and a rank without prompts calls :func:`match_expert_peers` instead. Dense models and
    EP=1: ``generating``, without communication."""
    gpt = unwrap(model)
    lockstep = _ExpertLockstep.of(gpt)
    if lockstep is None:
        return generating
    return lockstep.round(gpt, int(generating), dummies=False) > 0


def match_expert_peers(model) -> None:
    """Take part in a :func:`generate` call the other ranks of this rank's expert-parallel group make while this
    one has no prompts: run dummy forwards against theirs until they are done (each MoE layer's all-to-all needs
    every rank of the group). A no-op for dense models and at EP=1."""
    gpt = unwrap(model)
    lockstep = _ExpertLockstep.of(gpt)
    if lockstep is None:
        return
    with _inference_mode(model, gpt):
        while lockstep.round(gpt, 0):
            pass


def decode_slots(model, rows: int, length: int, kv_cache_gib: float) -> int:
    """Rows of ``length`` columns the KV cache holds at once: ``rows``, or as many as fit ``kv_cache_gib`` GiB
    (0 = no bound); a budget too small for one row is an error."""
    if kv_cache_gib <= 0:
        return rows
    per_row = kv_bytes_per_row(unwrap(model), length)
    fit = int(kv_cache_gib * 2**30) // per_row
    if fit < 1:
        raise ValueError(f"generation.kv_cache_gib={kv_cache_gib} holds no row of {length} columns "
                         f"({per_row / 2**20:.1f} MiB each): raise it, or lower max_new_tokens")
    return min(rows, fit)


def prepare_generation(model, *, batch: int, length: int, prompt_len: int, vocab_size: int, pad_id: int,
                       cuda_graphs: bool = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                       tp_group=None, compile_step: bool = False) -> dict[str, float]:
    """One-off set-up before the first generation of a job, so that its cost is not part of the first (timed) rollout.

    Allocates the KV cache for ``batch`` rows x ``length`` columns (kept on the model). On a GPU it also captures the
    decode step of every batch width (:meth:`~align_pipeline.model.decode.DecodeEngine.capture_all`) and runs a short
    generation of the shape rollouts have: ``batch`` distinct prompts of ``prompt_len`` or ``prompt_len - 1`` tokens
    (the padded prefill), then of ``prompt_len`` tokens each (the unpadded prefill), 9 new tokens with stop ids, the
    same sampling settings. That builds cuDNN's attention plans of both prefills at that shape (other shapes get
    theirs when first seen), loads the kernels of the sampler and the finished-row check, and fills the memory
    allocator's cache: measured on an H200, without it the first rollout after the captures still took 1.5-3.6x a
    warm one. Returns ``{"capture_s": ..., "setup_s": ...}`` (seconds: graph captures, everything)."""
    import time

    gpt = unwrap(model)
    t0 = time.perf_counter()
    engine = decode_engine(gpt, batch, length)
    engine.use_compiled_step(gpt, compile_step)
    captured = engine.capture_seconds
    cuda_graphs = cuda_graphs and not getattr(gpt.config, "num_moe_experts", None)  # see _decode_continuous
    if engine.device.type == "cuda":
        if cuda_graphs:
            with _inference_mode(model, gpt), engine.attached(gpt):
                engine.capture_all(gpt)
        prompt_len = max(1, min(prompt_len, length - 9))
        full = [[(i * 7919 + j) % vocab_size for j in range(prompt_len)] for i in range(batch)]  # distinct prompts
        mixed = [row[: len(row) - i % 2] or [pad_id] for i, row in enumerate(full)]  # padded prefill (masked)
        for prompts in (mixed, full):  # then the unpadded (causal) prefill
            generate(model, prompts, max_new_tokens=min(9, length - prompt_len), eos_id=[pad_id], pad_id=pad_id,
                     vocab_size=vocab_size, temperature=temperature, top_k=top_k, top_p=top_p,
                     cuda_graphs=cuda_graphs, tp_group=tp_group, compile_step=compile_step)
        torch.cuda.synchronize(engine.device)
    return {"capture_s": engine.capture_seconds - captured, "setup_s": time.perf_counter() - t0}


@dataclass
class _Sampler:
    """Picks each step's tokens: the same on every TP rank (broadcast from TP rank 0)."""

    vocab_size: int
    temperature: float
    top_k: int
    top_p: float
    greedy: bool
    broadcast_src: int | None
    tp_group: object
    u: torch.Tensor | None  # [N, n + 1] float64: the uniform of sample i's token t at [t, i] (None: greedy)

    def __call__(self, logits: torch.Tensor, samples: torch.Tensor, steps: torch.Tensor):
        """logits [k, V_padded] of the rows generating token ``steps`` [k] of samples ``samples`` [k] -> (tokens [k],
        their plain log-probs [k])."""
        logits = logits[:, : self.vocab_size].float()  # [k, V] padded vocab rows dropped
        u = None if self.u is None else self.u[steps, samples]  # [k]
        token = sample_next_token(logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                  greedy=self.greedy, u=u)  # [k]
        if self.broadcast_src is not None:  # TP ranks hold identical logits; make identical tokens a guarantee
            tdist.broadcast(token, src=self.broadcast_src, group=self.tp_group)
        return token, F.log_softmax(logits, dim=-1).gather(1, token.unsqueeze(1)).squeeze(1)


def _uniforms(n: int, max_new_tokens: int, max_rows: int, seed: int, device) -> torch.Tensor:
    """[N, n + 1] float64: static batch ``c`` (prompts ``[c * max_rows, (c + 1) * max_rows)``) draws its columns
    step-major from a generator seeded ``seed + c * max_rows`` (one uniform per row per step, as a static batch
    would draw them); the last column serves idle rows. 8 bytes per sample and token."""
    u = torch.full((max_new_tokens, n + 1), 0.5, dtype=torch.float64, device=device)
    for lo in range(0, n, max_rows):
        hi = min(lo + max_rows, n)
        generator = torch.Generator(device=device).manual_seed(seed + lo)
        u[:, lo:hi] = torch.rand(max_new_tokens, hi - lo, generator=generator, device=device, dtype=torch.float64)
    return u


@dataclass
class _Output:
    """What the decoding loops fill, one row per sample (prompt order) + an idle row ``n`` that absorbs the writes of
    rows that are not generating (ended, or free slots)."""

    tokens: torch.Tensor  # [n + 1, N] generated tokens
    logprobs: torch.Tensor  # [n + 1, N]
    lengths: torch.Tensor  # [n + 1] tokens generated so far
    done: torch.Tensor  # [n + 1] the response has ended (a stop id, or N tokens); the idle row always
    ended: torch.Tensor  # [n + 1] it ended with a stop id
    stop: torch.Tensor  # [k] stop ids
    pad_id: int
    sampler: _Sampler

    @classmethod
    def empty(cls, n: int, max_new_tokens: int, stop: torch.Tensor, pad_id: int, sampler: _Sampler, device):
        done = torch.zeros(n + 1, dtype=torch.bool, device=device)
        done[n] = True
        return cls(tokens=torch.full((n + 1, max_new_tokens), pad_id, dtype=torch.long, device=device),
                   logprobs=torch.zeros((n + 1, max_new_tokens), dtype=torch.float32, device=device),
                   lengths=torch.zeros(n + 1, dtype=torch.long, device=device), done=done,
                   ended=torch.zeros(n + 1, dtype=torch.bool, device=device), stop=stop, pad_id=pad_id,
                   sampler=sampler)

    @property
    def n(self) -> int:
        return len(self.done) - 1

    def record(self, logits: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
        """Sample the next token of ``samples`` [k] (the idle row ``n`` for rows not generating) from their logits
        [k, V_padded] -> the tokens [k] (a pad where not generating)."""
        running = ~self.done[samples]  # [k]
        steps = self.lengths[samples].clamp(max=self.tokens.shape[1] - 1)  # [k] index of the token being sampled
        token, logprob = self.sampler(logits, samples, steps)
        token = torch.where(running, token, torch.full_like(token, self.pad_id))
        target = torch.where(running, samples, torch.full_like(samples, self.n))  # idle rows write row n
        self.tokens[target, steps] = token
        self.logprobs[target, steps] = logprob
        stopped = running & torch.isin(token, self.stop) if len(self.stop) else torch.zeros_like(running)
        self.lengths[target] = torch.where(running, steps + 1, self.lengths[target])
        self.ended[target] = self.ended[target] | stopped
        self.done[target] = self.done[target] | stopped | (running & (steps + 1 >= self.tokens.shape[1]))
        self.done[self.n] = True
        return token

    def response(self, i: int) -> tuple[list[int], list[float], bool]:
        length = int(self.lengths[i])
        return self.tokens[i, :length].tolist(), self.logprobs[i, :length].tolist(), bool(self.ended[i])

    def generation(self) -> Generation:
        lengths = self.lengths[: self.n].tolist()
        tokens, logprobs = self.tokens[: self.n].tolist(), self.logprobs[: self.n].tolist()
        return Generation(tokens=[t[:k] for t, k in zip(tokens, lengths)],
                          logprobs=[lp[:k] for lp, k in zip(logprobs, lengths)],
                          ended_with_eos=[bool(e) for e in self.ended[: self.n].tolist()])


def _left_padded(prompts: list[list[int]], width: int, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [b, width] (prompts left-padded), real [b, width] (True = not padding)."""
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    real = torch.zeros((len(prompts), width), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long, device=device)
        real[i, width - len(p) :] = True
    return ids, real


def _bucketed(length: int, bucket: int) -> int:
    return -(-length // bucket) * bucket


def _decode_recompute(gpt, prompts: list[list[int]], out: _Output, max_new_tokens: int, bucket: int) -> None:
    """The reference: every step a full forward over all known columns of every row (no cache)."""
    p = _bucketed(max(len(x) for x in prompts), bucket)
    device = out.tokens.device
    prompt_ids, prompt_real = _left_padded(prompts, p, out.pad_id, device)
    tokens = torch.cat([prompt_ids, torch.full((len(prompts), max_new_tokens), out.pad_id, dtype=torch.long,
                                               device=device)], dim=1)  # [b, P + N]
    real = torch.cat([prompt_real, torch.ones((len(prompts), max_new_tokens), dtype=torch.bool, device=device)], 1)
    positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)  # [b, P + N] position of each token within its row
    padded = not bool(prompt_real.all())
    samples = torch.arange(len(prompts), device=device)
    for step in range(max_new_tokens):
        end = p + step  # columns [0, end) are known; this step predicts column `end`
        mask = _attention_mask(real[:, :end], end) if padded else None  # [b, 1, end, end] True = masked out
        logits = gpt(tokens[:, :end].contiguous(), positions[:, :end].contiguous(), mask,
                     runtime_gather_output=True)  # [b, end, V_padded], full vocab on every TP rank
        tokens[:, end] = out.record(logits[:, -1], samples)
        if bool(out.done.all()):
            return


def _decode_continuous(gpt, prompts: list[list[int]], out: _Output, max_new_tokens: int, cuda_graphs: bool,
                       bucket: int, slots: int, kv_cache_gib: float, on_finished,
                       compile_step: bool = False) -> tuple[int, int]:
    """Static KV cache (:mod:`~align_pipeline.model.decode`) of ``slots`` rows (fewer under ``kv_cache_gib``), kept
    full: samples enter free slots in order (identical prompts entering together prefilled once), one token per slot
    per step, ended responses checked for every few steps and their slots refilled; with nothing pending, the step is
    compacted to the rows still running once half of them have ended -> (slots, refills)."""
    n, device = len(prompts), out.tokens.device
    length = _bucketed(max(len(x) for x in prompts), bucket) + max_new_tokens
    slots = decode_slots(gpt, slots, length, kv_cache_gib)
    engine = decode_engine(gpt, slots, length, max_bytes=int(kv_cache_gib * 2**30) if kv_cache_gib > 0 else None)
    engine.use_compiled_step(gpt, compile_step)
    # An MoE step routes a data-dependent number of tokens to each expert (host-side splits): not capturable.
    graphs = cuda_graphs and engine.device.type == "cuda" and not getattr(gpt.config, "num_moe_experts", None)
    # Ended rows are looked for every few steps on a GPU (each look waits for the GPU), every step on the CPU; free
    # slots are refilled once a sixteenth of them are free (each refill is a prefill).
    check_every = 8 if engine.device.type == "cuda" else 1
    refill_at = max(1, slots // 16)
    held: list[int | None] = [None] * slots  # the sample in each slot (host copy)
    made = [0] * slots  # tokens the slot's sample has (host count; a stop id may end it sooner)
    column = [0] * slots  # the cache column each slot's next step writes (host copy of engine.column; idle: 0)
    slot_sample = torch.full((slots,), n, dtype=torch.long, device=device)  # [slots] n = idle
    pending, rows, admissions = 0, 0, -1  # next sample to enter; slots [0, rows) are stepped

    def admit(free: list[int]) -> None:
        nonlocal pending, rows, admissions
        chosen = free[: n - pending]
        samples = list(range(pending, pending + len(chosen)))
        pending += len(chosen)
        first: dict[tuple[int, ...], int] = {}
        owner = [first.setdefault(tuple(prompts[i]), j) for j, i in enumerate(samples)]  # first entrant alike
        unique = sorted(set(owner))
        ids, real = _left_padded([prompts[samples[j]] for j in unique],
                                 _bucketed(max(len(prompts[samples[j]]) for j in unique), bucket), out.pad_id, device)
        positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
        slot_of = torch.tensor(chosen, device=device)  # [k]
        logits = engine.prefill(gpt, ids, positions, None if bool(real.all()) else real,
                                slot_of[torch.tensor(unique, device=device)])  # [u, V_padded]
        if len(unique) < len(chosen):
            copies = [j for j in range(len(chosen)) if owner[j] != j]
            engine.copy_rows(slot_of[torch.tensor(copies, device=device)],
                             slot_of[torch.tensor([owner[j] for j in copies], device=device)])
            logits = logits.index_select(0, torch.tensor([unique.index(o) for o in owner], device=device))
        sample_of = torch.tensor(samples, device=device)
        slot_sample[slot_of] = sample_of
        engine.ids[slot_of] = out.record(logits, sample_of)
        for slot, i in zip(chosen, samples):
            held[slot], made[slot], column[slot] = i, 1, ids.shape[1]
        rows = max(rows, max(chosen) + 1)
        admissions += 1

    lockstep = _ExpertLockstep.of(gpt)
    with engine.attached(gpt):
        if lockstep is not None:
            lockstep.round(gpt, 1)
        admit(list(range(slots)))
        while True:
            ended = out.done[slot_sample[:rows]].tolist()  # waits for the GPU
            finished = [slot for slot in range(rows) if held[slot] is not None and ended[slot]]
            if finished:
                for slot in finished:
                    if on_finished is not None:
                        tokens, _, eos = out.response(held[slot])
                        on_finished(held[slot], tokens, eos)
                    held[slot], column[slot] = None, 0
                slot_sample[torch.tensor(finished, device=device)] = n
                engine.column[torch.tensor(finished, device=device)] = 0  # idle: no column keeps the span wide
            free = [slot for slot in range(slots) if held[slot] is None]
            if pending < n and free and (len(free) >= refill_at or len(free) == slots):
                if lockstep is not None:
                    lockstep.round(gpt, 1)
                admit(free)
                continue  # an entrant may have ended at its first token
            running = [slot for slot in range(rows) if held[slot] is not None]
            if not running:
                if lockstep is not None and lockstep.round(gpt, 0):
                    continue  # another expert-parallel rank still generates: this one matched its forwards
                break
            if pending == n and engine.width(len(running)) <= engine.width(rows) // 2:
                engine.compact(torch.tensor(running, device=device))
                slot_sample[: len(running)] = slot_sample[torch.tensor(running, device=device)].clone()
                slot_sample[len(running) :] = n
                held[:] = [held[s] for s in running] + [None] * (slots - len(running))
                made[:] = [made[s] for s in running] + [0] * (slots - len(running))
                column[:] = [column[s] for s in running] + [0] * (slots - len(running))
                rows = len(running)
            steps = min(check_every, max(max_new_tokens - made[slot] for slot in range(rows)
                                         if held[slot] is not None))
            # every column these steps write or read (a row past its budget stops at the last column)
            span = engine.span_for(min(max(column[:rows]) + steps, engine.length))
            if lockstep is not None:
                lockstep.round(gpt, steps)
            for _ in range(steps):
                logits = engine.decode(gpt, engine.width(rows), graphs, span)[:rows]
                engine.ids[:rows] = out.record(logits, slot_sample[:rows])
            made[:] = [m + steps for m in made]
            column[:rows] = [min(c + steps, engine.length - 1) if held[s] is not None else 0
                             for s, c in enumerate(column[:rows])]
    return slots, admissions


class _ExpertLockstep:
    """Expert-parallel ranks generate in step. Every forward of an MoE model exchanges tokens with the other ranks of
    its expert-parallel group (one all-to-all per MoE layer), but each rank generates its own samples: one may
    prefill while another decodes, or finish first. Before each of its rounds of forwards (a prefill, a few decode
    steps, or none when it is done) a rank learns the most any rank of the group runs in that round, and after its
    own forwards it runs the difference as dummy forwards: one token through each MoE layer's MLP, which takes part
    in the same exchanges and changes nothing. Generation ends when no rank has work left."""

    def __init__(self, group, layers: list):
        self.group, self.layers = group, layers

    @classmethod
    def of(cls, gpt) -> _ExpertLockstep | None:
        if not getattr(gpt.config, "num_moe_experts", None) or gpt.pg_collection.ep.size() == 1:
            return None
        return cls(gpt.pg_collection.ep, [layer for layer in gpt.decoder.layers if hasattr(layer.mlp, "router")])

    def round(self, gpt, forwards: int, dummies: bool = True) -> int:
        """Agree on a round in which this rank runs ``forwards`` forwards of its own: run the dummy forwards it lacks
        against the most any rank of the group runs (how forwards pair up across ranks does not matter, only their
        number), and return that most (0: every rank is done). ``dummies=False``: only agree (no forwards)."""
        most = torch.tensor([forwards], dtype=torch.long, device=next(gpt.parameters()).device)
        tdist.all_reduce(most, op=tdist.ReduceOp.MAX, group=self.group)
        for _ in range(int(most.item()) - forwards if dummies else 0):
            self.dummy_forward()
        return int(most.item())

    def dummy_forward(self) -> None:
        for layer in self.layers:
            weight = layer.mlp.router.weight
            layer.mlp(torch.zeros(1, 1, weight.shape[1], dtype=next(layer.mlp.experts.parameters()).dtype,
                                  device=weight.device))


# Module attributes that switch sequence parallelism (the list Megatron's own inference code toggles).
_SEQUENCE_PARALLEL_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


@contextlib.contextmanager
def _inference_mode(model, gpt):
    """eval() + no_grad, sequence parallelism off (a 1-token decode step cannot be split over TP ranks); on exit the
    training mode and every sequence-parallel switch get back their exact previous values."""
    was_training = model.training
    config_sp = gpt.config.sequence_parallel
    saved = [(m, a, getattr(m, a)) for m in gpt.modules() for a in _SEQUENCE_PARALLEL_ATTRS if hasattr(m, a)]
    model.eval()
    gpt.config.sequence_parallel = False  # one config object shared by every layer
    for m, a, _ in saved:
        setattr(m, a, False)
    try:
        with torch.no_grad():
            yield
    finally:
        for m, a, value in saved:
            setattr(m, a, value)
        gpt.config.sequence_parallel = config_sp
        model.train(was_training)


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    u: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick one token per row from ``logits`` [b, V] -> [b] (int64).

    Greedy (or temperature 0): argmax. Otherwise logits / temperature, then top-k, then top-p filtering, then
    inverse-CDF sampling with one uniform per row: ``u`` [b] (float64 in [0, 1)) or drawn from ``generator`` (whatever
    the filtering, so the random stream depends only on the batch size and the number of steps).
    """
    if greedy or temperature == 0.0:
        return logits.argmax(dim=-1)
    b, v = logits.shape
    if u is None:
        u = torch.rand(b, generator=generator, device=logits.device, dtype=torch.float64)  # [b]
    scaled = logits.float() / temperature  # [b, V]
    if 0 < top_k < v:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]  # [b, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [b, V]
        sorted_probs = sorted_logits.softmax(dim=-1)  # [b, V]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [b, V] probability of the more likely tokens
        drop_sorted = mass_before >= top_p  # [b, V] the most likely token is always kept (mass_before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)  # [b, V] back to vocab order
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = scaled.softmax(dim=-1).double()  # [b, V]
    cdf = probs.cumsum(dim=-1)  # [b, V]
    # First index whose cdf exceeds u * total: a token with nonzero probability (right=True skips zero-mass ones).
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)  # [b]
    return torch.where(picked < v, picked, probs.argmax(dim=-1))  # [b] (u * total rounding up to total: fall back)


def _attention_mask(real: torch.Tensor, sq: int) -> torch.Tensor:
    """Boolean mask [b, 1, sq, sk] (True = masked out) for the last ``sq`` of the ``sk`` columns of ``real`` [b, sk].

    A query attends causally to real keys, and always to itself (so a pad query's softmax row is never empty).
    """
    sk = real.shape[1]
    q_pos = torch.arange(sk - sq, sk, device=real.device).unsqueeze(1)  # [sq, 1]
    k_pos = torch.arange(sk, device=real.device).unsqueeze(0)  # [1, sk]
    keep = (k_pos <= q_pos) & (real[:, None, None, :] | (k_pos == q_pos))  # [b, 1, sq, sk]
    return ~keep


@contextlib.contextmanager
def _mask_honouring_attention(gpt):
    """Generation applies its own masks (left padding; bottom-right causal while decoding with the cache). Transformer
    Engine's core attention ignores an explicit mask under a causal mask type, so for the duration of a generate()
    call every layer whose core attention is neither :class:`SDPAttention` nor Megatron's local one gets an
    :class:`SDPAttention` with the same config, layer number and mask type (core attention has no weights); the
    original is put back on exit. TE's linear layers and norms keep running."""
    swapped = []
    for layer in gpt.decoder.layers:
        attn = layer.self_attention
        core = attn.core_attention
        if isinstance(core, (SDPAttention, DotProductAttention)):
            continue
        replacement = SDPAttention(config=getattr(core, "config", attn.config), layer_number=attn.layer_number,
                                   attn_mask_type=attn.attn_mask_type, attention_type=attn.attention_type,
                                   softmax_scale=attn.config.softmax_scale, pg_collection=attn.pg_collection)
        swapped.append((attn, core))
        attn.core_attention = replacement
    try:
        yield
    finally:
        for attn, core in swapped:
            attn.core_attention = core