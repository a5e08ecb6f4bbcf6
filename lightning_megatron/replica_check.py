"""A parameter replicated over the tensor-parallel ranks must get the same gradient on each of them.

Every TP rank of a data-parallel replica holds the whole of a replicated parameter (a norm's weight, a bias
after a row-parallel layer, a parameter of a user's own) and must step it alike, or the copies drift apart.
That holds when the parameter is applied to whole activations, which every TP rank has the same of. One
applied to activations split over TP (the vocab-parallel logits, a column-parallel output, heads, under
sequence parallelism a piece of the sequence) gets a part of its gradient on each rank, which must be summed
over TP: the parallel layers and the transformer's norms declare theirs (``ParamFacts.sequence_parallel``);
a user's parameter the machinery knows nothing of trained on each rank's part, unsaid (the audit of
2026-12-07: a learned scale of the logits got 0.16 and 0.09 of its gradient 0.25 on the two ranks).

:func:`check_replicated_grads` runs at the first training step (``StepRunner``), after the gradients are
reduced and before any optimizer reads them: each replicated gradient's elementwise largest and smallest over
the TP group (one MAX all-reduce of the replicated gradients, once), then one flag over every rank, so that a
parameter on one pipeline stage stops every rank, rank 0 saying it (:class:`ReplicaGradientError`, naming the
parameters and the fix), when an element differs by more than :data:`RTOL` of the parameter's largest
gradient. Nothing after that step (a step whose gradients are not finite anywhere is checked at the next). It
cannot see a parameter whose parts happen to be equal on every rank (each copy then steps alike, by its part
only): ``lightning-megatron check`` compares every gradient with one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.tensor_parallel.mappings import all_reduce
from lightning_megatron.tensor_parallel.param_facts import param_facts

__all__ = ["ReplicaGradientError", "check_replicated_grads"]

RTOL = 5e-2
"""Copies computed from the same activations agree to the bit on a CPU; a GPU kernel that accumulates a 16-bit
gradient in another order differs by a few of its ulps (2^-8 of an element); a part of a gradient differs from
another part by the order of the gradient itself."""


class ReplicaGradientError(RuntimeError):
    """A parameter replicated over the TP ranks got different gradients on them (raised on every rank)."""


def check_replicated_grads(params: Iterable[torch.nn.Parameter], ps: ParallelState,
                           names: Callable[[], dict[int, str]], device: torch.device) -> bool:
    """Raise :class:`ReplicaGradientError` on every rank when a TP-replicated parameter of ``params`` (their
    reduced ``main_grad``) got different gradients on the TP ranks of any pipeline stage; ``names``:
    ``id(param) -> name`` (read only for the message); ``device``: the gradients' (the collectives' on NCCL, a
    rank without parameters included). Returns whether the check was made (False: gradients
    not finite somewhere). Every rank of a run with TP > 1 takes part, whatever it holds."""
    if ps.tp_size == 1:
        return True
    replicated = [p for p in params if "tp" in param_facts(p).replicated_over]
    problem, finite = None, True
    if replicated:  # the same parameters on every rank of a TP group (one stage, one chunk layout)
        flat = torch.cat([p.main_grad.detach().reshape(-1).float() for p in replicated])
        extremes = torch.cat([flat, -flat])
        all_reduce(extremes, ps.group("tp"), op=dist.ReduceOp.MAX)  # largest, and minus the smallest
        high, low = extremes[:flat.numel()], -extremes[flat.numel():]
        finite = bool(torch.isfinite(extremes).all())
        if finite:
            problem = _problem(replicated, high, low, ps.tp_size, names)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    flags = torch.tensor([float(problem is not None), float(not finite)], device=device)
    if world > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank decides alike: no rank left in a collective
    if flags[1] > 0:
        return False  # an overflow (skipped by the loss scaler) or a NaN (the finite check's): the next step
    if flags[0] == 0:
        return True
    said = [problem]
    if world > 1:
        said = [None] * world
        dist.all_gather_object(said, problem)  # the stage that found it tells every rank (rank 0 prints it)
    raise ReplicaGradientError(next(m for m in said if m is not None))


def _problem(replicated: list[torch.nn.Parameter], high: torch.Tensor, low: torch.Tensor, tp: int,
             names: Callable[[], dict[int, str]]) -> str | None:
    """The message naming the parameters whose elementwise spread over the TP ranks passes :data:`RTOL` of
    their largest gradient; None when none does."""
    bad, start = [], 0
    for p in replicated:
        end = start + p.numel()
        spread = float((high[start:end] - low[start:end]).max()) if end > start else 0.0
        scale = max(float(high[start:end].abs().max()), float(low[start:end].abs().max())) if end > start else 0.0
        if spread > RTOL * scale:
            bad.append((p, spread, scale))
        start = end
    if not bad:
        return None
    named = names()
    found = [f"{named.get(id(p), '?')!r} (shape {tuple(p.shape)})" for p, _, _ in bad]
    _, spread, scale = bad[0]
    return (f"parameter {found[0]} is replicated over the {tp} tensor-parallel ranks but got different gradients "
            f"on them at the first step (elements differ by up to {spread:.4g}, its largest gradient {scale:.4g})"
            + (f", as did {len(found) - 1} more: {', '.join(found[1:4])}{' ...' if len(found) > 4 else ''}"
               if len(found) > 1 else "")
            + ": it is applied to activations split over the TP ranks (the vocab-parallel logits, a "
              "column-parallel output, attention heads; under sequence parallelism a piece of the sequence), so "
              "each rank computes a part of its gradient, and its copies would drift apart. Declare it: "
              "lightning_megatron.tensor_parallel.set_param_facts(param, sequence_parallel=True) sums its gradient "
              "over the TP ranks; or apply it to whole activations. `lightning-megatron check` compares a layout "
              "with one process")
