"""OptimizerConfig: which Megatron optimizer wrapper a torch optimizer gets, with which loss scaler.

megatron-core's field names. :meth:`OptimizerConfig.wrap` chooses, from the parameters' dtypes:

===========================  ===================  ==========================================
parameters                   wrapper              loss scaler (``loss_scale=None``)
===========================  ===================  ==========================================
fp32                         FP32Optimizer        none (clipping and logging only)
bf16                         Float16Optimizer...  ``ConstantGradScaler(1.0)``: inf/nan skip
fp16                         Float16Optimizer...  ``DynamicGradScaler``
any, ZeRO-1                  DistributedOptimizer as above, by the lowest precision present
===========================  ===================  ==========================================

``Float16Optimizer...`` is :class:`~lightning_megatron.optimizer.float16.Float16OptimizerWithFloat16Params`.
A float ``loss_scale`` gives ``ConstantGradScaler(loss_scale)`` in every case. No Lightning here:
:class:`~lightning_megatron.callbacks.MegatronOptimizerCallback` carries it into a Trainer, and the
:class:`~lightning_megatron.strategy.MegatronStrategy` calls :meth:`OptimizerConfig.wrap` right after
``configure_optimizers`` (where it owns the parallel state and the gradient buffer).

Clipping has one owner, ``clip_grad``: Lightning's ``Trainer(gradient_clip_val=...)`` would clip each
rank's piece of the gradient by its own norm. :func:`gradient_clip_val_problem` is the one rule, used
before launch and at set-up; it follows Lightning's meaning of the value: ``None`` and ``0`` both mean
"no clipping by Lightning" and are accepted, any other value is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lightning_megatron.optimizer.distrib_optimizer import DistributedOptimizer
from lightning_megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from lightning_megatron.optimizer.float16 import Float16OptimizerWithFloat16Params
from lightning_megatron.optimizer.mixed_precision import FP32Optimizer, MegatronOptimizer

from lightning_megatron.tensor_parallel.param_facts import has_param_facts, param_facts

if TYPE_CHECKING:
    from lightning_megatron.grads import GradBuffer
    from lightning_megatron.parallel_state import Group, ParallelState

__all__ = ["OptimizerConfig", "gradient_clip_val_problem"]


def gradient_clip_val_problem(gradient_clip_val: float | None) -> str | None:
    """Why ``Trainer(gradient_clip_val=...)`` is refused alongside our clipping (``None`` when it is not).

    ``None`` and ``0`` disable Lightning's clipping (Lightning skips clipping for both) and are accepted.
    """
    if not gradient_clip_val:
        return None
    return (f"Trainer(gradient_clip_val={gradient_clip_val}) would clip each rank's piece of the gradient by its "
            f"own norm; remove it (None or 0) and set the clipping of MegatronOptimizerCallback instead "
            f"(--megatron_optimizer.clip_grad {gradient_clip_val}, or OptimizerConfig(clip_grad="
            f"{gradient_clip_val})), which clips by the norm over all tensor- and pipeline-parallel ranks")


_NUMBERS = {"clip_grad": "1.0; 0 disables clipping", "initial_loss_scale": "2**32", "min_loss_scale": "1.0",
            "loss_scale_window": "1000", "hysteresis": "2"}
"""The :class:`OptimizerConfig` fields that take a number only, and what their defaults are."""


def none_problems(values: Mapping[str, Any]) -> list[str]:
    """A ``null`` given for a field of :class:`OptimizerConfig` that takes a number only (the CLI's
    ``megatron_optimizer`` section: refused before launch, as the config itself refuses it)."""
    return [f"megatron_optimizer.{key}=None: a number is needed (leave the key out for the default, {text})"
            for key, text in _NUMBERS.items() if key in values and values[key] is None]


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """fp32 main params, loss scaling with overflow skip, and model-parallel gradient clipping."""

    clip_grad: float = 1.0
    """Max global L2 norm of the gradients over all TP/PP ranks; 0 disables clipping (the norm is still computed)."""
    loss_scale: float | None = None
    """None: dynamic scaling for fp16 parameters, none for bf16/fp32; a float: that constant scale."""
    initial_loss_scale: float = 2.0**32
    """Starting scale of the dynamic scaler."""
    min_loss_scale: float = 1.0
    """The dynamic scale never goes below this."""
    loss_scale_window: int = 1000
    """Clean steps before the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale halves."""
    log_num_zeros_in_grad: bool = False
    """Also count the zero entries of the gradient."""
    use_distributed_optimizer: bool = False
    """Shard the fp32 main params and optimizer state over the data-parallel ranks (ZeRO-1)."""

    def __post_init__(self) -> None:
        missing = none_problems(vars(self))
        if missing:
            raise ValueError("; ".join(missing))
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad={self.clip_grad!r} must be >= 0 (0 disables clipping)")
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise ValueError(f"loss_scale={self.loss_scale!r} must be > 0, or None for dynamic loss scaling")
        if self.loss_scale is None:
            self.grad_scaler(torch.float16)  # the dynamic scaler's arguments are checked now

    def grad_scaler(self, dtype: torch.dtype) -> MegatronGradScaler | None:
        """The scaler for parameters of the (lowest) precision ``dtype``."""
        if self.loss_scale is not None:
            return ConstantGradScaler(self.loss_scale)
        if dtype == torch.float16:
            return DynamicGradScaler(initial_scale=self.initial_loss_scale, min_scale=self.min_loss_scale,
                                     growth_factor=2.0, backoff_factor=0.5,
                                     growth_interval=self.loss_scale_window, hysteresis=self.hysteresis)
        if dtype == torch.bfloat16:
            return ConstantGradScaler(1.0)  # no scaling, but inf/nan steps are skipped
        return None

    def wrap(self, optimizer: torch.optim.Optimizer, *, parallel_state: ParallelState | None = None,
             grad_buffer: GradBuffer | None = None) -> MegatronOptimizer:
        """``optimizer`` in the wrapper its parameters need (see the module's table); a wrapper is
        returned as it is. ``parallel_state`` None: one process; ``grad_buffer``: the strategy's,
        which the ZeRO-1 optimizer shards."""
        if isinstance(optimizer, MegatronOptimizer):
            return optimizer
        ps = parallel_state
        common = dict(clip_grad=self.clip_grad, log_num_zeros_in_grad=self.log_num_zeros_in_grad, grad_buffer=grad_buffer,
                      model_parallel_group=None if ps is None else ps.group("mp"),
                      expert_model_parallel_group=_expert_norm_group(optimizer, ps),
                      coordinates=None if ps is None else ps.coordinates)
        dtypes = {p.dtype for group in optimizer.param_groups for p in group["params"]}
        low = next((d for d in (torch.float16, torch.bfloat16) if d in dtypes), torch.float32)
        if self.use_distributed_optimizer:
            return DistributedOptimizer(optimizer, grad_scaler=self.grad_scaler(low),
                                        data_parallel_group=None if ps is None else ps.group("dp_cp"), **common)
        if low != torch.float32:
            return Float16OptimizerWithFloat16Params(optimizer, grad_scaler=self.grad_scaler(low), **common)
        return FP32Optimizer(optimizer, grad_scaler=self.grad_scaler(low), **common)


def _expert_norm_group(optimizer: torch.optim.Optimizer, ps: ParallelState | None) -> Group:
    """The group the experts' part of the gradient norm is summed over under expert parallelism (their TP,
    EP and PP ranks: ``expert_mp``); None without experts or EP (they are summed with the rest). Every
    rank of an EP layout holds experts (each stage has its MoE layers), so all take the same decision."""
    if ps is None or ps.ep_size == 1:
        return None
    has_experts = any(param_facts(p).data_parallel == "expert_dp" for group in optimizer.param_groups
                      for p in group["params"] if has_param_facts(p))
    return ps.group("expert_mp") if has_experts else None
