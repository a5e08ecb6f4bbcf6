"""The raw collectives of the package behind one small interface: :class:`Communicator`.

Every all-reduce, all-gather and reduce-scatter that :mod:`lightning_megatron.tensor_parallel.mappings`
runs (tensor-parallel regions, gradient reduction, grad-norm and logged-metric reductions) goes
through the communicator of the group it is given: a
:class:`~lightning_megatron.parallel_state.ParallelGroup` (a process group and its communicator,
owned by the :class:`~lightning_megatron.parallel_state.ParallelState`). By default that is
:class:`TorchCommunicator`: ``torch.distributed`` on the group's backend (NCCL on GPUs, gloo on CPU):
one code path for every device.

A platform package may replace the communicator of a group for one run, explicitly, with
``ParallelState.set_communicator(name, comm)`` (closed by ``close_communicators()``). The opt-in CPU
tuning (:mod:`lightning_megatron.cpu`) installs shared-memory collectives this way. There is no
process-wide table: the communicator travels with the group object that layers are given.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = ["Communicator", "TorchCommunicator", "peer_lost"]

# torch >= 2.10 names the single-tensor collectives *_single; older releases *_into_tensor / *_tensor.
_all_gather_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@runtime_checkable
class Communicator(Protocol):
    """The three collectives of one process group (no autograd). Every member calls each one.

    With ``async_op=True`` a call returns a handle whose ``wait()`` completes it (an implementation
    may complete it before returning); otherwise it returns ``None`` once ``out`` holds the result.
    """

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, *,
                   async_op: bool = False) -> object | None:
        """Reduce the contiguous ``tensor`` over the group in place."""

    def all_gather_into_tensor(self, out: torch.Tensor, tensor: torch.Tensor, *,
                               async_op: bool = False) -> object | None:
        """``out`` (contiguous) = every rank's ``tensor`` concatenated along dim 0 in rank order."""

    def reduce_scatter_tensor(self, out: torch.Tensor, tensor: torch.Tensor, *,
                              async_op: bool = False) -> object | None:
        """``out`` (contiguous) = this rank's dim-0 chunk of the sum over ranks of ``tensor``."""

    def close(self) -> None:
        """Release what the communicator holds; the group's collectives go back to torch."""


class TorchCommunicator:
    """``torch.distributed`` on the group's own backend (NCCL, gloo, ...)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, *,
                   async_op: bool = False) -> object | None:
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def all_gather_into_tensor(self, out: torch.Tensor, tensor: torch.Tensor, *,
                               async_op: bool = False) -> object | None:
        return _all_gather_fn(out, tensor, group=self.group, async_op=async_op)

    def reduce_scatter_tensor(self, out: torch.Tensor, tensor: torch.Tensor, *,
                              async_op: bool = False) -> object | None:
        return _reduce_scatter_fn(out, tensor, group=self.group, async_op=async_op)

    def close(self) -> None:
        return None


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "died before arriving",
              "remote process exited or there was a network error", "Connection closed by remote peer")
"""What a collective's error says when another rank's process died: gloo's TCP pair, the CPU tuning's shared-memory
collectives, NCCL's ``ncclRemoteError`` (raised as ``DistBackendError``: the peer's process or the network)."""

_COLLECTIVE_FRAMES = ("torch/distributed/", "lightning_megatron/communicator.py", "lightning_megatron/cpu/")
"""Where such an error is raised: a collective (torch.distributed, ours, the CPU tuning's)."""


def peer_lost(error: BaseException | None) -> str | None:
    """The line of ``error`` (or of what caused it) saying that another rank's process is gone, else None: a rank's
    own failure is in its own output; the others see only their collective's connection close. Only a
    ``RuntimeError`` a collective raised counts (not an ``OSError``: this process's own socket, an HTTP client, a
    network file system; not a data-loader worker's error re-raised)."""
    import traceback

    seen = 0
    while error is not None and seen < 8:
        text = str(error)
        raised_in_collective = any(part in frame.filename for frame in traceback.extract_tb(error.__traceback__)
                                   for part in _COLLECTIVE_FRAMES)
        if isinstance(error, RuntimeError) and not isinstance(error, OSError) and raised_in_collective \
                and "DataLoader worker" not in text:
            for line in text.splitlines():
                if any(marker in line for marker in _PEER_LOST):
                    return line.strip()
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None
