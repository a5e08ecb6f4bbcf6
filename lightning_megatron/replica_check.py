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
reduced and before any optimizer reads them: two numbers per replicated parameter (the gradient's norm and
its projection on a fixed ramp), their largest and smallest over the TP group in one MAX all-reduce, and
:class:`ReplicaGradientError` on every rank, naming the parameters and the fix, when they differ by more
than rounding. Nothing after that step (a step whose gradients are not finite is checked at the next).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.tensor_parallel.mappings import all_reduce
from lightning_megatron.tensor_parallel.param_facts import param_facts

__all__ = ["ReplicaGradientError", "check_replicated_grads"]

RTOL = 1e-5
"""Copies computed from the same activations agree to the bit; this leaves room for a reduction order."""


class ReplicaGradientError(RuntimeError):
    """A parameter replicated over the TP ranks got different gradients on them (raised on every rank)."""


def check_replicated_grads(params: Iterable[torch.nn.Parameter], ps: ParallelState,
                           names: Callable[[], dict[int, str]]) -> bool:
    """Raise :class:`ReplicaGradientError` when a TP-replicated parameter of ``params`` (their reduced
    ``main_grad``) got different gradients on the TP ranks; ``names``: ``id(param) -> name`` (read only for
    the message). Returns whether the check was made (False: one process of TP, or gradients not finite)."""
    replicated = [p for p in params if "tp" in param_facts(p).replicated_over]
    if ps.tp_size == 1 or not replicated:
        return True
    rows = []
    for p in replicated:
        grad = p.main_grad.detach().reshape(-1).to(torch.float64)
        ramp = torch.linspace(-1.0, 1.0, grad.numel(), dtype=torch.float64, device=grad.device)
        rows.append(torch.stack([grad.norm(), grad @ ramp / ramp.norm().clamp_min(1.0)]))
    local = torch.stack(rows)
    extremes = torch.cat([local, -local]).contiguous()
    all_reduce(extremes, ps.group("tp"), op=dist.ReduceOp.MAX)  # largest, and minus the smallest
    high, low = extremes[:len(rows)], -extremes[len(rows):]
    if not bool(torch.isfinite(extremes).all()):
        return False  # an overflow (skipped by the loss scaler) or a NaN (the finite check's): the next step
    spread = (high - low).amax(dim=1)
    bad = (spread > RTOL * high[:, 0]).nonzero().flatten().tolist()
    if not bad:
        return True
    named = names()
    found = [f"{named.get(id(replicated[i]), '?')!r} (shape {tuple(replicated[i].shape)})" for i in bad]
    first = bad[0]
    raise ReplicaGradientError(
        f"parameter {found[0]} is replicated over the {ps.tp_size} tensor-parallel ranks but got different "
        f"gradients on them at the first step (norm {float(low[first, 0]):.6g} to {float(high[first, 0]):.6g})"
        + (f", as did {len(found) - 1} more: {', '.join(found[1:4])}{' ...' if len(found) > 4 else ''}"
           if len(found) > 1 else "")
        + ": it is applied to activations split over the TP ranks (the vocab-parallel logits, a column-parallel "
          "output, attention heads; under sequence parallelism a piece of the sequence), so each rank computes "
          "a part of its gradient, and its copies would drift apart. Declare it: "
          "lightning_megatron.tensor_parallel.set_param_facts(param, sequence_parallel=True) sums its gradient "
          "over the TP ranks; or apply it to whole activations. `lightning-megatron check` compares a layout "
          "with one process")
