"""The few ops of the transformer that a platform package may replace: :class:`Kernels`.

The library runs one code path on every device: these defaults (``F.dropout``, SDPA for the "auto"
attention backend, the softmax in fp32 when the config asks). A platform package can install its own
subclass on a built model with :func:`set_kernels`; the opt-in CPU tuning
(:class:`lightning_megatron.cpu.CPUTuning`) does, with :class:`lightning_megatron.cpu.kernels.CPUKernels`.
Modules that use kernels hold them in a ``kernels`` attribute (:class:`DotProductAttention`,
:class:`TransformerLayer`'s bias-dropout-add, :class:`Dropout`, a mixture of experts' ``LocalExperts``, the
language model's loss: :class:`~lightning_megatron.language.model.LanguageModule`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Kernels", "DEFAULT_KERNELS", "set_kernels"]


class Kernels:
    """The default, device-generic kernels."""

    def dropout(self, x: torch.Tensor, p: float) -> torch.Tensor:
        """Training-mode dropout with drop probability ``p`` (0 < p < 1), from the device's default generator."""
        return F.dropout(x, p=p, training=True)

    def use_sdpa(self, query: torch.Tensor, p: float, backend: str) -> bool:
        """Whether core attention calls ``scaled_dot_product_attention`` ("auto": yes)."""
        return backend != "unfused"

    def attention_operands(self, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The unfused attention's ``q, k, v`` ([b, n, s, d] views of the ``[s, b, n, d]`` projections) in the
        layout its batched matmuls read (the defaults: as they are; a GPU's strided batched GEMM reads them)."""
        return q, k, v

    def softmax(self, scores: torch.Tensor, in_fp32: bool) -> torch.Tensor:
        """Row softmax of ``scores``; computed in fp32 and cast back when ``in_fp32`` and 16-bit."""
        if in_fp32 and scores.dtype != torch.float32:
            return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
        return torch.softmax(scores, dim=-1)

    def loss_rows(self, logits: torch.Tensor) -> int | None:
        """Rows (tokens) of ``logits`` [..., V/t] the cross entropy takes through its fp32 passes at a time
        (:func:`~lightning_megatron.tensor_parallel.vocab_parallel_cross_entropy`'s ``rows_per_piece``; the
        same bits either way). The default, None: all rows in each pass, one kernel per pass."""
        return None

    def expert_rows(self, rows: int, x: torch.Tensor) -> int:
        """The rows to run an expert's matmuls on when it receives ``rows`` tokens (``x`` one of them): more
        pads the input with zero rows (the extra outputs are dropped; the result is the same)."""
        return rows


DEFAULT_KERNELS = Kernels()


def set_kernels(module: nn.Module, kernels: Kernels) -> int:
    """Install ``kernels`` on every submodule of ``module`` that uses kernels; returns how many."""
    count = 0
    for m in module.modules():
        if isinstance(getattr(m, "kernels", None), Kernels):
            m.kernels = kernels
            count += 1
    return count
