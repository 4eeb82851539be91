"""Static-KV-cache decoding for a Megatron-core ``GPTModel``, the decode step captured once as a CUDA graph.

:func:`~align_pipeline.model.generate.generate` drives it; this module owns the state that makes one decode step
cheap:

* **Static KV cache.** Per layer one key and one value buffer ``[B, groups, S, head_dim]`` (``B`` rows, ``S``
  columns), allocated once and kept on the model between calls (:func:`decode_engine`), so a PPO/REINFORCE job
  allocates it at its first rollout and never again. Each row has its own column (``column`` [B], on the device): a
  decode step writes every row's key and value at that row's column (``scatter_``) and attends over the first
  ``span`` columns with a boolean key mask (``keep``), ``span`` the smallest bucket (256 columns, then steps of
  about 1.25x in multiples of 128, and ``S``) that holds every row's columns (the caller knows them: :meth:`DecodeEngine.span_for`); the step of each
  (width, span) has fixed shapes, so it can be captured. Rows are
  independent, so a row whose response has ended can be given a new prompt while the others go on
  (:meth:`DecodeEngine.prefill` into chosen rows): continuous batching.
* **The model's own modules.** The step calls the GPT's embedding, its decoder (every layer's norms, fused QKV,
  QK-norm, RoPE, projection, MLP, TP all-reduces) and its output layer; only each layer's *core* attention is swapped,
  for the duration of a call, for :class:`_CachedCoreAttention`, which reads and writes the cache. So the numbers are
  those of a training forward (same kernels, same TP reductions), with any layer spec (local, SDPA, TE).
* **CUDA graphs.** On a GPU the step of a given width (rows computed) and span is captured once into a
  ``torch.cuda.CUDAGraph`` (all from one memory pool) and replayed: one launch instead of ~40 kernels per layer. Widths are buckets (``B`` and the powers of two below
  it), so finished rows can be dropped (:meth:`DecodeEngine.compact`) and the step run on a smaller graph. The graphs
  read the live parameter tensors: training updates them in place, so new weights need no refresh and no
  re-capture (a changed parameter *address*, e.g. a model moved between devices, drops the graphs and recaptures).
  TP > 1 captures the NCCL collectives inside the graph. On the CPU the same step runs eagerly.
* **Prefill** runs eagerly (its shape changes with every batch) with the prompts left-padded to one width; it writes
  columns ``[0, P)`` of the rows it is given and returns the last column's logits. Identical prompts (several samples
  per prompt) are prefilled once and their cache rows copied (:meth:`DecodeEngine.copy_rows`).

RoPE: Megatron rotates by column index (left padding shifts a row's columns, which RoPE's relative scores do not
see), so a decode step looks up the frequencies of its column in a table built by the model's own
``rotary_pos_emb``; plain RoPE is applied by the cached attention itself from cos/sin tables computed once (the
same arithmetic as Megatron's, a quarter of its kernels). Learned absolute positions use per-row position ids (real tokens before the column).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config

from align_pipeline.model.gpt import unwrap

# With graphs, decode-step widths are the engine's batch and the powers of two below it down to _MIN_WIDTH (a step of
# fewer rows costs about as much: not worth a capture of its own).
_MIN_WIDTH = 8
# A decode step attends over the first ``span`` cache columns: the smallest bucket from _MIN_SPAN up (or the whole
# cache) that holds every row's columns, so a step early in a long generation does not read the keys and values of
# columns nothing has written yet. Buckets grow by _SPAN_GROWTH rounded up to _SPAN_QUANTUM columns: a step reads at
# most ~1.25x the columns it needs (powers of two read up to 2x, ~1.46x on average over a uniform 2,048-token
# generation: the attention is most of a decode step at batch 256), for a few more captured graphs (10 spans instead
# of 5 for a 2,560-column cache).
_MIN_SPAN = 256
_SPAN_GROWTH = 1.25
_SPAN_QUANTUM = 128


class DecodeEngine:
    """KV cache, step buffers and captured graphs for batches of up to ``batch`` rows and ``length`` columns."""

    allocations = 0  # engines (KV caches) built in this process

    def __init__(self, gpt, batch: int, length: int):
        attention = gpt.decoder.layers[0].self_attention
        groups, head_dim, value_dim = _cache_widths(gpt)
        param = next(gpt.parameters())
        device, dtype = param.device, param.dtype
        self.batch, self.length, self.device = batch, length, device
        n = len(gpt.decoder.layers)
        self.keys = [torch.zeros(batch, groups, length, head_dim, dtype=dtype, device=device) for _ in range(n)]
        self.values = [torch.zeros(batch, groups, length, value_dim, dtype=dtype, device=device) for _ in range(n)]
        # Multi-head latent attention rotates inside each layer (its own, YaRN-capable RoPE): the layers' rotary
        # modules are swapped (in ``attached``) for one that hands them the current forward's columns from this table.
        self.mla = bool(getattr(gpt.config, "multi_latent_attention", False))
        self.mla_freqs: torch.Tensor | None = None  # [S, 1, 1, rot_dim]
        self.mla_mscale = 1.0
        self.mla_current: torch.Tensor | None = None  # the current forward's: [P, 1, 1, rot] or [1, w, 1, rot]
        if self.mla:
            table = attention.rotary_pos_emb(length)
            self.mla_yarn = isinstance(table, tuple)  # YaRN's module also gives its cos/sin coefficient
            self.mla_freqs, self.mla_mscale = table if self.mla_yarn else (table, 1.0)
            self.mla_step = self.mla_freqs[:1].expand(batch, -1, -1, -1).clone()  # [B, 1, 1, rot]
        self.keep = torch.zeros(batch, length, dtype=torch.bool, device=device)  # [B, S] True = key column is real
        self.ids = torch.zeros(batch, dtype=torch.long, device=device)  # [B] token each row feeds the next step
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)  # [B] its position id
        self.column = torch.zeros(batch, dtype=torch.long, device=device)  # [B] the column each row's next step writes
        # [S, 1, 1, rot_dim] RoPE frequencies per column, from the model's own rotary embedding
        self.freqs = gpt.rotary_pos_emb(length) if getattr(gpt, "rotary_pos_emb", None) is not None else None
        # Plain (non-interleaved, unfused) RoPE is applied here, to query and key together, from cos/sin tables made
        # once: 5 kernels a layer instead of Megatron's ~24 (it recomputes cos and sin per layer and per tensor),
        # with Megatron's exact arithmetic. Other variants keep Megatron's own application.
        cfg = gpt.config
        # (apply_rope_fusion is only ever ours, model/kernels.py: the same rotation.)
        self.rope = self.freqs is not None and not (cfg.rotary_interleaved
                                                    or getattr(cfg, "multi_latent_attention", False))
        if self.rope:
            mscale = _yarn_get_concentration_factor_from_config(cfg)
            self.cos = (torch.cos(self.freqs) * mscale).to(dtype)  # [S, 1, 1, rot_dim]
            sin = (torch.sin(self.freqs) * mscale).to(dtype)
            half = sin.shape[-1] // 2
            # rotate_half(t) * sin == cat(t2, t1) * cat(-sin1, sin2) exactly ((-x) * y == x * (-y) in IEEE)
            self.sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            # the decode columns' tables, one per row ([B, 1, 1, rot_dim], viewed [1, b, 1, rot_dim] by a step)
            self.step_cos = self.cos[:1].expand(batch, -1, -1, -1).clone()
            self.step_sin = self.sin_signed[:1].expand(batch, -1, -1, -1).clone()
        self.rope_cos: torch.Tensor | None = None  # the tables the current forward applies ([sq, 1, 1, rot_dim])
        self.rope_sin: torch.Tensor | None = None
        # MLA: its softmax scale (with YaRN's attention temperature), computed by the layer
        self.scale = (attention.softmax_scale if self.mla else None) or gpt.config.softmax_scale or head_dim**-0.5
        self.prefill_mask: torch.Tensor | None = None  # [u, 1, P, P] True = attend; None = plain causal
        self.decoding = False
        self.prefill_rows: torch.Tensor | None = None  # [u] the rows a prefill writes (None: [0, u))
        self.kv_index: torch.Tensor | None = None  # [b, groups, 1, head_dim] each row's column, for scatter_
        self.v_index: torch.Tensor | None = None  # the same for the values' width
        self.span = length  # columns the current decode step attends over (a value of spans())
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (width, span) ->
        self.pool = None  # the graphs' shared memory pool (they are never replayed at once)
        self.captures = 0  # graphs captured so far (tests and benchmarks read it)
        self.prefill_shapes: set[tuple[int, int, bool]] = set()  # (rows, columns, masked) of every prefill: what
        # the attention kernels plan for (a shape not seen before costs a new plan on a GPU)
        self.capture_seconds = 0.0
        self.compactions = 0
        DecodeEngine.allocations += 1
        self._weights = _parameter_addresses(gpt)
        # the stand-ins ``attached`` swaps in: the same objects every call (a compiled step guards on them)
        self._cores = [_CachedCoreAttention(self, i) for i in range(n)]
        self.compile_step = False  # run the step through torch.compile (:meth:`use_compiled_step`)

    # ---------------------------------------------------------------------------------------------------------------
    # The forward pieces
    # ---------------------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def attached(self, gpt):
        """Every layer's core attention reads/writes this cache for the duration of the block (restored on exit).
        Parameters that moved since the graphs were captured drop them."""
        addresses = _parameter_addresses(gpt)
        if addresses != self._weights:
            self.graphs.clear()
            self._weights = addresses
        swapped = []
        for i, layer in enumerate(gpt.decoder.layers):
            attn = layer.self_attention
            swapped.append((attn, attn.core_attention, getattr(attn, "rotary_pos_emb", None)))
            attn.core_attention = self._cores[i]
            if self.mla:
                attn.rotary_pos_emb = _EngineRope(self, attn.rotary_pos_emb)
        try:
            yield
        finally:
            for attn, core, rotary in swapped:
                attn.core_attention = core
                if self.mla:
                    attn.rotary_pos_emb = rotary

    def _forward(self, gpt, ids: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor | None) -> torch.Tensor:
        """ids, positions [b, sq] -> logits [b, V_padded] of the last column (full vocabulary on every TP rank).
        ``freqs``: Megatron's RoPE frequencies of the columns, None when this engine applies RoPE itself."""
        hidden = gpt.embedding(input_ids=ids, position_ids=positions)  # [sq, b, h]
        hidden = gpt.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=freqs)  # [sq, b, h]
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        logits, _ = gpt.output_layer(hidden[-1:], weight=weight, runtime_gather_output=True)  # [1, b, V_padded]
        return logits[0]

    def prefill(self, gpt, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor | None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Left-padded prompts ids/positions [u, P] (``real`` [u, P] True = not padding; None = no padding) -> logits
        [u, V_padded] of column P - 1. Fills columns [0, P) of cache rows ``rows`` [u] (default [0, u)), whose next
        decode step then writes column P at the position after each prompt's last; the other rows are untouched."""
        u, p = ids.shape
        self.prefill_shapes.add((u, p, real is not None))
        self.decoding = False
        self.prefill_mask = None if real is None else _prefill_keep(real)
        rows = torch.arange(u, device=ids.device) if rows is None else rows
        self.prefill_rows = rows
        keep = torch.zeros(u, self.length, dtype=torch.bool, device=ids.device)  # [u, S]
        keep[:, :p] = True if real is None else real
        self.keep[rows] = keep
        self.column[rows] = p
        self.positions[rows] = positions[:, -1] + 1
        freqs = self.freqs[:p] if self.freqs is not None else None
        if self.mla:
            self.mla_current = self.mla_freqs[:p]
        if self.rope:
            self.rope_cos, self.rope_sin, freqs = self.cos[:p], self.sin_signed[:p], None
        try:
            return self._forward(gpt, ids, positions, freqs)
        finally:
            self.prefill_mask = self.prefill_rows = None

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Rows ``dst`` become copies of rows ``src`` (e.g. every sample of a prompt gets its prefill)."""
        for buffer in (*self.keys, *self.values, self.keep, self.ids, self.positions, self.column):
            buffer[dst] = buffer[src]

    def compact(self, slots: torch.Tensor) -> None:
        """Rows ``slots`` (ascending) move to [0, len(slots)): the step then runs on fewer rows."""
        self._reorder(slots)
        self.compactions += 1

    def _reorder(self, index: torch.Tensor) -> None:
        n = len(index)
        for buffer in (*self.keys, *self.values, self.keep, self.ids, self.positions, self.column):
            buffer[:n] = buffer.index_select(0, index)

    def width(self, rows: int) -> int:
        """Rows a step computes to serve ``rows`` rows: exactly ``rows`` on the CPU, a bucket on a GPU (with or without
        graphs, so both run the same kernels on the same shapes and agree bit for bit)."""
        if self.device.type != "cuda":
            return rows
        return min(self.batch, max(_MIN_WIDTH, 1 << (rows - 1).bit_length()))

    def spans(self) -> list[int]:
        """Every span a step can attend over (ascending): ``_MIN_SPAN``, then each about ``_SPAN_GROWTH`` times the
        last, rounded up to a multiple of ``_SPAN_QUANTUM``, while below the cache's length; and the length."""
        out, span = [], _MIN_SPAN
        while span < self.length:
            out.append(span)
            span = -(-int(span * _SPAN_GROWTH) // _SPAN_QUANTUM) * _SPAN_QUANTUM
        return out + [self.length]

    def span_for(self, columns: int) -> int:
        """The smallest span that holds columns [0, ``columns``)."""
        return next(s for s in self.spans() if s >= columns)

    def use_compiled_step(self, gpt, on: bool) -> bool:
        """Whether the decode step runs through ``torch.compile`` (``generation.compile_step``); returns the choice
        made. Inductor fuses the elementwise work between the GEMMs - each layer's norms, RoPE, the cache writes,
        SwiGLU, the residual adds - into a few generated kernels, and the compiled step is what the CUDA graphs
        capture. Only where the whole step traces as one graph: a dense model (no MoE: host-side token counts; no
        multi-head latent attention) at TP=1. Changing it drops the graphs captured for the other step."""
        cfg = gpt.config
        on = bool(on) and cfg.tensor_model_parallel_size == 1 and not getattr(cfg, "num_moe_experts", None) \
            and not self.mla
        if on != self.compile_step:
            self.graphs.clear()
            self.compile_step = on
        return on

    def _run_step(self, gpt, width: int, span: int) -> torch.Tensor:
        if not self.compile_step:
            return self._step(gpt, width, span)
        return _compiled_step()(self, gpt, width, span)

    def decode(self, gpt, width: int, graphs: bool, span: int | None = None) -> torch.Tensor:
        """One step over rows [0, width): feeds ``ids`` at each row's column, then advances the columns -> logits
        [width, V_padded] (with ``graphs``, a captured graph's output buffer: read it before the next step). The step
        attends over the first ``span`` columns (a value of :meth:`spans`; default: all), which must hold every
        column a row of [0, width) writes or reads. A row whose response has ended keeps stepping until it is
        replaced or compacted away: its column stops at the last one (what it writes there is never read)."""
        span = self.length if span is None else span
        if graphs:
            graph = self.graphs.get((width, span))
            if graph is None:
                graph = self.graphs[width, span] = self._capture(gpt, width, span)
            graph[0].replay()
            logits = graph[1]
        else:
            logits = self._run_step(gpt, width, span)
        self.column.add_(1).clamp_(max=self.length - 1)
        self.positions += 1
        return logits

    def widths(self) -> list[int]:
        """Every width :meth:`width` can return on a GPU (largest first)."""
        out, w = [self.batch], 1 << (self.batch - 1).bit_length()
        while w // 2 >= _MIN_WIDTH:
            w //= 2
            if w < self.batch:
                out.append(w)
        return out

    def capture_all(self, gpt) -> None:
        """Capture the step of every width and span not captured yet (inside :meth:`attached`, in inference mode),
        so that no capture happens in the middle of a timed generation. Every TP rank captures them in one order."""
        for width in self.widths():
            for span in self.spans():
                if (width, span) not in self.graphs:
                    self.graphs[width, span] = self._capture(gpt, width, span)

    def _step(self, gpt, width: int, span: int) -> torch.Tensor:
        self.decoding, self.span = True, span
        column = self.column[:width]  # [w]
        self.keep[:width].scatter_(1, column[:, None], True)  # the column each row writes this step
        k, v = self.keys[0], self.values[0]
        self.kv_index = column.view(width, 1, 1, 1).expand(width, k.shape[1], 1, k.shape[3])  # [w, groups, 1, hd]
        self.v_index = column.view(width, 1, 1, 1).expand(width, v.shape[1], 1, v.shape[3])
        freqs = None
        if self.mla:
            torch.index_select(self.mla_freqs, 0, column, out=self.mla_step[:width])  # [w, 1, 1, rot_dim]
            self.mla_current = self.mla_step[:width].view(1, width, 1, self.mla_step.shape[-1])
        elif self.rope:
            torch.index_select(self.cos, 0, column, out=self.step_cos[:width])  # [w, 1, 1, rot_dim]
            torch.index_select(self.sin_signed, 0, column, out=self.step_sin[:width])
            rot = self.step_cos.shape[-1]
            self.rope_cos = self.step_cos[:width].view(1, width, 1, rot)  # [1, w, 1, rot_dim]
            self.rope_sin = self.step_sin[:width].view(1, width, 1, rot)
        elif self.freqs is not None:
            freqs = self.freqs.index_select(0, column)  # [w, 1, 1, rot_dim]
            freqs = freqs.view(1, width, 1, freqs.shape[-1])  # [1, w, 1, rot_dim]
        return self._forward(gpt, self.ids[:width, None], self.positions[:width, None], freqs)

    def apply_rope(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on query [sq, b, np, hn] and key [sq, b, ng, hn] at the current forward's columns, computed as
        Megatron's ``_apply_rotary_pos_emb_bshd`` computes it (same operations in the same dtype)."""
        heads = query.shape[2]
        t = torch.cat((query, key), dim=2)  # [sq, b, np + ng, hn]
        rot = self.rope_cos.shape[-1]
        t, t_pass = t[..., :rot], t[..., rot:]
        t1, t2 = t.chunk(2, dim=-1)
        t = t * self.rope_cos + torch.cat((t2, t1), dim=-1) * self.rope_sin
        if t_pass.shape[-1]:
            t = torch.cat((t, t_pass), dim=-1)
        return t[:, :, :heads], t[:, :, heads:]

    def _capture(self, gpt, width: int, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the step of ``width`` rows over ``span`` columns. The warm-up runs write the current column,
        which the replay that follows rewrites, so capturing leaves no trace in the results. Every graph allocates
        from one pool: they run one at a time, and each output is read before the next replay."""
        import time

        t0 = time.perf_counter()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # kernel selection, cuBLAS workspaces, NCCL set-up, compilation: before capture
                self._run_step(gpt, width, span)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._run_step(gpt, width, span)
        torch.cuda.synchronize(self.device)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0
        return graph, logits


class _CachedCoreAttention(torch.nn.Module):
    """Core attention of layer ``index`` against the engine's cache. query [sq, b, np, hn], key/value [sq, b, ng, hn]
    (RoPE applied) -> context [sq, b, np*hn]. Prefill (sq = P): writes columns [0, P) and attends causally among them
    (with the engine's padding mask). Decode (sq = 1): writes the current column and attends over every column
    ``keep`` marks."""

    def __init__(self, engine: DecodeEngine, index: int):
        super().__init__()
        self.engine, self.index = engine, index

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        e = self.engine
        sq, b, np_, _ = query.shape
        if e.rope:
            query, key = e.apply_rope(query, key)
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)  # [b, ng, sq, hn]
        v = value.permute(1, 2, 0, 3)
        if e.decoding:
            k_cache, v_cache = e.keys[self.index][:b], e.values[self.index][:b]  # [b, ng, S, hn]
            k_cache.scatter_(2, e.kv_index, k)  # each row at its own column
            v_cache.scatter_(2, e.v_index, v)
            span = e.span  # the columns any row of the step has: [0, span)
            mask = e.keep[:b, None, None, :span]  # [b, 1, 1, span]
            context = attend_cache(q, k_cache[:, :, :span], v_cache[:, :, :span], mask, e.scale)
        else:
            e.keys[self.index][e.prefill_rows, :, :sq] = k
            e.values[self.index][e.prefill_rows, :, :sq] = v
            mask = e.prefill_mask
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=e.scale,
                                                     enable_gqa=np_ != k.shape[1])
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * v.shape[-1])  # [sq, b, np*hv]


class _EngineRope(torch.nn.Module):
    """Stands in for a multi-head latent attention layer's rotary module while the engine runs it: the layer asks
    for the frequencies of ``seq_len`` positions and slices the first ``sq``; it gets those of the current forward's
    cache columns ([P, 1, 1, rot] for a prefill, [1, w, 1, rot] per row for a decode step), and YaRN's
    cos/sin coefficient as the layer's own module gives it."""

    def __init__(self, engine: DecodeEngine, inner):
        super().__init__()
        self.engine = engine
        object.__setattr__(self, "inner", inner)  # not a submodule: the layer's own, restored after

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, seq_len: int, packed_seq: bool = False):
        e = self.engine
        return (e.mla_current, e.mla_mscale) if e.mla_yarn else e.mla_current


def _cache_widths(gpt) -> tuple[int, int, int]:
    """(key/value heads per TP rank, key width, value width) of one layer's cache: the query groups and the head
    width, or for multi-head latent attention every head with its rotated key (``qk_head_dim`` +
    ``qk_pos_emb_head_dim``) and its value (``v_head_dim``): the keys and values as the layer computes them."""
    attention = gpt.decoder.layers[0].self_attention
    cfg = gpt.config
    if getattr(cfg, "multi_latent_attention", False):
        return (attention.num_attention_heads_per_partition, cfg.qk_head_dim + cfg.qk_pos_emb_head_dim,
                cfg.v_head_dim)
    head_dim = attention.hidden_size_per_attention_head
    return attention.num_query_groups_per_partition, head_dim, head_dim


def attend_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode step's attention: q [b, heads, 1, d] over the cache k, v [b, groups, span, d] where ``keep``
    [b, 1, 1, span] is True -> [b, heads, 1, d]. SDPA with ``enable_gqa``: on an H100 its cuDNN kernel reads the
    cache at 83-89 % of HBM bandwidth at spans of 1,024-2,560 columns (``benchmarks/decode_attention.py``), faster
    than folding each group's query heads into the query axis (59-65 %), which is therefore not done."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _prefill_keep(real: torch.Tensor) -> torch.Tensor:
    """[u, 1, P, P] True = attend: causal among real columns, and every query to itself (a padding query's softmax row
    is never empty: NaN would spread through later layers)."""
    p = real.shape[1]
    col = torch.arange(p, device=real.device)
    causal = col[None, :] <= col[:, None]  # [P, P]
    return (causal & real[:, None, None, :]) | torch.eye(p, dtype=torch.bool, device=real.device)


@functools.cache
def _compiled_step():
    """:meth:`DecodeEngine._step` through ``torch.compile``, one for the process: a new engine (a cache of another
    size) reuses its code. dynamic=True: compiled once with symbolic sizes (widths, spans, cache rows and columns)
    instead of once per size first seen."""
    _tp_group_without_warning()
    return torch.compile(DecodeEngine._step, dynamic=True)


@functools.cache
def _tp_group_without_warning() -> None:
    """Megatron 0.16's row-parallel linear passes ``tp_group=None`` to its GEMM function, which looks the default
    group up and calls ``warnings.warn`` (a deprecation, hidden by Python's filters): a call ``torch.compile`` cannot
    trace, inside a context manager it cannot split, so each layer's step fell apart into several graphs. The same
    lookup without the warning (installed once, for the process, when a step is first compiled)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

    def group(tp_group, is_expert=False, check_initialized=True):
        if not torch.distributed.is_initialized():
            return None
        if tp_group is not None or not parallel_state.is_initialized():
            return tp_group
        if is_expert:
            return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
        return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)

    layers.get_tensor_model_parallel_group_if_none = group


def _parameter_addresses(gpt) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in gpt.parameters())


_ROUND = 64  # cache columns are allocated in multiples of this (fewer re-allocations across calls)


def kv_bytes_per_row(gpt, length: int) -> int:
    """Bytes of KV cache one row of ``length`` columns takes (keys and values of every layer, this TP rank's query
    groups, columns rounded up as :func:`decode_engine` allocates them)."""
    groups, key_width, value_width = _cache_widths(gpt)
    itemsize = next(gpt.parameters()).element_size()
    return len(gpt.decoder.layers) * groups * (key_width + value_width) * _bucket(length) * itemsize


def _bucket(length: int) -> int:
    return -(-length // _ROUND) * _ROUND


def decode_engine(gpt, batch: int, length: int, max_bytes: int | None = None) -> DecodeEngine:
    """The engine kept on ``gpt`` for batches of ``batch`` rows and ``length`` columns: reused when large enough
    (same dtype and device), else replaced by one at least as large as both where that fits ``max_bytes`` of KV
    cache, else by one of exactly ``batch`` x ``length`` (the old cache is freed first)."""
    engine: DecodeEngine | None = getattr(gpt, "_align_decode_engine", None)
    param = next(gpt.parameters())
    if (engine is not None and engine.batch >= batch and engine.length >= length
            and engine.keys[0].dtype == param.dtype and engine.device == param.device
            and (max_bytes is None or engine.batch * kv_bytes_per_row(gpt, engine.length) <= max_bytes)):
        return engine
    if engine is not None:
        grown = max(batch, engine.batch), max(length, engine.length)
        if max_bytes is None or grown[0] * kv_bytes_per_row(gpt, grown[1]) <= max_bytes:
            batch, length = grown
        release_decode_engine(gpt)
    engine = DecodeEngine(gpt, batch, _bucket(length))
    object.__setattr__(gpt, "_align_decode_engine", engine)
    return engine


def release_decode_engine(model) -> None:
    """Free the KV cache and graphs kept on ``model`` (or the GPT inside a wrapper)."""
    model = unwrap(model)
    if getattr(model, "_align_decode_engine", None) is not None:
        object.__setattr__(model, "_align_decode_engine", None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
