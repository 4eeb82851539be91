"""Mixture-of-experts pieces around Megatron-core's MoE layer: a random init that does not depend on the expert
layout, and the router's load statistics.

Experts: Megatron's :class:`SequentialMLP` (a GEMM pair per local expert), or with ``parallel.moe_grouped_gemm``
its :class:`GroupedMLP` on torch's grouped matmul (one GEMM per projection for all local experts); checkpoints of
either load into the other.

Router: :class:`PerTokenAuxLossRouter` weighs the load-balancing loss the same at every TP size.

Random init: Megatron builds each rank's local experts from the one RNG stream every rank shares, so at EP=2 both
ranks would draw the same experts, and the layers after the first MoE layer would draw other values than at EP=1
(fewer experts consumed the stream). On CPU initialisation (where our dense init is already TP-invariant) the
experts are built without touching the shared stream (:class:`SeededSequentialMLP`), then every expert is drawn from
its own generator, seeded by (seed, layer, global expert index) and sliced for expert TP (:func:`init_experts`): the
same model at every EP x expert-TP layout.

Dispatch: with grouped experts and no expert or tensor parallelism inside the MoE layer (EP = expert TP = 1), the
tokens are sorted by expert without a host synchronisation (:class:`SyncFreeTokenDispatcher`); otherwise Megatron's
all-to-all dispatcher (EP > 1) or its all-gather one moves and sorts them.

Router statistics: :class:`RouterStats` counts, per MoE layer, the tokens each expert receives (top-k choices) and
the load-balancing loss of the micro-batches it saw; :meth:`RouterStats.metrics` gives ``moe/expert_load/max``
(the busiest expert's share over the fair share, 1.0 = balanced), ``moe/expert_load/min``, ``moe/aux_loss`` (Switch
loss, unscaled, mean over layers) and per-layer token fractions ``moe/layer_<i>/expert_<e>``.
"""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher


class SeededSequentialMLP(SequentialMLP):
    """Megatron's :class:`SequentialMLP`, built without drawing from the shared RNG stream (see the module doc)."""

    def __init__(self, *args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            super().__init__(*args, **kwargs)


class PerTokenAuxLossRouter(TopKRouter):
    """Megatron's top-k router with the load-balancing loss weighted as every layout weighs it alike.

    With per-token loss normalisation (our losses: gradients divided by the batch's loss tokens) Megatron multiplies
    each rank's share of the aux loss by the tokens that rank routed, so that the division gives the loss its
    coefficient. Under sequence parallelism a rank routes 1/TP of the tokens while its share is already a partial
    sum over all of them: the aux gradient came out TP times weaker (seen: TP=2 + SP trained differently from TP=1
    with the aux loss on, identically with it off). The count used here is the micro-batch's whole, as Megatron's own
    ``total_num_tokens`` is (the local count times the group, shards being equal)."""

    def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group,
                                           reduce_group_has_dp=False, valid_token_count=None):
        if (self.calculate_per_token_loss and not reduce_group_has_dp and reduce_group is not None
                and reduce_group.size() > 1):
            local = valid_token_count if valid_token_count is not None else activation.shape[0]
            valid_token_count = local * reduce_group.size()
        return super().attach_and_log_load_balancing_loss(activation, aux_loss_coeff, aux_loss, aux_loss_name,
                                                          reduce_group, reduce_group_has_dp, valid_token_count)


class SeededGroupedMLP(GroupedMLP):
    """Megatron's :class:`GroupedMLP` (all local experts' weights in two tensors, one grouped GEMM per projection),
    built without drawing from the shared RNG stream, its GEMMs torch's grouped matmul in any dtype (Megatron's
    forward asserts bf16, which only the CUTLASS kernels need)."""

    def __init__(self, *args, **kwargs):
        install_grouped_gemm()
        with torch.random.fork_rng(devices=[]):
            super().__init__(*args, **kwargs)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        hidden, local = self.config.hidden_size, self.num_local_experts
        probs = permuted_probs.unsqueeze(-1)
        if permuted_local_hidden_states.nelement() == 0:  # no token here: a zero-size product keeps the gradients
            h = torch.matmul(permuted_local_hidden_states, self.weight1.view(hidden, -1))
            return torch.matmul(self.activation_func_with_probs(h, probs), self.weight2.view(-1, hidden)), None
        gmm = _TorchGroupedGemmOps.gmm
        fc1 = gmm(permuted_local_hidden_states, self.weight1.view(local, hidden, -1), tokens_per_expert)
        return gmm(self.activation_func_with_probs(fc1, probs), self.weight2.view(local, -1, hidden),
                   tokens_per_expert), None


