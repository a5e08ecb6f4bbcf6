"""The routed experts of one rank: SwiGLU MLPs over the rows each receives, split over TP like the dense MLP.

Rank ``r`` of the expert-parallel group holds the contiguous block of global experts
``[r E/ep, (r+1) E/ep)`` as ``local_experts.0 .. E/ep - 1`` (megatron-core's ``SequentialMLP`` names;
checkpoints and :meth:`LanguageModule.global_named_parameters` use the global index). Each expert is
``y = (silu(x G^T) * (x U^T)) D^T`` with ``linear_fc1.weight = [G; U]`` [2f, h] and ``linear_fc2.weight``
= D [h, f]; under tensor parallelism rank i keeps rows i of G and U (megatron's ``stride=2``) and
columns i of D, so its output is a partial sum the MoE layer reduces over TP.

Parameter facts (:class:`~lightning_megatron.tensor_parallel.ParamFacts`): sharded over ``tp``,
replicated over nothing (each EP rank holds other experts), gradients averaged over the
expert-data-parallel group ``expert_dp``. Initialization is layout-independent: expert ``g``'s
full fp32 weights are drawn from a stream keyed by ``g``, whatever rank builds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_megatron.parallel_state import Group, group_rank, group_size
from lightning_megatron.tensor_parallel.layers import (
    _initialize_affine_weight,
    init_method_normal,
    scaled_init_method_normal,
)
from lightning_megatron.tensor_parallel.param_facts import set_param_facts
from lightning_megatron.transformer.config import TransformerConfig
from lightning_megatron.transformer.kernels import DEFAULT_KERNELS, Kernels
from lightning_megatron.transformer.utils import gated_activation, get_activation_func, seeded

__all__ = ["ExpertMLP", "LocalExperts"]


class _ExpertLinear(nn.Module):
    """A bias-free weight of one expert (no communication: the MoE layer reduces over TP)."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ExpertMLP(nn.Module):
    """One expert's TP shard: [rows, h] -> partial [rows, h]."""

    def __init__(self, config: TransformerConfig, ffn: int, *, tp_group: Group = None) -> None:
        super().__init__()
        t, rank = group_size(tp_group), group_rank(tp_group)
        h, dtype = config.hidden_size, config.params_dtype
        self.linear_fc1 = _ExpertLinear(2 * ffn // t, h, dtype)
        self.linear_fc2 = _ExpertLinear(h, ffn // t, dtype)
        _initialize_affine_weight(self.linear_fc1.weight, (2 * ffn, h), 0, init_method_normal(config.init_method_std),
                                  rank, t, stride=2)
        _initialize_affine_weight(self.linear_fc2.weight, (h, ffn), 1,
                                  scaled_init_method_normal(config.init_method_std, config.num_layers), rank, t)
        for p in self.parameters():
            set_param_facts(p, replicated_over=(), data_parallel="expert_dp")
        self.activation = config.activation
        get_activation_func(self.activation)  # the error that names the choices, at build

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(gated_activation(self.linear_fc1(x), self.activation))


class LocalExperts(nn.Module):
    """This EP rank's experts: rows sorted by local expert -> their (TP-partial) outputs, in the same order."""

    def __init__(self, config: TransformerConfig, *, num_local_experts: int, first_expert: int, seed: int,
                 tp_group: Group = None) -> None:
        super().__init__()
        self.num_local_experts, self.first_expert = num_local_experts, first_expert
        experts = []
        for i in range(num_local_experts):
            with seeded(seed, f"experts.{first_expert + i}"):
                experts.append(ExpertMLP(config, config.moe_ffn_hidden_size, tp_group=tp_group))
        self.local_experts = nn.ModuleList(experts)
        self.kernels: Kernels = DEFAULT_KERNELS  # how many rows an expert's matmuls run on (transformer.kernels)

    def forward(self, rows: torch.Tensor, counts: list[int], capacity: int | None = None) -> torch.Tensor:
        """``rows`` [R, h] sorted by local expert, ``counts`` (host ints) rows per local expert. ``capacity``:
        pad every expert's rows to it (static shapes; padded rows' outputs are dropped)."""
        pieces = torch.split(rows, counts)
        sizes = [max(n, capacity or 0, self.kernels.expert_rows(n, x)) for n, x in zip(counts, pieces)]
        if sizes != list(counts):
            # One tensor of every expert's rows, each followed by its zeros, and a view of it for each expert: an
            # expert left unpadded would keep a view of ``rows``, which holds them all, beside the padded copies.
            parts = [p for x, n, m in zip(pieces, counts, sizes) for p in (x, x.new_zeros(m - n, x.shape[1])) if len(p)]
            pieces = torch.split(torch.cat(parts), sizes)
        outputs = [expert(x)[:n] if n or capacity is not None else x.new_zeros(0, x.shape[1])
                   for expert, x, n in zip(self.local_experts, pieces, counts)]
        return torch.cat(outputs) if outputs else rows.new_zeros(0, rows.shape[1])
