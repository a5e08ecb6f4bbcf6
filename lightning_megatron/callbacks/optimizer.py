"""MegatronOptimizerCallback: Megatron's mixed-precision optimizer step inside a Lightning Trainer.

The mechanism is :class:`lightning_megatron.optimizer.OptimizerConfig` (which wrapper, which loss
scaler, clipping); this callback carries it into a Trainer and logs the step's gradient norm, loss
scale and skipped steps. Who wraps the optimizers:

- under a strategy that owns the optimizer step (:class:`~lightning_megatron.protocols.WrapsOptimizers`,
  i.e. the :class:`~lightning_megatron.strategy.MegatronStrategy`), the callback hands it the config
  in ``setup`` and the strategy wraps every optimizer right after ``configure_optimizers``, with its
  parallel state and gradient buffer; this module does not import the strategy;
- under any other Lightning strategy (one process, or Lightning's DDP where every rank holds the whole
  model), the callback wraps them itself at ``on_fit_start`` through the public
  ``trainer.strategy.optimizers``, with no model-parallel group.

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

import dataclasses
import math

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_megatron.optimizer.config import OptimizerConfig, gradient_clip_val_problem
from lightning_megatron.optimizer.mixed_precision import MegatronOptimizer
from lightning_megatron.protocols import PlainOptimizer, WrapsOptimizers, optimizer_wrapper
from lightning_megatron.callbacks.scheduler import OptimizerParamSchedulerCallback

__all__ = ["MegatronOptimizerCallback"]


class MegatronOptimizerCallback(Callback):
    """fp32 main params, loss scaling with overflow skip, and model-parallel gradient clipping.

    Args:
        config: :class:`~lightning_megatron.optimizer.OptimizerConfig` (Megatron's names: ``clip_grad``,
            ``loss_scale``, ``initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window``,
            ``hysteresis``, ``log_num_zeros_in_grad``, ``use_distributed_optimizer``); None: its
            defaults. In a recipe, the ``megatron_optimizer:`` section holds these fields. (The NaN/Inf
            guard is the MegatronStrategy's training step, with or without this callback.)

    Logged every training batch (rank zero): ``grad_norm`` (nan on a skipped step), ``loss_scale``,
    ``skipped_steps`` and ``num_zeros`` if enabled; with several optimizers, names of optimizer
    ``i > 0`` get the suffix ``_{i}``.
    """

    def __init__(self, config: OptimizerConfig | None = None) -> None:
        if config is not None and not isinstance(config, OptimizerConfig):
            raise TypeError(f"MegatronOptimizerCallback(config=...) takes an OptimizerConfig, got "
                            f"{type(config).__name__}; write MegatronOptimizerCallback(OptimizerConfig(clip_grad=...))")
        self.config = config if config is not None else OptimizerConfig()
        self._step_lr_wd: tuple[float, float] | None = None
        """(lr, weight decay) of this batch's optimizer step, logged when no schedule callback logs them."""

    def run_settings(self) -> dict[str, Any]:
        """The OptimizerConfig's fields: what every rank of a run must have been given (the strategy compares them)."""
        return dataclasses.asdict(self.config)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and isinstance(trainer.strategy, WrapsOptimizers):
            trainer.strategy.set_optimizer_config(self.config)  # it wraps after configure_optimizers

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy, WrapsOptimizers):
            return  # wrapped by the strategy in its setup
        problem = gradient_clip_val_problem(trainer.gradient_clip_val)
        if problem is not None:
            raise ValueError(f"MegatronOptimizerCallback: {problem}")
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "the Trainer's precision plugin already scales the loss (torch GradScaler); use "
                "precision='bf16-true'/'16-true' or '32-true' with MegatronOptimizerCallback, which does the scaling"
            )
        wrapped = [self.config.wrap(opt) for opt in trainer.strategy.optimizers]
        needs_scaled_loss = any(
            opt.grad_scaler is not None and float(opt.grad_scaler.scale.item()) != 1.0 for opt in wrapped
        )
        module_scales = type(pl_module).backward is not pl.LightningModule.backward
        if needs_scaled_loss and not module_scales:
            raise ValueError(
                "loss scaling (fp16 parameters or loss_scale != 1) needs the loss multiplied by the scale "
                "before backward: use the MegatronStrategy, or override LightningModule.backward as "
                "`self.trainer.strategy.optimizers[0].scale_loss(loss).backward()`; or set loss_scale=1.0"
            )
        trainer.strategy.optimizers = wrapped

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Every OptimizerWrapper (ours, or one of your own); a plain torch optimizer has nothing to log.
        wrapped = [w for w in map(optimizer_wrapper, trainer.optimizers) if not isinstance(w, PlainOptimizer)]
        for i, opt in enumerate(wrapped):
            suffix = "" if i == 0 else f"_{i}"
            metrics: dict[str, float | torch.Tensor] = {
                # a tensor: Lightning reads it when it writes the logs, not every step (no host sync)
                f"loss_scale{suffix}": 1.0 if opt.grad_scaler is None else opt.grad_scaler.scale.detach().float(),
                f"skipped_steps{suffix}": float(opt.num_skipped_steps),
            }
            # A skipped step has no norm: nan (not logged, Lightning would write the step before's again)
            skipped = bool(opt.last_step_skipped)
            if opt.last_grad_norm is not None or skipped:
                metrics[f"grad_norm{suffix}"] = math.nan if opt.last_grad_norm is None else opt.last_grad_norm
            if self.config.log_num_zeros_in_grad and isinstance(opt, MegatronOptimizer) and (
                    opt.last_num_zeros is not None or skipped):
                metrics[f"num_zeros{suffix}"] = math.nan if opt.last_num_zeros is None else float(opt.last_num_zeros)
            for name, value in metrics.items():
                pl_module.log(name, value, on_step=True, on_epoch=False, rank_zero_only=True)
        if self._step_lr_wd is not None:
            lr, wd = self._step_lr_wd
            pl_module.log("lr", lr, on_step=True, on_epoch=False, rank_zero_only=True)
            pl_module.log("wd", wd, on_step=True, on_epoch=False, rank_zero_only=True)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # Without the schedule callback, which logs them (a torch --lr_scheduler, or a constant lr): the lr and
        # weight decay this batch's optimizer step uses, read before Lightning steps a torch scheduler after it,
        # before the groups' lr_mult / wd_mult, as the schedule callback logs them.
        self._step_lr_wd = None
        if trainer.optimizers and not any(isinstance(cb, OptimizerParamSchedulerCallback) for cb in trainer.callbacks):
            groups = trainer.optimizers[0].param_groups
            base = next((g for g in groups if g.get("lr_mult", 1.0) == 1.0), groups[0])
            decayed = next((g for g in groups if g.get("wd_mult", 1.0) != 0.0), None)
            wd = 0.0 if decayed is None else decayed.get("weight_decay", 0.0) / decayed.get("wd_mult", 1.0)
            self._step_lr_wd = (float(base["lr"]), float(wd))
