"""Small pure helpers for tensor parallelism: division checks, vocab ranges, parameter metadata."""

from __future__ import annotations

import torch

__all__ = [
    "divide",
    "pad_vocab_size",
    "VocabUtility",
    "set_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "param_is_not_tensor_parallel_duplicate",
    "split_tensor_along_last_dim",
]


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """``numerator // denominator``, raising ``ValueError`` naming both numbers when it does not divide."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor_model_parallel_size={denominator}; "
            f"choose a {what} that is a multiple of {denominator} or a different parallel size"
        )
    return numerator // denominator


def pad_vocab_size(vocab_size: int, tensor_model_parallel_size: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron's vocab padding: the smallest multiple of ``make_vocab_size_divisible_by * tp`` >= vocab_size.

    Every TP rank then holds an equal slice of the embedding and of the output logits.
    """
    if vocab_size < 1 or tensor_model_parallel_size < 1 or make_vocab_size_divisible_by < 1:
        raise ValueError(
            f"pad_vocab_size needs positive numbers, got vocab_size={vocab_size}, "
            f"tensor_model_parallel_size={tensor_model_parallel_size}, "
            f"make_vocab_size_divisible_by={make_vocab_size_divisible_by}"
        )
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


class VocabUtility:
    """Which contiguous slice ``[first, last)`` of the vocabulary a TP rank owns."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int) -> tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
        per_partition = divide(global_vocab_size, world_size, "vocab size (pad it with pad_vocab_size)")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank)


_TP_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1) -> None:
    """Mark ``param`` as sharded along ``dim`` across TP ranks (or replicated when ``is_parallel`` is False)."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(param: torch.Tensor) -> None:
    for name, value in _TP_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(param, name):
            setattr(param, name, value)


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True when ``param`` is sharded or this is TP rank 0: norms count a replicated parameter once."""
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` into ``num_partitions`` equal chunks along its last dimension (views)."""
    last = tensor.size(-1)
    return torch.split(tensor, divide(last, num_partitions, "last dimension"), dim=-1)
