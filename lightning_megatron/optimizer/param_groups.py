"""Parameter groups with Megatron's per-group multipliers.

By default biases and norm weights (every parameter whose name ends in ``.bias`` or that is 1-D)
get no weight decay: they do not multiply activations into many outputs, so shrinking them only
shifts or rescales features and hurts more than it regularizes. Every group carries

- ``wd_mult``: 0.0 (no decay) or 1.0, multiplied into the weight decay by OptimizerParamScheduler;
- ``lr_mult``: 1.0, or ``lr_mult`` for parameters selected by ``scale_lr_cond``;

and ``weight_decay = weight_decay * wd_mult`` and ``lr = lr * lr_mult`` so a plain torch optimizer
built from the groups is right before any scheduler runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["get_param_groups", "default_no_weight_decay_cond"]

NameParamCond = Callable[[str, torch.nn.Parameter], bool]


def default_no_weight_decay_cond(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's default: biases and 1-D parameters (norm weights) get no weight decay."""
    return name.endswith(".bias") or name == "bias" or param.ndim == 1


def get_param_groups(
    modules: torch.nn.Module | Iterable[torch.nn.Module],
    *,
    lr: float,
    weight_decay: float,
    no_weight_decay_cond: NameParamCond | None = default_no_weight_decay_cond,
    scale_lr_cond: NameParamCond | None = None,
    lr_mult: float = 1.0,
) -> list[dict[str, Any]]:
    """Split the trainable parameters of ``modules`` (one or several model chunks) into groups.

    ``no_weight_decay_cond=None`` decays every parameter. Groups are keyed by ``(wd_mult, lr_mult)``
    and returned in a stable order (decayed first, then undecayed; unscaled before scaled); empty
    groups are dropped. A parameter shared by two modules appears once.
    """
    if isinstance(modules, torch.nn.Module):
        modules = [modules]
    if weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be >= 0")
    buckets: dict[tuple[float, float], list[torch.nn.Parameter]] = {}
    seen: set[int] = set()
    for module in modules:
        for name, param in module.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            no_wd = no_weight_decay_cond is not None and no_weight_decay_cond(name, param)
            scale_lr = scale_lr_cond is not None and scale_lr_cond(name, param)
            key = (0.0 if no_wd else 1.0, lr_mult if scale_lr else 1.0)
            buckets.setdefault(key, []).append(param)
    groups = []
    for (wd_mult, group_lr_mult) in sorted(buckets, key=lambda k: (-k[0], k[1] != 1.0)):
        groups.append(
            {
                "params": buckets[(wd_mult, group_lr_mult)],
                "wd_mult": wd_mult,
                "lr_mult": group_lr_mult,
                "weight_decay": weight_decay * wd_mult,
                "lr": lr * group_lr_mult,
            }
        )
    return groups
