"""The fp32 gradient buffer of the model chunks and its finalization (Megatron's DDP grad buffer).

One owner for the main gradients: :class:`GradBuffer` holds ONE contiguous fp32 tensor for every
trainable parameter, cut into buckets, and gives each parameter ``param.main_grad``, a view of it.
Every optimizer wrapper reads those views: the non-distributed wrappers step on them, the
DistributedOptimizer (ZeRO-1) steps on this rank's shard of every bucket. So the fp32 grads exist
once (4 bytes per parameter, plus less than the DP size of padding per bucket), with no per-step
allocation and no concatenation.

Lifecycle of one training step (the strategy drives it)::

    start(m)  ->  backward of microbatch 1..m  ->  finalize_model_grads(buffer, ps)  ->  optimizer.step()
                  hook: main_grad (+)= grad, free grad
                  last microbatch: a bucket whose grads are final starts its DP reduction (overlap)

- A post-accumulate-grad hook adds each microbatch's gradient into ``main_grad`` during backward
  (the first one is copied) and frees ``.grad`` at once, as Megatron's DDP does: microbatches are
  summed in fp32 whatever the parameter dtype, and the 16-bit grads never all exist at once.
- A parameter's gradient is final after its m-th hook call of the step (``m`` microbatches). With
  ``overlap_grad_reduce`` a bucket starts its DP reduction (asynchronous all-reduce, or
  reduce-scatter when a DistributedOptimizer shards the buffer) as soon as all its parameters are
  final, while backward goes on through the earlier layers. Buckets are started in order on every
  rank (a bucket waits for the ones before it), so all DP ranks issue the same collectives in the
  same order. A gradient that arrives after its bucket's reduction started (a parameter whose gradient
  came more often than once a microbatch: used in two separately recomputed layers) is refused, not lost. Parameters are laid out in reverse model order, so buckets become final in order (within
  a bucket the optimizer wrapper stepping flat runs orders them by its parameter groups:
  :meth:`GradBuffer.order_within_buckets`).
- :func:`finalize_model_grads` starts what is left, waits for every bucket, divides by the DP size
  (the mean), then sums the sequence-parallel grads over TP and the tied word embedding over the
  first and last pipeline stage. Overlap on or off runs the same collectives on the same bytes:
  the results are bitwise equal.

The hooks act only between :meth:`GradBuffer.start` and :func:`finalize_model_grads` (the training
schedule); a backward outside leaves ``.grad`` where autograd put it.

ZeRO-1 parameter all-gather (megatron-core's ``start_param_sync`` / ``finish_param_sync``): after
its step a DistributedOptimizer writes this rank's updated piece of every bucket into the buffer
(the grads are consumed by then) and calls :meth:`GradBuffer.start_param_gather`, which all-gathers
every bucket and copies it into the model params. With ``overlap_param_gather`` the all-gathers are
launched asynchronously, last bucket first (buckets are in reverse model order: the first layers
first), and each bucket is waited for and copied by :meth:`GradBuffer.finish_param_gather` when it
is first needed: by the forward pre-hook of a module owning one of its params
(:meth:`GradBuffer.add_param_gather_hooks`), waiting in launch order, so the gather hides behind
the forward of the layers before. Everything that reads params outside a forward (checkpoint save,
the end of fit) and everything that writes the buffer (the next backward, ``finish_grad_sync``)
waits for all pending gathers first. Same collectives on the same bytes: bitwise equal to off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_megatron.parallel_state import ParallelState, group_rank, group_size
from lightning_megatron.tensor_parallel.mappings import (
    all_gather_into_tensor,
    all_reduce,
    all_reduce_coalesced,
    reduce_scatter_tensor,
)
from lightning_megatron.tensor_parallel.param_facts import has_param_facts, param_facts

__all__ = ["GradBuffer", "Bucket", "finalize_model_grads", "buffer_order"]


@dataclass(eq=False)
class Bucket:
    """Elements ``[start, end)`` of the buffer (``end - start`` a multiple of the padding unit)."""

    index: int
    start: int
    end: int
    params: list[nn.Parameter]
    numel: int
    """Elements that belong to parameters (the rest, at the end, is zero padding)."""
    deferred: bool = False
    """Reduced only in finalize_model_grads, after the tied-embedding sum (shared embeddings)."""
    handle: Any = None
    ready: int = field(default=0, repr=False)
    gather: Any = None
    """The pending asynchronous parameter all-gather of this bucket (overlap_param_gather)."""
    group: Any = None
    """The data-parallel group this bucket is reduced (and, under ZeRO-1, sharded) over; None: no DP."""
    family: str = "dp_cp"
    """The ``data_parallel`` name (:class:`~lightning_megatron.tensor_parallel.ParamFacts`) of its params."""
    divisor: int = 1
    """What the reduced sum is divided by: the group's size, or for the experts the data-parallel size of
    the dense params (their gradient sums the tokens of every data-parallel rank of the EP group)."""

    @property
    def size(self) -> int:
        """Ranks of :attr:`group`."""
        return group_size(self.group)


def buffer_order(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The trainable parameters of ``chunks`` in buffer order: reverse model order (the order in
    which backward finishes them), the tied word embedding (``shared_embedding``) last."""
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    params.reverse()
    return [p for p in params if not param_facts(p).shared_embedding] + \
        [p for p in params if param_facts(p).shared_embedding]


