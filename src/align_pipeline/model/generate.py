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
* **KV cache.** A static cache kept on the model (:mod:`~align_pipeline.model.decode`): identical prompts (several
  samples per prompt) are prefilled once, then each step feeds one column; on a GPU the step is a captured CUDA graph.
  Every few steps the rows that have emitted a stop id are dropped (the step runs on a smaller graph once half of
  them are done). ``use_cache=False`` recomputes the full sequence every step (the reference path for tests).
* **Sampling** draws one uniform per row of the whole batch per step, so a row's tokens do not depend on which other
  rows were still running (the cached and the reference path sample the same tokens).
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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from align_pipeline.model.attention import SDPAttention
from align_pipeline.model.decode import decode_engine
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
    b = len(prompts)
    if prefill_bucket < 1:
        raise ValueError(f"prefill_bucket must be >= 1, got {prefill_bucket}")
    prompt_len = -(-max(len(p) for p in prompts) // prefill_bucket) * prefill_bucket  # left padding to the bucket
    if tp_group is None:
        tp_group = gpt.pg_collection.tp
    broadcast_src = tdist.get_global_rank(tp_group, 0) if tp_group is not None and tp_group.size() > 1 else None
    device = next(gpt.parameters()).device
    total = prompt_len + max_new_tokens

    tokens = torch.full((b, total), pad_id, dtype=torch.long, device=device)  # [b, T] left-padded prompt, then new
    real = torch.zeros((b, total), dtype=torch.bool, device=device)  # [b, T] True = prompt or generated token
    for i, p in enumerate(prompts):
        tokens[i, prompt_len - len(p) : prompt_len] = torch.tensor(p, dtype=torch.long, device=device)
        real[i, prompt_len - len(p) :] = True
    positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)  # [b, T] position of each token within its own row
    state = _Decoding(
        tokens=tokens, real=real, positions=positions, prompt_len=prompt_len,
        logprobs=torch.zeros((b, max_new_tokens), dtype=torch.float32, device=device),  # [b, N]
        done=torch.zeros(b, dtype=torch.bool, device=device),  # [b] row has emitted a stop id
        stop=torch.tensor(sorted({eos_id} if isinstance(eos_id, int) else set(eos_id or ())), dtype=torch.long,
                          device=device),  # [k] stop ids
        sampler=_Sampler(vocab_size, temperature, top_k, top_p, greedy,
                         torch.Generator(device=device).manual_seed(seed), pad_id, broadcast_src, tp_group, b),
    )
    with _inference_mode(model, gpt):
        if max_new_tokens == 0:
            steps = 0
        elif use_cache:
            steps = _decode_cached(gpt, prompts, state, max_new_tokens, cuda_graphs)
        else:
            with _mask_honouring_attention(gpt):
                steps = _decode_recompute(gpt, state, max_new_tokens)

    tokens, logprobs = state.tokens, state.logprobs
    out = Generation(tokens=[], ended_with_eos=[], logprobs=[])
    stop_ids = set(state.stop.tolist())
    for row, row_lp in zip(tokens[:, prompt_len : prompt_len + steps].tolist(), logprobs[:, :steps].tolist()):
        n = next((j + 1 for j, t in enumerate(row) if t in stop_ids), None)  # cut after the first stop id
        out.tokens.append(row[: n or len(row)])
        out.logprobs.append(row_lp[: n or len(row)])
        out.ended_with_eos.append(n is not None)
    return out


def prepare_generation(model, *, batch: int, length: int, prompt_len: int, vocab_size: int, pad_id: int,
                       cuda_graphs: bool = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                       tp_group=None) -> dict[str, float]:
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
    captured = engine.capture_seconds
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
                     cuda_graphs=cuda_graphs, tp_group=tp_group)
        torch.cuda.synchronize(engine.device)
    return {"capture_s": engine.capture_seconds - captured, "setup_s": time.perf_counter() - t0}


@dataclass
class _Sampler:
    """Picks each step's tokens: the same on every TP rank (broadcast from TP rank 0), a pad for finished rows."""

    vocab_size: int
    temperature: float
    top_k: int
    top_p: float
    greedy: bool
    generator: torch.Generator
    pad_id: int
    broadcast_src: int | None
    tp_group: object
    batch: int  # rows of the whole batch

    def __call__(self, logits: torch.Tensor, done: torch.Tensor, rows: torch.Tensor | None):
        """logits [n, V_padded] of the rows ``rows`` (None: every row, in order), done [n] -> (tokens [n], their
        plain log-probs [n]). One uniform is drawn for *every* row of the batch per step, so a row's random stream
        does not depend on which rows were still being computed."""
        logits = logits[:, : self.vocab_size].float()  # [n, V] padded vocab rows dropped
        u = None
        if not (self.greedy or self.temperature == 0.0):
            u = torch.rand(self.batch, generator=self.generator, device=logits.device, dtype=torch.float64)  # [b]
            u = u if rows is None else u[rows]
        token = sample_next_token(logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                  greedy=self.greedy, u=u)  # [n]
        if self.broadcast_src is not None:  # TP ranks hold identical logits; make identical tokens a guarantee
            tdist.broadcast(token, src=self.broadcast_src, group=self.tp_group)
        token = torch.where(done, torch.full_like(token, self.pad_id), token)  # finished rows idle
        return token, F.log_softmax(logits, dim=-1).gather(1, token.unsqueeze(1)).squeeze(1)


