"""The word embedding's gradient of a microbatch as rows, on a pipeline's first stage (CPU tuning).

torch's embedding backward writes a dense ``[V, h]`` gradient per microbatch (zero-filled, then each
token's output gradient added into its row), and the gradient buffer's hook then adds the whole
tensor into the fp32 ``main_grad``: at bert-base 23 M elements twice per microbatch for the few
hundred rows a microbatch touches. On a pipeline's first stage the word embedding is used by the lookup
only (the tied output layer is on the last stage), so its gradient can go straight into ``main_grad``
as rows: :class:`RowSparseEmbeddingGrad`.

Same bits as the lookup without it (:func:`lightning_megatron.tensor_parallel.embedding.embedding`): each touched
row's sum is built by the same :func:`~lightning_megatron.tensor_parallel.embedding.row_sums` (a 16-bit table's in
fp32, rounded once; an fp32 table's as torch's CPU kernel builds it, the tokens in their order), then added into
``main_grad`` as the hook would add the dense row (untouched rows would get ``+ 0``). Only for CPU
tensors: a GPU's embedding backward sums in another order, and writes dense gradients fast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_megatron.tensor_parallel.embedding import embedding, row_sums

__all__ = ["RowSparseEmbeddingGrad", "row_sums"]

AddRows = Callable[[nn.Parameter, torch.Tensor, torch.Tensor], None]


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
    that backward; otherwise it is :func:`~lightning_megatron.tensor_parallel.embedding.embedding`.
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
        return embedding(ids, weight)
