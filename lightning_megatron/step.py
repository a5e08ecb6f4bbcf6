"""One step of the strategy: a batch's microbatches through the schedule, for every stage.

Training, validation, test and prediction take the same path (:meth:`StepRunner.run`):

1. split this data-parallel rank's batch into microbatches of ``micro_batch_size``;
2. run the strategy's named schedule (:mod:`lightning_megatron.pipeline.registry`: no pipelining,
   1F1B, interleaved 1F1B, or a registered one) over this rank's model chunks with the module's
   ``forward_step``; when training, backward runs inside it (the loss of each microbatch scaled by the
   loss scale and divided by the number of microbatches) through the step's
   :class:`~lightning_megatron.tensor_parallel.backward.WeightGradPolicy`, and the gradients
   accumulate into the :class:`~lightning_megatron.grads.GradBuffer`; the weight gradients the policy
   deferred are computed after the schedule (``backward_weight``: the pipeline flush). Before it, a
   module's optional ``start_step(microbatches)`` sees the step's microbatches (a per-token loss counts
   the global batch's tokens there);
3. training: :func:`~lightning_megatron.grads.finalize_model_grads` (DP reduction, sequence-parallel
   and tied-embedding sums);
4. the metrics the loss function logged: mean over microbatches (last stage) and DP (weighted by the
   ``num_tokens`` it counts when evaluating or with a per-token loss; else microbatches without any left out),
   broadcast along the pipeline, so every rank logs the same values; or, when predicting, the
   microbatches' ``predictions`` concatenated (last stage; ``None`` on the others);
5. training, with ``check_for_nan_in_loss_and_grad`` (megatron-core's option, on by default): THE
   NaN/Inf guard of a training step, whatever optimizer (wrapper or plain torch optimizer) steps
   next. A non-finite loss or gradient anywhere raises :class:`NonFiniteLossOrGradError` on every
   rank before the optimizer updates anything, naming the step and the first parameter with a
   non-finite gradient (gathered from the rank that holds it); an fp16 overflow with a finite loss is
   not an error when the optimizer's dynamic loss scaler skips it. The gradients are read here, or,
   when the strategy's optimizers are our wrappers and read every gradient, by the wrapper's norm,
   whose step raises the same error through :meth:`StepRunner.non_finite_grads` (one pass, not two).

No Lightning here: the strategy passes what this needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron.grads import GradBuffer, finalize_model_grads
from lightning_megatron.transformer.moe import aux_loss_scale
from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.pipeline.microbatches import split_microbatches
from lightning_megatron.pipeline.registry import PipelineSchedule
from lightning_megatron.protocols import LightningStepsModule, MegatronModule
from lightning_megatron.replica_check import check_replicated_grads
from lightning_megatron.tensor_parallel.backward import WeightGradPolicy
from lightning_megatron.tensor_parallel.mappings import all_reduce

__all__ = ["BatchSizes", "NonFiniteLossOrGradError", "StepRunner", "batch_size_problem"]


class NonFiniteLossOrGradError(FloatingPointError):
    """A NaN/Inf loss or gradient in a training step with ``check_for_nan_in_loss_and_grad``: raised on
    every rank before the optimizer step, so no parameter, optimizer state or checkpoint holds that state."""


def batch_size_problem(micro_batch_size: int | None, global_batch_size: int | None,
                       data_parallel_size: int) -> str | None:
    """The rule ``global = micro x num_microbatches x dp``: the one validator :class:`BatchSizes` (at
    set-up) and ``config_checks`` (before launch) call; None when it holds or a size is unknown."""
    micro, glob, dp = micro_batch_size, global_batch_size, data_parallel_size
    if micro is not None and glob is not None and glob % (micro * dp) != 0:
        return (f"global_batch_size={glob} is not divisible by micro_batch_size={micro} x data-parallel "
                f"size={dp} (= {micro * dp}); choose a global batch that is a multiple of it")
    return None


@dataclass(frozen=True, kw_only=True)
class BatchSizes:
    """``global_batch_size = micro_batch_size x num_microbatches x data_parallel_size``."""

    micro_batch_size: int | None
    """Samples per microbatch on one rank; None: the whole per-rank batch is one microbatch."""
    global_batch_size: int | None
    """Samples per optimizer step over all data-parallel ranks; None when unknown (not checked)."""
    data_parallel_size: int = 1
    """Number of model replicas."""

    def __post_init__(self) -> None:
        micro, glob, dp = self.micro_batch_size, self.global_batch_size, self.data_parallel_size
        for name, value in (("micro_batch_size", micro), ("global_batch_size", glob)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        problem = batch_size_problem(micro, glob, dp)
        if problem:
            raise ValueError(problem)

    @property
    def num_microbatches(self) -> int | None:
        """Microbatches per step on each rank (None when a size is unknown)."""
        if self.micro_batch_size is None or self.global_batch_size is None:
            return None
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)


class StepRunner:
    """Runs the microbatches of a step through ``module``'s chunks under ``parallel_state`` with
    ``schedule`` (:func:`lightning_megatron.pipeline.get_schedule`). ``named_parameters``: the
    module's ``(name, parameter)`` pairs in its order, for the NaN guard's message."""

    def __init__(self, parallel_state: ParallelState, module: MegatronModule, *, schedule: PipelineSchedule,
                 micro_batch_size: int | None, device: torch.device, overlap_p2p_comm: bool = False,
                 check_for_nan_in_loss_and_grad: bool = True, check_replicated_grads: bool = True,
                 named_parameters: Sequence[tuple[str, torch.nn.Parameter]] = ()) -> None:
        self.ps = parallel_state
        self.check_for_nan_in_loss_and_grad = check_for_nan_in_loss_and_grad
        """Stop on a NaN/Inf loss or gradient before the optimizer step (megatron-core's option)."""
        self.named_parameters = list(named_parameters)
        self.schedule = schedule
        self.overlap_p2p_comm = overlap_p2p_comm
        self.module = module
        self.weight_grads = WeightGradPolicy.for_chunks(list(module.model_chunks))
        """Which layers defer their weight gradient, and the backward primitives of a training step
        (set up by the model's ``defer_embedding_wgrad_compute``, the schedule and the CPU tuning)."""
        schedule.configure_weight_grads(self.weight_grads, list(module.model_chunks))
        self.micro_batch_size = micro_batch_size
        self.device = device
        self._replicas_checked = not check_replicated_grads
        """Whether the TP-replicated parameters' gradients were compared over TP (at the first training step:
        :func:`~lightning_megatron.replica_check.check_replicated_grads`), or are not to be."""
        self._logged_keys: dict[str, list[str]] = {}  # per stage: metric names known on every pipeline rank
        self.per_token_loss = bool(getattr(module, "calculate_per_token_loss", False))
        """The module's training loss is the mean over the global batch's tokens: logged so too."""

    def run(self, batch: Any, batch_idx: int, stage: str, *, grad_buffer: GradBuffer | None = None,
            grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None, trace: list | None = None,
            iteration: int | None = None, overflow_is_skipped: bool = False,
            grads_checked_by_optimizer: bool = False, loss_checked_by_optimizer: bool = False) -> Any:
        """One step. ``stage``: ``train`` (needs ``grad_buffer``), ``val``, ``test`` -> the logged
        means ``{name: scalar tensor}``; ``predict`` -> the batch's predictions. ``trace``: a list
        that receives the schedule's events (:class:`~lightning_megatron.pipeline.schedules.ScheduleEvent`).
        Training: ``iteration`` is the step the NaN guard's message names; ``overflow_is_skipped``: the
        optimizer's dynamic loss scaler skips a step whose gradients overflowed (fp16), so non-finite
        gradients with a finite loss are its business, not an error. ``grads_checked_by_optimizer`` /
        ``loss_checked_by_optimizer``: the optimizer's step checks the gradients / the loss (handed to it by
        the strategy) instead (:func:`~lightning_megatron.optimizer.mixed_precision.route_non_finite_grads`)."""
        ps = self.ps
        forward_only = stage != "train"
        microbatches = split_microbatches(batch, self.micro_batch_size)
        self.schedule.validate(ps.pp_size, ps.vp_size, len(microbatches))
        if isinstance(self.module, LightningStepsModule):
            self.module.batch_idx = batch_idx
        chunks = list(self.module.model_chunks)
        tensor_shape: tuple[int, ...] = ()
        if ps.pp_size > 1:
            tensor_shape = tuple(self.module.pipeline_tensor_shape(microbatches[0]))
        run = dict(forward_step_func=self.module.forward_step, microbatches=microbatches, model=chunks,
                   num_microbatches=len(microbatches), parallel_state=ps, tensor_shape=tensor_shape,
                   dtype=next(chunks[0].parameters()).dtype, forward_only=forward_only,
                   grad_scale_func=grad_scale_func, trace=trace, overlap_p2p_comm=self.overlap_p2p_comm)
        if forward_only:
            logged = self.schedule.run(**run)
        else:
            assert grad_buffer is not None, "training needs the strategy's grad buffer"
            grad_buffer.start(len(microbatches))
            start_step = getattr(self.module, "start_step", None)
            if start_step is not None:  # e.g. a per-token loss counting the global batch's tokens
                start_step(microbatches)
            # Auxiliary losses added inside the model (MoE load balancing) get the loss's backward scale.
            one = torch.ones((), device=self.device)
            scale = (one if grad_scale_func is None else grad_scale_func(one)) / len(microbatches)
            with self.weight_grads.step(grad_buffer.add_grad, grad_buffer.add_grad_rows), aux_loss_scale(scale):
                logged = self.schedule.run(**run, weight_grads=self.weight_grads)
                # The pipeline flush: the weight gradients still deferred (the last stage's, while the
                # earlier stages run their last backward passes).
                self.weight_grads.backward_weight()
            finalize_model_grads(grad_buffer, ps)
            if not self._replicas_checked:
                self._replicas_checked = check_replicated_grads(
                    grad_buffer.params, ps, lambda: {id(p): name for name, p in self.named_parameters},
                    grad_buffer.data.device)
        if stage == "predict":
            return self._predictions(logged)
        means = self._reduce_logged(logged, stage)
        step_metrics = getattr(self.module, "step_metrics", None)
        if not forward_only and step_metrics is not None:
            means.update(step_metrics(len(microbatches)))
        if not forward_only and self.check_for_nan_in_loss_and_grad and not loss_checked_by_optimizer:
            self._check_finite(grad_buffer, means.get("loss"), iteration, overflow_is_skipped,
                               grads=not grads_checked_by_optimizer)
        return means

    def _check_finite(self, buffer: GradBuffer, loss: torch.Tensor | None, iteration: int | None,
                      overflow_is_skipped: bool, grads: bool = True) -> None:
        """Raise :class:`NonFiniteLossOrGradError` on every rank when the loss or any gradient of any rank
        is NaN/Inf (after :func:`finalize_model_grads`, before any optimizer reads the gradients).

        One pass over this rank's fp32 grad buffer: its smallest and largest element (``aminmax``, one
        reduction that allocates nothing; a NaN makes both NaN, an inf is the largest or the smallest, so
        both are finite exactly when every element is), the loss (the same on every rank: reduced over
        DP, broadcast along the pipeline) beside them in fp64, one SUM all-reduce over the world (fp64
        sums of finite fp32 values cannot overflow) and one read on the host. Only a failing step does
        more: it finds and gathers the parameter to name. (A sum of the buffer in fp64, the check before,
        casts the whole buffer into a new fp64 tensor first on CPU: at bert-base 95 ms and 842 MiB of peak
        memory a step, against 28 ms and none; docs/reliability.md.)

        ``grads=False`` when the optimizer's own pass over the gradients (its norm, which finds inf/nan on
        any rank) raises through :meth:`non_finite_grads` instead: then only the loss is checked here, and a
        non-finite loss still checks the gradients, for the message.
        """
        device = buffer.data.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        loss_value = zero if loss is None else loss.detach().to(device, torch.float64).reshape(())
        if not grads:
            if bool(torch.isfinite(loss_value)):  # the same on every rank: every rank decides alike
                return
            grads = True
        low, high = torch.aminmax(buffer.data) if buffer.data.numel() else (zero, zero)
        values = torch.stack([low.to(torch.float64), high.to(torch.float64), loss_value])
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(values)  # a NaN/Inf on any rank makes the sum non-finite on every rank
        low_sum, high_sum, loss_sum = values.tolist()
        grad_sum = low_sum + high_sum  # non-finite exactly when one of them is (-inf + inf is nan)
        if math.isfinite(grad_sum) and math.isfinite(loss_sum):
            return
        if math.isfinite(loss_sum) and overflow_is_skipped:
            return  # an fp16 overflow: the dynamic loss scaler skips the step and backs off
        self._raise_non_finite(buffer, loss, loss_sum, grad_sum, iteration)

    def non_finite_grads(self, buffer: GradBuffer, iteration: int | None) -> None:
        """The guard's error when the optimizer's pass found an inf/nan gradient on some rank (every rank
        calls it: the optimizer's check reduces over every rank's gradients): the parameter named, raised
        before anything is updated (``MegatronOptimizer.on_non_finite_grads``)."""
        self._raise_non_finite(buffer, None, 0.0, math.nan, iteration)

    def non_finite_loss(self, buffer: GradBuffer, loss: torch.Tensor, loss_sum: float, grad_sum: float,
                        iteration: int | None) -> None:
        """The guard's error when the optimizer's step found the loss handed to it not finite (it reads the loss
        with the gradients, after queueing an update the non-finite flag skips: nothing was updated)."""
        self._raise_non_finite(buffer, loss, loss_sum, grad_sum, iteration)

    def _raise_non_finite(self, buffer: GradBuffer, loss: torch.Tensor | None, loss_sum: float, grad_sum: float,
                          iteration: int | None) -> None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        named = self.named_parameters or [(f"<parameter {i} of shape {tuple(p.shape)}>", p)
                                          for i, p in enumerate(buffer.params)]
        mine = next(((name, "nan" if bool(torch.isnan(g).any()) else "inf") for name, p in named
                     if (g := buffer.main_grad_of(p)) is not None and not bool(torch.isfinite(g).all())), None)
        rank = dist.get_rank() if world > 1 else 0
        found = [(rank, mine)]
        if world > 1:
            found = [None] * world
            dist.all_gather_object(found, (rank, mine))
        first = next(((r, name_kind) for r, name_kind in found if name_kind), None)
        what = [] if math.isfinite(loss_sum) else [f"the loss is {loss.detach().float().reshape(()).item()}"]
        if not math.isfinite(grad_sum):
            what.append(f"the gradient is not finite ({first[1][1] if first else 'nan'})")
        where = ("no gradient is non-finite (only the loss is)" if first is None
                 else f"first parameter with a non-finite gradient on rank {first[0]}: {first[1][0]}")
        step = "" if iteration is None else (f"at step {iteration} (the state at global_step={iteration} is the "
                                             f"last good one) ")
        raise NonFiniteLossOrGradError(
            f"{step}{' and '.join(what)}; {where}. The run stops before the optimizer step: parameters, optimizer "
            f"state and checkpoints keep the last good step (resume from the last checkpoint with another lr, data "
            f"or seed). MegatronStrategy(check_for_nan_in_loss_and_grad=False) (--trainer.strategy.init_args."
            f"check_for_nan_in_loss_and_grad false) turns this check off")

    def _predictions(self, logged: list[dict[str, Any]]) -> Any:
        # Predictions live on the last pipeline stage. Tensors (and dicts of tensors, key by key) are
        # concatenated over the microbatches; one microbatch's prediction is returned as it is.
        if not self.ps.is_pipeline_last_stage():
            return None
        predictions = [d.get("predictions") for d in logged]
        if len(predictions) == 1:
            return predictions[0]
        if predictions and all(torch.is_tensor(p) for p in predictions):
            return torch.cat(predictions)
        if predictions and all(isinstance(p, dict) and all(torch.is_tensor(v) for v in p.values())
                               for p in predictions):
            return {k: torch.cat([p[k] for p in predictions]) for k in predictions[0]}
        return predictions

    def _reduce_logged(self, logged: list[dict[str, Any]], stage: str) -> dict[str, torch.Tensor]:
        """Mean over microbatches (last stage) and DP ranks, then broadcast along the pipeline. A loss function
        that logs ``num_tokens`` (the tokens its loss averages) has each microbatch weighted by its tokens when
        evaluating or where the module's ``calculate_per_token_loss`` is true; else (a training loss of microbatch
        means) its microbatches without any left out. ``num_tokens`` is then the step's total.

        The pipeline broadcast is one tensor op (no host sync): the metric names are sent as objects
        only on the first step of ``stage``; a loss function whose names change later is refused.
        """
        ps = self.ps
        keys: list[str] = []
        values: torch.Tensor | None = None
        if ps.is_pipeline_last_stage() and logged:
            keys = sorted(k for k, v in logged[0].items() if torch.is_tensor(v) and v.numel() == 1)
        if keys:  # a loss function may log nothing per step (fine-tuning's evaluation logs per epoch)
            stacked = torch.stack([torch.stack([d[k].detach().float().reshape(()) for k in keys]) for d in logged])
            weights = torch.ones(len(logged), device=stacked.device)
            extra = [weights.sum()]
            if "num_tokens" in keys:
                # Evaluation and a loss per token (the module's calculate_per_token_loss) weigh each microbatch by
                # its tokens: the mean over the tokens of the step, whatever microbatches hold them. A training
                # loss of microbatch means averages those, leaving out a microbatch that counted no token (it has
                # no loss to report). num_tokens itself is the step's count, summed.
                counted = stacked[:, keys.index("num_tokens")]
                by_tokens = stage != "train" or self.per_token_loss
                weights = counted if by_tokens else (counted > 0).float()
                extra = [weights.sum(), counted.sum()]
            packed = torch.cat([(stacked * weights[:, None]).sum(dim=0), torch.stack(extra)])
            if ps.dp_size > 1:
                all_reduce(packed, ps.group("dp"))
            values = packed[:len(keys)] / packed[len(keys)].clamp(min=1.0)
            if "num_tokens" in keys:
                values[keys.index("num_tokens")] = packed[-1]
        if ps.pp_size > 1:
            keys, values = self._broadcast_logged(keys, values, stage)
        return {} if values is None else dict(zip(keys, values.unbind(0)))

    def _broadcast_logged(self, keys: list[str], values: torch.Tensor | None, stage: str
                          ) -> tuple[list[str], torch.Tensor | None]:
        ps = self.ps
        src, last = ps.pp_ranks[-1], ps.is_pipeline_last_stage()
        cached = self._logged_keys.get(stage)
        if cached is None:  # first step of this stage: every pipeline rank learns the names
            holder = [keys if last else None]
            dist.broadcast_object_list(holder, src=src, group=ps.pp_group)
            cached = self._logged_keys[stage] = list(holder[0])
        if not cached:
            return [], None
        if last and keys != cached:
            # Still send (NaN) so that the other stages do not wait, then refuse.
            dist.broadcast(torch.full((len(cached),), float("nan"), dtype=torch.float32, device=self.device), src=src,
                           group=ps.pp_group)
            raise ValueError(f"MegatronStrategy: the {stage} loss function returned the metrics {keys} after "
                             f"{cached} in an earlier step; with pipeline parallelism every step must log the "
                             f"same metric names")
        # fp32 on every stage, whatever default dtype the precision plugin's context set (bf16-true sets bf16)
        buf = (values.to(self.device, torch.float32) if last and values is not None
               else torch.empty(len(cached), dtype=torch.float32, device=self.device))
        dist.broadcast(buf, src=src, group=ps.pp_group)
        return list(cached), buf
