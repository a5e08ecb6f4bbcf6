"""Mixture of experts: router, experts, token dispatch and the layer (docs/moe.md)."""

from lightning_megatron.transformer.moe.dispatcher import DISPATCHERS, dispatch_allgather, dispatch_alltoall
from lightning_megatron.transformer.moe.experts import ExpertMLP, LocalExperts
from lightning_megatron.transformer.moe.layer import (
    AuxLossScaler,
    ExpertGroups,
    MoELayer,
    MoESubmodules,
    aux_loss_scale,
)
from lightning_megatron.transformer.moe.router import Routing, TopKRouter, capacity_mask, load_balancing_losses, route

__all__ = ["MoELayer", "MoESubmodules", "ExpertGroups", "AuxLossScaler", "aux_loss_scale", "TopKRouter", "Routing",
           "route", "capacity_mask", "load_balancing_losses", "LocalExperts", "ExpertMLP", "DISPATCHERS",
           "dispatch_alltoall", "dispatch_allgather"]
