"""fp32 main gradients of the model chunks and their finalization (Megatron's DDP grad buffer).

Every trainable parameter gets ``param.main_grad``, an fp32 tensor of its shape, where the
gradients of all microbatches of a step are summed and then reduced:

- bf16/fp16 parameters own a *persistent* main grad, allocated once. A post-accumulate-grad hook
  adds each microbatch's gradient into it during backward (the first one is copied) and frees the
  16-bit ``.grad`` at once, as Megatron's DDP does. So microbatches are summed in fp32, not bf16,
  the 16-bit grads never all exist at the same time, and no step allocates (and page-faults in)
  a fresh fp32 copy of every gradient.
- fp32 parameters keep autograd's own accumulation; their ``main_grad`` is ``.grad`` itself.
- With the DistributedOptimizer, every main grad (any dtype) is a view of its flat fp32 grad
  buffer (:meth:`MainGrads.use_buffer`): backward accumulates straight into what the optimizer
  reduce-scatters, so the fp32 grads exist once.

:meth:`MainGrads.finish` then reduces in fp32: TP all-reduce of sequence-parallel grads, the
bucketed DP mean, and the sum of the tied word embedding's grads over the first and last stage.

The hooks act only between :meth:`MainGrads.start` and :meth:`MainGrads.finish` (the training
schedule); a backward outside it leaves ``.grad`` where autograd put it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.tensor_parallel.mappings import all_reduce_coalesced

__all__ = ["MainGrads", "bucketed_all_reduce_mean"]


class MainGrads:
    """``param.main_grad`` (fp32) for the trainable parameters of ``chunks``; see the module docstring."""

    def __init__(self, chunks: Iterable[nn.Module]) -> None:
        self.params: list[nn.Parameter] = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        self._active = False
        self._written: set[int] = set()
        self._buffer: torch.Tensor | None = None
        self._in_buffer: set[int] = set()
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params]

    def _persistent(self, p: torch.Tensor) -> bool:
        return p.dtype != torch.float32 or id(p) in self._in_buffer

    def use_buffer(self, buffer: torch.Tensor, views: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make ``main_grad`` of each param in ``views`` its given view of ``buffer`` (once per buffer)."""
        if buffer is self._buffer:
            return
        self._buffer = buffer
        self._in_buffer = {id(p) for p, _ in views}
        for p, view in views:
            p.main_grad = view

    def _accumulate(self, p: torch.Tensor) -> None:
        if not self._active or p.grad is None or not self._persistent(p):
            return
        if id(p) in self._written:
            p.main_grad.add_(p.grad)
        else:
            p.main_grad.copy_(p.grad)
            self._written.add(id(p))
        p.grad = None

    def start(self) -> None:
        """Before the first microbatch's backward: no grads yet; main grads (re)allocated if needed."""
        self._written.clear()
        for p in self.params:
            p.grad = None
            if id(p) in self._in_buffer:
                continue
            if self._persistent(p):
                main = getattr(p, "main_grad", None)
                if main is None or main.shape != p.shape or main.device != p.device or main.dtype != torch.float32:
                    p.main_grad = torch.empty_like(p, dtype=torch.float32)
            elif hasattr(p, "main_grad"):
                del p.main_grad
        self._active = True

    def finish(self, ps: ParallelState, *, reduce_dp: bool = True, bucket_bytes: int = 40 * 2**20) -> None:
        """After the last backward: every ``main_grad`` holds this step's fp32 grad, reduced.

        ``reduce_dp=False`` leaves the DP reduction to the optimizer (the distributed optimizer
        reduce-scatters). ``.grad`` is None afterwards (see :meth:`expose`).
        """
        self._active = False
        for p in self.params:
            if self._persistent(p):
                if id(p) not in self._written:
                    if p.grad is None:
                        p.main_grad.zero_()
                    else:  # accumulated outside start() / finish(): take it as it is
                        p.main_grad.copy_(p.grad)
            else:
                p.main_grad = torch.zeros_like(p) if p.grad is None else p.grad
            p.grad = None
        grads = [p.main_grad for p in self.params]
        if ps.tp_size > 1:
            all_reduce_coalesced([p.main_grad for p in self.params if getattr(p, "sequence_parallel", False)],
                                 ps.tp_group)
        if reduce_dp and ps.dp_size > 1:
            bucketed_all_reduce_mean(grads, ps.dp_group, bucket_bytes)
        if ps.pp_size > 1 and ps.embedding_group is not None and len(ps.embedding_ranks) > 1:
            all_reduce_coalesced([p.main_grad for p in self.params if getattr(p, "shared_embedding", False)],
                                 ps.embedding_group)

    def expose(self, reads_main_grad: bool) -> None:
        """Before ``optimizer.step``: fp32 params get ``.grad = main_grad`` (the same tensor).

        16-bit params get a rounded ``.grad`` only for an optimizer that does not read
        ``main_grad`` itself (the Megatron wrappers do: they step fp32 main params).
        """
        for p in self.params:
            main = getattr(p, "main_grad", None)
            if main is None:
                continue
            if main.dtype == p.dtype:
                p.grad = main
            elif not reads_main_grad:
                p.grad = main.to(p.dtype)

    def release(self) -> None:
        """After the step: drop the fp32 aliases (persistent buffers stay for the next step)."""
        for p in self.params:
            if not self._persistent(p) and hasattr(p, "main_grad"):
                del p.main_grad

    def remove(self) -> None:
        """Remove the hooks and every ``main_grad`` (teardown)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._active = False
        self._buffer, self._in_buffer = None, set()
        for p in self.params:
            if hasattr(p, "main_grad"):
                del p.main_grad


def bucketed_all_reduce_mean(grads: list[torch.Tensor], group: Any, bucket_bytes: int) -> None:
    """Mean of ``grads`` over ``group``: flat all-reduces of about ``bucket_bytes`` each, per dtype."""
    world = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for tensors in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for g in tensors:
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= bucket_bytes or g is tensors[-1]:
                all_reduce_coalesced(bucket, group)
                for t in bucket:
                    t.div_(world)
                bucket, size = [], 0