class GradBuffer:
    """One fp32 buffer with bucket views and ``param.main_grad`` views for ``params`` (in that order).

    Args:
        params: trainable parameters, in buffer order (see :func:`buffer_order`).
        bucket_bytes: a bucket is closed once it holds at least this many bytes; a parameter is
            never split across buckets.
        pad_to: every bucket's size is a multiple of this (the DP size: a DistributedOptimizer
            gives each DP rank an equal contiguous piece of every bucket).
        separate_shared_embedding: put ``shared_embedding`` parameters in their own, deferred
            bucket (with pipelining, their grads are summed over stages before the DP reduction).
        dp_group: the data-parallel group the buckets are reduced over (``None``: no DP).
        groups: the data-parallel group of each other ``data_parallel`` name of the params' facts (the
            experts' ``expert_dp``): their params get buckets of their own (after the others), reduced,
            padded and sharded over that group. A name missing here uses ``dp_group``.
        divisors: what each named family's reduced sum is divided by (default: its group's size).
        overlap_grad_reduce: start a bucket's DP reduction during the last microbatch's backward.
        overlap_param_gather: ZeRO-1: the parameter all-gather of :meth:`start_param_gather` runs
            asynchronously and each bucket is waited for when first needed (see the module doc).
        accumulate: ``accumulate(main_grad, grad)`` adds a later microbatch's gradient into
            ``main_grad``; must be bitwise equal to ``main_grad.add_(grad)`` (the default). The opt-in
            CPU tuning installs :func:`lightning_megatron.cpu.accumulate.accumulate_grad`.
        norm_piece: elements of these gradients the optimizers' norm squares in fp64 at a time
            (:func:`~lightning_megatron.optimizer.clip_grads.sum_of_squares_fp64`; None: its default, one fused
            fp64 norm). The
            opt-in CPU tuning sets cache-sized pieces (:meth:`lightning_megatron.cpu.CPUTuning.norm_piece`).
        decide_on_host: the optimizers read their step's checks before the update, on the host, rather than
            leaving the skip to the device and reading once after it
            (:meth:`~lightning_megatron.optimizer.mixed_precision.MegatronOptimizer.decides_on_device`). The
            opt-in CPU tuning sets it on CPU, where a read waits for nothing and the device's decision costs a
            pass over the gradients when clipping (their product by 1).
    """

    def __init__(self, params: Sequence[nn.Parameter], *, bucket_bytes: float = 40 * 2**20, pad_to: int = 1,
                 separate_shared_embedding: bool = False, dp_group: Any = None,
                 overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                 accumulate: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
                 groups: Mapping[str, Any] | None = None, divisors: Mapping[str, int] | None = None,
                 norm_piece: int | None = None, decide_on_host: bool = False) -> None:
        if pad_to < 1:
            raise ValueError(f"GradBuffer: pad_to={pad_to} must be >= 1")
        self.params = list(params)
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("GradBuffer: a parameter is listed twice")
        for p in self.params:
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise TypeError(f"parameter of dtype {p.dtype} is not supported; use float32, float16 or bfloat16")
        self.dp_group = dp_group
        self.dp_size = group_size(dp_group)
        self.groups = dict(groups or {})
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.accumulate = accumulate or torch.Tensor.add_
        self.norm_piece = norm_piece
        self.decide_on_host = decide_on_host
        self._reduce_scatter = False  # use_reduce_scatter(): a DistributedOptimizer shards this buffer
        self.offsets: dict[int, int] = {}
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        offset = 0
        current: list[nn.Parameter] = []
        start = 0

        def family(p: nn.Parameter) -> str:
            if not self.groups or not has_param_facts(p):
                return ""
            name = param_facts(p).data_parallel
            return name if name in self.groups else ""

        def close(deferred: bool = False) -> None:
            nonlocal offset, current, start
            if not current:
                return
            name = family(current[0])
            group = self.groups[name] if name else dp_group
            unit = group_size(group) if name else pad_to
            numel = offset - start
            offset = start + -(-numel // unit) * unit
            bucket = Bucket(len(self.buckets), start, offset, current, numel, deferred,
                            group=group if group_size(group) > 1 else None,
                            family=name or "dp_cp",
                            divisor=(divisors or {}).get(name, group_size(group)) if name else group_size(group))
            self.buckets.append(bucket)
            for q in current:
                self._bucket_of[id(q)] = bucket
            current, start = [], offset

        shared = [p for p in self.params if separate_shared_embedding and param_facts(p).shared_embedding]
        shared_ids = {id(p) for p in shared}
        rest = [p for p in self.params if id(p) not in shared_ids]
        families = [""] + [name for name in self.groups]
        rest = [p for name in families for p in rest if family(p) == name]  # one family after another
        for p in rest + shared:
            if current and ((id(p) in shared_ids and id(current[0]) not in shared_ids)
                            or family(p) != family(current[0])):
                close()
            self.offsets[id(p)] = offset
            current.append(p)
            offset += p.numel()
            if id(p) not in shared_ids and (offset - start) * 4 >= bucket_bytes:
                close()
        close(deferred=bool(shared))
        device = self.params[0].device if self.params else torch.device("cpu")
        self.data = torch.zeros(offset, dtype=torch.float32, device=device)
        for p in self.params:
            p.main_grad = self.main_grad_view(p)
        self.num_microbatches = 1
        self._counts: dict[int, int] = {}
        self._next_launch = 0
        self._active = False
        self._reduced = False  # between finalize_model_grads and the optimizer step (see ``reduced``)
        self.exposed_comm_seconds = 0.0
        """Seconds this step's backward and finalize_model_grads were blocked in gradient collectives: the host's
        time (gloo's waits block it; NCCL's return at once, the device waits: ~0 on a GPU, where a profile tells)."""
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params]
        self._removed = False
        self._gathers: list[Bucket] = []  # buckets whose parameter all-gather is in flight, in launch order
        self._gather_view: torch.Tensor | None = None
        self._gathered_views: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}  # _gathered_params
        self.param_gather_seconds = 0.0
        """Seconds blocked in the last parameter all-gather (launches, waits and copies into the params)."""

    # -- layout ----------------------------------------------------------------------------------
    def order_within_buckets(self, key: Callable[[nn.Parameter], int]) -> None:
        """Lay each bucket's parameters out by ``key`` (a stable sort: an optimizer's group index), so that a flat
        step over the buffer (the DistributedOptimizer's, the 16-bit wrapper's) meets one run of consecutive
        elements per group and bucket, instead of one per alternation of the groups in model order (bert-base's
        weights and biases: ~100 runs, each a tensor of the inner optimizer's step). Which parameters a bucket holds, its bounds and
        its padding are unchanged, so is when its reduction starts (when all its parameters are final); every
        ``main_grad`` is made anew. Before the first step only: refused once the buffer holds values (a step's grads,
        or ZeRO-1's gathered parameters)."""
        if (self._active or self._reduced or self._counts or self._gathers
                or any(b.handle is not None for b in self.buckets) or bool(self.data.any())):
            raise RuntimeError("GradBuffer.order_within_buckets: the buffer is in use (a step's gradients or gathered "
                               "parameters); order it before the first step")
        for bucket in self.buckets:
            bucket.params.sort(key=key)  # stable: model order within a group
            offset = bucket.start
            for p in bucket.params:
                self.offsets[id(p)] = offset
                offset += p.numel()
        self.params.sort(key=lambda p: self.offsets[id(p)])
        for p in self.params:
            p.main_grad = self.main_grad_view(p)
        self._gathered_views.clear()

    def runs_of(self, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``views`` (contiguous views of this buffer, none overlapping) as views of its data, the adjacent ones
        merged into one: the same elements in fewer tensors."""
        base = self.data.storage_offset()
        runs: list[list[int]] = []  # [start, elements]
        for start, n in sorted((v.storage_offset() - base, v.numel()) for v in views):
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1][1] += n
            else:
                runs.append([start, n])
        return [self.data[start: start + n] for start, n in runs]

    def main_grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s fp32 main grad (a view of the buffer), ``None`` when ``p`` is not in this buffer."""
        return self.main_grad_view(p) if id(p) in self.offsets else None

    def main_grad_view(self, p: nn.Parameter) -> torch.Tensor:
        o = self.offsets[id(p)]
        return self.data[o: o + p.numel()].view(p.shape)

    @property
    def reduced(self) -> bool:
        """True between finalize_model_grads and the optimizer step: ``main_grad`` holds the DP mean."""
        return self._reduced

    def mark_consumed(self) -> None:
        """The optimizer step read (or skipped) this step's reduced grads: the next step reduces anew."""
        self._reduced = False

    @property
    def reduces_by_scatter(self) -> bool:
        """Whether the DP reduction is a reduce-scatter (a DistributedOptimizer shards this buffer)."""
        return self._reduce_scatter

    def use_reduce_scatter(self) -> None:
        """Called by the DistributedOptimizer that shards this buffer: from now on every bucket's DP
        reduction is a reduce-scatter (each DP rank keeps the mean of its own piece) instead of an
        all-reduce. Refused while reductions are in flight."""
        if any(b.handle is not None for b in self.buckets):
            raise RuntimeError("GradBuffer.use_reduce_scatter: reductions of a step are in flight")
        self._reduce_scatter = True

    def bucket_data(self, bucket: Bucket) -> torch.Tensor:
        return self.data[bucket.start: bucket.end]

    def shard(self, bucket: Bucket, rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` in the buffer of DP rank ``rank``'s (default: this rank's) piece of ``bucket``."""
        rank = group_rank(bucket.group) if rank is None else rank
        size = (bucket.end - bucket.start) // bucket.size
        return bucket.start + rank * size, bucket.start + (rank + 1) * size

    def memory_bytes(self) -> int:
        """Bytes of fp32 gradient storage on this rank (the buffer: every main grad is a view of it)."""
        return self.data.numel() * self.data.element_size()

    def holds(self, t: torch.Tensor | None) -> bool:
        """Whether ``t`` is a view of this buffer."""
        return t is not None and t.untyped_storage().data_ptr() == self.data.untyped_storage().data_ptr()

    # -- the step --------------------------------------------------------------------------------
    def start(self, num_microbatches: int = 1) -> None:
        """Before the first microbatch's backward: no grads yet, nothing in flight."""
        if any(b.handle is not None for b in self.buckets):
            raise RuntimeError("GradBuffer.start: the previous step's reductions were never waited for "
                               "(finalize_model_grads did not run)")
        self._reset(num_microbatches)
        for p in self.params:
            p.grad = None
        self._active = True

    def _reset(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self._counts.clear()
        for b in self.buckets:
            b.ready = 0
        self._next_launch = 0
        self._reduced = False
        self.exposed_comm_seconds = 0.0

    def reduce_param_grads(self) -> None:
        """Without the strategy's hooks: take every param's ``.grad`` (zero if None) into the
        buffer, free it, and DP-reduce the buffer (no TP or pipeline sums)."""
        if any(b.handle is not None for b in self.buckets):
            raise RuntimeError("GradBuffer.reduce_param_grads: reductions of a step are still in flight")
        self._reset(1)
        self.finish_grad_sync()
        self.finish_deferred()

    def add_grad(self, p: nn.Parameter, grad: torch.Tensor, *, microbatches: int = 1) -> None:
        """A gradient of ``p`` computed outside autograd (a weight gradient deferred to the pipeline
        flush, :mod:`lightning_megatron.tensor_parallel.deferred_wgrad`): taken as autograd's
        accumulation would take it, into ``p.grad`` and then, within the training schedule, through the
        same hook into ``main_grad``. ``microbatches``: how many microbatches' gradients ``grad`` holds
        (one GEMM over several), for the count that says when ``p``'s gradient is final."""
        if p.grad is None:
            p.grad = grad
        else:
            p.grad += grad
        self._accumulate(p, microbatches)

    def add_grad_rows(self, p: nn.Parameter, rows: torch.Tensor, sums: torch.Tensor) -> None:
        """A microbatch's gradient of ``p`` given as rows (the CPU tuning's word-embedding lookup,
        :mod:`lightning_megatron.cpu.embedding_grad`): ``p``'s dense gradient would be ``sums`` at
        ``rows`` and zero elsewhere. Within the schedule it is added into ``main_grad`` as the hook
        adds the dense gradient (the first microbatch's replaces, later ones add; an untouched row's
        ``+ 0`` is skipped), with the same bookkeeping; outside, the dense gradient goes to ``p.grad``."""
        if not self._active:
            dense = torch.zeros_like(p)
            dense[rows] = sums
            p.grad = dense if p.grad is None else p.grad + dense
            return
        count = self._before_write(p)
        if not count:
            p.main_grad.zero_()
        p.main_grad.index_add_(0, rows, sums.to(p.main_grad.dtype))
        self._after_write(p, count)

    def _before_write(self, p: torch.Tensor) -> int:
        bucket = self._bucket_of[id(p)]
        if self._next_launch > bucket.index and bucket.size > 1:
            # Its reduction started when every gradient of the bucket had come in its microbatches' count: a
            # gradient after that would be lost to the other ranks, or race the collective reading the bucket.
            raise RuntimeError(
                f"a gradient of a parameter {tuple(p.shape)} reached the gradient buffer after its bucket's "
                f"data-parallel reduction had started (overlap_grad_reduce): it came more often than once a "
                f"microbatch ({self._counts.get(id(p), 0)} of {self.num_microbatches} counted), as when one "
                "parameter is used in two separately recomputed layers (each recomputation runs its own backward "
                "pass) or its weight gradient is deferred in one use and not in another. Use it once a backward "
                "pass (recompute those layers together), or set overlap_grad_reduce=False")
        if self._gathers:  # the buffer is about to be written: no gathered params may be lost
            self.finish_param_gather(bucket)
        return self._counts.get(id(p), 0)

    def _accumulate(self, p: torch.Tensor, microbatches: int = 1) -> None:
        if not self._active or p.grad is None:
            return
        count = self._before_write(p)
        if count:
            self.accumulate(p.main_grad, p.grad)
        else:
            p.main_grad.copy_(p.grad)
        p.grad = None
        self._after_write(p, count, microbatches)

    def _after_write(self, p: torch.Tensor, count: int, microbatches: int = 1) -> None:
        self._counts[id(p)] = count + microbatches
        if self.overlap_grad_reduce and count < self.num_microbatches <= count + microbatches:
            bucket = self._bucket_of[id(p)]
            bucket.ready += 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        # In bucket order on every rank: later buckets wait for earlier ones.
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if b.deferred or b.ready < len(b.params):
                return
            self._launch(b)
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        data = self.bucket_data(bucket)
        data[bucket.numel:].zero_()  # padding: the ZeRO-1 all-gather may have left bytes there
        if bucket.size == 1:
            return
        t0 = time.perf_counter()
        if self._reduce_scatter:
            lo, hi = self.shard(bucket)
            bucket.handle = reduce_scatter_tensor(self.data[lo:hi], data, bucket.group, async_op=True)
        else:
            bucket.handle = all_reduce(data, bucket.group, async_op=True)
        self.exposed_comm_seconds += time.perf_counter() - t0

    def finish_grad_sync(self) -> None:
        """Start the reductions not started yet, wait for all, take the DP mean (see the module doc)."""
        self.finish_param_gather()  # params no forward used: their gathered values are still here
        self._active = False
        for p in self.params:
            if id(p) not in self._counts:  # no grad this step (or set outside start/finish)
                if p.grad is not None:
                    p.main_grad.copy_(p.grad)
                else:
                    p.main_grad.zero_()
                p.grad = None
        while self._next_launch < len(self.buckets):
            if self.buckets[self._next_launch].deferred:
                break
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        self._wait_and_average(b for b in self.buckets if not b.deferred)

    def finish_deferred(self) -> None:
        """Reduce the deferred (shared-embedding) buckets, after their sum over stages."""
        for b in self.buckets[self._next_launch:]:
            self._launch(b)
        self._next_launch = len(self.buckets)
        self._wait_and_average(b for b in self.buckets if b.deferred)
        self._reduced = True

    def _wait_and_average(self, buckets: Any) -> None:
        t0 = time.perf_counter()
        for b in buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
            if b.divisor > 1:
                lo, hi = self.shard(b) if self._reduce_scatter else (b.start, b.end)
                self.data[lo:hi].div_(b.divisor)
        self.exposed_comm_seconds += time.perf_counter() - t0

    # -- ZeRO-1 parameter all-gather --------------------------------------------------------------
    def start_param_gather(self, view: torch.Tensor) -> None:
        """All-gather every bucket of ``view`` (the buffer's memory in the params' dtype, holding this
        rank's updated piece of every bucket in place) and copy it into the params; with
        ``overlap_param_gather`` asynchronously (the copies happen in :meth:`finish_param_gather`)."""
        if self._gathers:
            raise RuntimeError("GradBuffer.start_param_gather: the previous parameter all-gather was never waited for")
        self._gather_view = view
        self.param_gather_seconds = 0.0
        t0 = time.perf_counter()
        for bucket in reversed(self.buckets):  # the first layers' bucket first: the next forward needs it first
            if bucket.size > 1:
                bucket.gather = all_gather_into_tensor(view[bucket.start: bucket.end], view[slice(*self.shard(bucket))],
                                                       bucket.group, async_op=self.overlap_param_gather)
            self._gathers.append(bucket)
        self.param_gather_seconds += time.perf_counter() - t0
        if not self.overlap_param_gather:
            self.finish_param_gather()

    def finish_param_gather(self, bucket: Bucket | None = None) -> None:
        """Wait for the pending parameter all-gathers, in launch order, up to ``bucket`` (``None``:
        all of them), and copy each gathered bucket into its params."""
        if not self._gathers or (bucket is not None and bucket not in self._gathers):
            return
        t0 = time.perf_counter()
        view = self._gather_view
        assert view is not None
        while self._gathers:
            b = self._gathers.pop(0)
            if b.gather is not None:
                b.gather.wait()  # bounded by the DP group's timeout
                b.gather = None
            with torch.no_grad():  # also from a forward pre-hook
                torch._foreach_copy_(b.params, self._gathered_params(b, view))
            if b is bucket:
                break
        if not self._gathers:
            self._gather_view = None
        self.param_gather_seconds += time.perf_counter() - t0

    def _gathered_params(self, bucket: Bucket, view: torch.Tensor) -> list[torch.Tensor]:
        """``bucket``'s parameters in ``view`` (the gather's memory in their dtype), as views of their shapes. The
        same memory every step: made once per (memory, dtype), not a slice and a view per parameter each step."""
        key = (bucket.index, view.data_ptr(), view.dtype)
        views = self._gathered_views.get(key)
        if views is None:
            views = [view[self.offsets[id(p)]: self.offsets[id(p)] + p.numel()].view_as(p) for p in bucket.params]
            self._gathered_views[key] = views
        return views

    def add_param_gather_hooks(self, chunks: Sequence[nn.Module]) -> None:
        """A forward pre-hook on every module of ``chunks`` that owns params of this buffer: it waits
        for their buckets' pending all-gathers (removed by :meth:`remove`)."""
        for chunk in chunks:
            for module in chunk.modules():
                buckets = {self._bucket_of[id(p)].index for p in module.parameters(recurse=False)
                           if id(p) in self._bucket_of}
                if not buckets:
                    continue
                # Waiting in launch order (last bucket first): the lowest index is the last one needed.
                target = self.buckets[min(buckets)]
                self._handles.append(module.register_forward_pre_hook(
                    lambda _module, _args, b=target: self.finish_param_gather(b) if self._gathers else None))

    def set_param_grads(self) -> None:
        """For an optimizer that reads ``.grad`` (a plain torch optimizer): fp32 params get
        ``.grad = main_grad`` (the same memory), 16-bit params a rounded copy."""
        for p in self.params:
            p.grad = p.main_grad if p.dtype == torch.float32 else p.main_grad.to(p.dtype)

    @classmethod
    def for_chunks(cls, chunks: Sequence[nn.Module], parallel_state: ParallelState, *, bucket_bytes: float,
                   overlap_grad_reduce: bool, overlap_param_gather: bool = False,
                   accumulate: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
                   norm_piece: int | None = None, decide_on_host: bool = False) -> GradBuffer:
        """The buffer of this rank's model ``chunks`` (:func:`buffer_order`), padded to and reduced over
        the data-parallel group their :class:`~lightning_megatron.tensor_parallel.ParamFacts` name
        (``data_parallel``), the tied embedding in its own last bucket under pipelining."""
        ps = parallel_state
        params = buffer_order(chunks)
        names = sorted({param_facts(p).data_parallel for p in params} - {"dp_cp"})
        group = ps.group("dp_cp")
        size = 1 if group is None else group.size
        dp_group = group if size > 1 else None
        others = {name: ps.group(name) for name in names}  # the experts' expert_dp: buckets of their own
        reduced = dp_group is not None or any(group_size(g) > 1 for g in others.values())
        return cls(params, bucket_bytes=bucket_bytes, pad_to=size,
                   separate_shared_embedding=ps.pp_size > 1 and ps.embedding_group is not None,
                   dp_group=dp_group, overlap_grad_reduce=overlap_grad_reduce and reduced,
                   overlap_param_gather=overlap_param_gather and reduced, accumulate=accumulate, groups=others,
                   divisors={name: size for name in others}, norm_piece=norm_piece, decide_on_host=decide_on_host)

    def remove(self) -> None:
        """Remove the hooks and every ``main_grad`` (teardown)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._active = False
        # Not waited for: after a normal fit the strategy's on_train_end did; after a failure a dead
        # peer would hold teardown for the whole collective timeout.
        for b in self._gathers:
            b.gather = None
        self._gathers = []
        self._gather_view = None
        if not self._removed:  # every param got its main_grad in __init__
            for p in self.params:
                del p.main_grad
        self._removed = True


def finalize_model_grads(buffer: GradBuffer, ps: ParallelState) -> None:
    """After the last microbatch's backward: every ``main_grad`` holds this step's reduced fp32 grad.

    1. DP: every bucket's reduction started (or started now) and waited for, divided by the DP size
       (with a DistributedOptimizer only this rank's piece of each bucket is reduced);
    2. TP: the grads of sequence-parallel parameters (computed from a part of the sequence on each
       TP rank) summed over TP;
    3. PP: the tied word embedding's grads summed over the first and last stage, then DP-reduced.
    """
    buffer.finish_grad_sync()
    t1 = time.perf_counter()
    if ps.tp_size > 1:
        all_reduce_coalesced([p.main_grad for p in buffer.params if param_facts(p).sequence_parallel],
                             ps.group("tp"))
    if ps.pp_size > 1 and ps.embedding_group is not None and len(ps.embedding_ranks) > 1:
        deferred = [b for b in buffer.buckets if b.deferred]
        if deferred:  # the shared embeddings are contiguous there: reduce in place, no copy
            for b in deferred:
                all_reduce(buffer.data[b.start: b.start + b.numel], ps.group("embedding"))
        else:
            all_reduce_coalesced([p.main_grad for p in buffer.params if param_facts(p).shared_embedding],
                                 ps.group("embedding"))
    t2 = time.perf_counter()
    buffer.finish_deferred()
    buffer.exposed_comm_seconds += t2 - t1
