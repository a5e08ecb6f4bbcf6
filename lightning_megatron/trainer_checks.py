"""Trainer flags and Lightning callbacks that MegatronStrategy cannot honour with the recipes: said before launch
(:func:`lightning_megatron.config_checks.check_config`) and, for callbacks built in Python, at set-up
(:func:`lightning_megatron.setup_checks.check_trainer`), instead of a traceback on the ranks or a silent change."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["callback_problem", "callback_class_problem", "trainer_flag_problems"]


def trainer_flag_problems(t: Mapping[str, Any], data_class: type | None) -> list[str]:
    """Trainer flags that fail in Lightning's own code (a traceback, on the ranks or before) with what the recipes
    set: a fraction of an epoch to validate at while the recipes validate by steps, ``barebones`` (it turns off
    the logger, bar and checkpoints they configure), Lightning's sampler over our datamodules' batch samplers."""
    problems = []
    interval = t.get("val_check_interval")
    if isinstance(interval, float) and "check_val_every_n_epoch" in t and t["check_val_every_n_epoch"] is None:
        problems.append(f"val_check_interval={interval} is a fraction of an epoch, but check_val_every_n_epoch=None "
                        f"validates every val_check_interval steps (the recipes' way); give a number of steps "
                        f"(e.g. --trainer.val_check_interval 250), or --trainer.check_val_every_n_epoch 1 to validate "
                        f"within each epoch")
    if t.get("barebones") is True:
        problems.append("barebones=True turns off the logger, progress bar, model summary and checkpoints the recipes "
                        "configure; use --trainer.logger false --trainer.enable_progress_bar false "
                        "--trainer.enable_checkpointing false for a quiet run")
    if t.get("use_distributed_sampler") is True and data_class is not None:
        from lightning_megatron.datamodules.finetune import FinetuneDataModule
        from lightning_megatron.datamodules.pretraining import PretrainingDataModule
        from lightning_megatron.datamodules.sft import SFTDataModule

        if issubclass(data_class, (PretrainingDataModule, FinetuneDataModule, SFTDataModule)):
            problems.append(f"use_distributed_sampler=True: {data_class.__name__} gives each data-parallel rank its "
                            f"share itself (a batch sampler Lightning cannot wrap); set trainer.use_distributed_sampler"
                            f": false")
    return problems


_UNSUPPORTED_CALLBACKS = {
    "GradientAccumulationScheduler": "it accumulates by setting accumulate_grad_batches, which the microbatch schedule "
                                     "replaces (every batch but the last one's gradient would be dropped); raise "
                                     "data global_batch_size instead (= micro_batch_size x microbatches x DP size)",
    "StochasticWeightAveraging": "it averages a copy of the weights outside the strategy's fp32 main params, "
                                 "sharded state and checkpoints",
    "LearningRateFinder": "the lr_schedule section sets the lr every step, so the finder's sweep never reaches the "
                          "optimizer; choose lr_schedule.max_lr by short runs",
    "BatchSizeFinder": "the batch is the data section's global_batch_size split into microbatches; `lightning-megatron "
                       "check --estimate-memory` gives the memory of a micro_batch_size",
    "BaseFinetuning": "it changes the optimizer's parameter groups while training, which the Megatron optimizer and "
                      "its gradient buffer fix at set-up; freeze parameters in the module (requires_grad=False) "
                      "before fit",
}
"""Lightning callbacks that would train silently wrong or fail on the ranks under MegatronStrategy, and why."""


def callback_problem(callback_class: type) -> str | None:
    """The refusal of a Lightning callback class (or a subclass of one) MegatronStrategy does not support."""
    for base in callback_class.__mro__:
        why = _UNSUPPORTED_CALLBACKS.get(base.__name__) if base.__module__.startswith(
            ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks")) else None
        if why is not None:
            return f"callback {callback_class.__name__} is not supported by MegatronStrategy: {why}"
    return None


def callback_class_problem(class_path: Any) -> str | None:
    """:func:`callback_problem` of a recipe's callback ``class_path`` (one that cannot be imported: LightningCLI's)."""
    import importlib

    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return callback_problem(cls) if isinstance(cls, type) else None
