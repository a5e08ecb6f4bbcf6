"""Backward primitives: a step's input gradients and weight gradients, apart.

The backward pass of a linear layer ``Y = X W^T + b`` computes ``dX = dY W`` (what the earlier layers
and the previous pipeline stage wait for) and ``dW = dY^T X`` (what only the optimizer reads).
:class:`WeightGradPolicy` is the one object, owned by the step, that decides which layers of a rank's
model chunks compute ``dW`` inside the backward pass (autograd's way, the default) and which defer it
(:class:`~lightning_megatron.tensor_parallel.deferred_wgrad.DeferredWeightGrad`), and that hands the
deferred gradients to the gradient buffer:

- :meth:`WeightGradPolicy.backward_input`: the backward pass of one microbatch from its output: every
  input gradient, and the weight gradients of the layers not deferred;
- :meth:`WeightGradPolicy.backward_weight`: the deferred weight gradients (of one microbatch, or all
  that are pending), into the gradient buffer.

The schedules call ``backward_input`` for every backward pass and the step calls ``backward_weight()``
once after the schedule (the pipeline flush); a zero-bubble schedule would call
``backward_weight(microbatch)`` where its bubbles are. What plugs in, at set-up:

- the model's option ``defer_embedding_wgrad_compute`` (megatron-core's name): the model declares its
  output layer with :func:`defer_output_layer_weight_grad`; :meth:`WeightGradPolicy.for_chunks` defers
  the declared layers of the chunks, one microbatch at a time (the same bits as autograd);
- the CPU tuning (:meth:`lightning_megatron.cpu.CPUTuning.configure_grads`): ``weight_grads_per_step``
  defers every linear layer with :meth:`WeightGradPolicy.defer` ``(per_step=True)``, and a pipeline first
  stage's word embedding hands its gradient over as rows (:meth:`WeightGradPolicy.route_embedding_grad`).

The layers carry none of this: :class:`~lightning_megatron.tensor_parallel.ColumnParallelLinear`,
``RowParallelLinear`` and ``VocabParallelEmbedding`` ask the active policy (:func:`policy_linear`,
:func:`policy_embedding`), which the step makes active around its training schedule
(:meth:`WeightGradPolicy.step`). With none active (evaluation, a backward outside the step) they run
plain ``F.linear`` / :func:`~lightning_megatron.tensor_parallel.embedding.embedding`. The active policy is one
per process, not per thread: autograd runs an accelerator's backward (and the activations recomputed inside it)
on its own threads.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.variable import Variable

from lightning_megatron.tensor_parallel.deferred_wgrad import DeferredWeightGrad
from lightning_megatron.tensor_parallel.embedding import embedding

__all__ = [
    "EmbeddingGradRows",
    "WeightGradPolicy",
    "active_weight_grad_policy",
    "custom_backward",
    "defer_output_layer_weight_grad",
    "policy_embedding",
    "policy_linear",
]

AddGrad = Callable[..., None]
"""``add_grad(param, grad, microbatches=1)``: :meth:`lightning_megatron.grads.GradBuffer.add_grad`."""
AddRows = Callable[[nn.Parameter, Tensor, Tensor], None]
"""``add_rows(param, rows, sums)``: :meth:`lightning_megatron.grads.GradBuffer.add_grad_rows`."""


class EmbeddingGradRows(Protocol):
    """A word-embedding lookup whose weight gradient goes to ``add_rows(weight, rows, sums)`` between
    :meth:`open` and :meth:`close` (the training schedule); :meth:`WeightGradPolicy.route_embedding_grad`."""

    def open(self, add_rows: AddRows) -> None: ...

    def close(self) -> None: ...

    def lookup(self, ids: Tensor, weight: Tensor) -> Tensor: ...


def custom_backward(output: Tensor, grad_output: Tensor | None) -> None:
    """``torch.autograd.backward(output, grad_output)`` without the shape check (Megatron's).

    Needed after :func:`lightning_megatron.pipeline.schedules.deallocate_output_tensor` shrank
    ``output.data``; calls the autograd engine directly, as Megatron does.
    """
    if grad_output is None:
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True,
    )


_declared: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
"""Output layers whose model asked for ``defer_embedding_wgrad_compute``, and their ``wgrad_deferral_limit`` (read
by ``for_chunks`` only)."""


def defer_output_layer_weight_grad(layer: nn.Module, defer: bool, *, pre_process: bool, limit: int = 0) -> None:
    """The model's ``defer_embedding_wgrad_compute`` (megatron-core's name) for its output ``layer``:
    the step's :class:`WeightGradPolicy` computes that layer's weight gradient of every microbatch at
    the pipeline flush (:meth:`WeightGradPolicy.for_chunks`), of at most ``limit`` microbatches (0: all; the
    model's ``wgrad_deferral_limit``) when more would wait. Refused on a chunk that also holds the
    embedding (``pre_process``): without pipeline parallelism there is no flush to hide the work in,
    and a tied weight's two gradients are summed by autograd within the one backward."""
    if not defer:
        _declared.pop(layer, None)
        return
    if pre_process:
        raise ValueError("defer_embedding_wgrad_compute=True needs pipeline parallelism "
                         "(pipeline_model_parallel_size >= 2): the output layer's weight gradient is deferred to the "
                         "pipeline flush of the last stage, and with one stage there is none. Set it to False.")
    _declared[layer] = limit


_active: WeightGradPolicy | None = None
"""The policy of the training schedule running now (:meth:`WeightGradPolicy.step`)."""


def active_weight_grad_policy() -> WeightGradPolicy | None:
    """The :class:`WeightGradPolicy` whose :meth:`~WeightGradPolicy.step` is running, or None."""
    return _active


def policy_linear(layer: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` of ``layer`` (a column- or row-parallel linear layer), its weight gradient
    deferred when the active policy defers ``layer``'s.

    The deferral is the layer's own ``weight_grad_deferral`` (set by :meth:`WeightGradPolicy.step`), not looked
    up by the layer's ``id``: under ``torch.compile`` an ``id`` ties the compiled graph to that one layer object,
    and every transformer layer would compile again (past torch's recompile limit, 8, the rest run eager)."""
    deferral = layer.weight_grad_deferral
    return F.linear(x, weight, bias) if deferral is None else deferral.linear(x, weight, bias)


def policy_embedding(layer: nn.Module, ids: Tensor, weight: Tensor) -> Tensor:
    """:func:`~lightning_megatron.tensor_parallel.embedding.embedding` of ``layer``, through the row lookup the
    active policy routes ``layer``'s gradient to, if any."""
    if _active is None:
        return embedding(ids, weight)
    return _active.embedding(layer, ids, weight)


class WeightGradPolicy:
    """Which layers of a rank's chunks defer their weight gradient, and the backward primitives.

    Set up once (:meth:`for_chunks`, :meth:`defer`, :meth:`route_embedding_grad`); then every training
    step runs its schedule inside :meth:`step`, whose backward passes go through
    :meth:`backward_input`, and calls :meth:`backward_weight` for what is still deferred.
    """

    def __init__(self) -> None:
        self._deferral_of: dict[int, tuple[nn.Module, DeferredWeightGrad]] = {}
        self._rows_of: dict[int, tuple[nn.Module, EmbeddingGradRows]] = {}
        self._add_grad: AddGrad | None = None

    @classmethod
    def for_chunks(cls, chunks: Sequence[nn.Module]) -> WeightGradPolicy:
        """The policy the model asks for: the output layers declared with
        :func:`defer_output_layer_weight_grad` deferred, one microbatch at a time; the rest to autograd."""
        policy = cls()
        for chunk in chunks:
            for m in chunk.modules():
                if m in _declared:
                    policy.defer([m], limit=_declared[m])
        return policy

    # -- set-up ---------------------------------------------------------------------------------------

    def defer(self, layers: Iterable[nn.Module], *, per_step: bool = False, limit: int = 0) -> int:
        """Defer the weight gradients of ``layers`` (column- and row-parallel linear layers: the layers
        that ask the policy) to :meth:`backward_weight`, through one shared
        :class:`~lightning_megatron.tensor_parallel.deferred_wgrad.DeferredWeightGrad` (``per_step``:
        one GEMM per weight over the microbatches drained together; ``limit``: at most that many microbatches
        wait, 0 all). A layer deferred again takes the later deferral. Returns the number of layers."""
        self._check_idle("defer")
        deferral = DeferredWeightGrad(per_step=per_step, limit=limit)
        count = 0
        for layer in layers:
            self._deferral_of[id(layer)] = (layer, deferral)
            count += 1
        return count

    def route_embedding_grad(self, embedding: nn.Module, lookup: EmbeddingGradRows) -> None:
        """Look ``embedding``'s ids up with ``lookup``, which hands the weight gradient to the gradient
        buffer as rows during the training schedule (the CPU tuning's, on a pipeline's first stage)."""
        self._check_idle("route_embedding_grad")
        self._rows_of[id(embedding)] = (embedding, lookup)

    def _check_idle(self, what: str) -> None:
        if self._add_grad is not None:
            raise RuntimeError(f"WeightGradPolicy.{what}: not while a step runs (set the policy up before it)")

    # -- what it holds --------------------------------------------------------------------------------

    def deferral(self, layer: nn.Module) -> DeferredWeightGrad | None:
        """The deferral of ``layer``'s weight gradient (None: autograd computes it in the backward)."""
        entry = self._deferral_of.get(id(layer))
        return None if entry is None else entry[1]

    @property
    def deferrals(self) -> list[DeferredWeightGrad]:
        """Every deferral in use, each once."""
        return list({id(d): d for _, d in self._deferral_of.values()}.values())

    @property
    def embedding_rows(self) -> list[EmbeddingGradRows]:
        """The row lookups word embeddings are routed to."""
        return [rows for _, rows in self._rows_of.values()]

    @property
    def drained(self) -> int:
        """Microbatch weight gradients :meth:`backward_weight` computed so far (all steps)."""
        return sum(d.drained for d in self.deferrals)

    # -- the step -------------------------------------------------------------------------------------

    @contextmanager
    def step(self, add_grad: AddGrad, add_grad_rows: AddRows) -> Iterator[WeightGradPolicy]:
        """Around one training step's schedule: defer from now on (a failed step's leftovers are
        dropped), route the embeddings' rows to ``add_grad_rows``, and make this the active policy the
        layers ask; :meth:`backward_weight` hands the deferred gradients to ``add_grad``."""
        global _active
        if _active is not None:
            raise RuntimeError("WeightGradPolicy.step: another policy's step is running")
        for deferral in self.deferrals:
            deferral.open(add_grad)
        for rows in self.embedding_rows:
            rows.open(add_grad_rows)
        self._add_grad, _active = add_grad, self
        for layer, deferral in self._deferral_of.values():
            layer.weight_grad_deferral = deferral
        try:
            yield self
        finally:
            for layer, _ in self._deferral_of.values():
                layer.weight_grad_deferral = None
            _active, self._add_grad = None, None
            for rows in self.embedding_rows:
                rows.close()

    def embedding(self, layer: nn.Module, ids: Tensor, weight: Tensor) -> Tensor:
        """``layer``'s ``F.embedding`` during the step (:func:`policy_embedding`)."""
        entry = self._rows_of.get(id(layer))
        return embedding(ids, weight) if entry is None else entry[1].lookup(ids, weight)

    def backward_input(self, output: Tensor, grad_output: Tensor | None, *, microbatch: int) -> None:
        """The backward pass of ``microbatch`` from ``output`` (``grad_output`` None: a scalar loss):
        input gradients and the weight gradients of the layers not deferred; the deferred layers'
        stashed under ``microbatch`` for :meth:`backward_weight`."""
        for deferral in self.deferrals:
            deferral.microbatch = microbatch
        custom_backward(output, grad_output)

    def backward_weight(self, microbatch: int | None = None) -> int:
        """The deferred weight gradients of ``microbatch`` (None: every pending one, which also ends
        the deferring until the next :meth:`step`), in the order of their backward passes, handed to
        the gradient buffer. Returns how many microbatch gradients."""
        if self._add_grad is None:
            raise RuntimeError("WeightGradPolicy.backward_weight: only inside WeightGradPolicy.step")
        return sum(d.drain(self._add_grad, microbatch=microbatch) for d in self.deferrals)