class SyncFreeTokenDispatcher(MoEAllGatherTokenDispatcher):
    """Megatron's all-gather dispatcher where the MoE layer has no expert or tensor parallelism (nothing to gather),
    sorting the tokens by expert without waiting for the GPU. Megatron's sort (``moe_utils.permute`` without TE)
    and its probabilities use ``masked_select`` and copy the tokens per expert to the host: several device-to-host
    synchronisations per MoE layer and micro-batch, each stalling the host until the GPU has caught up. Dropless
    top-k routing sends every token to exactly ``topk`` experts, so the number of sorted rows is known on the host:
    each token's experts come from one small per-row sort of the routing map, the rows are ordered by a stable sort
    of their expert ids (expert-major, token order within an expert: Megatron's order) and the counts per expert are
    the routing map's column sums, all on the device. The grouped experts take the counts on the device (torch's
    grouped matmul reads offsets from device memory). Same rows, same order, same probabilities as Megatron's path."""

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape_before_permute = hidden_states.shape
        routing_map = self.routing_map  # [T, E] bool, exactly topk True per row (dropless)
        experts = routing_map.shape[1]
        topk = self.config.moe_router_topk
        with torch.no_grad():
            # each token's topk experts, ascending; then every (token, choice) pair ordered by expert, stably
            chosen = torch.sort(torch.where(routing_map, torch.arange(experts, device=routing_map.device), experts),
                                dim=1).values[:, :topk]  # [T, k]
            flat = chosen.reshape(-1)  # [T*k]
            order = torch.sort(flat, stable=True).indices  # [T*k]
            sorted_tokens = order // topk  # the token of each sorted row
            tokens_per_expert = routing_map.sum(dim=0)  # [E] on the device (CUDA's bincount reads the max back)
        permuted = hidden_states.index_select(0, sorted_tokens)
        self.local_probs = probs[sorted_tokens, flat[order]]  # [T*k], differentiable through probs
        self.reversed_local_input_permutation_mapping = sorted_tokens
        self.local_map = routing_map
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs


def use_sync_free_dispatch(gpt) -> int:
    """Give every MoE layer of ``gpt`` with grouped experts and EP = expert TP = 1 the
    :class:`SyncFreeTokenDispatcher` (its MoE settings chose Megatron's all-gather dispatcher for them, whose state
    it shares); returns the layers switched."""
    switched = 0
    for layer in moe_layers(gpt):
        dispatcher = layer.mlp.token_dispatcher
        if (type(dispatcher) is MoEAllGatherTokenDispatcher and isinstance(layer.mlp.experts, GroupedMLP)
                and dispatcher.tp_size == 1 and dispatcher.ep_size == 1
                and dispatcher.config.moe_expert_capacity_factor is None):
            dispatcher.__class__ = SyncFreeTokenDispatcher
            switched += 1
    return switched


class _TorchGroupedGemmOps:
    """``grouped_gemm.ops.gmm`` as Megatron's GroupedMLP calls it, on ``torch._grouped_mm``: rows of ``a`` [T, K]
    grouped by ``batch_sizes`` (tokens per local expert, in order) times that expert's ``b[e]`` [K, N] (``trans_b``:
    [N, K]). On a GPU the kernel wants ``b`` column-major: it gets a column-major copy."""

    @staticmethod
    def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
        if trans_b:
            b = b.transpose(1, 2)
        if a.is_cuda:
            b = b.transpose(1, 2).contiguous().transpose(1, 2)
        offs = torch.cumsum(batch_sizes.to(device=a.device), 0).to(torch.int32)
        return torch._grouped_mm(a, b, offs=offs)


class _TorchGroupedGemm:
    ops = _TorchGroupedGemmOps


def install_grouped_gemm() -> None:
    """Megatron's GroupedMLP needs the ``grouped_gemm`` package (CUTLASS, built from source): when it is not there,
    torch's grouped matmul stands in (the same call; CPU and CUDA)."""
    from megatron.core.transformer.moe import grouped_gemm_util

    if grouped_gemm_util.grouped_gemm is None:
        grouped_gemm_util.grouped_gemm = _TorchGroupedGemm
        grouped_gemm_util.ops = _TorchGroupedGemmOps


def grouped_gemm_wanted(setting: str, bf16: bool) -> bool:
    """``parallel.moe_grouped_gemm``: on, off, or auto (on for bf16 on a Hopper-class GPU or newer, where torch's
    grouped matmul has its CUDA kernel)."""
    if setting != "auto":
        return setting == "on"
    return (bf16 and hasattr(torch, "_grouped_mm") and torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= (9, 0))


def _expert_generator(seed: int, layer: int, expert: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + layer * 4_099 + expert) % (2**63 - 1))


