"""MegatronOptimizerCallback: Megatron's mixed-precision optimizer step inside a Lightning Trainer.

At ``on_fit_start`` every optimizer returned by ``configure_optimizers`` is wrapped, in place in
``trainer.strategy.optimizers``:

- bf16/fp16 parameters -> :class:`Float16OptimizerWithFloat16Params` (fp32 main params);
- fp32 parameters -> :class:`FP32Optimizer` (clipping and logging only).

Lightning restores optimizer state after ``on_fit_start``, so a resumed run loads the checkpoint
through the wrapper's ``load_state_dict`` (main params and scaler state included). The wrapper is a
``torch.optim.Optimizer`` sharing its inner optimizer's ``param_groups``: LR schedulers returned
from ``configure_optimizers`` keep working.

Loss scaling acts on ``backward``, which Lightning runs inside the optimizer closure; the callback
cannot reach it without patching Lightning. So a scale other than 1 needs someone to multiply the
loss: the MegatronStrategy's microbatch schedule (``optimizer.scale_loss``), or a LightningModule
that overrides ``backward`` to do so. Without either, fp16 with loss scaling is refused.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_megatron.optimizer.distrib_optimizer import DistributedOptimizer
from lightning_megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from lightning_megatron.optimizer.mixed_precision import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
)

__all__ = ["MegatronOptimizerCallback"]


class MegatronOptimizerCallback(Callback):
    """fp32 main params, loss scaling with overflow skip, and model-parallel gradient clipping.

    Args (Megatron's flag names):
        clip_grad: max global L2 norm of the gradients; 0 disables clipping (the norm is still logged).
        loss_scale: ``None`` = dynamic scaling for fp16 parameters; a float = that constant scale.
            bf16 parameters run at scale 1 unless a float is given (inf/nan steps are still skipped).
        initial_loss_scale: starting scale of the dynamic scaler.
        min_loss_scale: the dynamic scale never goes below this.
        loss_scale_window: clean steps before the dynamic scale doubles (``growth_interval``).
        hysteresis: overflows tolerated before the dynamic scale halves.
        log_num_zeros_in_grad: also count and log the zero entries of the gradient.
        use_distributed_optimizer: shard the fp32 main params and optimizer state over the
            data-parallel group (Megatron's DistributedOptimizer, ZeRO stage 1): grads are
            reduce-scattered instead of all-reduced, updated params all-gathered.

    Logged every training batch (rank zero): ``grad_norm`` (not on skipped steps), ``loss_scale``,
    ``skipped_steps`` and ``num_zeros`` if enabled; with several optimizers, names of optimizer
    ``i > 0`` get the suffix ``_{i}``.
    """

    def __init__(
        self,
        clip_grad: float = 1.0,
        loss_scale: float | None = None,
        initial_loss_scale: float = 2.0**32,
        min_loss_scale: float = 1.0,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        log_num_zeros_in_grad: bool = False,
        use_distributed_optimizer: bool = False,
    ) -> None:
        if clip_grad < 0:
            raise ValueError(f"clip_grad={clip_grad!r} must be >= 0 (0 disables clipping)")
        if loss_scale is not None and not loss_scale > 0:
            raise ValueError(f"loss_scale={loss_scale!r} must be > 0, or None for dynamic loss scaling")
        self.clip_grad = clip_grad
        self.loss_scale = loss_scale
        self.initial_loss_scale = initial_loss_scale
        self.min_loss_scale = min_loss_scale
        self.loss_scale_window = loss_scale_window
        self.hysteresis = hysteresis
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.use_distributed_optimizer = use_distributed_optimizer
        # Validate the dynamic scaler's arguments now rather than at fit time.
        if loss_scale is None:
            self._make_scaler(torch.float16)
        self.optimizers: list[MegatronOptimizer] = []

    def _make_scaler(self, dtype: torch.dtype) -> MegatronGradScaler | None:
        if self.loss_scale is not None:
            return ConstantGradScaler(self.loss_scale)
        if dtype == torch.float16:
            return DynamicGradScaler(
                initial_scale=self.initial_loss_scale,
                min_scale=self.min_loss_scale,
                growth_factor=2.0,
                backoff_factor=0.5,
                growth_interval=self.loss_scale_window,
                hysteresis=self.hysteresis,
            )
        if dtype == torch.bfloat16:
            return ConstantGradScaler(1.0)  # no scaling, but inf/nan steps are skipped
        return None

    def _wrap(self, optimizer: torch.optim.Optimizer, trainer: pl.Trainer) -> MegatronOptimizer:
        if isinstance(optimizer, MegatronOptimizer):
            return optimizer
        ps = getattr(trainer.strategy, "parallel_state", None)
        kwargs: dict[str, Any] = dict(
            clip_grad=self.clip_grad,
            log_num_zeros_in_grad=self.log_num_zeros_in_grad,
            model_parallel_group=None if ps is None else ps.mp_group,
            tp_rank=0 if ps is None else ps.tp_rank,
            pp_rank=0 if ps is None else ps.pp_rank,
        )
        dtypes = {p.dtype for group in optimizer.param_groups for p in group["params"]}
        if self.use_distributed_optimizer:
            low = next((d for d in (torch.float16, torch.bfloat16) if d in dtypes), torch.float32)
            scaler = self._make_scaler(low) if low != torch.float32 else (
                None if self.loss_scale is None else ConstantGradScaler(self.loss_scale))
            return DistributedOptimizer(optimizer, grad_scaler=scaler,
                                        data_parallel_group=None if ps is None else ps.dp_group,
                                        grad_buffer=getattr(trainer.strategy, "grad_buffer", None), **kwargs)
        if torch.float16 in dtypes or torch.bfloat16 in dtypes:
            low = torch.float16 if torch.float16 in dtypes else torch.bfloat16
            return Float16OptimizerWithFloat16Params(optimizer, grad_scaler=self._make_scaler(low), **kwargs)
        return FP32Optimizer(
            optimizer,
            grad_scaler=None if self.loss_scale is None else ConstantGradScaler(self.loss_scale),
            **kwargs,
        )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.gradient_clip_val is not None:
            raise ValueError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips per rank and would clip a second "
                "time; remove it and set MegatronOptimizerCallback(clip_grad=...) instead, which clips by the "
                "global norm over all model-parallel ranks"
            )
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "the Trainer's precision plugin already scales the loss (torch GradScaler); use "
                "precision='bf16-true'/'16-true' or '32-true' with MegatronOptimizerCallback, which does the scaling"
            )
        wrapped = [self._wrap(opt, trainer) for opt in trainer.strategy.optimizers]
        needs_scaled_loss = any(
            opt.grad_scaler is not None and float(opt.grad_scaler.scale.item()) != 1.0 for opt in wrapped
        )
        module_scales = type(pl_module).backward is not pl.LightningModule.backward
        strategy_scales = hasattr(trainer.strategy, "parallel_state")
        if needs_scaled_loss and not (module_scales or strategy_scales):
            raise ValueError(
                "loss scaling (fp16 parameters or loss_scale != 1) needs the loss multiplied by the scale "
                "before backward: use the MegatronStrategy, or override LightningModule.backward as "
                "`self.trainer.strategy.optimizers[0].scale_loss(loss).backward()`; or set loss_scale=1.0"
            )
        trainer.strategy.optimizers = wrapped
        self.optimizers = wrapped

    def get_loss_scale(self, optimizer_idx: int = 0) -> torch.Tensor:
        """The loss scale the schedule multiplies the loss by before ``backward``."""
        return self.optimizers[optimizer_idx].get_loss_scale()

    def scale_loss(self, loss: torch.Tensor, optimizer_idx: int = 0) -> torch.Tensor:
        """``loss * loss_scale`` in fp32, for the schedule to call before ``backward``."""
        return self.optimizers[optimizer_idx].scale_loss(loss)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for i, opt in enumerate(self.optimizers):
            suffix = "" if i == 0 else f"_{i}"
            metrics: dict[str, float | torch.Tensor] = {
                # a tensor: Lightning reads it when it writes the logs, not every step (no host sync)
                f"loss_scale{suffix}": opt.get_loss_scale().detach().float(),
                f"skipped_steps{suffix}": float(opt.num_skipped_steps),
            }
            if opt.last_grad_norm is not None:
                metrics[f"grad_norm{suffix}"] = opt.last_grad_norm
            if self.log_num_zeros_in_grad and opt.last_num_zeros is not None:
                metrics[f"num_zeros{suffix}"] = float(opt.last_num_zeros)
            for name, value in metrics.items():
                pl_module.log(name, value, on_step=True, on_epoch=False, rank_zero_only=True)
