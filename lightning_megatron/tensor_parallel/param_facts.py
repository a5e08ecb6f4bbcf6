"""What the parallel machinery must know about a parameter: one typed record, set and read here only.

A parameter's facts decide how its gradient is reduced, how it enters the gradient norm and how a
checkpoint reassembles it. They are a frozen dataclass, :class:`ParamFacts`, attached to the parameter
by :func:`set_param_facts` and read with :func:`param_facts`, which refuses a parameter that has none
(a typo in a field name is a ``TypeError`` of the dataclass, not a silently ignored attribute).

Who sets what:

- the parallel layers (``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``):
  ``sharded_over=("tp",)``, ``partition_dim``, ``partition_stride`` (through Megatron's
  :func:`set_tensor_model_parallel_attributes`), and ``sequence_parallel`` for the row-parallel bias;
- the transformer's norms and biases under sequence parallelism, the norms of queries and keys always:
  ``sequence_parallel``;
- a model with tied word embeddings: ``shared_embedding``; one with a padded vocabulary:
  ``real_vocab_size`` of its embedding and output rows;
- every other parameter is replicated across tensor-parallel ranks: the strategy (and a standalone
  optimizer wrapper) records that explicitly with :func:`mark_replicated` at set-up.

The facts of a model parameter follow its fp32 main copy (:func:`copy_param_facts`). ``deepcopy`` of
a parameter does not keep them (torch builds a new Parameter): build models, don't copy them.

"Count a replicated parameter once" is :func:`is_counted`, used by the gradient norm, the zero count
and the model's parameter count alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

__all__ = [
    "ParamFacts",
    "param_facts",
    "has_param_facts",
    "set_param_facts",
    "copy_param_facts",
    "mark_replicated",
    "set_tensor_model_parallel_attributes",
    "is_counted",
]

_ATTRIBUTE = "_lightning_megatron_param_facts"  # the one attribute; only this module touches it
# Stored as a dict of plain values, not the dataclass: torch pickles a tensor's attributes with it
# (an fp32 main param in an optimizer state dict), and torch.load(weights_only=True) loads plain values only.


@dataclass(frozen=True, kw_only=True)
class ParamFacts:
    """How one parameter is laid out over the parallel dimensions (names of
    :class:`~lightning_megatron.parallel_dims.ParallelDims` and its groups).

    The machinery reads only these fields: the gradient is averaged over the group
    ``data_parallel`` (where the ZeRO-1 state is sharded too), the gradient norm counts the parameter
    on rank 0 of every dimension in ``replicated_over`` (and sums the shards of ``sharded_over``),
    and a checkpoint stores the global tensor, reassembled along ``partition_dim`` from the shards
    of ``sharded_over``. A new kind of parameter (an expert's weight: sharded over ``ep``, averaged
    over ``expert_dp``) is new values here, not new code there.
    """

    sharded_over: tuple[str, ...] = ()
    """Model-parallel dimensions the tensor is split across along ``partition_dim`` (``("tp",)`` for a
    tensor-parallel weight), outermost first: every rank of them holds a different piece."""
    replicated_over: tuple[str, ...] = ("tp",)
    """Model-parallel dimensions whose ranks each hold the whole tensor (counted once: on rank 0 of each)."""
    data_parallel: str = "dp_cp"
    """The group (:data:`~lightning_megatron.parallel_state.GROUP_NAMES`) that averages the gradient and
    shards the optimizer state: ``dp_cp`` (data and context parallel ranks) for dense parameters."""
    partition_dim: int = -1
    """The dimension it is sharded along (-1 when not sharded)."""
    partition_stride: int = 1
    """Megatron's stride of the shards along ``partition_dim`` (1: contiguous slices)."""
    sequence_parallel: bool = False
    """Replicated across TP, but its gradient is partial: under sequence parallelism (norm weights and
    biases, row-parallel biases), and always for the norms of queries and keys (each TP rank normalizes its own
    heads): the gradients are summed over TP."""
    shared_embedding: bool = False
    """The tied word embedding: held by the first and the last pipeline stage, its gradients summed
    over the embedding group; counted once, on the first stage."""
    real_vocab_size: int | None = None
    """For a vocabulary-padded embedding or output weight: rows past it (along ``partition_dim``, or dim
    0 when replicated) are padding, not saved."""

    def __post_init__(self) -> None:
        both = set(self.sharded_over) & set(self.replicated_over)
        if both:
            raise ValueError(f"ParamFacts(sharded_over={self.sharded_over}, replicated_over={self.replicated_over}): "
                             f"{sorted(both)} cannot be both")
        if self.sharded_over and self.partition_dim < 0:
            raise ValueError(f"ParamFacts(sharded_over={self.sharded_over}, partition_dim={self.partition_dim}): a "
                             f"sharded parameter needs the dimension it is split along (>= 0)")
        if self.partition_stride < 1:
            raise ValueError(f"ParamFacts(partition_stride={self.partition_stride}) must be >= 1")
        if self.real_vocab_size is not None and self.real_vocab_size < 1:
            raise ValueError(f"ParamFacts(real_vocab_size={self.real_vocab_size}) must be >= 1 or None")

    @property
    def tensor_model_parallel(self) -> bool:
        """Megatron's attribute: split across the tensor-parallel ranks."""
        return "tp" in self.sharded_over

    def shard(self, coordinates: Mapping[str, int], sizes: Mapping[str, int]) -> tuple[int, int]:
        """``(index, count)``: which of ``count`` pieces along ``partition_dim`` this rank holds, from its
        coordinates and the sizes of the ``sharded_over`` dimensions (``(0, 1)`` when not sharded)."""
        index, count = 0, 1
        for dim in self.sharded_over:
            index, count = index * sizes[dim] + coordinates[dim], count * sizes[dim]
        return index, count


