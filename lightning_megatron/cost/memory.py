"""Closed-form bytes per rank of a layout: parameters, gradients, optimizer state, activations.

Two halves. The model declares its own costs (:class:`~lightning_megatron.cost.protocols.MemoryCost`:
parameters per stage, activation bytes per layer and microbatch, what the first and last stage add;
:class:`~lightning_megatron.cost.transformer.TransformerCost` for transformer layers, with each family's
ends in ``models/<family>/cost.py``). :func:`estimate_stage` adds the layout's part for any model: fp32
gradients and optimizer state from the parameter count, ZeRO-1 shards, and the microbatches in flight
under the pipeline schedule (its ``in_flight``: :mod:`lightning_megatron.pipeline.registry`).

The formulas (derivation in docs/memory.md, section "Predicting memory per rank") count what this
library allocates, tensor by tensor; ``lightning-megatron check --estimate-memory`` prints them next
to the bytes a check run measured, and ``--gpus N --gpu-memory 80GB`` lists the layouts that fit.
Pure arithmetic: no torch, no process groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.pipeline.layout import STAGE_SIZES, get_layer_range
from lightning_megatron.pipeline.registry import AUTO, PipelineSchedule, get_schedule

if TYPE_CHECKING:
    from lightning_megatron.cost.protocols import MemoryCost

__all__ = ["MemoryEstimate", "LayoutSearch", "candidate_layouts", "search_layouts", "estimate_memory",
           "estimate_stage", "layout_schedule", "node_bytes"]


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes on the fullest rank of a layout (the maximum over pipeline stages of each term's stage)."""

    layout: str
    params: int
    """Parameter count on that rank (elements)."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """Peak bytes of the tensors saved for backward (all microbatches in flight)."""

    stage: int
    """The pipeline stage of the fullest rank."""

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes


def layout_schedule(layout: ParallelDims, schedule: str | PipelineSchedule = AUTO) -> PipelineSchedule:
    """The pipeline schedule ``layout`` runs: ``schedule`` by name (``"auto"``: the layout's own), or as given."""
    if isinstance(schedule, PipelineSchedule):
        return schedule
    return get_schedule(schedule, layout.pp, layout.vp)


def stage_layers(m: MemoryCost, pp: int, stage: int, vp: int | None = None) -> list[int]:
    """Layers of each model chunk of pipeline stage ``stage``, as the model builds them
    (:func:`lightning_megatron.pipeline.layout.get_layer_range`): uneven where ``pp x vp`` does not divide the
    layers, and the model's ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` (which
    one stage, ``pp = 1``, has no use for). Raises ``ValueError`` when the layers cannot fill the chunks."""
    ends = {name: getattr(m, name, None) if pp > 1 else None for name in STAGE_SIZES}
    return [len(get_layer_range(m.num_layers, pp, stage, vp, c, **ends)) for c in range(vp or 1)]


def estimate_stage(m: MemoryCost, layout: ParallelDims, stage: int, *,
                   schedule: str | PipelineSchedule = AUTO) -> MemoryEstimate:
    """Bytes on a rank of pipeline stage ``stage`` of ``layout`` for the model whose costs are ``m``,
    under the pipeline ``schedule`` (a registered name, ``"auto"``: the layout's)."""
    t, pp, d, vp, cp = layout.tp, layout.pp, layout.dp, layout.vp or 1, layout.cp
    chunk_layers = stage_layers(m, pp, stage, vp)
    microbatches = m.global_batch_size // (m.micro_batch_size * d)
    if microbatches < 1 or m.global_batch_size % (m.micro_batch_size * d):
        raise ValueError(f"global batch {m.global_batch_size} is not divisible by micro batch "
                         f"{m.micro_batch_size} x dp {d}")
    # the in-flight chunks of an uneven stage counted at its largest chunk's layers (exact without interleaving)
    per_chunk = max(chunk_layers)
    # A mixture of experts' routed experts (the model says how many a rank holds): split over EP, their
    # ZeRO-1 state over the expert-data-parallel ranks.
    expert_params = getattr(m, "stage_expert_parameters", None)
    n_experts = expert_params(t, layout.ep, pp, stage) if expert_params is not None else 0
    n = m.stage_parameters(t, pp, stage) + n_experts
    e = m.param_bytes
    # LoRA: only the adapters have gradients and optimizer state (the model says how many; None: all train)
    trainable = getattr(m, "stage_trainable_parameters", None)
    trained = trainable(t, pp, stage) if trainable is not None else None
    if trained is not None:
        n_experts = 0
    dense = n - n_experts if trained is None else trained
    dense_shard, expert_shard = math.ceil(dense / (d * cp)), math.ceil(n_experts / layout.expert_dp)
    shard = dense_shard + expert_shard  # ZeRO-1 shards over the data- (and context-) parallel ranks
    # fp32 main grads (ZeRO-1: one flat buffer, each part padded to its group)
    n_trained = n if trained is None else trained
    grads = 4 * (dense_shard * d * cp + expert_shard * layout.expert_dp) if layout.zero1 else 4 * n_trained
    moments = 8 if m.optimizer in ("adam", "adamw") else 4
    main = 4 if (e != 4 or layout.zero1) else 0  # fp32 main copy: 16-bit params, or the ZeRO-1 shard
    opt = (moments + main) * (shard if layout.zero1 else n_trained)
    chunks = layout_schedule(layout, schedule).in_flight(pp, layout.vp, stage, microbatches)
    sp = layout.sequence_parallel
    # Context parallelism splits every token-sized tensor over cp ranks; a layer's attention also keeps the
    # keys and values gathered from the other ranks (the model says how many bytes: context_parallel_bytes).
    gathered = getattr(m, "context_parallel_bytes", None)
    layer = m.layer_activation_bytes(t, sp) / cp + (gathered(t, cp) if cp > 1 and gathered is not None else 0.0)
    head = m.last_stage_activation_bytes(t, sp) / cp if stage == pp - 1 else 0.0
    # What a chunk of c layers keeps through its forward. A recomputed layer keeps only its input: "uniform" keeps a
    # group's (k layers) and recomputes a group at a time, "block" recomputes the first k layers of a chunk and keeps
    # everything of the rest.
    k = getattr(m, "recompute_num_layers", None) or 1
    kept_input = m.layer_input_bytes(t, sp) / cp
    block = getattr(m, "recompute_method", None) == "block"

    def kept(c: int) -> float:
        if not m.recompute:
            return c * layer
        return min(k, c) * kept_input + (c - min(k, c)) * layer if block else -(-c // k) * kept_input

    # The forwards still waiting for their backward: ``chunks`` consecutive ones in the schedule's order (the
    # interleaved schedule runs pp microbatches of a chunk, then of the next), at their fullest (chunks of an
    # uneven stage differ; the order repeats every pp x vp forwards).
    order = [kept(chunk_layers[(i // pp) % vp]) for i in range(min(microbatches * vp, chunks + pp * vp))]
    window = max(sum(order[i:i + chunks]) for i in range(len(order) - chunks + 1))
    # The peak is the forward's (with the head) or, in the backward, after the head's and the kept layers' backward,
    # the recomputed layers' activations (of which the first layer's input is already kept).
    if not m.recompute:  # selective recomputation: the backward holds one layer's replayed core attention
        replayed = getattr(m, "replay_peak_bytes", None)
        replay = replayed(t, sp) / cp if getattr(m, "selective_recompute", False) and replayed is not None else 0.0
        act = window + max(head, replay)
    elif block:
        act = max(window + head, window - kept(per_chunk) + (min(k, per_chunk) - 1) * kept_input + layer)
    else:
        act = window + max(head, min(k, per_chunk) * layer - kept_input)
    deferred = getattr(m, "deferred_output_bytes", None)
    if stage == pp - 1 and deferred is not None:  # the output layer's weight gradient at the flush: the step's
        waiting = microbatches - 1  # earlier microbatches' output gradients and inputs, kept (the most: the limit)
        limit = getattr(m, "wgrad_deferral_limit", 0)
        act += (min(waiting, limit) if limit else waiting) * deferred(t) / cp
    if stage == 0:  # e.g. the embedding dropout's mask, once per first-chunk forward
        act += -(-chunks // vp) * m.first_stage_activation_bytes(t, sp) / cp
    return MemoryEstimate(layout=layout.name, params=n, param_bytes=e * n, grad_bytes=grads, optimizer_bytes=opt,
                          activation_bytes=int(act), stage=stage)


def estimate_memory(m: MemoryCost, layout: ParallelDims, *, schedule: str | PipelineSchedule = AUTO) -> MemoryEstimate:
    """Bytes on the fullest rank of ``layout`` (the pipeline stage with the largest total)."""
    return max((estimate_stage(m, layout, s, schedule=schedule) for s in range(layout.pp)),
               key=lambda e: e.total_bytes)


def node_bytes(m: MemoryCost, layout: ParallelDims, ranks_per_node: int | None = None) -> int:
    """Bytes of the ranks of ``layout`` that share a host, summed, on the fullest host (``ranks_per_node``
    consecutive global ranks each, as launchers number them; None: all of them on one): what a CPU run's
    processes take from its host's memory together."""
    k = ranks_per_node or layout.world_size
    stages = [estimate_stage(m, layout, s).total_bytes for s in range(layout.pp)]
    ranks = [stages[layout.coordinates(r)["pp"]] for r in range(layout.world_size)]
    return max(sum(ranks[i:i + k]) for i in range(0, layout.world_size, k))


@dataclass(frozen=True, kw_only=True)
class LayoutSearch:
    """The layouts of N ranks a model allows, and what was left out and why."""

    layouts: list[ParallelDims]
    skipped: dict[str, int]
    """Reason -> how many TP x PP (x VP) x DP combinations it excluded."""


def adapters_only(m: MemoryCost) -> bool:
    """Whether ``m`` trains LoRA adapters on a frozen base (its embeddings and output layer frozen too)."""
    return bool(getattr(m, "lora_rank", 0))


def recomputed_share(m: MemoryCost, layout: ParallelDims, stage: int = 0) -> float:
    """The share of the layers of ``stage`` whose forward runs again in the backward: none without recomputation,
    all with "uniform" groups, the first ``recompute_num_layers`` of each chunk with "block"."""
    if not getattr(m, "recompute", False):
        return 0.0
    if getattr(m, "recompute_method", None) != "block":
        return 1.0
    chunks = stage_layers(m, layout.pp, stage, layout.vp)
    k = getattr(m, "recompute_num_layers", None) or 1
    return sum(min(k, n) for n in chunks) / sum(chunks)


def trained_parameters(m: MemoryCost, layout: ParallelDims, stage: int,
                       schedule: str | PipelineSchedule = AUTO) -> int:
    """Parameter elements with gradients on a rank of ``stage``: its LoRA adapters, else all of them."""
    trainable = getattr(m, "stage_trainable_parameters", None)
    trained = trainable(layout.tp, layout.pp, stage) if trainable is not None else None
    return estimate_stage(m, layout, stage, schedule=schedule).params if trained is None else trained


def _divisors(n: int) -> list[int]:
    return [x for x in range(1, n + 1) if n % x == 0]


def search_layouts(m: MemoryCost, gpus: int, max_tp: int = 8, max_vp: int | None = None,
                   context_parallel: bool = False) -> LayoutSearch:
    """Every TP x PP (x VP) x DP of ``gpus`` ranks, with and without SP and ZeRO-1, that the model's
    sizes and the batch allow; each excluded combination is counted under its reason.

    VP: every v >= 2 (up to ``max_vp``) dividing the layers per stage; the interleaved schedule needs
    the microbatches per step divisible by PP. ``context_parallel`` (the module takes it,
    :func:`lightning_megatron.module.context_parallel_problem`): every CP size too whose ``2 cp`` chunks split the
    sequence (and, under SP, whose CP rank's part TP splits; with ``cp_comm_type="a2a"``, dividing a TP rank's
    heads). EP: every size dividing the experts and the stage's ``cp x dp`` ranks (expert TP = TP).
    """
    out: list[ParallelDims] = []
    skipped: dict[str, int] = {}

    def skip(reason: str, n: int = 1) -> None:
        skipped[reason] = skipped.get(reason, 0) + n

    G, b = m.global_batch_size, m.micro_batch_size
    seq = getattr(m, "seq_length", None)
    for t in _divisors(gpus):
        pps = _divisors(gpus // t)
        if t > max_tp:
            skip(f"TP={t} > {max_tp} (TP stays within a node)", len(pps))
            continue
        problem = m.tensor_parallel_problem(t)
        if problem:
            skip(problem, len(pps))
            continue
        for pp in pps:
            uneven = pp > 1 and any(getattr(m, name, None) is not None for name in STAGE_SIZES)
            if uneven:  # the model's own first / last stage sizes: every stage must get its layers
                try:
                    per_stage = [sum(stage_layers(m, pp, s)) for s in range(pp)]
                except ValueError:
                    skip(f"PP={pp} does not fit the model's first / last pipeline stage sizes")
                    continue
            elif m.num_layers % pp:
                skip(f"PP={pp} does not divide {m.num_layers} layers")
                continue
            else:
                per_stage = [m.num_layers // pp]
            for cp in (_divisors(gpus // (t * pp)) if context_parallel and seq else [1]):
                if cp > 1 and seq % (2 * cp):
                    skip(f"CP={cp} does not split sequence {seq} into {2 * cp} chunks")
                    continue
                if cp > 1 and getattr(m, "cp_comm_type", None) == "a2a" and (m.num_attention_heads // t) % cp:
                    skip(f"cp_comm_type='a2a': CP={cp} does not divide the {m.num_attention_heads // t} heads of a "
                         f"TP={t} rank")
                    continue
                d = gpus // (t * pp * cp)
                if G % (b * d):
                    skip(f"DP={d} does not divide global batch {G} into micro batches of {b}")
                    continue
                microbatches = G // (b * d)
                vps: list[int | None] = [None]
                if pp > 1:
                    for v in _divisors(math.gcd(*per_stage))[1:]:
                        if max_vp is not None and v > max_vp:
                            continue
                        if microbatches % pp:
                            skip(f"VP with PP={pp}: the microbatches per step (G / (b x DP)) are not divisible by PP")
                        else:
                            vps.append(v)
                sps = [False]
                if t > 1 and cp > 1 and (seq // cp) % t:
                    skip(f"SP with TP={t} x CP={cp} does not split sequence {seq}", len(vps))
                elif t > 1:
                    sps.append(True)
                experts = getattr(m, "num_moe_experts", None)
                # Expert parallelism takes its ranks from the data- and context-parallel ones (expert TP = TP).
                eps = [ep for ep in _divisors(cp * d) if experts and experts % ep == 0] or [1]
                for v in vps:
                    for sp in sps:
                        for zero1 in ((False, True) if d > 1 else (False,)):
                            for ep in eps:
                                out.append(ParallelDims(tp=t, pp=pp, vp=v, cp=cp, dp=d, ep=ep, sequence_parallel=sp,
                                                        zero1=zero1))
    return LayoutSearch(layouts=out, skipped=skipped)


def candidate_layouts(m: MemoryCost, gpus: int, max_tp: int = 8) -> list[ParallelDims]:
    """The layouts of :func:`search_layouts` (without the reasons for the ones left out)."""
    return search_layouts(m, gpus, max_tp).layouts
