"""MoELayer: the MLP slot of a decoder layer as a mixture of experts (megatron-core's ``MoELayer``).

``[s, b, h] -> ([s, b, h], None)`` (``[s/t, b, h]`` under sequence parallelism)::

    routing  = router(x)                                     top-k experts and weights per token
    y[t, j]  = expert_{e(t, j)}(x[t])                        dispatched over the EP group
    out[t]   = sum_j probs[t, j] y[t, j]  (+ shared(x[t]) * sigmoid(x[t] w_gate))

Layout. Under sequence parallelism each TP rank routes its own tokens, then the tokens and their
routing are gathered over TP, so every TP rank dispatches the same rows over EP and runs its TP
shard of each expert; the partial outputs are combined, then summed over TP (reduce-scattered: each TP rank
keeps its part of the sequence). Without sequence parallelism the TP ranks hold the same tokens throughout.

Auxiliary losses (:func:`~lightning_megatron.transformer.moe.router.load_balancing_losses`) are added to
the training objective through :class:`AuxLossScaler`: the forward passes the output through, the
backward adds the gradient of the weighted losses with the scale of the microbatch's loss
(:func:`aux_loss_scale`, set by the training step around its schedule: the loss scale over the microbatch
count). Under
context parallelism the scale is multiplied by the CP size, as the language-model loss is (the
gradients are averaged over the data- and context-parallel ranks).

Per training forward with gradients (under recomputation, the replay in backward only) the layer adds to
``stats`` [2 + E]: its share of the aux loss and of the z-loss,
and its share of the tokens each expert was routed (``tokens / token-group size``);
:func:`lightning_megatron.transformer.moe.stats.moe_metrics` reduces them for logging.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_megatron.parallel_state import Group, ParallelState, group_rank, group_size
from lightning_megatron.tensor_parallel.mappings import (
    _gather_along_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from lightning_megatron.tensor_parallel.param_facts import set_param_facts
from lightning_megatron.transformer.config import TransformerConfig
from lightning_megatron.transformer.moe.dispatcher import DISPATCHERS
from lightning_megatron.transformer.moe.experts import LocalExperts
from lightning_megatron.transformer.moe.router import TopKRouter, load_balancing_losses
from lightning_megatron.transformer.spec import ModuleSpec, build_module

__all__ = ["MoELayer", "MoESubmodules", "ExpertGroups", "AuxLossScaler", "aux_loss_scale"]


@dataclass(frozen=True)
class ExpertGroups:
    """The process groups an MoE layer communicates over (None: one rank)."""

    ep: Group = None
    """Expert-parallel group: the ranks the experts are split over."""
    token: Group = None
    """The ranks holding other tokens of the same microbatch (CP, and TP under sequence parallelism):
    where the router's token statistics are summed."""
    cp_size: int = 1
    """Context-parallel size (the aux-loss gradient's scale, as the language-model loss's)."""

    @classmethod
    def of(cls, parallel_state: ParallelState | None) -> ExpertGroups:
        """The groups of this rank's layout (None: one process)."""
        ps = parallel_state
        if ps is None:
            return cls()
        token = "tp_cp" if ps.dims.sequence_parallel else "cp"
        return cls(ep=ps.group("ep"), token=ps.group(token), cp_size=ps.cp_size)


@dataclass(kw_only=True)
class MoESubmodules:
    """Submodule slots of :class:`MoELayer`: the shared experts (a dense MLP spec, or None)."""

    shared_experts: ModuleSpec | type | None = None


_AUX_LOSS_SCALE: list[torch.Tensor | float] = [1.0]


@contextlib.contextmanager
def aux_loss_scale(scale: torch.Tensor | float) -> Iterator[None]:
    """The scale the auxiliary losses' gradient gets in the backward passes run inside: the training step
    sets the loss scale divided by the number of microbatches around its schedule (megatron-core's
    ``MoEAuxLossAutoScaler.set_loss_scale``). Outside, 1: a backward of one's own loss gives the aux losses
    the gradient 1, as if they had been added to it."""
    previous = _AUX_LOSS_SCALE[0]
    _AUX_LOSS_SCALE[0] = scale
    try:
        yield
    finally:
        _AUX_LOSS_SCALE[0] = previous


