"""Megatron's distributed optimizer (ZeRO stage 1): fp32 main params and optimizer state sharded over DP.

Layout. The fp32 main grads live in one :class:`~lightning_megatron.grads.GradBuffer` (the
strategy's, or one this optimizer builds over its params when used on its own): buckets of whole
parameters, each padded to a multiple of the DP size ``d``. DP rank ``r`` owns the ``r``-th of the
``d`` equal contiguous pieces of every bucket (Megatron's layout): it holds the fp32 main params and
the optimizer state of those elements only, and a bucket's reduction is one in-place
reduce-scatter (each rank's piece of the mean lands where it is). ``main_shard`` is the
concatenation of this rank's pieces. The inner optimizer's group ``k`` holds flat fp32 views of
``main_shard`` (one per run of consecutive elements of that group inside one bucket piece) and
keeps its own hyperparameters (lr, weight_decay, ...), so an LR / weight-decay scheduler keeps
driving them. Adam-like optimizers are elementwise, so stepping flat pieces equals stepping every
param. On its own (no strategy), with the params in group order and one bucket, the layout is the
classic one: rank ``r`` owns ``[r S, (r + 1) S)`` of the padded flat params, ``S = ceil(N / d)``.

One step (``step(closure)``), Megatron's order, on every DP rank:

1. the grads are reduced: by the strategy's ``finalize_model_grads`` (reduce-scatter of every
   bucket, possibly overlapped with backward), or here when the buffer was not finalized: model
   grads (``param.grad``) -> the buffer, reduce-scatter (SUM) over DP, ``/ d`` (with
   ``grads_already_reduced=True`` only copied);
2. with a grad scaler: ``shard *= 1/scale``, ``found_inf`` reduced over DP and the model-parallel
   group (every rank takes the same decision); ``scaler.update``; skip on overflow;
3. ``||g||_2 = sqrt(all-reduce SUM over DP and MP of the shard's fp64 sum of squares)``, each
   element of a TP-duplicated param counted on ``tp_rank == 0`` only and a ``shared_embedding`` on
   ``pp_rank == 0`` only (``is_counted``: clip_grads.py, the same arithmetic as the other wrappers); clip by it;
4. inner optimizer step on the shard;
5. ``all_gather`` per bucket (into the grad buffer, free by now; in the params' 16-bit dtype when
   they all have one) and copy into the model params (one rounding per step for bf16/fp16):
   :meth:`GradBuffer.start_param_gather`, asynchronous and waited for by the next forward with the
   buffer's ``overlap_param_gather`` (the strategy's option of that name). With one data-parallel rank
   for every bucket there is nothing to gather: the main params are copied into the model params directly.

Memory per parameter and rank (persistent, ``d`` = DP size), Adam: model params ``m`` bytes (2 for
bf16/fp16, 4 for fp32) + fp32 grad buffer 4 + fp32 main shard ``4/d`` + two fp32 moments ``8/d``::

    bf16 params: 6 + 12/d        fp32 params: 8 + 12/d

(the non-distributed wrappers: bf16 2 + 4 + 12 = 18, fp32 4 + 4 + 8 = 16). ``memory_bytes()``
returns the measured numbers; benchmarks/optimizer_memory.py prints them.

Checkpoints: ``sharded_state_for_checkpoint()`` lists this rank's pieces per model param, which
:mod:`lightning_megatron.sharded_state` saves as chunks of the global tensors (any layout loads them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron.grads import GradBuffer
from lightning_megatron.optimizer.clip_grads import sum_of_squares_fp64
from lightning_megatron.optimizer.grad_scaler import MegatronGradScaler
from lightning_megatron.optimizer.mixed_precision import ELEMENTWISE_OPTIMIZERS, MegatronOptimizer, zero_grads
from lightning_megatron.parallel_state import Group, group_rank, group_size
from lightning_megatron.tensor_parallel.mappings import all_reduce
from lightning_megatron.tensor_parallel.param_facts import is_counted, param_facts

__all__ = ["DistributedOptimizer", "distributed_optimizer_problem"]


def distributed_optimizer_problem(optimizer_class: type, named: str | None = None) -> str | None:
    """Why the DistributedOptimizer cannot wrap an optimizer of ``optimizer_class`` (``named``: how the
    configuration names it), or None: it steps flat pieces of several parameters, which is the step over each
    parameter for an elementwise optimizer only (:data:`~lightning_megatron.optimizer.ELEMENTWISE_OPTIMIZERS`)."""
    if optimizer_class in ELEMENTWISE_OPTIMIZERS:
        return None
    return (f"{named or optimizer_class.__name__} with use_distributed_optimizer=True: {optimizer_class.__name__} is "
            f"not one of torch's elementwise optimizers ({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}; "
            f"the exact classes). ZeRO-1 steps flat pieces of several parameters, which equals a step over each "
            f"parameter only when every element is updated from its own gradient and state (not Adafactor's "
            f"factored second moment, not a subclass's step of its own). Use one of those, or "
            f"use_distributed_optimizer=False (a step over each parameter)")


class DistributedOptimizer(MegatronOptimizer):
    """ZeRO-1 wrapper of a torch optimizer built over the model params (fp32, bf16 or fp16).

    ``grad_buffer``: the strategy's :class:`~lightning_megatron.grads.GradBuffer` holding every
    trainable param of the optimizer (``MegatronOptimizerCallback`` passes it): this optimizer
    shards it and switches its DP reduction to reduce-scatter. ``None``: it builds its own over its
    params and reduce-scatters the raw per-rank ``.grad`` itself in ``step`` (otherwise pass
    ``grads_already_reduced=True``). ``data_parallel_group=None`` means DP size 1.
    """

    reduces_gradients = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        grad_scaler: MegatronGradScaler | None = None,
        clip_grad: float = 0.0,
        data_parallel_group: Group,
        model_parallel_group: Group = None,
        coordinates: Mapping[str, int] | None = None,
        log_num_zeros_in_grad: bool = False,
        grads_already_reduced: bool = False,
        grad_buffer: GradBuffer | None = None,
        expert_model_parallel_group: Group = None,
    ) -> None:
        super().__init__(optimizer, grad_scaler=grad_scaler, clip_grad=clip_grad,
                         log_num_zeros_in_grad=log_num_zeros_in_grad,
                         model_parallel_group=model_parallel_group, coordinates=coordinates,
                         expert_model_parallel_group=expert_model_parallel_group)
        if len(optimizer.state) > 0:
            raise ValueError("wrap the optimizer before its first step: its state is keyed by model params "
                             "and cannot be sharded afterwards")
        problem = distributed_optimizer_problem(type(optimizer))
        if problem is not None:
            raise ValueError(f"DistributedOptimizer: {problem}")
        self.data_parallel_group = data_parallel_group
        self.grads_already_reduced = grads_already_reduced
        self.dp_size = group_size(data_parallel_group)
        self.dp_rank = group_rank(data_parallel_group)

        # Model params, group by group.
        self.model_groups: list[list[torch.nn.Parameter]] = []
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise TypeError(f"parameter of dtype {p.dtype} is not supported; use float32, float16 or bfloat16")
                params.append(p)
            self.model_groups.append(params)
        mine = [p for params in self.model_groups for p in params]
        self.numel = sum(p.numel() for p in mine)
        if grad_buffer is None:
            grad_buffer = GradBuffer(mine, bucket_bytes=float("inf"), pad_to=self.dp_size,
                                     dp_group=data_parallel_group if self.dp_size > 1 else None)
        elif {id(p) for p in grad_buffer.params} != {id(p) for p in mine} or grad_buffer.dp_size != self.dp_size:
            raise ValueError(
                f"DistributedOptimizer: the grad buffer holds {len(grad_buffer.params)} params reduced over "
                f"{grad_buffer.dp_size} DP ranks but the optimizer has {len(mine)} trainable params over "
                f"{self.dp_size}: one DistributedOptimizer must own every trainable param of the buffer, "
                f"with the same data-parallel group")
        uneven = [b.index for b in grad_buffer.buckets if (b.end - b.start) % b.size]
        if uneven:
            raise ValueError(f"DistributedOptimizer: buckets {uneven} of the grad buffer are not padded to a multiple "
                             f"of their DP size; build the GradBuffer with pad_to={self.dp_size}")
        self.buffer = grad_buffer
        group_of = {id(p): k for k, params in enumerate(self.model_groups) for p in params}
        grad_buffer.order_within_buckets(lambda p: group_of[id(p)])  # one flat main param per group and bucket
        grad_buffer.use_reduce_scatter()
        dtypes = {p.dtype for p in mine}
        self._gather_dtype = dtypes.pop() if len(dtypes) == 1 and dtypes != {torch.float32} else torch.float32
        self.padded_numel = grad_buffer.data.numel()
        # Each bucket is sharded over its own data-parallel group (the experts' over expert_dp).
        self.shard_size = sum((b.end - b.start) // b.size for b in grad_buffer.buckets)
        device = grad_buffer.data.device

        # This rank's piece of every bucket, concatenated: [main position, buffer start, buffer end).
        self._pieces: list[tuple[int, int, int]] = []
        pos = 0
        for bucket in grad_buffer.buckets:
            lo, hi = grad_buffer.shard(bucket)
            self._pieces.append((pos, lo, hi))
            pos += hi - lo
        # Per param piece here: (param, start, end in the param's flat numbering, main pos, buffer pos).
        segments: list[tuple[torch.nn.Parameter, int, int, int, int]] = []
        for (base, lo, hi), bucket in zip(self._pieces, grad_buffer.buckets):
            for p in bucket.params:
                o = grad_buffer.offsets[id(p)]
                a, b = max(o, lo), min(o + p.numel(), hi)
                if a < b:
                    segments.append((p, a - o, b - o, base + a - lo, a))
        self.main_shard = torch.zeros(self.shard_size, dtype=torch.float32, device=device)
        for p, lo, hi, s, _ in segments:
            self.main_shard[s: s + hi - lo].copy_(p.detach().reshape(-1)[lo:hi])
        # Runs of consecutive segments of one group inside one bucket piece: one flat main param each.
        self._segments: list[tuple[torch.nn.Parameter, int, int, int, int]] = segments
        runs: list[list[tuple[int, int, int]]] = [[] for _ in self.model_groups]  # (main pos, buffer pos, n)
        last: tuple[int, int, int] | None = None  # (group, main end, buffer end)
        for p, lo, hi, s, g in segments:
            k = group_of[id(p)]
            if last is not None and last == (k, s, g):
                m, b, n = runs[k][-1]
                runs[k][-1] = (m, b, n + hi - lo)
            else:
                runs[k].append((s, g, hi - lo))
            last = (k, s + hi - lo, g + hi - lo)
        self.main_params: list[torch.Tensor] = []
        self._main_grad_views: list[torch.Tensor] = []
        for group, group_runs in zip(optimizer.param_groups, runs):
            mains = []
            for s, g, n in group_runs or [(0, 0, 0)]:  # a group with nothing here keeps an empty view
                mains.append(self.main_shard[s: s + n])  # a view: a leaf, main_shard does not require grad
                self._main_grad_views.append(grad_buffer.data[g: g + n])
            self.main_params.extend(mains)
            group["params"] = mains
        self._grads_ready = False
        # One data-parallel rank for every bucket (DP size 1, or data parallelism off): the model params and their
        # main params as views of the shard, copied straight into the params after the step (the gather through
        # the grad buffer's memory would copy every element twice).
        self._unsharded_mains: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        if all(b.size == 1 for b in grad_buffer.buckets):
            self._unsharded_mains = ([p for p, *_ in segments],
                                     [self.main_shard[s: s + hi - lo].view_as(p) for p, lo, hi, s, _ in segments])
        self._norm_pieces_made: list[tuple[bool, list[torch.Tensor], list[torch.Tensor]]] | None = None

    # -- step pieces ---------------------------------------------------------------------------
    @property
    def grad_buffer(self) -> torch.Tensor:
        """The fp32 grad storage (the GradBuffer's data): every ``main_grad`` is a view of it."""
        return self.buffer.data

    def _copy_model_grads_to_main_grads(self) -> None:
        buf = self.buffer
        if not buf.reduced:  # used on its own: the model grads are in .grad, not reduced yet
            if self.grads_already_reduced or self.dp_size == 1:
                for p in buf.params:
                    if p.grad is None:
                        p.main_grad.zero_()
                    else:
                        p.main_grad.copy_(p.grad)
                    p.grad = None  # now redundant: freeing it is what keeps the fp32 buffer cheap
            else:
                buf.reduce_param_grads()
        for main, grad in zip(self.main_params, self._main_grad_views):
            main.grad = grad
        self._grads_ready = True

    def _main_grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.main_params if m.grad is not None]

    def _all_reduce(self, t: torch.Tensor, op: dist.ReduceOp, experts: bool = False) -> None:
        """Over the shards' data-parallel group, then the model-parallel group (the experts': their own)."""
        groups = (self.data_parallel_group, self.model_parallel_group)
        if experts:
            groups = (self.buffer.groups.get("expert_dp", self.data_parallel_group), self.expert_model_parallel_group)
        for group in groups:
            if group is not None:
                all_reduce(t, group, op)

    def _segment_families(self) -> list[tuple[bool, list]]:
        """``(experts, segments)``: the shard's segments by the groups their norm is summed over."""
        if self.expert_model_parallel_group is None:
            return [(False, self._segments)]
        expert = [param_facts(seg[0]).data_parallel == "expert_dp" for seg in self._segments]
        return [(False, [seg for seg, e in zip(self._segments, expert) if not e]),
                (True, [seg for seg, e in zip(self._segments, expert) if e])]

    def _norm_pieces(self) -> list[tuple[bool, list[torch.Tensor], list[torch.Tensor]]]:
        """``(experts, counted, checked only)`` per family of the norm: the pieces of the grad shard this rank counts
        (duplicates once, see clip_grads) and the ones it only checks, each a view of the buffer over a run of
        adjacent segments (a few tensors, not one per parameter: the norm's per-tensor host work). The
        parameters' records and the layout do not change between steps: made once, not every step."""
        if self._norm_pieces_made is None:
            self._norm_pieces_made = []
            for experts, segments in self._segment_families():
                counted = [is_counted(seg[0], self.coordinates) for seg in segments]
                self._norm_pieces_made.append(
                    (experts, self._segment_grads([seg for seg, c in zip(segments, counted) if c]),
                     self._segment_grads([seg for seg, c in zip(segments, counted) if not c])))
        return self._norm_pieces_made

    def _segment_grads(self, segments: list[tuple[torch.nn.Parameter, int, int, int, int]]) -> list[torch.Tensor]:
        """The grads of ``segments``: views of the buffer, the adjacent ones merged (:meth:`GradBuffer.runs_of`)."""
        return self.buffer.runs_of([self.buffer.data[g: g + hi - lo] for _, lo, hi, _, g in segments])

    def _norm_totals(self) -> torch.Tensor:
        # One pass over the shard: counted pieces give the norm (fp64 sum of squares, as clip_grads), the rest
        # are only checked; reduced over DP and the model-parallel group (the experts': their own), left on the
        # device: MegatronOptimizer reads it once, after the update is queued where it can
        # (``decides_on_device``), or before it.
        totals = None
        for experts, counted, others in self._norm_pieces():
            total = torch.zeros(2, dtype=torch.float64, device=self.grad_buffer.device)
            total[0] = sum_of_squares_fp64(counted, self.grad_buffer.device, piece=self.buffer.norm_piece)
            for piece in others:
                total[1] += torch.linalg.vector_norm(piece, 2, dtype=torch.float32).double()
            self._all_reduce(total, dist.ReduceOp.SUM, experts)
            totals = total if totals is None else totals + total
        assert totals is not None
        return totals

    def decides_on_device(self) -> bool:
        # The shard's buffer is this wrapper's own (not the base class's ``_grad_buffer``): its
        # ``decide_on_host`` (the CPU tuning's) is asked here.
        return not self.buffer.decide_on_host and super().decides_on_device()

    def _num_zeros(self) -> int:
        zeros = 0
        for experts, counted, _ in self._norm_pieces():
            total = torch.zeros(1, dtype=torch.float64, device=self.grad_buffer.device)
            for g in counted:
                total += g.numel() - torch.count_nonzero(g)
            self._all_reduce(total, dist.ReduceOp.SUM, experts)
            zeros += int(total.item())
        return zeros

    def _copy_main_params_to_model_params(self) -> None:
        if self._unsharded_mains is not None:  # no bucket is sharded: every main param is here, nothing to gather
            self.buffer.mark_consumed()
            torch._foreach_copy_(self._unsharded_mains[0], self._unsharded_mains[1])  # round to nearest, once
            return
        # The grads are consumed: the grad buffer's memory is the gather target. When every model
        # param has one 16-bit dtype, the shard is rounded to it first and gathered in it (half the
        # bytes of fp32, as Megatron gathers its bf16 param buffer); rounding each element before or
        # after the gather gives the same bits. Every bucket is gathered in place (each rank's
        # piece already sits in its slot).
        dtype = self._gather_dtype
        target = self.grad_buffer if dtype == torch.float32 else self.grad_buffer.view(dtype)[: self.padded_numel]
        for (base, lo, hi), bucket in zip(self._pieces, self.buffer.buckets):
            target[lo:hi].copy_(self.main_shard[base: base + hi - lo])  # round to nearest, once per step
        self.buffer.mark_consumed()
        # All-gather every bucket in place (each rank's piece already sits in its slot) and copy into
        # the model params; with overlap_param_gather the buffer does it during the next forward.
        self.buffer.start_param_gather(target)

    # -- public API ----------------------------------------------------------------------------
    def params_from_mains(self) -> None:
        """The model params := the main params, gathered over the data-parallel ranks as after a step (a checkpoint
        load whose params were saved in 16 bits for this optimizer's fp32 ones: the mains are the exact weights).
        Collective over every DP group of the buffer."""
        self._copy_main_params_to_model_params()

    def get_parameters(self) -> list[torch.Tensor]:
        """The model params (the inner optimizer holds flat views of the main shard)."""
        return [p for group in self.model_groups for p in group]

    # step() is MegatronOptimizer.step; these hooks make it work on the flat shard.
    def _clip_parameters(self) -> list[torch.Tensor]:
        return self.main_params

    def _release_main_grads(self) -> None:
        for main in self.main_params:
            main.grad = None
        self.buffer.mark_consumed()  # consumed (or skipped): the next step reduces anew

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads([p for params in self.model_groups for p in params], set_to_none)
        for main in self.main_params:
            main.grad = None

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held on this rank: ``main_params`` (fp32 shard), ``optimizer_state`` (tensors of the
        inner optimizer's state, e.g. Adam's two moments), ``grad_buffer`` (fp32, all params) and
        ``model_params``."""
        state = sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                    for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
        return {
            "main_params": self.main_shard.numel() * self.main_shard.element_size(),
            "optimizer_state": state,
            "grad_buffer": self.grad_buffer.numel() * self.grad_buffer.element_size(),
            "model_params": sum(p.numel() * p.element_size() for g in self.model_groups for p in g),
        }

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        raise TypeError("DistributedOptimizer state is saved by the MegatronStrategy's sharded checkpoint "
                        "(trainer.save_checkpoint), which reshards it across layouts; a per-rank state_dict "
                        "would not load at another data-parallel size")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        raise TypeError("DistributedOptimizer state is loaded by the MegatronStrategy's sharded checkpoint "
                        "(trainer.fit(..., ckpt_path=...))")

    def _main_of(self, s: int) -> tuple[torch.Tensor, int]:
        """The flat main param holding main-shard position ``s``, and its start in ``main_shard``."""
        for main in self.main_params:
            start = main.storage_offset() - self.main_shard.storage_offset()
            if start <= s < start + main.numel():
                return main, start
        raise AssertionError(f"main-shard position {s} is in no main param")

    def main_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        raise TypeError("DistributedOptimizer: a parameter's main copy is split over the data-parallel ranks; "
                        "read this rank's pieces with sharded_state_for_checkpoint()")

    def sharded_state_for_checkpoint(self) -> list[dict[str, Any]]:
        """Per model param piece held here: ``{"param", "start", "end", "tensors"}``.

        ``tensors`` maps ``"main_param"`` and each elementwise state key (``exp_avg``...) to a view
        of elements ``[start, end)`` of ``param.reshape(-1)`` (this rank's TP-local param). A
        checkpointer can save each as a 1-D chunk of a ``[param.numel()]`` global tensor (e.g. a
        DCP ShardedTensor at offset ``start``) and so reshard across DP sizes.
        """
        out = []
        for p, lo, hi, s, _ in self._segments:
            main, base = self._main_of(s)
            state = self.optimizer.state.get(main, {})
            tensors = {"main_param": self.main_shard[s: s + hi - lo]}
            for key, v in state.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    tensors[key] = v[s - base: s - base + hi - lo]
            out.append({"param": p, "start": lo, "end": hi, "tensors": tensors})
        return out
