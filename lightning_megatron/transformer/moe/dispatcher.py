"""Token dispatch over the expert-parallel group: every assignment (token, slot) to the rank of its expert
and its output back, so that ``out[t] = sum_j probs[t, j] * expert_{e(t, j)}(x[t])``.

Both dispatchers give each local expert the same rows in the same order (by source EP rank, then
token, then slot) and return the per-slot outputs ``y`` [n, k, h] (zero where the capacity dropped
the assignment) to the token's own rank; the weighted sum over the slots is the layer's, so the
two are bitwise equal:

- ``alltoall``: each rank sorts its assignments by expert and sends each EP rank the rows of its
  experts (one all-to-all of the counts, whose sizes are the only host synchronisation, then one of
  the rows each way, autograd both ways);
- ``allgather``: every EP rank gathers every rank's tokens and routing, runs its experts on the rows
  routed to them, writes each output into the slot it answers and reduce-scatters the slots back
  (each slot has one non-zero summand, so the sum is exact). It moves ``k`` times the rows of a
  megatron-style reduce-scatter of summed outputs, in exchange for the bitwise equality.

Under tensor parallelism (expert TP = TP) every TP rank holds the same tokens here (the layer gathers
them under sequence parallelism) and the same routing; both dispatchers return each TP rank's partial
outputs, which the layer weighs, sums over the slots and then reduces over TP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_megatron.parallel_state import Group, group_rank, group_size, process_group
from lightning_megatron.tensor_parallel.mappings import (
    _gather_along_dim,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

__all__ = ["dispatch_alltoall", "dispatch_allgather", "DISPATCHERS"]

Experts = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""``(rows sorted by local expert, rows per local expert) -> outputs`` (this TP rank's partial sums)."""


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=process_group(group))
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to other ranks by split sizes; the backward sends the gradients back the other way."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


class _IntoSlots(torch.autograd.Function):
    """``out``'s rows into zeros of ``slots`` rows at ``index`` (``zeros.index_copy(0, index, out)``, the same bits),
    keeping only ``index`` for the backward, ``grad.index_select(0, index)``: autograd's ``index_copy`` keeps its
    source too (its formula reads the source's shape), ``k`` rows of ``h`` a token beside the slots the layer keeps
    for the routing weights' gradient."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, index: torch.Tensor, slots: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        return out.new_zeros(slots, out.shape[-1]).index_copy_(0, index, out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def _sort_key(experts: torch.Tensor, keep: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """Per assignment (flattened ``[n k]``): its expert, or ``num_experts`` (after every expert) if dropped."""
    key = experts.reshape(-1)
    return key if keep is None else torch.where(keep.reshape(-1), key, torch.full_like(key, num_experts))


def dispatch_alltoall(x: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor | None, *, num_experts: int,
                      ep_group: Group, run_experts: Experts) -> torch.Tensor:
    """``x`` [n, h], ``experts`` / ``keep`` [n, k] -> per-slot outputs [n, k, h] (module docstring)."""
    n, k = experts.shape
    ep = group_size(ep_group)
    local = num_experts // ep
    key = _sort_key(experts, keep, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]  # [E] assignments per expert
    if ep > 1:
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=process_group(ep_group))  # [ep, local] from each rank
        sent_host, received_host = torch.stack([counts, received]).tolist()
    else:
        sent_host = received_host = counts.tolist()
    total = sum(sent_host)
    rows = x[order[:total] // k]  # sorted by expert, then token, then slot
    if ep > 1:
        send = [sum(sent_host[r * local:(r + 1) * local]) for r in range(ep)]
        recv = [sum(received_host[r * local:(r + 1) * local]) for r in range(ep)]
        rows = _AllToAll.apply(rows, recv, send, ep_group)
        # [source rank][local expert] -> [local expert][source rank]
        pieces = torch.split(rows, received_host)
        by_expert = [pieces[r * local + e] for e in range(local) for r in range(ep)]
        per_expert = [sum(received_host[r * local + e] for r in range(ep)) for e in range(local)]
        out = run_experts(torch.cat(by_expert), per_expert)
        back = torch.split(out, [received_host[r * local + e] for e in range(local) for r in range(ep)])
        out = torch.cat([back[e * ep + r] for r in range(ep) for e in range(local)])
        out = _AllToAll.apply(out, send, recv, ep_group)
    else:
        out = run_experts(rows, received_host)
    return _IntoSlots.apply(out, order[:total], n * k).view(n, k, -1)


def dispatch_allgather(x: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor | None, *, num_experts: int,
                       ep_group: Group, run_experts: Experts) -> torch.Tensor:
    """``x`` [n, h], ``experts`` / ``keep`` [n, k] -> per-slot outputs [n, k, h] (module docstring)."""
    n, k = experts.shape
    ep, rank = group_size(ep_group), group_rank(ep_group)
    local = num_experts // ep
    key = _sort_key(experts, keep, num_experts)
    if ep > 1:
        x = gather_from_sequence_parallel_region(x, ep_group, True)  # [ep n, h]; backward: sum and keep mine
        key = _gather_along_dim(key, ep_group, 0)  # [ep n k]
    first = rank * local
    mine = (key >= first) & (key < first + local)
    # Stable sort of this rank's assignments by expert (the others after): by expert, then source rank, token, slot.
    local_key = torch.where(mine, key - first, torch.full_like(key, local))
    order = torch.argsort(local_key, stable=True)
    per_expert = torch.bincount(local_key, minlength=local + 1)[:local].tolist()
    total = sum(per_expert)
    out = run_experts(x[order[:total] // k], per_expert)
    slots = _IntoSlots.apply(out, order[:total], key.shape[0])
    if ep > 1:
        slots = reduce_scatter_to_sequence_parallel_region(slots, ep_group)  # each slot: one non-zero summand
    return slots.view(n, k, -1)


DISPATCHERS = {"alltoall": dispatch_alltoall, "allgather": dispatch_allgather}
