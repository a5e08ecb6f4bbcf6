"""Tensor-parallel shards <-> full tensors, for any model family, driven by the family's :class:`TPLayout`.

A state dict under our names is *full* at TP=1. At TP size ``t`` a column-parallel tensor keeps a row
slice on each rank, a row-parallel one a column slice, the rest is replicated; the family says which by
name suffix (:attr:`TPLayout.partition_dims`). Megatron's *strided* partition (a SwiGLU ``linear_fc1``,
full ``[gate; up]``, on rank ``r`` ``[gate_r; up_r]``) is a tensor made of ``stride`` blocks along the
split dim, each rank holding its slice of every block in order::

    shard(T, r) = cat([B_1 chunk r, ..., B_s chunk r])      T = [B_1; ...; B_s]
    merge([T_0 ... T_{t-1}]) = [B_1 of T_0 ... B_1 of T_{t-1}; ...; B_s of T_0 ... B_s of T_{t-1}]

:func:`gather_full_state_dict` does the same for a live model, from its parameters' facts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.parallel_state import Group, group_size, process_group
from lightning_megatron.tensor_parallel import param_facts

__all__ = ["TPLayout", "shard_tensor", "merge_tensors", "shard_state_dict", "merge_tp_shards",
           "gather_full_state_dict"]


@dataclass(frozen=True, kw_only=True)
class TPLayout:
    """How a family's tensors are split over tensor-parallel ranks, by name suffix."""

    partition_dims: Mapping[str, int]
    """Name suffix -> the dim the tensor is split along (column-parallel 0, row-parallel 1); a tensor
    no suffix matches is replicated."""
    strides: Mapping[str, int] = field(default_factory=dict)
    """Name suffix -> the number of blocks a split tensor is made of (Megatron's ``partition_stride``:
    2 for a SwiGLU ``linear_fc1``); absent: 1, contiguous slices."""
    vocab_keys: tuple[str, ...] = ()
    """Full names whose rows are the vocabulary (padded with zero rows by :func:`shard_state_dict`,
    trimmed by :func:`merge_tp_shards` given a ``vocab_size``)."""

    def __post_init__(self) -> None:
        bad = {k: s for k, s in self.strides.items() if s < 1}
        if bad:
            raise ValueError(f"TPLayout(strides={dict(self.strides)!r}): every stride must be >= 1 (1: contiguous)")
        unsplit = sorted(k for k, s in self.strides.items() if s > 1 and self.dim(k) is None)
        if unsplit:
            raise ValueError(f"TPLayout(strides=...) names {unsplit}, which partition_dims does not split: add "
                             f"their partition dim")

    def dim(self, key: str) -> int | None:
        """The dim ``key`` is split along, None when replicated."""
        return next((d for suffix, d in self.partition_dims.items() if key.endswith(suffix)), None)

    def stride(self, key: str) -> int:
        return next((s for suffix, s in self.strides.items() if key.endswith(suffix)), 1)


def shard_tensor(full: torch.Tensor, tp_rank: int, tp_size: int, dim: int, stride: int = 1) -> torch.Tensor:
    """Rank ``tp_rank``'s slice of ``full`` along ``dim``: of every one of its ``stride`` blocks, in order."""
    if stride == 1:
        return full.chunk(tp_size, dim=dim)[tp_rank].clone()
    return torch.cat([b.chunk(tp_size, dim=dim)[tp_rank] for b in full.chunk(stride, dim=dim)], dim=dim)


def merge_tensors(parts: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` over the ranks' ``parts`` (rank order)."""
    if stride == 1:
        return torch.cat(parts, dim=dim)
    blocks = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([b[i] for i in range(stride) for b in blocks], dim=dim)


def shard_state_dict(full: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int, layout: TPLayout, *,
                     padded_vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """TP rank ``tp_rank``'s shard of a full state dict; the ``layout.vocab_keys`` padded with zero rows to
    ``padded_vocab_size`` first (None: as they are)."""
    out = {}
    for key, t in full.items():
        if key in layout.vocab_keys and padded_vocab_size is not None:
            if t.size(0) > padded_vocab_size:
                raise ValueError(f"cannot pad a vocabulary of {t.size(0)} rows to {padded_vocab_size}")
            t = torch.cat([t, t.new_zeros((padded_vocab_size - t.size(0), *t.shape[1:]))])
        dim = layout.dim(key)
        out[key] = t.clone() if dim is None or tp_size == 1 else shard_tensor(t, tp_rank, tp_size, dim,
                                                                               layout.stride(key))
    return out


def merge_tp_shards(shards: list[Mapping[str, torch.Tensor]], layout: TPLayout, *,
                    vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """The full state dict of the TP ``shards`` (rank order); ``vocab_size`` drops vocabulary padding rows."""
    out = {}
    for key in shards[0]:
        parts = [s[key] for s in shards]
        dim = layout.dim(key)
        t = parts[0].clone() if dim is None or len(parts) == 1 else merge_tensors(parts, dim, layout.stride(key))
        out[key] = t[:vocab_size] if key in layout.vocab_keys and vocab_size is not None else t
    return out


def gather_full_state_dict(model: nn.Module, tp_group: Group) -> dict[str, torch.Tensor]:
    """All-gather every TP-sharded parameter of ``model`` (by its facts: ``partition_dim``,
    ``partition_stride``): the TP=1 state dict (vocabulary as padded), on every rank of ``tp_group``."""
    world = group_size(tp_group)
    out = {}
    params = dict(model.named_parameters())
    for key, value in model.state_dict().items():
        param = params.get(key)
        facts = None if param is None else param_facts(param)
        if world > 1 and facts is not None and facts.tensor_model_parallel:
            parts = [torch.empty_like(value) for _ in range(world)]
            dist.all_gather(parts, value.contiguous(), group=process_group(tp_group))
            value = merge_tensors(parts, facts.partition_dim % value.dim(), facts.partition_stride)
        out[key] = value.detach().clone()
    return out
