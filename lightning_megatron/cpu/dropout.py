"""A faster CPU dropout: ``y = x * keep / P(keep)``, ``keep ~ Bernoulli(1 - p)`` per element.

Part of the opt-in CPU tuning (:class:`lightning_megatron.cpu.CPUTuning` installs it through
:class:`lightning_megatron.cpu.kernels.CPUKernels`); the library's dropout is
``torch.nn.functional.dropout`` on every device. On CPU ``bernoulli_`` draws one Mersenne-Twister number per element, serially (at bert-base, 37
dropout sites and ~40 M elements per step: a large share of a bf16 step). Here the CPU
path draws one 64-bit number per *four* elements and compares each 16-bit lane with a threshold:

    k = round(p * 2^16),   drop = lane < k   (lanes uniform on 0 .. 2^16 - 1),
    P(keep) = 1 - k / 2^16,   y = x * keep * (1 / P(keep)).

So the drop probability is ``p`` rounded to a multiple of 2^-16 (0.1 -> 0.1000061) and the scale
uses the rounded value: ``E[y] = x``, as with torch's dropout. The scale multiplies in the op's
fp32 arithmetic, where torch's CPU dropout of a bf16 tensor multiplies by a bf16-rounded
``1 / (1 - p)`` (1.109375 for p = 0.1, a 0.16% bias). The numbers come from the default generator
of the tensor's device, so the RNG tracker's ``fork()`` and activation recomputation replay the
same masks, exactly as they do for ``F.dropout``.
"""

from __future__ import annotations

import torch

__all__ = ["cpu_dropout", "keep_mask"]

_LANES = 1 << 16


def _words(count: int, device: torch.device | str | None) -> torch.Tensor:
    """``count`` int64 words over their full range from the device's default generator."""
    return torch.empty(count, dtype=torch.int64, device=device).random_(-(2**63), None)


@torch.library.custom_op("lightning_megatron::dropout_words", mutates_args=())
def _draw_words(count: int, device: torch.device) -> torch.Tensor:
    """:func:`_words` as one opaque op for code being compiled (``compile=True``): dynamo does not trace
    ``random_``, which broke a compiled layer at every dropout (a BERT layer into 19 graphs); the compiler calls
    this op as it is and fuses the mask's arithmetic around it. The same numbers as eager."""
    return _words(count, device)


@_draw_words.register_fake
def _(count: int, device: torch.device) -> torch.Tensor:
    return torch.empty(count, dtype=torch.int64, device=device)


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """(``keep`` of ``shape`` and ``dtype``: 1 with probability P(keep), else 0; that P(keep)).

    P(keep) = 1 - round(p * 2^16) / 2^16. Draws ``ceil(numel / 4)`` int64 words over their full
    range from the device's default generator; nothing is drawn when P(keep) = 1.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p={p} must be in [0, 1)")
    drops = round(p * _LANES)
    if drops == 0:
        return torch.ones(shape, dtype=dtype, device=device), 1.0
    numel = 1
    for n in shape:
        numel *= n
    count = (numel + 3) // 4
    compiling = torch.compiler.is_compiling()
    words = _draw_words(count, torch.device(device or "cpu")) if compiling else _words(count, device)
    lanes = words.view(torch.int16)[:numel].view(shape)  # uniform on [-2^15, 2^15)
    # keep = lane >= t, as 0/1 by integer clamping: a bool mask would cost a slow bool -> float
    # conversion (slower than these two int16 passes and the cast together).
    t = drops - _LANES // 2
    keep = lanes.clamp(t - 1, t).sub_(t - 1).to(dtype)
    return keep, 1.0 - drops / _LANES


class _ApplyKeepMask(torch.autograd.Function):
    """``y = x * keep * scale``; ``dx = dy * keep * scale`` (saves the mask only).

    Two multiplications instead of one by ``keep * scale``: that product, stored in bf16, would
    round the scale (and bias E[y]); ``mul_(scale)`` multiplies in fp32 and rounds once.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x.mul(keep).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (keep,) = ctx.saved_tensors
        return grad.mul(keep).mul_(ctx.scale), None, None


def cpu_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout of ``x`` with probability ``p`` (rounded to a multiple of 2^-16) when ``training``."""
    if not training or p == 0.0:
        return x
    keep, keep_prob = keep_mask(x.shape, p, x.dtype, x.device)
    if keep_prob == 1.0:
        return x
    return _ApplyKeepMask.apply(x, keep, 1.0 / keep_prob)
