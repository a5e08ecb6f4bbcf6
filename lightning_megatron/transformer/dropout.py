"""Dropout: ``torch.nn.functional.dropout`` through the model's :class:`~lightning_megatron.transformer.kernels.Kernels`.

The masks come from the default generator of the tensor's device, so the RNG tracker's ``fork()``
and activation recomputation replay them. A platform package may install another kernel
(:func:`~lightning_megatron.transformer.kernels.set_kernels`).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_megatron.transformer.kernels import DEFAULT_KERNELS, Kernels

__all__ = ["dropout", "Dropout"]


def _check(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p={p} must be in [0, 1)")


def dropout(x: torch.Tensor, p: float, training: bool = True, kernels: Kernels = DEFAULT_KERNELS) -> torch.Tensor:
    """Dropout of ``x`` with probability ``p`` when ``training``; the identity otherwise."""
    _check(p)
    if not training or p == 0.0:
        return x
    return kernels.dropout(x, p)


class Dropout(nn.Module):
    """``nn.Dropout`` through :attr:`kernels`; ``p`` is the drop probability."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        _check(p)
        self.p = p
        self.kernels: Kernels = DEFAULT_KERNELS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, self.kernels)

    def extra_repr(self) -> str:
        return f"p={self.p}"