class AuxLossScaler(torch.autograd.Function):
    """``output`` unchanged; in backward the auxiliary loss gets the gradient ``scale``."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        scale = _AUX_LOSS_SCALE[0] * ctx.scale
        return grad, torch.ones_like(aux) * scale, None


class MoELayer(nn.Module):
    """Router, this rank's experts, the dispatcher and the optional shared experts (module docstring)."""

    def __init__(self, config: TransformerConfig, submodules: MoESubmodules | None = None, *,
                 tp_group: Group = None, expert_groups: ExpertGroups | None = None, layer_number: int = 1) -> None:
        super().__init__()
        self.layer_number = layer_number
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs config.num_moe_experts (the number of routed experts)")
        groups = expert_groups or ExpertGroups()
        ep = group_size(groups.ep)
        if ep != config.expert_model_parallel_size:
            raise ValueError(f"the EP group has {ep} ranks but config.expert_model_parallel_size="
                             f"{config.expert_model_parallel_size}; build the model at the strategy's layout")
        self.config, self.tp_group, self.groups = config, tp_group, groups
        self.num_experts = config.num_moe_experts
        self.num_local_experts = self.num_experts // ep
        self.first_expert = group_rank(groups.ep) * self.num_local_experts
        self.router = TopKRouter(config)
        shared = None
        if config.moe_shared_expert_intermediate_size is not None:
            spec = (submodules.shared_experts if submodules is not None else None)
            if spec is None:
                from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
                from lightning_megatron.transformer.mlp import MLP, MLPSubmodules
                spec = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                        linear_fc2=RowParallelLinear))
            shared_config = dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
            shared = build_module(spec, config=shared_config, tp_group=tp_group)
        self.shared_experts = shared
        if config.moe_shared_expert_gate:
            self.shared_expert_gate = nn.Parameter(
                torch.empty(1, config.hidden_size, dtype=torch.float32).normal_(0.0, config.init_method_std)
                .to(config.params_dtype))
            set_param_facts(self.shared_expert_gate, sequence_parallel=bool(config.sequence_parallel))
        else:
            self.register_parameter("shared_expert_gate", None)
        seed = int(torch.randint(0, 2**62, (1,)))  # from the layer's stream: the same at every layout
        self.experts = LocalExperts(config, num_local_experts=self.num_local_experts, first_expert=self.first_expert,
                                    seed=seed, tp_group=tp_group)
        self.register_buffer("stats", torch.zeros(2 + self.num_experts, dtype=torch.float32), persistent=False)
        self.dispatch = DISPATCHERS[config.moe_token_dispatcher_type]
        self._capacity: int | None = None

    def _run_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return self.experts(rows, counts, self._capacity)  # this TP rank's partial sums

    def _token_order(self, s: int, b: int, context_parallel: Any) -> torch.Tensor:
        """[s b] each of this rank's tokens' place in the microbatch's one-process order (``[s, b]`` rows): under
        context parallelism the ranks hold chunks from both ends of the sequence, and under sequence parallelism
        each TP rank its part of the CP rank's."""
        local = torch.arange(s, device=context_parallel.gathered.device)
        if self.config.sequence_parallel:
            local = local + group_rank(self.tp_group) * s
        positions = context_parallel.positions()[local]
        return (positions[:, None] * b + torch.arange(b, device=positions.device)).reshape(-1)

    takes_context_parallel = True
    """The layer passes its ``context_parallel`` (None: this rank holds the whole sequence)."""

    def forward(self, hidden_states: torch.Tensor, context_parallel: Any = None) -> tuple[torch.Tensor, None]:
        c = self.config
        s, b, h = hidden_states.shape
        x = hidden_states.reshape(s * b, h)
        token_group = self.groups.token
        if self.groups.cp_size > 1 and context_parallel is None:
            # the whole sequence on this rank (generation under a CP strategy runs each prompt whole on every CP
            # rank): the capacity is chosen over its own tokens, not over CP copies of them
            token_group = self.tp_group if c.sequence_parallel else None
        order = None
        if context_parallel is not None and c.moe_expert_capacity_factor is not None:
            order = self._token_order(s, b, context_parallel)
        routing = self.router(x, token_group, order)
        probs, experts, keep = routing.probs, routing.experts, routing.keep
        training = self.training and torch.is_grad_enabled()
        if training:  # with gradients: under recomputation the replay in backward, not the pass without them
            aux, z, tokens = load_balancing_losses(routing, c, num_tokens_per_sequence=s, token_group=token_group)
            token_ranks = group_size(token_group)
            self.stats += torch.cat([torch.stack([aux.detach(), z.detach()]), tokens / token_ranks])
        sp = bool(c.sequence_parallel) and group_size(self.tp_group) > 1
        self._capacity = None
        if c.moe_pad_expert_input_to_capacity:  # an expert's rows: at most the capacity from each EP rank
            self._capacity = routing.capacity * group_size(self.groups.ep)
        if sp:  # every TP rank dispatches the TP group's tokens; the routing weights' gradient is whole here
            tokens_in = gather_from_sequence_parallel_region(x, self.tp_group, True)
            probs = gather_from_sequence_parallel_region(probs, self.tp_group, False)
            experts = _gather_along_dim(experts, self.tp_group, 0)
            keep = None if keep is None else _gather_along_dim(keep, self.tp_group, 0)
        else:
            tokens_in = copy_to_tensor_model_parallel_region(x, self.tp_group)
        slots = self.dispatch(tokens_in, experts, keep, num_experts=self.num_experts, ep_group=self.groups.ep,
                              run_experts=self._run_experts)  # [n, k, h], this TP rank's partial sums
        # Weighted and summed first, then reduced over TP once: h a token, not the k slots' k h (megatron-core
        # reduce-scatters the k rows). The weights' gradient, read from partial slots, is summed over TP.
        probs = copy_to_tensor_model_parallel_region(probs, self.tp_group)
        out = (slots * probs.to(slots.dtype).unsqueeze(-1)).sum(dim=1)
        if sp:
            out = reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(out, self.tp_group)
        out = out.view(s, b, h)
        if self.shared_experts is not None:
            shared, bias = self.shared_experts(hidden_states)
            if bias is not None:
                shared = shared + bias
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(torch.nn.functional.linear(hidden_states, self.shared_expert_gate))
            out = out + shared
        if training and (aux.requires_grad or z.requires_grad):
            out = AuxLossScaler.apply(out, aux + z, float(self.groups.cp_size))
        return out, None
