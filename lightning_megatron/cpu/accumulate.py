"""Adding a 16-bit gradient into its fp32 main gradient on CPU, a cache-sized piece at a time.

Every microbatch's backward after the first adds each parameter's bf16/fp16 gradient into the fp32
``main_grad`` of the :class:`~lightning_megatron.grads.GradBuffer`. torch's CPU ``add_`` with mixed
dtypes converts element by element through its dynamic-cast loop; converting a piece of the gradient
into a small fp32 scratch tensor that stays in cache and adding that is one vectorized conversion
and one vectorized add. The result is the same bits: converting bf16/fp16 to fp32 is exact, and
each element gets the same one fp32 addition.

Under pipelining each stage accumulates every microbatch, so this is where the cost shows: a
bert-base stage holding 66 M parameters adds 3 x 66 M elements per step at four microbatches
(``docs/benchmarks.md``, "Figures behind the code", has the measurement).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["accumulate_grad", "CHUNK_ELEMENTS"]

CHUNK_ELEMENTS = 1 << 16
"""Elements converted per piece (256 KiB of fp32 scratch: in L2 on current x86 and Arm cores)."""

_scratch = threading.local()


def _scratch_of(device: torch.device) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.device != device:
        buf = _scratch.buf = torch.empty(CHUNK_ELEMENTS, dtype=torch.float32, device=device)
    return buf


def accumulate_grad(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    """``main_grad += grad`` (fp32 ``main_grad``), bitwise equal to ``main_grad.add_(grad)``."""
    n = grad.numel()
    if (grad.dtype == main_grad.dtype or n <= CHUNK_ELEMENTS or grad.device.type != "cpu"
            or not (grad.is_contiguous() and main_grad.is_contiguous())):
        main_grad.add_(grad)
        return
    flat_main, flat_grad = main_grad.view(-1), grad.view(-1)
    scratch = _scratch_of(grad.device)
    for lo in range(0, n, CHUNK_ELEMENTS):
        hi = min(n, lo + CHUNK_ELEMENTS)
        piece = scratch[: hi - lo]
        piece.copy_(flat_grad[lo:hi])
        flat_main[lo:hi].add_(piece)
