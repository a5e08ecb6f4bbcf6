"""An embedding lookup whose weight gradient a 16-bit table on CPU sums in fp32.

torch's CPU embedding backward (torch 2.13) adds each token's output-gradient row into its table row one at a
time in the table's dtype: in bf16 a row looked up by 2048 tokens gets a gradient 5% off the exact sum of the same
bf16 rows, the more the more tokens (BERT's token types, a decoder's padding and frequent tokens). :func:`embedding`
is ``F.embedding`` whose backward, for a 16-bit table on CPU
(:func:`~lightning_megatron.tensor_parallel.utils.kernel_sums_in_16_bits`), sums each row's tokens in fp32 and
rounds once (:func:`row_sums`), as GPU kernels accumulate. Every other case (fp32, an accelerator, code being
compiled) is ``F.embedding`` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_megatron.tensor_parallel.utils import kernel_sums_in_16_bits

__all__ = ["Embedding", "embedding", "row_sums"]

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def row_sums(ids: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, sums)``: the distinct ``ids`` (ascending) and, for each, the sum of the output-gradient rows of its
    tokens in ``grad``'s dtype: for a 16-bit ``grad`` summed in fp32 (in token order) and rounded once; otherwise
    accumulated in token order in ``grad``'s dtype, as torch's CPU embedding backward builds its dense gradient
    (the same bits as it)."""
    flat_ids, flat = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
    if flat.dtype in _SIXTEEN_BIT:
        rows, inverse = torch.unique(flat_ids, sorted=True, return_inverse=True)
        sums = torch.zeros(rows.numel(), flat.shape[-1], dtype=torch.float32, device=flat.device)
        return rows, sums.index_add_(0, inverse, flat.float()).to(flat.dtype)
    sorted_ids, order = torch.sort(flat_ids, stable=True)  # stable: the tokens of a row stay in order
    rows, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    sums = flat[order[starts]].clone()  # 0 + g is g exactly: the first token of each row
    for k in range(1, int(counts.max()) if counts.numel() else 0):
        more = torch.nonzero(counts > k).flatten()
        sums[more] = sums[more] + flat[order[starts[more] + k]]
    return rows, sums


class _LookupSummedInFp32(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(ids)
        ctx.table = (weight.shape, weight.dtype, weight.device)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        shape, dtype, device = ctx.table
        rows, sums = row_sums(ids, grad)
        dense = torch.zeros(shape, dtype=dtype, device=device)
        return None, dense.index_copy_(0, rows, sums.to(dtype))


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)``; for a 16-bit ``weight`` on CPU whose gradient is wanted, its gradient rows
    summed in fp32 (module doc)."""
    if kernel_sums_in_16_bits(weight) and weight.requires_grad and torch.is_grad_enabled() \
            and not torch.compiler.is_compiling():
        return _LookupSummedInFp32.apply(ids, weight)
    return F.embedding(ids, weight)


class Embedding(nn.Embedding):
    """``nn.Embedding`` (no padding row, norm limit or sparse gradient) whose lookup is :func:`embedding`: a module,
    so what hooks modules sees it run (ZeRO-1's overlapped parameter all-gather waits in a forward pre-hook)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight)
