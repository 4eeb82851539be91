"""The ``offload`` options of the RL stages: frozen models on the CPU except while scoring; Adam moments (and bf16
main weights) of the trained models on the CPU while generating and scoring."""

from __future__ import annotations

import torch


def offload_model(model, device: torch.device | str) -> None:
    """Move a frozen model's parameters and buffers (e.g. to the CPU between the phases that use it)."""
    model.to(device)


def offload_optimizer(optimizer, device: torch.device | str) -> None:
    """Move the Adam moments (and, for bf16 training, the fp32 main weights) of a Megatron optimizer.

    In fp32 training the main weights *are* the model's parameters, which generation needs, so they stay.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)
        for group in getattr(opt, "shard_fp32_from_float16_groups", []) or []:
            for p in group:
                p.data = p.data.to(device)


class Offload:
    """The ``offload`` options: frozen models on the CPU except while scoring; Adam moments (and bf16 main weights)
    of the trained models on the CPU while generating and scoring. No-ops unless configured."""

    def __init__(self, cfg, device, frozen: list, optimizers: list):
        self.cfg, self.device = cfg, device
        self.frozen = [m for m in frozen if m is not None]
        self.optimizers = optimizers
        self.frozen_to("cpu")

    def frozen_to(self, device) -> None:
        if self.cfg.frozen_models:
            for m in self.frozen:
                offload_model(m, device)

    def optimizers_to(self, device) -> None:
        if self.cfg.optimizer_states:
            for opt in self.optimizers:
                offload_optimizer(opt, device)
