"""Megatron's distributed optimizer (ZeRO stage 1): fp32 main params and optimizer state sharded over DP.

Layout. All trainable model params, in param-group order then param order, are laid end to end in
one flat fp32 buffer of ``N`` elements padded to ``P = ceil(N / d) * d`` (``d`` = DP size). DP rank
``r`` owns the contiguous range ``[r S, (r + 1) S)`` with ``S = P / d``. Because the groups are
contiguous in the buffer, a group's part of the range is contiguous too: the inner optimizer's
group ``k`` holds ONE flat fp32 tensor, a view of this rank's main-param shard, and keeps its own
hyperparameters (lr, weight_decay, ...), so an LR / weight-decay scheduler keeps driving them.
Adam-like optimizers are elementwise, so stepping the flat shard equals stepping every param.

One step (``step(closure)``), Megatron's order, on every DP rank:

1. model grads (``param.main_grad`` or ``param.grad``, any dtype) -> the flat fp32 grad buffer;
   the model grads are freed;
2. ``reduce_scatter`` (SUM) over DP, ``/ d``: this rank's fp32 grad shard is the DP mean
   (with ``grads_already_reduced=True`` the shard is just sliced out, no communication);
3. with a grad scaler: ``shard *= 1/scale``, ``found_inf`` MAX-reduced over DP and the
   model-parallel group (every rank takes the same decision); ``scaler.update``; skip on overflow;
4. ``||g||_2 = sqrt(all-reduce SUM over DP and MP of the shard's sum of squares)``, each element of
   a TP-duplicated param counted on ``tp_rank == 0`` only and a ``shared_embedding`` on
   ``pp_rank == 0`` only (as clip_grads.py); clip by it;
5. inner optimizer step on the shard;
6. ``all_gather`` (fp32, into the grad buffer which is free by now) and copy into the model params,
   cast to their dtype (one rounding per step for bf16/fp16 models).

Memory per parameter and rank (persistent, ``d`` = DP size), Adam: model params ``m`` bytes (2 for
bf16/fp16, 4 for fp32) + fp32 grad buffer 4 + fp32 main shard ``4/d`` + two fp32 moments ``8/d``::

    bf16 params: 6 + 12/d        fp32 params: 8 + 12/d

(the non-distributed wrappers: bf16 2 + 4 + 12 = 18, fp32 4 + 4 + 8 = 16). ``memory_bytes()``
returns the measured numbers; benchmarks/optimizer_memory.py prints them.

Checkpoints: ``state_dict()`` is this rank's shard plus the layout; ``full_state_dict()``
(collective) gathers an unsharded, DP-size-independent state and ``load_full_state_dict`` slices
it for the current DP size: that is how a run resumes after a DP size change.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron.optimizer.clip_grads import _is_counted
from lightning_megatron.optimizer.grad_scaler import MegatronGradScaler
from lightning_megatron.optimizer.mixed_precision import MegatronOptimizer, zero_grads
from lightning_megatron.tensor_parallel.mappings import all_gather_into_tensor, all_reduce, reduce_scatter_tensor

__all__ = ["DistributedOptimizer"]


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


class DistributedOptimizer(MegatronOptimizer):
    """ZeRO-1 wrapper of a torch optimizer built over the model params (fp32, bf16 or fp16).

    ``reduces_gradients = True``: this optimizer reduce-scatters the raw per-rank grads over
    ``data_parallel_group`` itself, so the strategy must skip its own DP all-reduce (otherwise pass
    ``grads_already_reduced=True``, correct but with the all-reduce's extra traffic).
    ``data_parallel_group=None`` means DP size 1.
    """

    reduces_gradients = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        grad_scaler: MegatronGradScaler | None = None,
        clip_grad: float = 0.0,
        data_parallel_group: dist.ProcessGroup | None,
        model_parallel_group: dist.ProcessGroup | None = None,
        tp_rank: int = 0,
        pp_rank: int = 0,
        log_num_zeros_in_grad: bool = False,
        grads_already_reduced: bool = False,
    ) -> None:
        super().__init__(optimizer, grad_scaler=grad_scaler, clip_grad=clip_grad,
                         log_num_zeros_in_grad=log_num_zeros_in_grad,
                         model_parallel_group=model_parallel_group, tp_rank=tp_rank, pp_rank=pp_rank)
        if len(optimizer.state) > 0:
            raise ValueError("wrap the optimizer before its first step: its state is keyed by model params "
                             "and cannot be sharded afterwards")
        self.data_parallel_group = data_parallel_group
        self.grads_already_reduced = grads_already_reduced
        self.dp_size = _size(data_parallel_group)
        self.dp_rank = _rank(data_parallel_group)

        # Model params, group by group, and their offsets in the flat buffer.
        self.model_groups: list[list[torch.nn.Parameter]] = []
        self._offsets: list[list[int]] = []
        offset = 0
        device = None
        for group in optimizer.param_groups:
            params, offs = [], []
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise TypeError(f"parameter of dtype {p.dtype} is not supported; use float32, float16 or bfloat16")
                device = p.device if device is None else device
                params.append(p)
                offs.append(offset)
                offset += p.numel()
            self.model_groups.append(params)
            self._offsets.append(offs)
        self.numel = offset
        dtypes = {p.dtype for params in self.model_groups for p in params}
        self._gather_dtype = dtypes.pop() if len(dtypes) == 1 and dtypes != {torch.float32} else torch.float32
        self.padded_numel = -(-offset // self.dp_size) * self.dp_size
        self.shard_size = self.padded_numel // self.dp_size
        self.shard_start = self.dp_rank * self.shard_size
        self.shard_end = self.shard_start + self.shard_size
        device = device if device is not None else torch.device("cpu")

        # Persistent buffers: fp32 grads of all params (4 B/param), fp32 main shard (4/d B/param).
        self.grad_buffer = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        self.main_shard = torch.zeros(self.shard_size, dtype=torch.float32, device=device)
        # Per param: (param, start, end in param's flat numbering, start in shard) for its piece here.
        self._segments: list[list[tuple[torch.nn.Parameter, int, int, int]]] = []
        self.main_params: list[torch.Tensor] = []
        for k, (group, params, offs) in enumerate(zip(optimizer.param_groups, self.model_groups, self._offsets)):
            segs = []
            for p, o in zip(params, offs):
                lo, hi = max(o, self.shard_start), min(o + p.numel(), self.shard_end)
                if lo < hi:
                    segs.append((p, lo - o, hi - o, lo - self.shard_start))
                    self.main_shard[lo - self.shard_start: hi - self.shard_start].copy_(
                        p.detach().reshape(-1)[lo - o: hi - o])
            self._segments.append(segs)
            if segs:
                a, b = segs[0][3], segs[-1][3] + segs[-1][2] - segs[-1][1]
            else:
                a = b = 0
            main = self.main_shard[a:b]  # a view: a leaf, since main_shard does not require grad
            self.main_params.append(main)
            group["params"] = [main]

    # -- step pieces ---------------------------------------------------------------------------
    def _all_segments(self):
        for segs in self._segments:
            yield from segs

    def main_grad_views(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(param, its slice of the flat fp32 grad buffer shaped like it), for every model param.

        The strategy's main grads (:class:`lightning_megatron.grads.MainGrads`) use these as
        ``param.main_grad``: backward accumulates straight into the buffer this optimizer
        reduce-scatters, so the fp32 grads exist once (4 bytes per parameter), not twice.
        """
        return [(p, self.grad_buffer[o: o + p.numel()].view_as(p))
                for params, offs in zip(self.model_groups, self._offsets) for p, o in zip(params, offs)]

    def _copy_model_grads_to_main_grads(self) -> None:
        buf = self.grad_buffer
        buf[self.numel:].zero_()
        for params, offs in zip(self.model_groups, self._offsets):
            for p, o in zip(params, offs):
                target = buf[o: o + p.numel()]
                g = getattr(p, "main_grad", None)
                if g is None:
                    g = p.grad
                if g is None:
                    target.zero_()
                elif g.data_ptr() != target.data_ptr():  # not already in place (see main_grad_views)
                    target.copy_(g.reshape(-1))
                p.grad = None  # now redundant: freeing it is what keeps the fp32 buffer cheap
        # This rank's slice of the buffer is its grad shard: reduce-scatter in place (Megatron's
        # layout; NCCL and gloo both take an output that is the rank's own chunk of the input),
        # so the step allocates no shard. The buffer is only overwritten by the all-gather after it.
        shard = buf[self.shard_start: self.shard_end]
        if not self.grads_already_reduced and self.dp_size > 1:
            reduce_scatter_tensor(shard, buf, self.data_parallel_group)
            shard.div_(self.dp_size)  # DP mean, as the strategy's all-reduce would give
        for main in self.main_params:
            start = main.storage_offset() - self.main_shard.storage_offset()
            main.grad = shard[start: start + main.numel()]
        self._grad_shard = shard

    def _main_grads(self) -> list[torch.Tensor]:
        return [self._grad_shard]

    def _all_reduce(self, t: torch.Tensor, op: dist.ReduceOp) -> None:
        for group in (self.data_parallel_group, self.model_parallel_group):
            if group is not None:
                all_reduce(t, group, op)

    def _unscale_main_grads(self) -> None:
        assert self.grad_scaler is not None
        inv_scale = self.grad_scaler.inv_scale.to(self._grad_shard.device)
        if not bool(inv_scale.item() == 1.0):
            self._grad_shard.mul_(inv_scale)

    def _counted_grad_pieces(self) -> list[torch.Tensor]:
        """Pieces of the grad shard this rank counts in the norm (duplicates once, see clip_grads)."""
        return [self._grad_shard[s: s + hi - lo] for p, lo, hi, s in self._all_segments()
                if _is_counted(p, self.tp_rank, self.pp_rank)]

    def _grad_norm(self) -> float:
        return self._grad_norm_and_found_inf()[0]

    def _grad_norm_and_found_inf(self) -> tuple[float, bool]:
        # One pass over the shard: counted pieces give the norm, the rest are only checked
        # (see clip_grads.grad_norm_and_found_inf); reduced over DP and the model-parallel group.
        total = torch.zeros(2, dtype=torch.float64, device=self.grad_buffer.device)
        for p, lo, hi, s in self._all_segments():
            piece = self._grad_shard[s: s + hi - lo]
            if _is_counted(p, self.tp_rank, self.pp_rank):
                total[0] += piece.double().pow(2).sum()
            else:
                total[1] += torch.linalg.vector_norm(piece, 2, dtype=torch.float32).double()
        self._all_reduce(total, dist.ReduceOp.SUM)
        squares, checked = total.tolist()
        return squares ** 0.5, not (math.isfinite(squares) and math.isfinite(checked))

    def _num_zeros(self) -> int:
        total = torch.zeros(1, dtype=torch.float64, device=self.grad_buffer.device)
        for g in self._counted_grad_pieces():
            total += g.numel() - torch.count_nonzero(g)
        self._all_reduce(total, dist.ReduceOp.SUM)
        return int(total.item())

    def _copy_main_params_to_model_params(self) -> None:
        # The grads are consumed: the grad buffer's memory is the gather target. When every model
        # param has one 16-bit dtype, the shard is rounded to it first and gathered in it (half the
        # bytes of fp32, as Megatron gathers its bf16 param buffer); rounding each element before or
        # after the gather gives the same bits.
        dtype = self._gather_dtype
        if dtype == torch.float32:
            target = self.grad_buffer
            if self.dp_size == 1:
                target.copy_(self.main_shard)
            else:
                all_gather_into_tensor(target, self.main_shard, self.data_parallel_group)
        else:
            target = self.grad_buffer.view(dtype)[: self.padded_numel]
            own = target[self.shard_start: self.shard_end]
            own.copy_(self.main_shard)  # round to nearest, once per step
            if self.dp_size > 1:
                all_gather_into_tensor(target, own, self.data_parallel_group)  # in place: own is our chunk
        for params, offs in zip(self.model_groups, self._offsets):
            for p, o in zip(params, offs):
                p.data.copy_(target[o: o + p.numel()].view_as(p))

    # -- public API ----------------------------------------------------------------------------
    def get_parameters(self) -> list[torch.Tensor]:
        # The model params: MegatronOptimizer.__init__ uses this for the scaler's device.
        return [p for group in getattr(self, "model_groups", [])
                for p in group] or [p for g in self.optimizer.param_groups for p in g["params"]]

    # step() is MegatronOptimizer.step; these hooks make it work on the flat shard.
    def _clip_parameters(self) -> list[torch.Tensor]:
        return self.main_params

    def _release_main_grads(self) -> None:
        self._release_grad_shard()

    def _release_grad_shard(self) -> None:
        for main in self.main_params:
            main.grad = None
        self._grad_shard = None

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

    def layout(self) -> dict[str, Any]:
        return {
            "dp_size": self.dp_size,
            "dp_rank": self.dp_rank,
            "numel": self.numel,
            "param_shapes": [[tuple(p.shape) for p in g] for g in self.model_groups],
        }

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """This rank's shard: ``{"optimizer", "grad_scaler", "main_params_shard", "layout"}``."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": self._scaler_state(),
            "main_params_shard": self.main_shard.clone(),
            "layout": self.layout(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a shard written by the same DP rank of the same layout; after a DP size change use
        :meth:`load_full_state_dict` with what :meth:`full_state_dict` wrote."""
        if "full_main_params" in state_dict:
            self.load_full_state_dict(state_dict)
            return
        saved, mine = state_dict.get("layout"), self.layout()
        if saved != mine:
            raise ValueError(f"sharded optimizer state of layout {saved} cannot be loaded into layout {mine}; "
                             "save with full_state_dict() to change the DP size")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._load_scaler_state(state_dict.get("grad_scaler"))
        self.main_shard.copy_(state_dict["main_params_shard"])
        self._copy_main_params_to_model_params()

    def sharded_state_for_checkpoint(self) -> list[dict[str, Any]]:
        """Per model param piece held here: ``{"param", "start", "end", "tensors"}``.

        ``tensors`` maps ``"main_param"`` and each elementwise state key (``exp_avg``...) to a view
        of elements ``[start, end)`` of ``param.reshape(-1)`` (this rank's TP-local param). A
        checkpointer can save each as a 1-D chunk of a ``[param.numel()]`` global tensor (e.g. a
        DCP ShardedTensor at offset ``start``) and so reshard across DP sizes.
        """
        out = []
        for main, segs in zip(self.main_params, self._segments):
            state = self.optimizer.state.get(main, {})
            base = main.storage_offset() - self.main_shard.storage_offset()
            for p, lo, hi, s in segs:
                tensors = {"main_param": self.main_shard[s: s + hi - lo]}
                for key, v in state.items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        tensors[key] = v[s - base: s - base + hi - lo]
                out.append({"param": p, "start": lo, "end": hi, "tensors": tensors})
        return out

    # -- DP-size independent checkpoint ---------------------------------------------------------
    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        if self.dp_size == 1:
            return shard.clone()
        out = torch.empty(self.padded_numel, dtype=shard.dtype, device=shard.device)
        all_gather_into_tensor(out, shard.contiguous(), self.data_parallel_group)
        return out

    def full_state_dict(self) -> dict[str, Any]:
        """Collective over DP: the unsharded state, identical on every DP rank, loadable at any DP size.

        ``{"full_main_params": [N] fp32, "full_state": {key: [N] fp32} for elementwise state,
        "group_state": per group {key: non-elementwise value (e.g. step)}, "param_groups": the
        hyperparameters, "grad_scaler", "param_shapes"}``.
        """
        keys = sorted({k for s in self.optimizer.state.values() for k, v in s.items()
                       if torch.is_tensor(v) and v.dim() > 0})
        full_state = {}
        for key in keys:
            shard = torch.zeros_like(self.main_shard)
            for main in self.main_params:
                st = self.optimizer.state.get(main, {})
                if key in st:
                    start = main.storage_offset() - self.main_shard.storage_offset()
                    shard[start: start + main.numel()].copy_(st[key])
            full_state[key] = self._gather(shard)[: self.numel]
        # Non-elementwise values (Adam's step) are equal on every rank for a group with elements; a
        # rank whose range misses a group has none, so take the max over DP.
        group_state = []
        for main in self.main_params:
            st = self.optimizer.state.get(main, {})
            group_state.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()
                                if not (torch.is_tensor(v) and v.dim() > 0)})
        if self.dp_size > 1:
            gathered: list[Any] = [None] * self.dp_size
            dist.all_gather_object(gathered, group_state, group=self.data_parallel_group)
            group_state = [next((g[k] for g in gathered if g[k]), {}) for k in range(len(group_state))]
        return {
            "full_main_params": self._gather(self.main_shard)[: self.numel],
            "full_state": full_state,
            "group_state": group_state,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "grad_scaler": self._scaler_state(),
            "param_shapes": [[tuple(p.shape) for p in g] for g in self.model_groups],
        }

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Slice an unsharded state (:meth:`full_state_dict`) for this rank; any DP size."""
        mine = [[tuple(p.shape) for p in g] for g in self.model_groups]
        if [[tuple(s) for s in g] for g in state_dict["param_shapes"]] != mine:
            raise ValueError("full optimizer state does not match this model's parameter shapes")
        lo, hi = self.shard_start, min(self.shard_end, self.numel)
        self.main_shard.zero_()
        self.main_shard[: max(hi - lo, 0)].copy_(state_dict["full_main_params"][lo:hi])
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update(saved)
        self.optimizer.state.clear()
        for main, gstate in zip(self.main_params, state_dict["group_state"]):
            if not gstate and not state_dict["full_state"]:
                continue
            start = main.storage_offset() - self.main_shard.storage_offset()
            st = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in gstate.items()}
            for key, full in state_dict["full_state"].items():
                piece = torch.zeros_like(main)
                a, b = lo + start, lo + start + main.numel()
                piece.copy_(full[a:b].to(piece.dtype))
                st[key] = piece
            self.optimizer.state[main] = st
        self._load_scaler_state(state_dict.get("grad_scaler"))
        self._copy_main_params_to_model_params()
