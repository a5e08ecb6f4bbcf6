"""Small helpers for transformer modules: layout-independent seeding, identity ops, activations."""

from __future__ import annotations

import contextlib
import enum
import hashlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lightning_megatron.tensor_parallel.param_facts import set_param_facts

__all__ = [
    "AttnMaskType",
    "IdentityOp",
    "IdentityFuncOp",
    "stable_seed",
    "seeded",
    "get_activation_func",
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


def stable_seed(seed: int, key: str) -> int:
    """A 63-bit seed derived from ``(seed, key)`` that is the same in every process and every run
    (Python's ``hash`` of a str is salted per process, so it cannot be used)."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def seeded(seed: int, key: str) -> Iterator[None]:
    """Build inside a CPU RNG stream keyed by ``(seed, key)``, restoring the caller's RNG after.

    Parallel layers draw their fp32 master weights on the CPU, so whichever pipeline stage builds
    ``layers.3``, and at whatever TP size, it draws the same numbers.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stable_seed(seed, key))
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


def mark_sequence_parallel(module: nn.Module, sequence_parallel: bool) -> None:
    """Set the ``sequence_parallel`` fact (:class:`~lightning_megatron.tensor_parallel.ParamFacts`) of every parameter of a replicated module that runs on the
    local sequence chunk under sequence parallelism: its gradient is partial and must be summed over TP."""
    for param in module.parameters():
        set_param_facts(param, sequence_parallel=sequence_parallel)
