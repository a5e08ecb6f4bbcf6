"""MegatronOptimizerCallback: Megatron's mixed-precision optimizer step inside a Lightning Trainer.

The mechanism is :class:`lightning_megatron.optimizer.OptimizerConfig` (which wrapper, which loss
scaler); this callback connects it to the Trainer: at ``on_fit_start`` every optimizer returned by
``configure_optimizers`` is wrapped in place in ``trainer.strategy.optimizers``, and the step's
gradient norm, loss scale and skipped steps are logged.

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

from lightning_megatron.optimizer.config import OptimizerConfig
from lightning_megatron.optimizer.mixed_precision import MegatronOptimizer

__all__ = ["MegatronOptimizerCallback"]


class MegatronOptimizerCallback(Callback):
    """fp32 main params, loss scaling with overflow skip, and model-parallel gradient clipping.

    Args: the fields of :class:`~lightning_megatron.optimizer.OptimizerConfig` (Megatron's names):
    ``clip_grad``, ``loss_scale``, ``initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window``,
    ``hysteresis``, ``log_num_zeros_in_grad``, ``use_distributed_optimizer``,
    ``check_for_nan_in_loss_and_grad`` (on: a NaN/Inf loss or gradient norm stops the run with an error
    naming the step and the first parameter with a non-finite gradient, before the optimizer step; an
    fp16 overflow that the dynamic loss scaler skips is not an error).

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
        check_for_nan_in_loss_and_grad: bool = True,
    ) -> None:
        self.config = OptimizerConfig(
            clip_grad=clip_grad, loss_scale=loss_scale, initial_loss_scale=initial_loss_scale,
            min_loss_scale=min_loss_scale, loss_scale_window=loss_scale_window, hysteresis=hysteresis,
            log_num_zeros_in_grad=log_num_zeros_in_grad, use_distributed_optimizer=use_distributed_optimizer,
            check_for_nan_in_loss_and_grad=check_for_nan_in_loss_and_grad)
        self.optimizers: list[MegatronOptimizer] = []

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
        from lightning_megatron.strategy import MegatronStrategy

        strategy = trainer.strategy
        under_megatron = isinstance(strategy, MegatronStrategy)
        wrapped = [self.config.wrap(opt, parallel_state=strategy.parallel_state if under_megatron else None,
                                    grad_buffer=strategy.grad_buffer if under_megatron else None)
                   for opt in strategy.optimizers]
        needs_scaled_loss = any(
            opt.grad_scaler is not None and float(opt.grad_scaler.scale.item()) != 1.0 for opt in wrapped
        )
        module_scales = type(pl_module).backward is not pl.LightningModule.backward
        if needs_scaled_loss and not (module_scales or under_megatron):
            raise ValueError(
                "loss scaling (fp16 parameters or loss_scale != 1) needs the loss multiplied by the scale "
                "before backward: use the MegatronStrategy, or override LightningModule.backward as "
                "`self.trainer.strategy.optimizers[0].scale_loss(loss).backward()`; or set loss_scale=1.0"
            )
        named = strategy.module_contract.sharded_named_parameters() if under_megatron else pl_module.named_parameters()
        named = list(named)
        for opt in wrapped:
            opt.name_parameters(named)  # errors name parameters
        trainer.strategy.optimizers = wrapped
        self.optimizers = wrapped

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        for opt in self.optimizers:
            opt.iteration = trainer.global_step  # the step an error names

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
            if self.config.log_num_zeros_in_grad and opt.last_num_zeros is not None:
                metrics[f"num_zeros{suffix}"] = float(opt.last_num_zeros)
            for name, value in metrics.items():
                pl_module.log(name, value, on_step=True, on_epoch=False, rank_zero_only=True)