_FIELDS = frozenset(f.name for f in fields(ParamFacts))


def _stored(param: torch.Tensor) -> dict[str, Any] | None:
    value = param.__dict__.get(_ATTRIBUTE)
    if not (isinstance(value, dict) and value.keys() == _FIELDS):
        return None
    return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}


def has_param_facts(param: torch.Tensor) -> bool:
    """Whether ``param`` carries a :class:`ParamFacts` record."""
    return _stored(param) is not None


def param_facts(param: torch.Tensor) -> ParamFacts:
    """The record of ``param``; refused when it has none."""
    stored = _stored(param)
    if stored is None:
        raise TypeError(
            f"parameter of shape {tuple(param.shape)} ({param.dtype}) has no ParamFacts: the parallel layers "
            f"set them, lightning_megatron.tensor_parallel.mark_replicated(params) declares the others "
            f"replicated (the MegatronStrategy does it for the model chunks at set-up), and "
            f"set_param_facts(param, ...) sets them by hand")
    return ParamFacts(**stored)


def set_param_facts(param: torch.Tensor, **changes: Any) -> ParamFacts:
    """Set fields of ``param``'s record (a new record from the defaults when it has none); returns it."""
    stored = _stored(param)
    facts = replace(ParamFacts() if stored is None else ParamFacts(**stored), **changes)
    param.__dict__[_ATTRIBUTE] = asdict(facts)
    return facts


def copy_param_facts(source: torch.Tensor, target: torch.Tensor) -> None:
    """``target`` (e.g. an fp32 main copy) gets ``source``'s record, if it has one."""
    if has_param_facts(source):
        target.__dict__[_ATTRIBUTE] = asdict(param_facts(source))


def mark_replicated(params: Iterable[torch.Tensor]) -> int:
    """Declare every parameter of ``params`` without a record replicated across TP (the defaults of
    :class:`ParamFacts`); returns how many were declared."""
    count = 0
    for p in params:
        if not has_param_facts(p):
            p.__dict__[_ATTRIBUTE] = asdict(ParamFacts())
            count += 1
    return count


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1) -> None:
    """Megatron's name: mark ``param`` as sharded along ``dim`` across TP ranks (or replicated when
    ``is_parallel`` is False)."""
    set_param_facts(param, sharded_over=("tp",) if is_parallel else (), replicated_over=() if is_parallel else ("tp",),
                    partition_dim=dim, partition_stride=stride)


def is_counted(param: torch.Tensor, coordinates: Mapping[str, int]) -> bool:
    """Whether this rank (at ``coordinates``, :attr:`ParallelState.coordinates`) counts ``param`` in sums
    over the model-parallel ranks (gradient norm, zero count, parameter count): on rank 0 of every
    dimension it is replicated over, and the tied word embedding on the first pipeline stage only."""
    facts = param_facts(param)
    if facts.shared_embedding and coordinates.get("pp", 0) != 0:
        return False
    return all(coordinates.get(dim, 0) == 0 for dim in facts.replicated_over)
