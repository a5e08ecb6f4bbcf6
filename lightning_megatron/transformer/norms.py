"""LayerNorm and RMSNorm over the last (hidden) dimension.

LayerNorm:  y = (x - mean(x)) / sqrt(var(x) + eps) * gamma + beta
RMSNorm:    y = x / sqrt(mean(x^2) + eps) * gamma

LayerNorm's gradient w.r.t. x is orthogonal to the all-ones direction and to x_hat: moving x along
either would be undone by the normalization, so no step ever goes there. RMSNorm drops the mean
(shift invariance is mostly redundant in a transformer; the scale control is what matters) and is
cheaper: one reduction instead of two.

Both are replicated across TP. Under sequence parallelism each rank normalizes only its own
sequence chunk, so gamma and beta get partial gradients: they are marked ``sequence_parallel`` and
the strategy sums their gradients over TP. Statistics are computed in fp32 for half-precision inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_megatron.tensor_parallel.param_facts import set_param_facts
from lightning_megatron.tensor_parallel.utils import kernel_sums_in_16_bits
from lightning_megatron.transformer.config import TransformerConfig

__all__ = ["LayerNorm", "RMSNorm", "Norm", "get_norm_class", "resolve_norm_class"]


class LayerNorm(nn.Module):
    """LayerNorm with weight (gamma, ones) and bias (beta, zeros) of shape [hidden_size]."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float | None = None) -> None:
        super().__init__()
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for param in (self.weight, self.bias):  # partial grads under sequence parallelism: summed over TP
            set_param_facts(param, sequence_parallel=config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's kernels accumulate mean and variance in fp32 for bf16/fp16 inputs; an explicit
        # fp32 round trip would only add two copies of the activation (and time: docs/benchmarks.md).
        weight, bias = self.weight.to(x.dtype), self.bias.to(x.dtype)
        if kernel_sums_in_16_bits(x) and torch.is_grad_enabled() and not torch.compiler.is_compiling() \
                and not torch.is_autocast_enabled(x.device.type):  # autocast: its own choice of dtype
            return _LayerNormWideSums.apply(x, weight, bias, self.eps)
        return F.layer_norm(x, self.weight.shape, weight, bias, self.eps)


class _LayerNormWideSums(torch.autograd.Function):
    """``F.layer_norm`` of a 16-bit ``x`` whose weight and bias gradients are summed over the tokens in fp32.

    torch's CPU kernel (torch 2.13) sums them in 16 bits: on ``[1024, 768]`` bf16 inputs it is 4-7% off the exact
    sums (of the same bf16 inputs), 12% on 4096 rows, and the error depends on the thread count, so one process and
    a layout of two (one thread each) disagree by 20% on a layer norm's bias where its terms cancel (docs/check.md,
    "bf16 on CPU"). Here the input gradient is torch's (``native_layer_norm_backward`` without the other two), the
    bias gradient ``sum dy`` and the weight gradient ``sum dy x_hat`` are fp32 sums rounded once, as the CUDA kernel
    does. The forward is torch's, the same bits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        y, mean, rstd = torch.native_layer_norm(x, weight.shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, weight, mean, rstd = ctx.saved_tensors
        h = weight.numel()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.ops.aten.native_layer_norm_backward(dy, x, weight.shape, mean, rstd, weight, None,
                                                           [True, False, False])[0]
        dy_2d = dy.reshape(-1, h).float()  # fp32 sums over the tokens, each column in token order (any thread count)
        dw = db = None
        if ctx.needs_input_grad[1]:
            rstd, mean = rstd.reshape(-1, 1).float(), mean.reshape(-1, 1).float()
            x_hat = torch.addcmul(-mean * rstd, x.reshape(-1, h), rstd)  # (x - mean) rstd in fp32, in one pass
            dw = x_hat.mul_(dy_2d).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            db = dy_2d.sum(0).to(weight.dtype)
        return dx, dw, db, None


class RMSNorm(nn.Module):
    """RMSNorm with weight (gamma, ones) of shape [hidden_size] and no bias."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float | None = None) -> None:
        super().__init__()
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        set_param_facts(self.weight, sequence_parallel=config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics and products, one rounding to x's dtype. With the weight in x's dtype that is torch's
        # rms_norm: one fused kernel each way where the device has one (CUDA), against ~148 bytes per element
        # moved by the arithmetic spelled out below (benchmarks/norm_bytes.py); on CPU its composite, the same bits.
        if self.weight.dtype == x.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()  # an fp32 weight on 16-bit activations: torch's fused op wants one dtype
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def get_norm_class(config: TransformerConfig) -> type[nn.Module]:
    """The norm class named by ``config.normalization``."""
    return LayerNorm if config.normalization == "LayerNorm" else RMSNorm


class Norm:
    """Spec slot that builds the norm named by ``config.normalization`` (Megatron's ``TENorm`` idea):
    ``Norm(config, hidden_size, eps)`` returns a :class:`LayerNorm` or an :class:`RMSNorm`."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float | None = None) -> nn.Module:
        return get_norm_class(config)(config, hidden_size, eps)


def resolve_norm_class(norm: type, config: TransformerConfig) -> type:
    """The concrete class a norm slot builds (``Norm`` resolves through the config)."""
    return get_norm_class(config) if norm is Norm else norm
