"""Output heads: the LM head (Megatron's vocab-parallel output layer) or a value head (reward model, critic).

A value head replaces ``GPTModel.output_layer`` with a small linear map hidden -> ``num_outputs`` (1 for a scalar
reward/value, A for a multi-attribute regression reward model). It is replicated on every tensor-parallel rank: its
input (the final-norm output) is identical on all TP ranks, so are its gradients, and no TP communication is needed
beyond gathering the sequence under sequence parallelism. ``GPTModel.forward(..., labels=None)`` then returns
``[b, s, num_outputs]`` instead of logits.
"""

from __future__ import annotations

import math

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class ValueHead(MegatronModule):
    """[s, b, h] hidden states -> [s, b, num_outputs] values (called like Megatron's output layer)."""

    def __init__(self, config: TransformerConfig, num_outputs: int = 1):
        super().__init__(config=config)
        self.num_outputs = num_outputs
        self.sequence_parallel = config.sequence_parallel
        # Named weight/bias like the LM output layer it replaces (Megatron's checkpoint code expects those keys).
        self.weight = torch.nn.Parameter(torch.empty(num_outputs, config.hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(num_outputs, dtype=config.params_dtype))
        with torch.no_grad():
            self.weight.normal_(0.0, 1.0 / math.sqrt(config.hidden_size + 1))

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.config.sequence_parallel:
            # [s/tp, b, h] -> [s, b, h]; backward takes this rank's slice (the head is replicated, not split).
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None  # [s, b, A]


def attach_value_head(gpt, num_outputs: int = 1):
    """Replace the LM output layer of a (last-stage) GPTModel with a fresh :class:`ValueHead`.

    The GPT must be built untied (``build_model`` does so for value models, also from tied sources)."""
    if gpt.post_process:
        if gpt.share_embeddings_and_output_weights:
            raise ValueError("a value head needs a GPT built with share_embeddings_and_output_weights=false "
                             "(model.init.build_model builds value models untied)")
        gpt.output_layer = ValueHead(gpt.config, num_outputs).to(next(gpt.parameters()).device)
    gpt.head = "value"
    return gpt

