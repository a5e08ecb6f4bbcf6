"""The position-wise MLP: h -> ffn (column-parallel) -> activation -> h (row-parallel).

Y = act(X A_1 + b_1) A_2 + b_2 with A_1 = [A_1^1 ... A_1^t] split by columns and A_2 split by
rows: rank i computes act(X A_1^i + b_1^i) A_2^i with no communication in between (the activation
is elementwise), and one all-reduce sums the partial outputs.

Gated linear unit (``config.gated_linear_unit``; SwiGLU with activation "silu")::

    Y = (act(X G) * (X U)) A_2          fc1 = [G; U] of width 2 * ffn

Rank i's fc1 rows are [G_i; U_i] (its slice of the gate, then its slice of the up projection, as in
megatron-core), so the gating stays local. The layer's logical full weight is [G; U], sharded with
Megatron's ``stride=2`` (rank i keeps piece i of each half): for one seed the TP=t shards are exact
slices of the TP=1 weight, as for every other parallel layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.tensor_parallel import init_method_normal, scaled_init_method_normal
from lightning_megatron.transformer.config import TransformerConfig
from lightning_megatron.transformer.spec import ModuleSpec, build_module
from lightning_megatron.transformer.utils import gated_activation, get_activation_func

__all__ = ["MLPSubmodules", "MLP"]


@dataclass(kw_only=True)
class MLPSubmodules:
    """Submodule slots of :class:`MLP` (Megatron's names)."""

    linear_fc1: ModuleSpec | type
    """Up-projection h -> ffn_hidden_size: column-parallel."""
    linear_fc2: ModuleSpec | type
    """Down-projection ffn_hidden_size -> h: row-parallel."""


class MLP(nn.Module):
    """[s, b, h] -> (output [s, b, h], bias [h] or None): fc2's bias is left to the bias-dropout-add."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, *,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        common = dict(tp_group=tp_group, bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
                      params_dtype=config.params_dtype)
        gated = config.gated_linear_unit
        fc1_extra = {"stride": 2} if gated else {}
        self.linear_fc1 = build_module(submodules.linear_fc1, config.hidden_size,
                                       (2 if gated else 1) * config.ffn_hidden_size, gather_output=False,
                                       init_method=init_method_normal(config.init_method_std), **fc1_extra,
                                       **common)
        self.activation_func = get_activation_func(config.activation)
        self.linear_fc2 = build_module(submodules.linear_fc2, config.ffn_hidden_size, config.hidden_size,
                                       input_is_parallel=True, skip_bias_add=True,
                                       init_method=scaled_init_method_normal(config.init_method_std,
                                                                             config.num_layers),
                                       **common)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        intermediate, bias = self.linear_fc1(hidden_states)  # [s, b, ffn/t] ([s, b, 2 * ffn/t] gated)
        if bias is not None:
            intermediate = intermediate + bias
        if self.config.gated_linear_unit:
            return self.linear_fc2(gated_activation(intermediate, self.config.activation))
        return self.linear_fc2(self.activation_func(intermediate))