@dataclass
class _Decoding:
    """What a decoding loop reads and fills, rows in prompt order."""

    tokens: torch.Tensor  # [b, P + N] left-padded prompts, then the generated tokens
    real: torch.Tensor  # [b, P + N] True = prompt or generated token
    positions: torch.Tensor  # [b, P + N] position id of each column
    prompt_len: int  # P
    logprobs: torch.Tensor  # [b, N]
    done: torch.Tensor  # [b]
    stop: torch.Tensor  # [k] stop ids
    sampler: _Sampler

    def record(self, step: int, logits: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Sample column P + step for ``rows`` (None: all) from their logits [n, V_padded]; returns the tokens [n]."""
        done = self.done if rows is None else self.done[rows]
        token, logprob = self.sampler(logits, done, rows)
        column = self.prompt_len + step
        if rows is None:
            self.logprobs[:, step] = logprob
            self.tokens[:, column] = token
            if len(self.stop):
                self.done |= torch.isin(token, self.stop)
        else:
            self.logprobs[rows, step] = logprob
            self.tokens[rows, column] = token
            if len(self.stop):
                self.done[rows] = done | torch.isin(token, self.stop)
        return token


def _decode_recompute(gpt, s: _Decoding, max_new_tokens: int) -> int:
    """The reference: every step a full forward over all known columns (no cache) -> steps taken."""
    padded = not bool(s.real[:, : s.prompt_len].all())
    for step in range(max_new_tokens):
        end = s.prompt_len + step  # columns [0, end) are known; this step predicts column `end`
        mask = _attention_mask(s.real[:, :end], end) if padded else None  # [b, 1, end, end] True = masked out
        logits = gpt(s.tokens[:, :end].contiguous(), s.positions[:, :end].contiguous(), mask,
                     runtime_gather_output=True)  # [b, end, V_padded], full vocab on every TP rank
        s.record(step, logits[:, -1], None)
        if len(s.stop) and bool(s.done.all()):
            return step + 1
    return max_new_tokens


def _decode_cached(gpt, prompts: list[list[int]], s: _Decoding, max_new_tokens: int, cuda_graphs: bool) -> int:
    """Static KV cache (:mod:`~align_pipeline.model.decode`): identical prompts prefilled once, then one column per
    step over the rows still running (compacted to a smaller graph when half of them have finished) -> steps taken."""
    b, p = len(prompts), s.prompt_len
    first: dict[tuple[int, ...], int] = {}
    owner = [first.setdefault(tuple(x), i) for i, x in enumerate(prompts)]  # [b] first row with the same prompt
    unique = sorted(set(owner))
    engine = decode_engine(gpt, b, p + max_new_tokens)
    graphs = cuda_graphs and engine.device.type == "cuda"
    # Check for finished rows every few steps on a GPU (each check waits for the GPU), every step on the CPU.
    check_every = 8 if engine.device.type == "cuda" else 1
    with engine.attached(gpt):
        rows_u = torch.tensor(unique, device=s.tokens.device)
        real = s.real[rows_u, :p]
        logits = engine.prefill(gpt, s.tokens[rows_u, :p], s.positions[rows_u, :p],
                                None if bool(real.all()) else real)  # [u, V_padded]
        if len(unique) < b:
            index = torch.tensor([unique.index(o) for o in owner], device=logits.device)  # [b] unique row of each
            engine.expand(index)
            logits = logits.index_select(0, index)
        engine.start(p, s.positions[:, p])
        rows, n = None, b  # rows: the prompt row of each engine row (None = identity), n of them still running
        for step in range(max_new_tokens):
            if step:
                logits = engine.decode(gpt, engine.width(n), graphs)[:n]
            engine.ids[:n] = s.record(step, logits, rows)
            if not len(s.stop) or (step + 1) % check_every:
                continue
            running = ~s.done if rows is None else ~s.done[rows]  # [n]
            left = int(running.sum())
            if left == 0:
                return step + 1
            if engine.width(left) <= engine.width(n) // 2:
                slots = running.nonzero().squeeze(1)  # [left]
                engine.compact(slots)
                rows = slots if rows is None else rows[slots]
                n = left
    return max_new_tokens


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