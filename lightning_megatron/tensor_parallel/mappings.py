"""The tensor-parallel regions: collectives as autograd Functions with the right backward.

| function                                     | forward               | backward       |
|----------------------------------------------|-----------------------|----------------|
| copy_to_tensor_model_parallel_region         | identity              | all-reduce     |
| reduce_from_tensor_model_parallel_region     | all-reduce            | identity       |
| scatter_to_tensor_model_parallel_region      | split last dim        | all-gather     |
| gather_from_tensor_model_parallel_region     | all-gather last dim   | split          |
| scatter_to_sequence_parallel_region          | split dim 0           | all-gather     |
| gather_from_sequence_parallel_region         | all-gather dim 0      | reduce-scatter |
| reduce_scatter_to_sequence_parallel_region   | reduce-scatter dim 0  | all-gather     |

Each forward/backward pair is a pair of adjoint linear maps: the gradient of "every rank holds the
same X" (copy) is the sum of the per-rank gradients (all-reduce), the gradient of a split is a
gather, and the gradient of an all-gather along the sequence is the reduce-scatter of the partial
gradients that each rank computed for the whole sequence. With a group of one rank (or ``None``)
every function is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_megatron.parallel_state import Group, group_communicator, group_rank, group_size
from lightning_megatron.tensor_parallel.utils import divide

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "CompletedWork",
]

class CompletedWork:
    """The handle ``async_op=True`` returns for a collective that needs no communication (a group of one)."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def all_reduce(t: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM, *,
               async_op: bool = False) -> torch.Tensor | object:
    """Reduce the contiguous ``t`` over ``group`` in place (no autograd) and return it.

    The one all-reduce of the package, through the group's communicator (a
    :class:`~lightning_megatron.parallel_state.ParallelGroup`'s own, torch's for a plain group); nothing with a group
    of one. ``async_op=True`` returns a handle to ``wait()`` on instead of ``t`` (a communicator
    that runs synchronously returns a completed one).
    """
    if group_size(group) == 1:
        return CompletedWork() if async_op else t
    work = group_communicator(group).all_reduce(t, op, async_op=async_op)
    return work if async_op else t


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group: Group, *,
                           async_op: bool = False) -> dist.Work | CompletedWork | None:
    """Gather ``t`` from every rank into the contiguous ``out`` (ranks concatenated along dim 0).

    ``t`` may be this rank's own chunk of ``out`` (in place). ``async_op=True``: returns a handle
    (see :func:`all_reduce`).
    """
    return group_communicator(group).all_gather_into_tensor(out, t, async_op=async_op)


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, group: Group, *,
                          async_op: bool = False) -> dist.Work | CompletedWork | None:
    """Sum ``t`` over ranks and keep this rank's dim-0 chunk in the contiguous ``out``.

    ``out`` may be this rank's own chunk of ``t`` (in place). ``async_op=True``: returns a handle
    (see :func:`all_reduce`).
    """
    return group_communicator(group).reduce_scatter_tensor(out, t, async_op=async_op)


# ---------------------------------------------------------------------------------------------
# Raw collectives (no autograd). They never modify their input unless ``inplace``.
# ---------------------------------------------------------------------------------------------

def _reduce(t: torch.Tensor, group: Group, inplace: bool = False) -> torch.Tensor:
    if group_size(group) == 1:
        return t
    if inplace and t.is_contiguous():
        return all_reduce(t, group)
    out = t.contiguous().clone()
    return all_reduce(out, group)


def _split_along_dim(t: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return t
    chunk = divide(t.size(dim), world, f"dimension {dim} of size")
    return t.narrow(dim, group_rank(group) * chunk, chunk).contiguous()


def _gather_along_dim(t: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return t
    t = t.contiguous()
    # Gather along dim 0 into one buffer (no per-rank list), then move the gathered axis to ``dim``.
    moved = t.movedim(dim, 0).contiguous() if dim != 0 else t
    out = torch.empty((world * moved.size(0), *moved.shape[1:]), dtype=t.dtype, device=t.device)
    all_gather_into_tensor(out, moved, group)
    return out.movedim(0, dim).contiguous() if dim != 0 else out


def _gather_along_last_dim(t: torch.Tensor, group: Group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return t
    t = t.contiguous()
    out = torch.empty((world * t.size(0), *t.shape[1:]), dtype=t.dtype, device=t.device)
    all_gather_into_tensor(out, t, group)
    return torch.cat(out.chunk(world, dim=0), dim=-1)


def _reduce_scatter_along_first_dim(t: torch.Tensor, group: Group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return t
    t = t.contiguous()
    chunk = divide(t.size(0), world, "sequence dimension (dim 0) of size")
    out = torch.empty((chunk, *t.shape[1:]), dtype=t.dtype, device=t.device)
    reduce_scatter_tensor(out, t, group)
    return out


def all_reduce_coalesced(tensors: list[torch.Tensor], group: Group) -> None:
    """Sum ``tensors`` (one dtype) over ``group`` in place, with one flat all-reduce (no autograd)."""
    if not tensors or group_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


# ---------------------------------------------------------------------------------------------
# Autograd Functions
# ---------------------------------------------------------------------------------------------

class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group, inplace):
        return _reduce(input_, group, inplace)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_dim(input_, group, input_.dim() - 1)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_dim(grad_output, ctx.group, grad_output.dim() - 1), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_dim(input_, group, 0)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_dim(grad_output, ctx.group, 0), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along_dim(input_, group, 0)

    @staticmethod
    def backward(ctx, grad_output):
        # When the consumer is tensor-parallel (a column-parallel matmul) every rank holds a partial
        # gradient for the whole sequence: sum them and keep our chunk (reduce-scatter). When the
        # consumer is replicated the gradient is already complete: just keep our chunk (split).
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad_output, ctx.group), None, None
        return _split_along_dim(grad_output, ctx.group, 0), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_dim(grad_output, ctx.group, 0), None


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------

def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Forward identity, backward all-reduce: the input of a column-parallel layer."""
    if group_size(group) == 1:
        return input_
    return _CopyToModelParallelRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group: Group = None, *,
                                             inplace: bool = False) -> torch.Tensor:
    """Forward all-reduce (sum), backward identity: the output of a row-parallel layer.

    ``inplace=True`` reduces into ``input_`` itself (the caller guarantees nothing else uses it),
    saving one copy of the activation.
    """
    if group_size(group) == 1:
        return input_
    return _ReduceFromModelParallelRegion.apply(input_, group, inplace)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim; backward: all-gather along the last dim."""
    if group_size(group) == 1:
        return input_
    return _ScatterToModelParallelRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Forward: all-gather along the last dim; backward: keep this rank's chunk."""
    if group_size(group) == 1:
        return input_
    return _GatherFromModelParallelRegion.apply(input_, group)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Forward: keep this rank's chunk of dim 0 (sequence); backward: all-gather along dim 0."""
    if group_size(group) == 1:
        return input_
    return _ScatterToSequenceParallelRegion.apply(input_, group)


def gather_from_sequence_parallel_region(input_: torch.Tensor, group: Group = None,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """Forward: all-gather along dim 0; backward: reduce-scatter (or split, see the Function)."""
    if group_size(group) == 1:
        return input_
    return _GatherFromSequenceParallelRegion.apply(input_, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Forward: reduce-scatter along dim 0; backward: all-gather along dim 0."""
    if group_size(group) == 1:
        return input_
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group)
