"""Device-agnostic RNG tracking for tensor parallelism, and activation recomputation.

Two streams: the default generator, seeded identically on every TP rank, drives dropout on
replicated activations (so every TP rank drops the same elements); a tracked "model-parallel"
stream, seeded differently per TP rank, drives dropout on TP-sharded activations (attention
probabilities of a rank's heads), so shards are not dropped in lock-step.

Each tracked stream holds the CPU generator state and, when an accelerator is present, its state.
``fork(name)`` swaps the stream in, runs the block, saves the advanced state and swaps back; inside a fork of
the same stream it swaps nothing (the stream is the generators' already: a second swap would restore the state
the outer fork started from and draw its numbers again).

``recompute(fn, *args)`` (activation recomputation; Megatron calls it ``checkpoint``) runs ``fn`` without keeping activations and recomputes it in backward,
restoring the CPU, accelerator and tracker RNG states of the forward so dropout masks repeat.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "RNGStatesTracker",
    "get_rng_tracker",
    "default_rng_states",
    "set_default_rng_states",
    "model_parallel_seed",
    "recompute",
    "MODEL_PARALLEL_RNG_TRACKER_NAME",
]

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def _accelerator_module():
    """The torch module of the current accelerator (the GPU backend, xpu, mps...) or None on CPU-only hosts."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    return torch.get_device_module(acc.current_accelerator().type)


def default_rng_states() -> tuple[torch.Tensor, torch.Tensor | None]:
    """The default generators' states: the CPU's, and the current accelerator's (None without one)."""
    mod = _accelerator_module()
    return torch.get_rng_state(), (mod.get_rng_state() if mod is not None else None)


def set_default_rng_states(states: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    """Restore :func:`default_rng_states` (the accelerator's where there is one and a state for it)."""
    cpu, accel = states
    torch.set_rng_state(cpu)
    mod = _accelerator_module()
    if mod is not None and accel is not None:
        mod.set_rng_state(accel)


class RNGStatesTracker:
    """Named RNG streams that can be forked into, each with CPU and accelerator state."""

    def __init__(self) -> None:
        self.states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.seeds: set[int] = set()
        self.forked: str | None = None
        """The stream the generators hold now (inside its :meth:`fork`), None for the default one."""

    def reset(self) -> None:
        self.states.clear()
        self.seeds.clear()
        self.forked = None

    def get_states(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        return {k: (v[0].clone(), None if v[1] is None else v[1].clone()) for k, v in self.states.items()}

    def set_states(self, states: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        self.states = {k: (v[0].clone(), None if v[1] is None else v[1].clone()) for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists in the tracker")
        self.seeds.add(seed)
        saved = default_rng_states()
        torch.manual_seed(seed)
        self.states[name] = default_rng_states()
        set_default_rng_states(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not in the tracker: call model_parallel_seed(seed, tp_rank) first")
        if self.forked == name:  # the generators hold this stream already: draw on from it
            yield
            return
        saved, outer = default_rng_states(), self.forked
        set_default_rng_states(self.states[name])
        self.forked = name
        try:
            yield
        finally:
            self.states[name] = default_rng_states()
            set_default_rng_states(saved)
            self.forked = outer


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (RNG state is process-wide in torch too)."""
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int, tracker: RNGStatesTracker | None = None) -> None:
    """Seed the default generators with ``seed`` (same on every TP rank) and the model-parallel
    stream with ``seed + 2718 + tp_rank`` (Megatron's offset), on CPU and accelerator."""
    tracker = tracker or _TRACKER
    torch.manual_seed(seed)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)


class _RecomputeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, tracker, *args):
        ctx.run_function, ctx.tracker = run_function, tracker
        ctx.autocast = _autocast_states()  # the forward's, which the replay in backward runs under again
        ctx.fwd_states = default_rng_states()
        ctx.fwd_tracker_states, ctx.fwd_forked = tracker.get_states(), tracker.forked
        with torch.no_grad():
            outputs = run_function(*args)
        tensor_idx = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.tensor_idx = tensor_idx
        ctx.non_tensors = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in tensor_idx])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.non_tensors)
        for i, t in zip(ctx.tensor_idx, ctx.saved_tensors):
            d = t.detach()
            d.requires_grad_(t.requires_grad)
            args[i] = d
        current, current_tracker, current_forked = default_rng_states(), ctx.tracker.get_states(), ctx.tracker.forked
        set_default_rng_states(ctx.fwd_states)
        ctx.tracker.set_states(ctx.fwd_tracker_states)
        ctx.tracker.forked = ctx.fwd_forked  # the forward ran inside that fork: its forks swap nothing again
        try:
            with torch.enable_grad(), contextlib.ExitStack() as autocast:
                for device_type, kwargs in ctx.autocast:
                    autocast.enter_context(torch.autocast(device_type, **kwargs))
                outputs = ctx.run_function(*args)
        finally:
            set_default_rng_states(current)
            ctx.tracker.set_states(current_tracker)
            ctx.tracker.forked = current_forked
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        arg_grads = tuple(a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args)
        return (None, None) + arg_grads


def _autocast_states() -> list[tuple[str, dict[str, Any]]]:
    """The autocast each device type runs under now (``torch.autocast``'s arguments), the CPU's and the
    accelerator's: what the replay of a recomputed forward enters again."""
    acc = getattr(torch, "accelerator", None)
    types = ["cpu"] + ([acc.current_accelerator().type] if acc is not None and acc.is_available() else [])
    return [(t, {"enabled": torch.is_autocast_enabled(t), "dtype": torch.get_autocast_dtype(t),
                 "cache_enabled": torch.is_autocast_cache_enabled()}) for t in types]


def recompute(function: Callable[..., Any], *args: Any, tracker: RNGStatesTracker | None = None) -> Any:
    """Run ``function(*args)`` keeping only its inputs; recompute it in backward with the same RNG and autocast.

    When gradients are on and no input needs one (LoRA's frozen embedding feeding a recomputed first layer), the
    first floating-point input is passed as a leaf that does: otherwise the output would carry no graph, and the
    weights the function trains would get no gradient (torch's reentrant checkpoint has the same limit; its
    non-reentrant one does not)."""
    if torch.is_grad_enabled() and not any(torch.is_tensor(a) and a.requires_grad for a in args):
        first = next((i for i, a in enumerate(args) if torch.is_tensor(a) and a.is_floating_point()), None)
        if first is not None:
            args = (*args[:first], args[first].detach().requires_grad_(), *args[first + 1:])
    return _RecomputeFunction.apply(function, tracker or _TRACKER, *args)
