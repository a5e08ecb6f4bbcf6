"""Megatron's optimizer wrappers: fp32 main params, loss-scale unscaling, overflow skip, clipping.

Here the wrappers' base (:class:`MegatronOptimizer`, whose ``step`` every wrapper runs) and the fp32 wrapper;
the 16-bit one is in :mod:`lightning_megatron.optimizer.float16`, ZeRO-1's in
:mod:`lightning_megatron.optimizer.distrib_optimizer`.
The wrappers subclass ``torch.optim.Optimizer`` (so Lightning accepts them) without owning any
state: ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's own objects, so a
torch LR scheduler built on the inner optimizer keeps driving the learning rate.

One step (``step(closure)``), in Megatron's order:

1. ``closure()`` if given (Lightning's closure runs forward and backward);
2. copy the model grads into the fp32 main grads (the 16-bit wrapper,
   :class:`~lightning_megatron.optimizer.float16.Float16OptimizerWithFloat16Params`);
3. with a grad scaler: main grads ``*= 1 / scale``; then one pass over the grads gives both the
   global grad norm and ``found_inf`` = any inf/nan on any model-parallel rank (one all-reduce, so
   every rank takes the same decision; see :func:`grad_norm_and_found_inf`); ``scaler.update(found_inf)``;
   on overflow the step is skipped: parameters and optimizer state are untouched;
4. clipping by the global grad norm when ``clip_grad > 0`` (without a scaler the norm is computed
   here), zero count if asked;
5. the inner optimizer's step on the fp32 main params;
6. copy the main params back into the bf16/fp16 model params (one rounding per step).

The NaN/Inf guard (``check_for_nan_in_loss_and_grad``: stop the run on a non-finite loss or gradient)
is not the wrappers': it belongs to the training step, whatever optimizer steps after it
(:mod:`lightning_megatron.step`, a ``MegatronStrategy`` argument). Here an inf/nan is only the
loss scaler's overflow (step 3).

Why main params: a bf16 weight has 8 significant bits, so an update smaller than ``2^-8 |w|`` rounds
back to ``w`` and is lost. Accumulating in an fp32 copy keeps every small update and rounds only
once, when the model copy is refreshed.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from lightning_megatron.parallel_state import Group
from lightning_megatron.optimizer.clip_grads import (
    clip_grads_by_squares,
    clip_grads_by_total_norm,
    count_zeros_fp32,
    grad_norm_squares,
)
from lightning_megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from lightning_megatron.tensor_parallel.param_facts import is_counted, mark_replicated, param_facts

if TYPE_CHECKING:
    from lightning_megatron.grads import GradBuffer

__all__ = ["ELEMENTWISE_OPTIMIZERS", "MegatronOptimizer", "FP32Optimizer", "route_non_finite_grads", "zero_grads"]

_NormFamily = tuple[list[torch.Tensor], list[torch.Tensor], Group]
"""One family of the norm: (parameters this rank counts, duplicates it only checks, the group summing them)."""


ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta)
"""torch's optimizers whose update of an element reads that element's parameter, gradient and state only (and
scalars a group shares, such as Adam's step): stepping flat runs of several parameters equals stepping each
parameter. Not Adafactor (it factors a matrix's second moment by its rows and columns), LBFGS (a global line
search) or a subclass (its step may be another)."""


def zero_grads(params: list[torch.Tensor], set_to_none: bool = True) -> None:
    """Drop (or zero) the ``.grad`` of every tensor in ``params``."""
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.detach_().zero_()


class MegatronOptimizer(torch.optim.Optimizer):
    """Common part of the wrappers: shared param groups, overflow check, norm, clipping, counters.

    Attributes set after every :meth:`step`: ``last_grad_norm`` (float, ``None`` on a skipped step),
    ``last_num_zeros`` (int or ``None``), ``last_step_skipped`` (bool), ``num_skipped_steps`` (int).
    Implements :class:`lightning_megatron.protocols.OptimizerWrapper`.
    """

    reduces_gradients = False
    """True for the DistributedOptimizer (ZeRO-1), which reads reduce-scattered gradient shards."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        grad_scaler: MegatronGradScaler | None = None,
        clip_grad: float = 0.0,
        log_num_zeros_in_grad: bool = False,
        model_parallel_group: Group = None,
        coordinates: Mapping[str, int] | None = None,
        grad_buffer: GradBuffer | None = None,
        expert_model_parallel_group: Group = None,
    ) -> None:
        # Deliberately no super().__init__: it would build new param groups and state; ours are the
        # inner optimizer's. The hook dicts exist so Optimizer's hook-registration API still works.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, MegatronOptimizer):
            raise TypeError("optimizer is already a MegatronOptimizer; wrap the plain torch optimizer once")
        if clip_grad < 0.0:
            raise ValueError(f"clip_grad={clip_grad!r} must be >= 0 (0 disables clipping)")
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.grad_scaler = grad_scaler
        self.clip_grad = float(clip_grad)
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.model_parallel_group = model_parallel_group
        self.expert_model_parallel_group = expert_model_parallel_group
        """Where the experts' part of the norm is summed (``expert_mp``: their TP, EP and PP ranks); None: no
        experts, or expert parallelism off (then they are summed with the rest over ``model_parallel_group``)."""
        self.coordinates: dict[str, int] = dict(coordinates or {})
        """This rank's coordinates (``ParallelState.coordinates``): which parameters it counts in the norm."""
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # Parameters no parallel layer described are replicated (one process, or plain layers): said
        # once here, so that the norm can count every parameter (tensor_parallel.param_facts).
        mark_replicated(params)
        self._grad_buffer = grad_buffer
        """The strategy's GradBuffer whose ``main_grad`` views hold the grads (None: ``.grad``)."""
        self._main_grad_views: dict[int, torch.Tensor] | None = None  # id(param) -> its main grad: _main_grad_of
        self._norm_plan_for: tuple[tuple[int, ...], list[_NormFamily]] | None = None  # (param ids, plan): _norm_plan
        self._norm_runs_for: tuple[list[_NormFamily], list[_NormFamily]] | None = None  # (plan, runs): _norm_grads
        self._clip_runs_for: tuple[list[_NormFamily], list[torch.Tensor]] | None = None  # (runs, union): _clip_grads
        if grad_scaler is not None and params:
            grad_scaler.to(params[0].device)  # the scale lives next to the grads
        self.last_grad_norm: float | None = None
        self.last_num_zeros: int | None = None
        self.last_step_skipped = False
        self.num_skipped_steps = 0
        self.on_non_finite_grads: Callable[[], None] | None = None
        """Called by :meth:`step` when a gradient on any rank is inf/nan and no dynamic loss scaler skips the
        step, before anything is updated: the strategy's NaN guard installs its raise here, so that the
        norm's pass over the gradients is also the guard's (``StepRunner``, ``check_for_nan_in_loss_and_grad``)."""
        self.on_non_finite_loss: Callable[[torch.Tensor, float, float], None] | None = None
        """Called by :meth:`step` with (the loss, its value, the sum of the norm's two parts) when the loss handed
        over in :attr:`loss_to_check` is not finite: the NaN guard's raise, where the step reads the device once
        (:meth:`decides_on_device`; the update was skipped there)."""
        self.loss_to_check: torch.Tensor | None = None
        """The step's loss, handed over by the strategy's NaN guard for this step's one read (then cleared)."""

    # -- shared containers ---------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    def get_parameters(self) -> list[torch.Tensor]:
        """The parameters the inner optimizer updates (fp32 main params for fp16/bf16 models)."""
        return [p for group in self.param_groups for p in group["params"]]

    def main_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The tensor the inner optimizer updates for model parameter ``param`` (``param`` itself here)."""
        return param

    def model_parameters(self) -> list[torch.Tensor]:
        """The model parameters whose gradients :meth:`step` reads (and checks for inf/nan)."""
        return self.get_parameters()

    def param_state(self, main: torch.Tensor) -> dict[str, Any]:
        """The inner optimizer's state of ``main`` (a :meth:`main_param`), as a checkpoint reads it: per-element
        tensors of ``main``'s shape and scalars (Adam's ``step``)."""
        return self.optimizer.state.get(main, {})

    def load_param_state(self, main: torch.Tensor, state: dict[str, Any]) -> None:
        """Install ``state`` (:meth:`param_state`'s form, loaded from a checkpoint) as ``main``'s."""
        self.optimizer.state[main] = state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} does not support add_param_group; add the group to the inner "
            "optimizer before wrapping it"
        )

    # -- loss scale ----------------------------------------------------------------------------
    def get_loss_scale(self) -> torch.Tensor:
        """Current loss scale as a ``[1]`` fp32 tensor (1.0 without a scaler)."""
        if self.grad_scaler is None:
            device = self.get_parameters()[0].device if self.get_parameters() else "cpu"
            return torch.ones(1, dtype=torch.float32, device=device)
        return self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` in fp32 (a 2**32 scale overflows fp16); call before ``backward``."""
        return loss * self.get_loss_scale().to(loss.device).reshape(())

    # -- step pieces (overridden by the fp16/bf16 wrapper) ---------------------------------------
    def _main_grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s main grad in the grad buffer (None: no buffer, or ``p`` is not in it). Where a parameter's grad
        lives in the buffer does not change: the views are made once, not every step (issue 39's "no
        per-parameter Python in the step": a slice and a view per parameter)."""
        if self._grad_buffer is None:
            return None
        if self._main_grad_views is None:
            buffer = self._grad_buffer
            self._main_grad_views = {id(q): buffer.main_grad_view(q) for q in buffer.params}
        return self._main_grad_views.get(id(p))

    def _copy_model_grads_to_main_grads(self) -> None:
        # Under the strategy the grads are in its GradBuffer (``main_grad``); hand them to the optimizer.
        if self._grad_buffer is not None:
            for p in self.get_parameters():
                main_grad = self._main_grad_of(p)
                if main_grad is not None:
                    p.grad = main_grad

    def _copy_main_params_to_model_params(self) -> None:
        pass

    def _main_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.get_parameters() if p.grad is not None]

    def _unscale_main_grads(self) -> None:
        """``g *= 1 / scale`` for every main grad. Nothing to do at a constant scale of 1 (bf16), known on the
        host; any other scale multiplies without reading it back (a read waits for the accelerator)."""
        assert self.grad_scaler is not None
        if isinstance(self.grad_scaler, ConstantGradScaler) and self.grad_scaler.constant == 1.0:
            return
        grads = self._main_grads()
        if grads:
            torch._foreach_mul_(grads, self.grad_scaler.inv_scale.to(grads[0].device).reshape(()))

    # -- public API ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (forward + backward) if given, then one Megatron step; return its loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        self._copy_model_grads_to_main_grads()
        if self.grad_scaler is not None:
            self._unscale_main_grads()
        if self.decides_on_device():
            self._step_deciding_on_device()
            return loss
        # One pass over the grads: the norm, and whether any grad on any model-parallel rank is inf/nan
        # (used with a scaler: the step is skipped; without one only the norm is used).
        grad_norm, found_inf = self._grad_norm_and_found_inf()
        if found_inf and self.on_non_finite_grads is not None and not isinstance(self.grad_scaler, DynamicGradScaler):
            self.on_non_finite_grads()
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.last_step_skipped = True
                self.num_skipped_steps += 1
                self.last_grad_norm = None
                self.last_num_zeros = None
                self._release_main_grads()
                return loss

        self.last_grad_norm = grad_norm
        if self.clip_grad > 0.0:
            clip_grads_by_total_norm(self._clip_grads(), self.clip_grad, self.last_grad_norm)
        self.last_num_zeros = self._num_zeros() if self.log_num_zeros_in_grad else None
        self.optimizer.step()
        self._release_main_grads()
        self._copy_main_params_to_model_params()
        self.last_step_skipped = False
        return loss

    def decides_on_device(self) -> bool:
        """Whether a step leaves the skip to the device and reads it once, after the update is queued: the inner
        optimizer is fused (it skips its update where a ``found_inf`` flag on the device is set: torch's
        ``GradScaler`` protocol), no dynamic loss scaler (its update needs the flag on the host first), no zero
        count (a host number before the update), the norm read from :meth:`_norm_totals` (a wrapper that reads
        it another way decides on the host), and the grad buffer does not ask for the host's decision
        (``GradBuffer.decide_on_host``: the CPU tuning's)."""
        return (bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))
                and not (self._grad_buffer is not None and self._grad_buffer.decide_on_host)
                and not isinstance(self.grad_scaler, DynamicGradScaler) and not self.log_num_zeros_in_grad
                and type(self)._grad_norm_and_found_inf is MegatronOptimizer._grad_norm_and_found_inf)

    def _step_deciding_on_device(self) -> None:
        """The step of :meth:`decides_on_device`. A read of a device value waits for all the work queued before
        it: read after the backward (as :meth:`step` does otherwise), it leaves the accelerator idle while the
        host prepares the update; read after the update is queued, that preparation overlaps the backward.

        The norm's two parts and the handed-over loss stay on the device; their non-finite flag skips the
        update in the fused kernel (a constant scaler's skip, the NaN guard's "before anything is updated")
        and makes the clipping coefficient 1; then one read decides on the host what the flag decided there:
        the guard's error, the skipped-step counters, the logged norm. Without a scaler or the guard nothing
        skips, as in :meth:`step`."""
        totals = self._norm_totals()  # [sum of squares counted, sum of the duplicates' norms], fp64
        loss, self.loss_to_check = self.loss_to_check, None
        if loss is not None:
            totals_and_loss = [totals, loss.detach().to(totals.device, totals.dtype).reshape(1)]
        values = totals if loss is None else torch.cat(totals_and_loss)
        skip = ~torch.isfinite(values).all()
        if self.clip_grad > 0.0:
            clip_grads_by_squares(self._clip_grads(), self.clip_grad, totals[0], skip)
        decides = self.grad_scaler is not None or self.on_non_finite_grads is not None or loss is not None
        if decides:
            self.optimizer.found_inf = skip.float()
        try:
            self.optimizer.step()
        finally:
            if decides:
                del self.optimizer.found_inf
        self._release_main_grads()
        self._copy_main_params_to_model_params()
        read = values.tolist()  # the step's one read of the device
        squares, checked = read[0], read[1]
        if loss is not None and not math.isfinite(read[2]) and self.on_non_finite_loss is not None:
            self.on_non_finite_loss(loss, read[2], squares + checked)
        self.last_num_zeros = None
        if not (math.isfinite(squares) and math.isfinite(checked)):
            if self.on_non_finite_grads is not None:
                self.on_non_finite_grads()
            if self.grad_scaler is not None:
                self.last_step_skipped, self.last_grad_norm = True, None
                self.num_skipped_steps += 1
                return
        self.last_grad_norm = squares**0.5
        self.last_step_skipped = False

    def _norm_totals(self) -> torch.Tensor:
        """[sum of the squares this rank counts, sum of the norms of the duplicates it only checks] over every
        rank of the norm's families (:func:`grad_norm_squares`), fp64 on the device: finite exactly when every
        gradient is."""
        piece = None if self._grad_buffer is None else self._grad_buffer.norm_piece
        totals = None
        for counted, others, group in self._norm_grads():
            part = grad_norm_squares(counted, others, group, piece=piece)
            totals = part if totals is None else totals + part
        assert totals is not None
        return totals

    def _norm_grads(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor], Group]]:
        """``(counted, checked only, group)``: this step's gradients by family of :meth:`_norm_plan`. When every one
        is a view of the grad buffer (the strategy's step: each parameter's main grad, the same view every step),
        the views adjacent in the buffer are merged into runs, found once: the norm then squares a few tensors,
        not one per parameter, and no list is built per step."""
        plan = self._norm_plan(self._norm_parameters())
        if self._norm_runs_for is not None and self._norm_runs_for[0] is plan:
            return self._norm_runs_for[1]
        grads = []
        for counted_params, other_params, group in plan:
            counted = [p.grad for p in counted_params if p.grad is not None]
            ids = {id(g) for g in counted}
            others = [p.grad for p in other_params if p.grad is not None and id(p.grad) not in ids]
            grads.append((counted, others, group))
        buffer = self._grad_buffer
        every = [p for params, others, _ in plan for p in params + others]
        if buffer is None or not all(p.grad is not None and buffer.holds(p.grad) and p.grad.is_contiguous()
                                     for p in every):
            return grads
        runs = [(buffer.runs_of(counted), buffer.runs_of(others), group) for counted, others, group in grads]
        self._norm_runs_for = (plan, runs)
        return runs

    def _clip_grads(self) -> list[torch.Tensor]:
        """The gradients clipping scales: those of :meth:`_clip_parameters`; when they are the norm's families, all
        of them views of the grad buffer (:meth:`_norm_grads`), its runs merged once more: a few tensors."""
        if type(self)._clip_parameters is MegatronOptimizer._clip_parameters:
            grads = self._norm_grads()
            if self._norm_runs_for is not None and grads is self._norm_runs_for[1]:
                if self._clip_runs_for is None or self._clip_runs_for[0] is not grads:
                    assert self._grad_buffer is not None
                    self._clip_runs_for = (grads, self._grad_buffer.runs_of(
                        [g for counted, others, _ in grads for g in counted + others]))
                return self._clip_runs_for[1]
        return [p.grad.detach() for p in self._clip_parameters() if p.grad is not None]

    def _norm_plan(self, params: list[torch.Tensor]) -> list[_NormFamily]:
        """``(counted, checked only, group)`` per family of the norm (:meth:`_norm_families`): the parameters whose
        grads this rank counts (:func:`grads_for_norm`'s rule) and the duplicates it only checks. Their records
        do not change between steps: read once for a list of parameters, not every step."""
        key = tuple(map(id, params))
        if self._norm_plan_for is None or self._norm_plan_for[0] != key:
            plan = []
            for family, group in self._norm_families(params):
                counted = [p for p in family if is_counted(p, self.coordinates)]
                ids = {id(p) for p in counted}
                plan.append((counted, [p for p in family if id(p) not in ids], group))
            self._norm_plan_for = (key, plan)
        return self._norm_plan_for[1]

    # Hooks of the step; the DistributedOptimizer overrides them for its flat shards.
    def _norm_parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients the norm sums, each with its records (which ranks count it): the inner
        optimizer's, unless it steps runs of several (the 16-bit wrapper over a grad buffer)."""
        return self.get_parameters()

    def _norm_families(self, params: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], Group]]:
        """``params`` by the group their part of the norm is summed over: the model-parallel group, and the
        experts' own when expert parallelism is on (each expert counted once, on its EP rank)."""
        if self.expert_model_parallel_group is None:
            return [(params, self.model_parallel_group)]
        experts = [p for p in params if param_facts(p).data_parallel == "expert_dp"]
        ids = {id(p) for p in experts}
        return [([p for p in params if id(p) not in ids], self.model_parallel_group),
                (experts, self.expert_model_parallel_group)]

    def _grad_norm_and_found_inf(self) -> tuple[float, bool]:
        """The global L2 norm and whether any main grad on any model-parallel rank is inf/nan: :meth:`_norm_totals`
        read on the host."""
        squares, checked = self._norm_totals().tolist()
        return squares ** 0.5, not (math.isfinite(squares) and math.isfinite(checked))

    def _num_zeros(self) -> int:
        return sum(count_zeros_fp32(params, model_parallel_group=group, coordinates=self.coordinates)
                   for params, group in self._norm_families(self._norm_parameters()))

    def _clip_parameters(self) -> list[torch.Tensor]:
        return self.get_parameters()

    def _release_main_grads(self) -> None:
        """Free what the step no longer needs (nothing here: main grads live until zero_grad)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _scaler_state(self) -> dict[str, Any] | None:
        return None if self.grad_scaler is None else self.grad_scaler.state_dict()

    def _load_scaler_state(self, state: dict[str, Any] | None) -> None:
        if self.grad_scaler is not None and state is not None:
            self.grad_scaler.load_state_dict(state)


class FP32Optimizer(MegatronOptimizer):
    """fp32 model: no main copies; norm, clipping, counters and (optional) overflow skip only.

    ``state_dict() = {"optimizer": inner state, "grad_scaler": scaler state or None}``;
    ``load_state_dict`` also accepts a bare torch optimizer state dict (a checkpoint written
    without this wrapper).
    """

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"optimizer": self.optimizer.state_dict(), "grad_scaler": self._scaler_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        if "optimizer" not in state_dict and "param_groups" in state_dict:
            self.optimizer.load_state_dict(state_dict)
            return
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._load_scaler_state(state_dict.get("grad_scaler"))


def route_non_finite_grads(optimizers: list[Any], params: list[torch.Tensor], raise_error: Callable[[], None],
                           raise_loss_error: Callable[[torch.Tensor, float, float], None] | None = None
                           ) -> tuple[bool, bool]:
    """Hand the NaN guard's gradient check to the optimizers' own pass over the gradients (their norm,
    which finds inf/nan on every rank) instead of a second pass: possible when every optimizer is one of
    our wrappers, with its ``step``, and together they read every one of ``params``. Then each calls
    ``raise_error`` before it updates anything (:attr:`MegatronOptimizer.on_non_finite_grads`); otherwise
    nothing is installed and the caller checks the gradients itself. When moreover every one decides on the
    device (:meth:`MegatronOptimizer.decides_on_device`), the loss's check goes with it too (the caller hands
    each step's loss to :attr:`~MegatronOptimizer.loss_to_check`; ``raise_loss_error`` raises): the step then
    reads the device once, after the update is queued. Returns (gradients routed, loss routed)."""
    if not optimizers or not all(isinstance(o, MegatronOptimizer) and type(o).step is MegatronOptimizer.step
                                 for o in optimizers):
        return False, False
    read = {id(p) for o in optimizers for p in o.model_parameters()}
    if any(id(p) not in read for p in params):
        return False, False
    loss_routed = raise_loss_error is not None and all(o.decides_on_device() for o in optimizers)
    for o in optimizers:
        o.on_non_finite_grads = raise_error
        o.on_non_finite_loss = raise_loss_error if loss_routed else None
    return True, loss_routed
