"""LoRA adapters on the tensor-parallel projections (qkv, output, fc1, fc2), at any TP x SP x PP layout.

A frozen base layer ``Y = X W^T`` gains ``Y += (alpha / r) * B A dropout(X)`` with ``A`` [r, in] (the
down-projection) and ``B`` [out, r] (the up-projection, zero at the start): Hu et al.'s LoRA, peft's
``LoraLayer`` (``lora_A`` kaiming-uniform with ``a = sqrt(5)``, ``lora_B`` zeros, scaling ``alpha / r``).

How the adapter is split over the TP group of size t matches its base layer (Megatron-Bridge's
``ParallelLinearAdapter``):

- **column-parallel base** (``linear_qkv``, ``linear_fc1``; output [s, b, out/t]): ``A`` is split by
  its rows ([r/t, in] per rank) and its output all-gathered ([s, b, r]); ``B`` is split like the base's
  output rows ([out/t, r], the same stride: a gated fc1's [gate_i; up_i]). The input is the one the base
  multiplies after its TP mapping (copied): ``ColumnParallelLinear.forward`` calls the adapter, so the input's
  gradient, the base's part and the adapter's summed, is all-reduced over TP once. Backward: ``B``'s input
  enters through ``copy_to`` (all-reduce of dL/da, each rank's B giving a part), and the gather's backward hands
  each rank its rows of A. Under sequence parallelism the adapter reads this rank's part of the sequence
  ([s/t, b, in], before the base's all-gather) with A's rows all-gathered ([r, in]) and all-gathers its output
  along the sequence ([s, b, r]): it keeps that part for A's gradient, not the gathered input (t times less;
  the frozen base keeps none, megatron-core's column layers keep their part likewise), for the same FLOPs.
  Backward: the gathers' reduce-scatters sum dL/da over the ranks' B (its rows of the sequence to each) and A's
  gradient over the ranks' parts of the sequence (its rows to each); the adapter's part of the input gradient
  is this rank's already, added to the base's reduce-scattered one. Needs ``t | r``.
- **row-parallel base** (``linear_proj``, ``linear_fc2``; input [s, b, in/t], output summed over TP):
  ``A`` is split by columns like the base ([r, in/t]), its partial outputs all-reduced (reduce-scattered
  along the sequence under sequence parallelism); ``B`` [out, r] is replicated, its gradient summed
  over TP under sequence parallelism (each rank saw its part of the sequence: ``sequence_parallel`` in
  its :class:`~lightning_megatron.tensor_parallel.ParamFacts`, the mechanism of the norm weights).

So at every layout the adapters' weights are slices of the one-process ones, their gradients too, and
the checkpoint machinery stores them as global tensors like any other parameter (names
``<base>.adapter.linear_in.weight`` = A, ``<base>.adapter.linear_out.weight`` = B, Megatron-Bridge's).
``A`` is drawn from a generator keyed by the seed and the layer's global name: the same at every layout.

The fused ``linear_qkv`` (``linear_fc1``) holds one ``A`` shared by q, k and v (gate and up): as peft
adapters on separate ``q_proj``, ``k_proj``, ``v_proj`` it is the same ``A`` on each and ``B``'s rows
split like the weight's (:func:`~lightning_megatron.models.gpt.lora_export`); peft's three ``A``
gradients sum to ours.

:func:`merged_state_dict` folds trained adapters into the base weights (``W + (alpha / r) B A``) of a
global state dict: what ``export hf`` writes.

Dropout (``lora_dropout``) acts on the adapter's input only, with the transformer's dropout and RNG
streams (sharded inputs under the model-parallel stream); layout parity is stated for ``dropout=0``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from lightning_megatron.parallel_state import Group, group_rank, group_size
from lightning_megatron.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_megatron.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from lightning_megatron.tensor_parallel.param_facts import copy_param_facts, set_param_facts
from lightning_megatron.tensor_parallel.random import get_rng_tracker
from lightning_megatron.transformer.dropout import dropout

__all__ = ["LoRAConfig", "LoRAAdapter", "add_lora", "is_adapter_name", "merged_state_dict", "LORA_TARGETS",
           "ADAPTER_IN", "ADAPTER_OUT"]

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The projections an adapter may sit on (megatron-core's names)."""
ADAPTER_IN = "adapter.linear_in.weight"
"""A, the down-projection, under its base layer's name: ``<base>.adapter.linear_in.weight``."""
ADAPTER_OUT = "adapter.linear_out.weight"
"""B, the up-projection: ``<base>.adapter.linear_out.weight``."""


