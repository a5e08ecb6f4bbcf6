"""Splitting one step's batch into microbatches (dim 0 of every tensor, nested dicts/tuples/lists)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["split_microbatches"]


def split_microbatches(batch: Any, micro_batch_size: int | None) -> list[Any]:
    """``batch`` cut along dim 0 into pieces of ``micro_batch_size`` (None: one piece)."""
    size = _batch_size(batch)
    mbs = micro_batch_size or size
    if size % mbs != 0:
        raise ValueError(f"the per-rank batch has {size} samples, not divisible by micro_batch_size={mbs}; make "
                         f"each rank's batch a multiple of micro_batch_size (a datamodule's global_batch_size a "
                         f"multiple of micro_batch_size x data-parallel size; a plain DataLoader's batch_size, which "
                         f"is each rank's, a multiple of micro_batch_size)")
    return [_slice_batch(batch, i * mbs, (i + 1) * mbs) for i in range(size // mbs)]


def _batch_size(batch: Any) -> int:
    if torch.is_tensor(batch):
        return batch.size(0)
    if isinstance(batch, Mapping):
        return _batch_size(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return _batch_size(batch[0])
    raise TypeError(f"cannot split a batch of type {type(batch).__name__} into microbatches; "
                    f"use a tensor, a dict or a tuple of tensors")


def _slice_batch(batch: Any, start: int, end: int) -> Any:
    if torch.is_tensor(batch):
        return batch[start:end]
    if isinstance(batch, Mapping):
        return {k: _slice_batch(v, start, end) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_slice_batch(v, start, end) for v in batch)
    if isinstance(batch, list):
        return [_slice_batch(v, start, end) for v in batch]
    return batch
