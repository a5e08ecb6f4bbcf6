"""The router of a mixture-of-experts layer: scores, the top-k choice, capacity and the auxiliary losses.

For tokens x [n, h] and router weight W [E, h], the logits are l = x W^T [n, E]. The choice of k experts
per token and their weights (``probs`` [n, k]), with megatron-core's names:

- ``softmax``, ``pre_softmax=False`` (Mixtral): the top k of the logits, then a softmax over those k.
  Equal (to rounding) to softmax over all experts, top k, renormalised to sum to one; Qwen2-MoE's
  ``norm_topk_prob=True``.
- ``softmax``, ``pre_softmax=True``: softmax over all experts, the top k kept as they are (they sum to
  less than one); Qwen2-MoE's ``norm_topk_prob=False``.
- ``sigmoid``: sigmoid scores per expert, the top k renormalised when k > 1.

The softmax and sigmoid are taken in fp32; the weights are cast to the activations' dtype (as
transformers and megatron-core do).

Capacity (``moe_expert_capacity_factor`` f): an expert takes at most ``ceil((N k / E) f)`` of the ``N``
tokens of the microbatch, the most probable ones; the others' assignments are dropped (their weight
is not renormalised: the token keeps its other experts and its residual). The choice is taken over the
whole microbatch whatever the layout (the ranks of the ``token_group`` exchange their routing first),
so token dropping does not change with sequence or context parallelism (megatron-core decides per
rank, over the tokens the rank routes).

Auxiliary losses (megatron-core's, each weighted by its coefficient and added to the objective of
the microbatch; ``N`` the microbatch's tokens, ``T_e`` the tokens routed to expert e before any
dropping, ``P_e`` the sum over the tokens of the scores of e, ``p`` the full score vector (softmax, or
the normalised sigmoid))::

    aux_loss       = E / (k N^2) * sum_e T_e P_e                           (switch-transformer balance)
    seq_aux_loss   = mean over sequences b of  sum_e (E T_be / (k S)) (P_be / S)   (S: sequence length)
    z_loss         = mean over tokens of logsumexp(l)^2

transformers' ``load_balancing_loss_func`` (Mixtral, Qwen2-MoE) computes ``E * sum_e (T_e / N) (P_e / N)``
over the tokens of every layer concatenated: it does not divide by k and pools the layers into one
loss, where megatron-core (and this module) takes one loss per layer, divided by k, and sums them.

Every statistic over tokens is summed over the ranks that hold other tokens of the same microbatch
(the ``token_group``: the context-parallel ranks, and the tensor-parallel ranks under sequence
parallelism), so each rank's share of a loss is its own tokens' part of the one-process value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_megatron.parallel_state import Group, group_rank, group_size
from lightning_megatron.tensor_parallel.layers import init_method_normal
from lightning_megatron.tensor_parallel.mappings import _gather_along_dim, all_reduce
from lightning_megatron.tensor_parallel.param_facts import set_param_facts
from lightning_megatron.transformer.config import TransformerConfig

__all__ = ["TopKRouter", "Routing", "route", "capacity_mask", "load_balancing_losses"]


@dataclass
class Routing:
    """One rank's routing of its ``n`` tokens."""

    probs: torch.Tensor
    """[n, k] the weight of each chosen expert (fp32)."""
    experts: torch.Tensor
    """[n, k] the chosen experts (int64), in top-k order."""
    keep: torch.Tensor | None
    """[n, k] False where the capacity dropped the assignment; None: nothing dropped."""
    scores: torch.Tensor
    """[n, E] fp32 scores of every expert (the load-balancing loss's ``p``)."""
    logits: torch.Tensor
    """[n, E] the router's logits."""
    capacity: int | None = None
    """Rows each expert takes of the microbatch's tokens (with a capacity factor)."""