def init_experts(gpt, seed: int) -> int:
    """Draw every local expert of ``gpt`` (built with CPU initialisation) from its own generator; returns how many.

    Expert e of layer l: fc1 = [gate; up], each [F, H] ~ N(0, std); fc2 [H, F] ~ N(0, std / sqrt(2 L)) (Megatron's
    scaled output init); this rank keeps rows (fc1: of gate and of up) or columns (fc2) of its expert-TP slice."""
    config = gpt.config
    std, out_std = config.init_method_std, config.init_method_std / math.sqrt(2.0 * config.num_layers)
    pgs = gpt.pg_collection
    ep_rank, etp_rank, etp_size = pgs.ep.rank(), pgs.expt_tp.rank(), pgs.expt_tp.size()
    hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
    count = 0
    with torch.no_grad():
        for layer in gpt.decoder.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            local = experts.num_local_experts
            for j in range(local):
                g = _expert_generator(seed, layer.layer_number, ep_rank * local + j)
                gate, up = (torch.randn(ffn, hidden, generator=g) * std for _ in range(2))
                down = torch.randn(hidden, ffn, generator=g) * out_std
                fc1 = torch.cat([gate.chunk(etp_size)[etp_rank], up.chunk(etp_size)[etp_rank]])
                set_expert_weights(experts, j, fc1, down.chunk(etp_size, dim=1)[etp_rank])
                count += 1
    return count


def set_expert_weights(experts, j: int, fc1: torch.Tensor, fc2: torch.Tensor) -> None:
    """Local expert ``j``'s fc1 [2F/etp, H] ([gate; up] rows of this expert-TP rank) and fc2 [H, F/etp], into a
    :class:`SequentialMLP` (one linear pair per expert) or a :class:`GroupedMLP` (``weight1`` holds, expert after
    expert, each fc1 transposed [H, 2F/etp]; ``weight2`` each fc2 transposed [F/etp, H])."""
    if isinstance(experts, GroupedMLP):
        hidden, local = experts.config.hidden_size, experts.num_local_experts
        experts.weight1.view(local, hidden, -1)[j].copy_(fc1.t())
        experts.weight2.view(local, -1, hidden)[j].copy_(fc2.t())
    else:
        experts.local_experts[j].linear_fc1.weight.copy_(fc1)
        experts.local_experts[j].linear_fc2.weight.copy_(fc2)


def moe_layers(gpt) -> list:
    """The MoE layers of a built GPT stage (wrappers allowed), in order."""
    while hasattr(gpt, "module"):  # Megatron's DDP / Float16Module wrappers
        gpt = gpt.module
    return [layer for layer in gpt.decoder.layers if hasattr(layer.mlp, "router")]


class RouterStats:
    """Per MoE layer, over the training forwards since :meth:`reset`: tokens routed to each expert and the sum of
    each expert's router probability (softmax over all experts), for the load metrics (module doc).

    A forward hook on each router reads its routing map and recomputes the router's fp32 logits from its input (one
    [tokens, hidden] x [hidden, experts] product, no gradient). Forward passes without gradient (validation,
    log-prob passes) are not counted. Ratios are taken after summing over all ranks, so tokens that several TP ranks
    see alike (no sequence parallelism) do not change them."""

    def __init__(self, gpt):
        layers = moe_layers(gpt)
        config = layers[0].mlp.router.config
        self.num_experts, self.topk = config.num_moe_experts, config.moe_router_topk
        self.num_layers = config.num_layers
        self.device = layers[0].mlp.router.weight.device
        self.handles = [layer.mlp.router.register_forward_hook(self._hook(layer.layer_number - 1))
                        for layer in layers]
        self.reset()

    def reset(self) -> None:
        # [layer, (E routed counts, E probability sums, tokens)]
        self.sums = torch.zeros(self.num_layers, 2 * self.num_experts + 1, dtype=torch.float64, device=self.device)

    def _hook(self, index: int):
        def hook(router, args, output):
            if not torch.is_grad_enabled():
                return
            with torch.no_grad():
                hidden = args[0].reshape(-1, args[0].shape[-1])
                probs = torch.softmax(hidden.float() @ router.weight.float().t(), dim=-1)
                routing_map = output[1].reshape(-1, self.num_experts)
                row = self.sums[index]
                row[: self.num_experts] += routing_map.sum(0).double()
                row[self.num_experts: 2 * self.num_experts] += probs.sum(0).double()
                row[-1] += hidden.shape[0]
        return hook

    def metrics(self) -> dict[str, float]:
        """All-reduced over the world (a collective: every rank calls it); {} when no training forward ran."""
        import torch.distributed as tdist

        sums = self.sums.clone()
        if tdist.is_initialized():
            tdist.all_reduce(sums)
        seen = sums[:, -1] > 0
        if not bool(seen.any()):
            return {}
        e = self.num_experts
        counts, prob_sums, tokens = sums[seen, :e], sums[seen, e: 2 * e], sums[seen, -1:]
        fraction = counts / counts.sum(1, keepdim=True)  # of the top-k choices
        mean_prob = prob_sums / tokens
        aux = e * (fraction * mean_prob).sum(1)  # Switch loss per layer: 1.0 when balanced
        load = e * fraction  # 1.0 = the fair share
        out = {"moe/aux_loss": aux.mean().item(), "moe/load_max": load.max().item(), "moe/load_min": load.min().item()}
        if e <= 64:
            out |= {f"moe/expert_{i}/load": v for i, v in enumerate(load.mean(0).tolist())}
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
