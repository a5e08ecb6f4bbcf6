"""The word embedding's gradient of a microbatch as rows, on a pipeline's first stage (CPU tuning).

torch's embedding backward writes a dense ``[V, h]`` gradient per microbatch (zero-filled, then each
token's output gradient added into its row), and the gradient buffer's hook then adds the whole
tensor into the fp32 ``main_grad``: at bert-base 23 M elements twice per microbatch for the few
hundred rows a microbatch touches. On a pipeline's first stage the word embedding is used by the lookup
only (the tied output layer is on the last stage), so its gradient can go straight into ``main_grad``
as rows: :class:`RowSparseEmbeddingGrad`.

Same bits as torch's CPU kernel: each touched row's sum is built as ``embedding_dense_backward_cpu``
builds it (the tokens in their order, one addition at a time in the parameter's dtype), then added into
``main_grad`` as the hook would add the dense row (untouched rows would get ``+ 0``). Only for CPU
tensors: a GPU's embedding backward sums in another order, and writes dense gradients fast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RowSparseEmbeddingGrad", "row_sums"]

AddRows = Callable[[nn.Parameter, torch.Tensor, torch.Tensor], None]


def row_sums(ids: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, sums)``: the distinct ``ids`` (ascending) and, for each, the sum of the output-gradient
    rows of its tokens, accumulated in token order in ``grad``'s dtype, as torch's CPU embedding
    backward accumulates them into its dense gradient."""
    flat_ids, flat = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
    sorted_ids, order = torch.sort(flat_ids, stable=True)  # stable: the tokens of a row stay in order
    rows, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    sums = flat[order[starts]].clone()  # 0 + g is g exactly: the first token of each row
    for k in range(1, int(counts.max()) if counts.numel() else 0):
        more = torch.nonzero(counts > k).flatten()
        sums[more] = sums[more] + flat[order[starts[more] + k]]
    return rows, sums


class _LookupWithRowGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, owner: RowSparseEmbeddingGrad) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.owner, ctx.weight = owner, weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        rows, sums = row_sums(ids, grad)
        ctx.owner.add_rows(ctx.weight, rows, sums)
        return None, None, None


class RowSparseEmbeddingGrad:
    """The lookup of a word embedding whose weight gradient goes to ``add_rows`` as rows.

    Between :meth:`open` and :meth:`close` (the training schedule, with the gradient buffer's
    :meth:`~lightning_megatron.grads.GradBuffer.add_grad_rows`), :meth:`lookup` is ``F.embedding`` with
    that backward; otherwise it is plain ``F.embedding``.
    """

    def __init__(self) -> None:
        self._add_rows: AddRows | None = None

    def open(self, add_rows: AddRows) -> None:
        self._add_rows = add_rows

    def close(self) -> None:
        self._add_rows = None

    def add_rows(self, weight: nn.Parameter, rows: torch.Tensor, sums: torch.Tensor) -> None:
        if self._add_rows is None:
            raise RuntimeError("RowSparseEmbeddingGrad: a backward after the schedule closed it")
        self._add_rows(weight, rows, sums)

    def lookup(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._add_rows is not None and torch.is_grad_enabled() and weight.requires_grad and weight.is_cpu:
            return _LookupWithRowGrad.apply(ids, weight, self)
        return F.embedding(ids, weight)
