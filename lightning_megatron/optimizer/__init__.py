"""Megatron's optimizer pieces, without Lightning: loss scalers, model-parallel gradient clipping,
mixed-precision optimizer wrappers, parameter groups and the OptimizerParamScheduler."""

from __future__ import annotations

from lightning_megatron.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    clip_grad_norm,
    count_zeros_fp32,
    get_grad_norm_fp32,
    grads_for_norm,
)
from lightning_megatron.optimizer.config import OptimizerConfig
from lightning_megatron.optimizer.distrib_optimizer import DistributedOptimizer
from lightning_megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from lightning_megatron.optimizer.float16 import Float16OptimizerWithFloat16Params
from lightning_megatron.optimizer.mixed_precision import ELEMENTWISE_OPTIMIZERS, FP32Optimizer, MegatronOptimizer
from lightning_megatron.optimizer.param_groups import default_no_weight_decay_cond, get_param_groups
from lightning_megatron.optimizer.scheduler import OptimizerParamScheduler

__all__ = [
    "OptimizerConfig",
    "DistributedOptimizer",
    "MegatronGradScaler",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "get_grad_norm_fp32",
    "clip_grad_norm",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
    "grads_for_norm",
    "MegatronOptimizer",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "ELEMENTWISE_OPTIMIZERS",
    "get_param_groups",
    "default_no_weight_decay_cond",
    "OptimizerParamScheduler",
]
