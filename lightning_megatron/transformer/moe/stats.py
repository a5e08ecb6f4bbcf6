"""The routing statistics of a training step, reduced for logging: per MoE layer its load-balancing loss, its
z-loss and the fraction of the routed tokens each expert received.

Every MoE layer adds its share to ``layer.stats`` in each training forward (:class:`MoELayer`); one
all-reduce over the world sums them (each layer lives on one pipeline stage; the token group's ranks
hold shares that add up to the microbatch's values) and the sum is divided by the copies of each
value (the data-parallel replicas, the tensor-parallel ranks without sequence parallelism) and the
microbatches.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.transformer.moe.layer import MoELayer

__all__ = ["moe_metrics"]


def moe_metrics(chunks: Iterable[nn.Module], parallel_state: ParallelState | None, *, num_layers: int,
                num_experts: int, num_microbatches: int) -> dict[str, torch.Tensor]:
    """``{"moe/aux_loss/layer_L", "moe/z_loss/layer_L", "moe/load/layer_L/expert_e", "moe/max_load"}``
    (layers numbered from 0, as the checkpoint's ``decoder.layers.{i}`` and megatron-core's ``moe/..._layer_{i}``;
    load the fraction of the layer's routed tokens) from the layers' ``stats`` of this step (reset here). A
    collective over the world: every rank calls it."""
    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]
    width = 2 + num_experts
    device = layers[0].stats.device if layers else torch.device("cpu")
    table = torch.zeros(num_layers, width, dtype=torch.float32, device=device)
    for layer in layers:
        table[layer.layer_number - 1] += layer.stats
        layer.stats.zero_()
    ps = parallel_state
    copies = num_microbatches
    if ps is not None and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
        copies *= ps.dp_size * (1 if ps.dims.sequence_parallel else ps.tp_size)
    table /= copies
    out: dict[str, torch.Tensor] = {}
    loads = table[:, 2:] / table[:, 2:].sum(dim=1, keepdim=True).clamp(min=1e-12)
    for i in range(num_layers):
        out[f"moe/aux_loss/layer_{i}"] = table[i, 0]
        out[f"moe/z_loss/layer_{i}"] = table[i, 1]
        for e in range(num_experts):
            out[f"moe/load/layer_{i}/expert_{e}"] = loads[i, e]
    out["moe/max_load"] = loads.max() * num_experts  # 1.0: perfectly balanced
    return out