@dataclass(kw_only=True)
class LoRAConfig:
    """Which projections get adapters and their shape (peft's ``LoraConfig`` names in our terms)."""

    rank: int = 8
    """r: the adapters' inner width (must be divisible by the TP size on column-parallel layers)."""
    alpha: float = 16.0
    """The adapter's output is scaled by ``alpha / rank`` (peft's ``lora_alpha``)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (peft's ``lora_dropout``)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Any of ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` (every transformer layer's)."""

    def __post_init__(self) -> None:
        problems = []
        if not (isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank >= 1):
            problems.append(f"lora.rank={self.rank!r} must be an integer >= 1")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            problems.append(f"lora.alpha={self.alpha!r} must be > 0")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            problems.append(f"lora.dropout={self.dropout!r} must be in [0, 1)")
        bad = [m for m in self.target_modules if m not in LORA_TARGETS]
        if bad or not self.target_modules:
            problems.append(f"lora.target_modules={list(self.target_modules)!r}: choose among {list(LORA_TARGETS)}")
        if problems:
            raise ValueError("; ".join(problems))
        self.target_modules = [m for m in LORA_TARGETS if m in self.target_modules]  # one order everywhere
        self.alpha = float(self.alpha)
        self.dropout = float(self.dropout)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def coerce(cls, value: LoRAConfig | Mapping[str, Any] | None) -> LoRAConfig | None:
        if value is None or isinstance(value, LoRAConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"lora={value!r}: a LoRAConfig or a mapping of its fields (rank, alpha, dropout, "
                            f"target_modules)")
        unknown = set(value) - {"rank", "alpha", "dropout", "target_modules"}
        if unknown:
            raise ValueError(f"lora: unknown fields {sorted(unknown)} (rank, alpha, dropout, target_modules)")
        return cls(**value)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _kaiming_uniform_rows(rows: int, cols: int, key: str) -> torch.Tensor:
    """peft's ``lora_A`` initialisation (``kaiming_uniform_(a=sqrt(5))``: U(-1/sqrt(in), 1/sqrt(in))) of the full
    [rows, cols] matrix from a generator keyed by ``key``: equal at every layout."""
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    bound = 1.0 / math.sqrt(cols)
    return (torch.rand(rows, cols, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


class LoRAAdapter(nn.Module):
    """``(alpha / r) * B A dropout(x)`` beside one column- or row-parallel base layer (module docstring);
    ``forward(x)`` takes the base's input and returns a tensor shaped like the base's output."""

    def __init__(self, base: ColumnParallelLinear | RowParallelLinear, config: LoRAConfig, *, key: str) -> None:
        super().__init__()
        self.column = isinstance(base, ColumnParallelLinear)
        self.tp_group: Group = base.tp_group
        self.sequence_parallel = base.sequence_parallel
        self.scaling, self.p = config.scaling, config.dropout
        t, rank_in_tp, r = group_size(base.tp_group), group_rank(base.tp_group), config.rank
        dtype, device = base.weight.dtype, base.weight.device
        full_a = _kaiming_uniform_rows(r, base.input_size, key)  # [r, in]
        if self.column:
            if r % t:
                raise ValueError(f"LoRA rank={r} on the column-parallel {key} must be divisible by "
                                 f"tensor_model_parallel_size={t} (A's rows are split over TP): choose a multiple of {t}")
            a = full_a.chunk(t, dim=0)[rank_in_tp]
            b = torch.zeros(base.output_size_per_partition, r)
        else:
            a = full_a.chunk(t, dim=1)[rank_in_tp]
            b = torch.zeros(base.output_size, r)
        self.linear_in = nn.Module()
        # a copy: this rank's rows or columns of A in a tensor of their own, not a view keeping all of A (t times
        # the bytes, and strided where the split is by columns)
        self.linear_in.weight = nn.Parameter(a.to(dtype=dtype, device=device).clone(
            memory_format=torch.contiguous_format))
        self.linear_out = nn.Module()
        self.linear_out.weight = nn.Parameter(b.to(dtype=dtype, device=device))
        sharded = t > 1
        if self.column:
            set_param_facts(self.linear_in.weight, sharded_over=("tp",) if sharded else (),
                            replicated_over=() if sharded else ("tp",), partition_dim=0)
            # B's rows are the base output's rows: the base weight's layout (stride, grouped-query rows) exactly
            copy_param_facts(base.weight, self.linear_out.weight)
        else:
            set_param_facts(self.linear_in.weight, sharded_over=("tp",) if sharded else (),
                            replicated_over=() if sharded else ("tp",), partition_dim=1)
            set_param_facts(self.linear_out.weight, sharded_over=(), replicated_over=("tp",),
                            sequence_parallel=self.sequence_parallel)

    def _dropout(self, x: torch.Tensor, sharded: bool) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if sharded:  # each TP rank holds different elements: its own stream (the block's under SP, if it forked)
            with get_rng_tracker().fork():
                return dropout(x, self.p)
        return dropout(x, self.p)

    def forward(self, x: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
        """``(alpha / r) B A dropout(x)``, shaped like the base's output, from the input the base layer multiplies:
        a column-parallel base's after its TP mapping (copied: the adapter's part of the input gradient joins the
        base's before that mapping's one reduction), under SP its input before it (this rank's part of the
        sequence, module docstring); a row-parallel base's parallel input. With ``base`` (the base layer's output
        before its bias) ``base`` plus that, by one GEMM that accumulates into it (``addmm``): the adapter's output
        is never written,
        scaled and added on its own, which would pass over the ``[s, b, out]`` tensor 4 more times forward and
        2 more backward (the scale lands on the ``r``-wide operands)."""
        a_w, b_w = self.linear_in.weight, self.linear_out.weight
        tp = self.tp_group
        if self.column and self.sequence_parallel:  # x: this rank's part of the sequence [s/t, b, in]
            x = self._dropout(x, True)  # each rank its part of the sequence: the model-parallel stream
            a_all = gather_from_sequence_parallel_region(a_w, tp, True)  # [r, in]; its gradient's rows to each
            a = gather_from_sequence_parallel_region(F.linear(x, a_all), tp, True)  # [s, b, r]
            return self._up(a, b_w, base)  # [s, b, out/t]; dL/da summed over the ranks' B by the reduce-scatter
        if self.column:
            total = self._dropout(x, False)  # the mapped input is the same on every TP rank: the shared stream
            a = gather_from_tensor_model_parallel_region(F.linear(total, a_w), tp)  # [s, b, r]
            return self._up(copy_to_tensor_model_parallel_region(a, tp), b_w, base)  # [s, b, out/t]
        x = self._dropout(x, group_size(tp) > 1)
        a = F.linear(x, a_w)  # [s, b, r], this rank's part of the sum over the input columns
        a = (reduce_scatter_to_sequence_parallel_region(a, tp) if self.sequence_parallel
             else reduce_from_tensor_model_parallel_region(a, tp))
        return self._up(a, b_w, base)

    def _up(self, a: torch.Tensor, b_w: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
        """``scaling * a B^T`` (``a`` [..., r]), added into ``base`` when given."""
        if base is None:
            return F.linear(a, b_w) * self.scaling
        out = torch.addmm(base.reshape(-1, base.shape[-1]), a.reshape(-1, a.shape[-1]), b_w.t(), alpha=self.scaling)
        return out.view(base.shape)

    def set_sequence_parallel(self, on: bool) -> bool:
        """Run with (``on``) or without sequence parallelism from now on (the weights do not depend on it);
        returns the previous setting."""
        previous, self.sequence_parallel = self.sequence_parallel, on
        return previous

    def extra_repr(self) -> str:
        kind = "column" if self.column else "row"
        return f"{kind}-parallel base, rank={self.linear_in.weight.shape[0 if self.column else 0]}, scaling={self.scaling}"


def add_lora(chunk: nn.Module, config: LoRAConfig, *, global_names: Mapping[int, str]) -> list[str]:
    """Attach a :class:`LoRAAdapter` to every target projection of ``chunk`` (``<base>.adapter``) and freeze
    every other parameter of it. ``global_names``: ``id(parameter) -> global name`` (the base weight's global
    name keys the adapter's initialisation). Returns the adapted layers' global names."""
    adapted = []
    for name, module in list(chunk.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf not in config.target_modules:
            continue
        if ".experts." in f".{name}." or ".shared_experts." in f".{name}.":
            raise ValueError(f"LoRA on a mixture of experts' projections ({name}) is not supported: target the "
                             f"attention only (lora.target_modules: [linear_qkv, linear_proj])")
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or module.weight is None:
            raise ValueError(f"LoRA target {name} is a {type(module).__name__}, not a Column/RowParallelLinear")
        key = global_names[id(module.weight)].removesuffix(".weight")
        module.adapter = LoRAAdapter(module, config, key=key)  # the layer's forward adds its output
        adapted.append(key)
    if not adapted:
        raise ValueError(f"lora.target_modules={config.target_modules}: no such layer in the model")
    for pname, p in chunk.named_parameters():
        p.requires_grad_(".adapter." in f".{pname}")
    return adapted


def is_adapter_name(name: str) -> bool:
    """Whether a global parameter name is a LoRA adapter's."""
    return name.endswith(ADAPTER_IN) or name.endswith(ADAPTER_OUT)


def merged_state_dict(state_dict: Mapping[str, torch.Tensor], config: LoRAConfig) -> dict[str, torch.Tensor]:
    """A global state dict with every adapter folded into its base weight, ``W + (alpha / r) B A`` (in fp32,
    cast back to W's dtype), and the adapters' tensors removed."""
    out = {k: v for k, v in state_dict.items() if not is_adapter_name(k)}
    for name in state_dict:
        if not name.endswith(ADAPTER_IN):
            continue
        base = name[: -len(ADAPTER_IN)]
        a, b = state_dict[name].float(), state_dict[base + ADAPTER_OUT].float()
        w = out[base + "weight"]
        out[base + "weight"] = (w.float() + config.scaling * (b @ a)).to(w.dtype)
    return out


def adapter_names(names: Iterable[str]) -> list[str]:
    return [n for n in names if is_adapter_name(n)]
