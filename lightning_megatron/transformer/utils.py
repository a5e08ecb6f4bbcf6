"""Small helpers for transformer modules: layout-independent seeding, identity ops, activations."""

from __future__ import annotations

import contextlib
import enum
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_megatron.tensor_parallel.param_facts import set_param_facts

__all__ = [
    "AttnMaskType",
    "IdentityOp",
    "IdentityFuncOp",
    "owned",
    "stable_seed",
    "seeded",
    "get_activation_func",
    "gated_activation",
    "mark_sequence_parallel",
]


class AttnMaskType(enum.Enum):
    """Which mask core attention applies: BERT uses ``padding`` (keys at pad positions are hidden)."""

    padding = 1
    causal = 2
    no_mask = 3


class IdentityOp(nn.Module):
    """A placeholder submodule that returns its first input (Megatron's ``IdentityOp``)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return x


class IdentityFuncOp(IdentityOp):
    """A placeholder for a function slot: calling it returns the identity function."""

    def forward(self, *args: object, **kwargs: object) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x, *a, **k: x


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` when it is all of its storage, else a contiguous copy: a view kept for a backward keeps all of the
    tensor it views alive (the attention's queries, keys and values cut from ``linear_qkv``'s output)."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone(
        memory_format=torch.contiguous_format)


def stable_seed(seed: int, key: str) -> int:
    """A 63-bit seed derived from ``(seed, key)`` that is the same in every process and every run
    (Python's ``hash`` of a str is salted per process, so it cannot be used)."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def seeded(seed: int, key: str) -> Iterator[None]:
    """Build inside a CPU RNG stream keyed by ``(seed, key)``, restoring the caller's RNG after.

    Parallel layers draw their fp32 master weights on the CPU, so whichever pipeline stage builds
    ``layers.3``, and at whatever TP size, it draws the same numbers. Only the CPU generator is seeded:
    ``torch.manual_seed`` would re-seed the accelerator's too, which ``fork_rng(devices=[])`` does not restore (on a
    GPU the dropout outside the tensor-parallel streams draws from it: the run's seed would have no say).
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(stable_seed(seed, key))
        yield


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact: x * Phi(x) with the erf; Hugging Face "gelu"
    "gelu_tanh": _gelu_tanh,  # Hugging Face "gelu_new" / "gelu_pytorch_tanh"
    "relu": F.relu,
    "silu": F.silu,
}


def get_activation_func(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise function named by ``TransformerConfig.activation``."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation={name!r} is not supported; use one of {sorted(_ACTIVATIONS)}") from None


_ACTIVATION_BACKWARDS: dict[str, tuple[torch._ops.OpOverloadPacket, dict[str, Any]]] = {
    # The op autograd's own backward of each activation calls. relu's passes relu's output; x <= 0 exactly
    # where relu(x) <= 0, so the input gives the same bits.
    "gelu": (torch.ops.aten.gelu_backward, {}),
    "gelu_tanh": (torch.ops.aten.gelu_backward, {"approximate": "tanh"}),
    "relu": (torch.ops.aten.threshold_backward, {"threshold": 0}),
    "silu": (torch.ops.aten.silu_backward, {}),
}


def _activation_backward(name: str, grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    op, kwargs = _ACTIVATION_BACKWARDS[name]
    return op.default(grad, x, **kwargs) if out is None else op.grad_input(grad, x, **kwargs, grad_input=out)


class _GatedActivation(torch.autograd.Function):
    """``act(gate) * up`` of ``x = [gate, up]`` that saves ``x`` alone (not ``act(gate)``, [.., f]: the
    backward computes it again) and writes both halves of its gradient into one tensor (no concatenation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, name: str) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.name = name
        gate, up = torch.chunk(x, 2, dim=-1)
        return _ACTIVATIONS[name](gate).mul_(up)  # act(gate) is ours alone: the product in its place

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        gate, up = torch.chunk(x, 2, dim=-1)
        if torch.is_grad_enabled():  # only under create_graph: a second derivative through autograd's own first
            a = _ACTIVATIONS[ctx.name](gate)
            (d_gate,) = torch.autograd.grad(a, gate, grad * up, create_graph=True)
            return torch.cat([d_gate, grad * a], dim=-1), None
        if torch.compiler.is_compiling():
            # dynamo cannot trace out= into a view (a graph break each side); the compiler fuses the concatenation.
            return torch.cat([_activation_backward(ctx.name, grad * up, gate),
                              grad * _ACTIVATIONS[ctx.name](gate)], dim=-1), None
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        d_gate, d_up = torch.chunk(dx, 2, dim=-1)
        torch.mul(grad, _ACTIVATIONS[ctx.name](gate), out=d_up)  # what autograd's mul gives up: grad * act(gate)
        torch.mul(grad, up, out=d_gate)  # and act(gate): grad * up, through act's derivative in place
        _activation_backward(ctx.name, d_gate, gate, out=d_gate)
        return dx, None


def gated_activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """A gated linear unit's ``act(gate) * up`` for ``x = [gate, up]`` along the last dimension (SwiGLU with
    "silu"), ``act`` named as by :func:`get_activation_func`: the bits of that expression through autograd,
    saving ``x`` only. megatron-core's fused SwiGLU saves its input likewise; act(gate) ([.., f], a quarter of
    a Llama MLP's saved activations) is computed again in the backward, whose gradient is written in place
    of the concatenation autograd would make of the two halves'."""
    get_activation_func(name)  # the error that names the choices
    return _GatedActivation.apply(x, name)


def mark_sequence_parallel(module: nn.Module, sequence_parallel: bool) -> None:
    """Set the ``sequence_parallel`` fact (:class:`~lightning_megatron.tensor_parallel.ParamFacts`) of every parameter of a replicated module that runs on the
    local sequence chunk under sequence parallelism: its gradient is partial and must be summed over TP."""
    for param in module.parameters():
        set_param_facts(param, sequence_parallel=sequence_parallel)
