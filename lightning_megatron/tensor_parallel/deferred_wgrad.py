"""The output layer's weight gradient computed at the pipeline flush (megatron-core's
``defer_embedding_wgrad_compute``).

On the last pipeline stage the output layer's ``[V/t, h]`` weight gradient (the LM head, tied to the
word embedding or not) is a large GEMM output per microbatch, plus its accumulation into the fp32
``main_grad``. Its backward needs only the input gradient to go on to the earlier layers and to the
previous stage. :class:`DeferredWeightGrad` keeps each microbatch's ``(grad_output, input)`` instead
and computes the weight gradients when the schedule is over (:meth:`DeferredWeightGrad.drain`), while
the earlier stages still run their last backward passes: the last stage's steady state gets shorter,
and the work moves into the time it would wait at the flush.

Same numbers: the input, bias and weight gradients are the GEMMs and sums autograd runs for
``F.linear`` (``tests/test_deferred_wgrad.py`` holds them bitwise equal to autograd), and the
weight gradients reach the gradient buffer in microbatch order, as they did during the backward
passes: the fp32 ``main_grad`` sums are the same bits. Costs memory until the flush: each
microbatch's output gradient ``[tokens, V/t]`` and input ``[tokens, h]`` (BERT's head on the masked
tokens: ~2 MB per microbatch at bert-base; a decoder's full-sequence logits: ``s b V/t`` elements).
``limit`` (megatron-core's ``wgrad_deferral_limit``) bounds that to as many microbatches: when one more
would wait, the oldest waiting one is computed first (in its turn: the same bits), and the flush computes
the last ``limit``.

``DeferredWeightGrad(per_step=True)`` (the CPU tuning's ``weight_grads_per_step``,
:mod:`lightning_megatron.cpu`) drains differently: one GEMM per weight over the step's microbatches
(their output gradients and inputs concatenated in microbatch order), added into ``main_grad`` once.
That is the weight gradient one microbatch of all the step's tokens would have (bitwise, for the same
token order), not the sum of per-microbatch 16-bit gradients in fp32: other bits, so it is never the
default. It saves the ``m - 1`` additions of every weight gradient into the fp32 ``main_grad``.

Which layers defer, and when their gradients are drained, is decided in one place: the step's
:class:`~lightning_megatron.tensor_parallel.backward.WeightGradPolicy` (its ``backward_weight``
drains these, all at the flush or one microbatch at a time).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DeferredWeightGrad"]


class _LinearDeferredWeightGrad(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward returns the input and bias gradients and stashes
    what the weight gradient needs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                deferral: DeferredWeightGrad) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.deferral = bias is not None, deferral
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        ctx.deferral.stash(weight, grad_2d.detach(), x_2d.detach())  # values only: no graph kept alive
        # autograd's addmm/mm backward for F.linear: grad @ W for the input, the row sum for the bias
        grad_x = torch.mm(grad_2d, weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


class DeferredWeightGrad:
    """Defers weight gradients of ``F.linear`` calls to :meth:`drain`.

    Between :meth:`open` and the full :meth:`drain` (the step's
    :class:`~lightning_megatron.tensor_parallel.backward.WeightGradPolicy`), :meth:`linear` runs
    ``F.linear`` with the weight gradient deferred; otherwise (evaluation, a backward outside the
    schedule) it is plain ``F.linear``.
    """

    def __init__(self, *, per_step: bool = False, limit: int = 0) -> None:
        if limit < 0 or (limit and per_step):
            raise ValueError(f"limit={limit} must be >= 0 (0: every microbatch waits for the drain), and 0 with "
                             f"per_step=True (one GEMM over all the step's microbatches)")
        self.per_step = per_step
        """Drain one GEMM per weight over all the microbatches drained together (see the module doc)."""
        self.limit = limit
        """The most microbatches that wait (megatron-core's ``wgrad_deferral_limit``; 0: all): when one more would,
        the oldest is drained first, so the gradients still reach ``main_grad`` in microbatch order."""
        self.microbatch: int | None = None
        """The microbatch whose backward runs now: what the stashed gradients are filed under (set by
        :meth:`~lightning_megatron.tensor_parallel.backward.WeightGradPolicy.backward_input`)."""
        self.drained = 0
        """Microbatch weight gradients computed by :meth:`drain` so far (all steps)."""
        self._open = False
        self._add_grad: Callable[..., None] | None = None
        self._stashed: list[tuple[int | None, nn.Parameter, torch.Tensor, torch.Tensor]] = []

    @property
    def pending(self) -> int:
        """Microbatches whose weight gradient is stashed and not drained yet."""
        return len(self._stashed)

    def open(self, add_grad: Callable[..., None] | None = None) -> None:
        """Before a step's first microbatch: defer from now on (a failed step's leftovers are dropped);
        ``add_grad`` takes the gradients drained early under a :attr:`limit`."""
        if self.limit and add_grad is None:
            raise ValueError("DeferredWeightGrad(limit=...) drains early: open it with the step's add_grad")
        self._stashed.clear()
        self._open, self._add_grad = True, add_grad

    def defers(self, weight: torch.Tensor) -> bool:
        """Whether a linear layer of ``weight`` run now stashes its weight gradient (open, training, trained)."""
        return self._open and torch.is_grad_enabled() and weight.requires_grad

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.defers(weight):
            return _LinearDeferredWeightGrad.apply(x, weight, bias, self)
        return F.linear(x, weight, bias)

    def stash(self, weight: nn.Parameter, grad_2d: torch.Tensor, x_2d: torch.Tensor) -> None:
        waiting = list(dict.fromkeys(entry[0] for entry in self._stashed))
        if self.limit and self.microbatch not in waiting and len(waiting) >= self.limit:
            self.drain(self._add_grad, microbatch=waiting[0])  # the oldest, in its turn
        self._stashed.append((self.microbatch, weight, grad_2d, x_2d))

    def drain(self, add_grad: Callable[..., None], *, microbatch: int | None = None) -> int:
        """Each stashed weight gradient (autograd's ``grad_output^T @ input``) of ``microbatch`` (None:
        all of them), in the order of the backward passes, handed to ``add_grad(weight, grad)``
        (:meth:`lightning_megatron.grads.GradBuffer.add_grad`): once per weight and microbatch, a layer run
        more than once in a microbatch's forward handing the sum of its uses' gradients, as autograd does (the
        buffer counts one gradient per microbatch to know when a bucket is final). With :attr:`per_step`, one
        ``add_grad(weight, grad, microbatches=n)`` per weight instead, ``grad`` over its ``n`` drained
        microbatches. Returns how many microbatch gradients; after a drain of all of them, stops
        deferring until the next :meth:`open`."""
        if microbatch is None:
            self._open = False
            stashed, self._stashed = self._stashed, []
        else:
            stashed = [entry for entry in self._stashed if entry[0] == microbatch]
            self._stashed = [entry for entry in self._stashed if entry[0] != microbatch]
        # A weight's uses in one microbatch (a layer run twice in a forward) are one microbatch gradient, as autograd
        # sums them before the gradient buffer's hook: one key per (microbatch, weight); an entry filed under no
        # microbatch (a deferral used outside a policy's step) counts as its own.
        keys = [(mb, id(weight)) if mb is not None else (i,) for i, (mb, weight, _, _) in enumerate(stashed)]
        count = len(set(keys))
        with torch.no_grad():  # as inside autograd's backward: the gradients carry no graph
            if not self.per_step:
                uses: dict[tuple, list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]] = {}
                for key, (_, weight, grad_2d, x_2d) in zip(keys, stashed):
                    uses.setdefault(key, []).append((weight, grad_2d, x_2d))
                stashed.clear()
                for key in list(uses):
                    entries = uses.pop(key)
                    grad = torch.mm(entries[0][1].t(), entries[0][2])
                    for _, grad_2d, x_2d in entries[1:]:  # in the order the backward reached them, as autograd adds
                        grad = grad + torch.mm(grad_2d.t(), x_2d)
                    add_grad(entries[0][0], grad)
            else:
                by_weight: dict[int, tuple[nn.Parameter, list[torch.Tensor], list[torch.Tensor], set]] = {}
                for key, (_, weight, grad_2d, x_2d) in zip(keys, stashed):
                    entry = by_weight.setdefault(id(weight), (weight, [], [], set()))
                    entry[1].append(grad_2d)
                    entry[2].append(x_2d)
                    entry[3].add(key)
                stashed.clear()  # each weight's tensors are freed as soon as its gradient is computed
                for key in list(by_weight):
                    weight, grads, xs, microbatches = by_weight.pop(key)
                    grad = (torch.mm(torch.cat(grads).t(), torch.cat(xs)) if len(grads) > 1
                            else torch.mm(grads[0].t(), xs[0]))
                    del grads, xs
                    add_grad(weight, grad, microbatches=len(microbatches))
        self.drained += count
        return count
