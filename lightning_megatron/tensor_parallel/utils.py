"""Small pure helpers for tensor parallelism: division checks, vocab ranges (parameter facts:
:mod:`lightning_megatron.tensor_parallel.param_facts`), which devices' kernels sum 16-bit gradients in 16 bits."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["divide", "kernel_sums_in_16_bits", "pad_vocab_size", "torch_kernel_sums", "VocabUtility"]

_TORCH_SUMS = [False]
"""Inside :func:`torch_kernel_sums`."""


def kernel_sums_in_16_bits(t: torch.Tensor) -> bool:
    """Whether torch's kernels on ``t``'s device sum the weight gradient of a 16-bit ``t`` over the tokens in 16 bits,
    so the library sums it itself (:class:`~lightning_megatron.transformer.norms.LayerNorm`,
    :func:`~lightning_megatron.tensor_parallel.embedding.embedding`): torch 2.13's CPU layer norm and embedding
    backward do (5-14% off the exact sums of bf16 numbers over 4096 tokens, 5% for an embedding row looked up 2048
    times: ``tests/test_wide_sums.py``); GPU kernels accumulate in fp32. Not a tuning but a correction, so not in
    the opt-in :mod:`lightning_megatron.cpu`: the one place the library branches on a CPU outside it
    (``tests/test_device_neutral.py``). False inside :func:`torch_kernel_sums`."""
    return t.dtype in (torch.bfloat16, torch.float16) and t.device.type == "cpu" and not _TORCH_SUMS[0]


@contextmanager
def torch_kernel_sums() -> Iterator[None]:
    """Within it the library leaves every weight gradient's sum to torch's kernels (:func:`kernel_sums_in_16_bits` is
    False), as on an accelerator: what ``check --estimate-time`` counts of a GPU's dispatch on the CPU
    (:mod:`lightning_megatron.check.host_ops`)."""
    previous, _TORCH_SUMS[0] = _TORCH_SUMS[0], True
    try:
        yield
    finally:
        _TORCH_SUMS[0] = previous


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
