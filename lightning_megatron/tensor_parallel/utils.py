"""Small pure helpers for tensor parallelism: division checks, vocab ranges (parameter facts:
:mod:`lightning_megatron.tensor_parallel.param_facts`)."""

from __future__ import annotations


__all__ = ["divide", "pad_vocab_size", "VocabUtility"]


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