def route(logits: torch.Tensor, topk: int, score_function: str = "softmax", pre_softmax: bool = False) -> Routing:
    """The top-k choice of ``logits`` [n, E] (module docstring); ``keep`` is None (no capacity)."""
    logits32 = logits if logits.dtype == torch.float64 else logits.float()  # fp32 at least (fp64: the router's)
    if score_function == "softmax":
        scores = torch.softmax(logits32, dim=-1)
        if pre_softmax:
            probs, experts = torch.topk(scores, topk, dim=-1)
        else:
            top, experts = torch.topk(logits32, topk, dim=-1)
            probs = torch.softmax(top, dim=-1)
    elif score_function == "sigmoid":
        sig = torch.sigmoid(logits32)
        probs, experts = torch.topk(sig, topk, dim=-1)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        scores = sig / (sig.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function={score_function!r}: use 'softmax' or 'sigmoid'")
    return Routing(probs=probs.float(), experts=experts, keep=None, scores=scores.float(), logits=logits)


def capacity_mask(probs: torch.Tensor, experts: torch.Tensor, num_experts: int, capacity_factor: float,
                  order: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """``(keep [n, k], capacity)``: each expert keeps its ``capacity = ceil((n k / E) f)`` most probable
    assignments (megatron-core's "probs" drop policy); of assignments of exactly equal probability the one of
    the earlier token (``order`` [n]: the rows' place in the one-process sequence; None: the rows' order) is
    kept, so the choice does not depend on which rank holds a row or on the sort's kernel."""
    n, k = probs.shape
    capacity = math.ceil((n * k / num_experts) * capacity_factor)  # megatron-core's get_capacity, to the rounding
    if capacity >= n:
        return torch.ones_like(experts, dtype=torch.bool), capacity
    if order is not None:  # the rows in sequence order; the choice mapped back to the rows' order at the end
        rows = torch.argsort(order)
        probs, experts = probs[rows], experts[rows]
    dense = torch.zeros(n, num_experts, dtype=probs.dtype, device=probs.device).scatter(1, experts, probs.detach())
    chosen = torch.zeros(n, num_experts, dtype=torch.bool, device=probs.device).scatter(1, experts, True)
    # Unrouted entries rank below every routed one (a routed weight may be 0 in fp32 underflow); the stable sort
    # keeps ties in sequence order.
    ranked = torch.where(chosen, dense, torch.full_like(dense, -1.0))
    top = torch.sort(ranked, dim=0, descending=True, stable=True).indices[:capacity]  # [capacity, E]
    kept = torch.zeros_like(chosen).scatter(0, top, True) & chosen
    keep = kept.gather(1, experts)
    if order is not None:
        keep = torch.empty_like(keep).index_copy_(0, rows, keep)
    return keep, capacity


def load_balancing_losses(routing: Routing, config: TransformerConfig, *, num_tokens_per_sequence: int,
                          token_group: Group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(aux, z, tokens_per_expert)``: this rank's share of the layer's weighted load-balancing loss and
    z-loss (0-d fp32, with autograd), and the microbatch's token count per expert [E] (summed over
    ``token_group``; before dropping). ``num_tokens_per_sequence``: this rank's tokens of each sequence
    (the local ``s``; tokens are ordered ``[s, b]``)."""
    scores, experts = routing.scores, routing.experts
    n, num_experts = scores.shape
    k = experts.shape[1]
    ranks = group_size(token_group)
    s = num_tokens_per_sequence
    b = n // s
    routed = torch.zeros(n, num_experts, dtype=torch.float32, device=scores.device).scatter(1, experts, 1.0)
    kind, coeff = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    per_sequence = routed.view(s, b, num_experts).sum(dim=0)  # [b, E]
    counts = torch.cat([per_sequence.reshape(-1), routed.sum(dim=0)])
    all_reduce(counts, token_group)  # no autograd: counts are not differentiable
    per_sequence, tokens_per_expert = counts[:-num_experts].view(b, num_experts), counts[-num_experts:]
    zero = scores.new_zeros(())
    aux = zero
    if coeff > 0 and kind == "aux_loss":
        total = n * ranks
        aux = (scores.sum(dim=0) * tokens_per_expert).sum() * (coeff * num_experts / (k * total * total))
    elif coeff > 0 and kind == "seq_aux_loss":
        length = s * ranks
        f = per_sequence * (num_experts / (k * length))  # [b, E]
        p = scores.view(s, b, num_experts).sum(dim=0) / length
        aux = (f * p).sum(dim=1).mean() * coeff
    z = zero
    if config.moe_z_loss_coeff:
        z = torch.logsumexp(routing.logits.float(), dim=-1).square().sum() * (config.moe_z_loss_coeff / (n * ranks))
    return aux, z, tokens_per_expert


class TopKRouter(nn.Module):
    """``x`` [n, h] -> :class:`Routing`. Weight [E, h], replicated over TP (its gradient summed over TP
    under sequence parallelism, where each TP rank routes its own tokens)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        master = torch.empty(config.num_moe_experts, config.hidden_size, dtype=torch.float32)
        init_method_normal(config.init_method_std)(master)
        self.weight = nn.Parameter(master.to(config.params_dtype))
        set_param_facts(self.weight, sequence_parallel=bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor, token_group: Group = None, order: torch.Tensor | None = None) -> Routing:
        """``token_group``: the ranks holding the microbatch's other tokens (the capacity is chosen over all);
        ``order`` [n]: each token's place in the microbatch's one-process order (None: the ranks' tokens gathered
        in rank order are in that order), which breaks exact ties at an expert's capacity."""
        c = self.config
        if c.moe_router_dtype is None:
            logits = F.linear(x, self.weight)
        else:  # megatron-core's router dtype: the product wider than the parameters, outside any autocast
            wide = torch.float64 if c.moe_router_dtype == "fp64" else torch.float32
            with torch.autocast(x.device.type, enabled=False):
                logits = F.linear(x.to(wide), self.weight.to(wide))
        routing = route(logits, c.moe_router_topk, c.moe_router_score_function, c.moe_router_pre_softmax)
        if c.moe_expert_capacity_factor is not None:
            probs, experts, n = routing.probs.detach(), routing.experts, x.shape[0]
            if group_size(token_group) > 1:
                probs = _gather_along_dim(probs, token_group, 0)
                if order is None:
                    experts = _gather_along_dim(experts, token_group, 0)
                else:  # one gather: the experts with each token's place
                    both = _gather_along_dim(torch.cat([experts, order.to(experts.dtype)[:, None]], dim=1),
                                             token_group, 0)
                    experts, order = both[:, :-1], both[:, -1]
            keep, routing.capacity = capacity_mask(probs, experts, c.num_moe_experts, c.moe_expert_capacity_factor,
                                                   order)
            first = group_rank(token_group) * n
            routing.keep = keep[first: first + n]
        return routing
