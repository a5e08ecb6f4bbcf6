"""CPU kernels for the transformer (installed by :class:`lightning_megatron.cpu.CPUTuning`).

- dropout: :func:`lightning_megatron.cpu.dropout.cpu_dropout` (one 64-bit draw per four elements
  instead of torch's one Mersenne-Twister draw per element; compiled, the draw is one opaque op);
- attention "auto": SDPA only for fp32 without dropout; else the unfused math, because SDPA's CPU
  kernels draw the dropout mask with ``bernoulli_`` and run bf16 through a slower path (the
  measurement is in docs/benchmarks.md, "Figures behind the code");
- attention operands: the unfused attention's 16-bit Q, K and V made contiguous ([b, n, s, d]) before its
  batched matmuls: oneDNN's matmul copies any operand that is neither contiguous nor transposed in its last two
  dims, and its copies of these views (K transposed: a gather) are slower than copying them first; the
  same bits (docs/benchmarks.md, "Figures behind the code");
- softmax: a 16-bit softmax on CPU already computes in fp32 (forward bit-identical to fp32 then
  rounding; backward within an ulp), as Megatron's fused softmax does on GPUs: no casts of
  [b, n, s, s] needed;
- expert rows: a mixture of experts' bf16/fp16 expert matmuls run on the rows rounded up to a multiple of
  128 (zero padding): oneDNN builds a new 16-bit GEMM kernel for every row count it has not seen, and
  routing gives each expert a new count every step (measured: 2.8 ms per call for a new count against
  0.23 ms for a known one; docs/moe.md, "Speed").

- loss rows: the cross entropy's fp32 passes over the logits (the widening subtraction of the max, ``exp_``, the
  sums; in the backward the scaling and the narrowing to the logits' dtype) go ~4 MiB of rows at a time, each
  piece through all of them while it is in cache, instead of each pass over all [tokens, V] (the same bits;
  measured on [2048, 32000] bf16 logits: forward 42-46 against 51-61 ms, backward 11 against 22 ms; docs/benchmarks.md,
  "The loss a piece of rows at a time"). On a GPU one kernel per pass is what is fast, so this is CPU-only.

Tensors on other devices get the generic kernels.
"""

from __future__ import annotations

import torch

from lightning_megatron.cpu.dropout import cpu_dropout
from lightning_megatron.transformer.kernels import Kernels

__all__ = ["CPUKernels"]


def _on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


class CPUKernels(Kernels):
    """:class:`~lightning_megatron.transformer.kernels.Kernels` tuned for CPU tensors."""

    EXPERT_ROW_MULTIPLE = 128
    """16-bit expert matmuls run on a multiple of this many rows."""

    LOSS_PIECE_BYTES = 4 << 20
    """Bytes of fp32 logits the cross entropy takes through its passes at a time (at least two rows)."""

    def __init__(self, *, dropout: bool = True, attention: bool = True, expert_rows: bool = True,
                 loss_pieces: bool = True) -> None:
        self.fast_dropout, self.attention, self.pad_expert_rows = dropout, attention, expert_rows
        self.loss_pieces = loss_pieces

    def dropout(self, x: torch.Tensor, p: float) -> torch.Tensor:
        if self.fast_dropout and _on_cpu(x):
            return cpu_dropout(x, p)
        return super().dropout(x, p)

    def use_sdpa(self, query: torch.Tensor, p: float, backend: str) -> bool:
        if backend == "auto" and self.attention and _on_cpu(query):
            return p == 0.0 and query.dtype == torch.float32
        return super().use_sdpa(query, p, backend)

    def attention_operands(self, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.attention and _on_cpu(q) and q.dtype in (torch.bfloat16, torch.float16):  # fp32: no copy to save
            return q.contiguous(), k.contiguous(), v.contiguous()
        return super().attention_operands(q, k, v)

    def softmax(self, scores: torch.Tensor, in_fp32: bool) -> torch.Tensor:
        if self.attention and _on_cpu(scores):
            return torch.softmax(scores, dim=-1)
        return super().softmax(scores, in_fp32)

    def loss_rows(self, logits: torch.Tensor) -> int | None:
        if self.loss_pieces and _on_cpu(logits):
            return max(2, self.LOSS_PIECE_BYTES // (4 * logits.size(-1)))
        return super().loss_rows(logits)

    def expert_rows(self, rows: int, x: torch.Tensor) -> int:
        if self.pad_expert_rows and rows and _on_cpu(x) and x.dtype in (torch.bfloat16, torch.float16):
            return -(-rows // self.EXPERT_ROW_MULTIPLE) * self.EXPERT_ROW_MULTIPLE
        return super().expert_rows(rows, x)

    def __repr__(self) -> str:
        return (f"CPUKernels(dropout={self.fast_dropout}, attention={self.attention}, "
                f"expert_rows={self.pad_expert_rows}, loss_pieces={self.loss_pieces})")
