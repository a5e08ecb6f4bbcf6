"""The collectives and sends of a step, per pipeline stage: what the library's layers, schedule and gradient code
issue at a layout (:func:`stage_messages`), timed by :func:`~lightning_megatron.check.timing.estimate_time` and
counted on a run by ``check --estimate-memory --estimate-time`` (:mod:`lightning_megatron.check.traffic`:
:func:`stage_traffic`, the bytes a rank puts on the wire). Derivation: docs/check.md, "Communication"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_megatron.check.records import Device, Efficiency, Framework, collective_time, link_rate
from lightning_megatron.cost.memory import adapters_only, recomputed_share, stage_layers, trained_parameters
from lightning_megatron.cost.protocols import StepCost
from lightning_megatron.cost.transformer import TransformerCost
from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.pipeline.registry import AUTO, PipelineSchedule

__all__ = ["Message", "stage_messages", "stage_traffic"]


@dataclass(frozen=True, kw_only=True)
class Message:
    """A collective (or send) a rank of a pipeline stage takes part in, ``times`` a microbatch (``per_step``: a
    step): ``kind`` and ``nbytes`` as :func:`collective_time` takes them, over ``ranks`` ranks."""

    part: str
    """The layout's dimension it belongs to: ``tp``, ``cp``, ``ep``, ``pp`` or ``dp`` (:class:`StepTime`'s)."""
    kind: str
    nbytes: float
    ranks: int
    times: float = 1.0
    crosses_nodes: bool = False
    p2p: bool = False
    """A send on the pipeline's path (:attr:`Device.p2p` where the device has one)."""
    hidden: bool = False
    """Overlapped with compute (:class:`Framework`): no time on the critical path; the bytes are sent all the same."""
    beside_flops: float = 0.0
    """Matrix-product FLOPs that run while it is in flight, each time (the ring's blocks beside the next block's
    exchange): only the time it takes beyond theirs is on the critical path."""
    beside_16_bit: bool = True
    """Those products run at the 16-bit rate (else the fp32 one)."""
    per_step: bool = False

    @property
    def sent(self) -> float:
        """Bytes a rank puts on the wire for it, all ``times``."""
        return self.times * collective_time(self.kind, self.nbytes, self.ranks, 1.0, 0.0)

    def seconds(self, dev: Device, eff: Efficiency) -> float:
        """Its time on the critical path, all ``times``."""
        if self.hidden or self.times == 0:
            return 0.0
        bw, lat = link_rate(dev, eff, self.crosses_nodes)
        if self.p2p and dev.p2p is not None:
            bw, lat = dev.p2p * eff.link, dev.p2p_latency
        each = collective_time(self.kind, self.nbytes, self.ranks, bw, lat)
        if self.beside_flops:
            each = max(0.0, each - self.beside_flops / ((dev.flops_16 if self.beside_16_bit else dev.flops_32)
                                                        * eff.gemm))
        return self.times * each


def _chunks_sending(p: int, v: int, stage: int) -> tuple[int, int]:
    """(forward sends, backward sends) a microbatch of a rank of ``stage``: each of its ``v`` model chunks sends
    its output on unless it is the model's last chunk, and its input gradient back unless it is the first."""
    chunks = [j * p + stage for j in range(v)]
    return sum(c < p * v - 1 for c in chunks), sum(c > 0 for c in chunks)


def stage_messages(m: StepCost, layout: ParallelDims, stage: int, fw: Framework = Framework(), *,
                   devices_per_node: int = 8, schedule: str | PipelineSchedule = AUTO) -> list[Message]:
    """Every collective and send of a rank of ``stage`` in one step of ``m`` at ``layout``: what the library's
    layers, schedule and gradient code issue (``check --estimate-time`` counts them on a run:
    :mod:`lightning_megatron.check.traffic`). A microbatch's ``tokens = s/c b`` of ``h`` elements of ``e`` bytes,
    ``x = e tokens h``:

    - TP, a layer: without SP an all-reduce of ``x`` after the attention's and the MLP's row-parallel layers
      (forward) and of their column-parallel layers' input gradients (backward); under SP an all-gather and a
      reduce-scatter for each (the same bytes), and the column-parallel layers' inputs gathered again for their
      weight gradients (:attr:`~lightning_megatron.cost.TransformerCost.regathered_inputs`); recomputed layers'
      forwards again. A MoE layer's MLP all-reduces its experts' ``k`` rows a token (forward) and the tokens'
      input gradient (backward; under SP it gathers its tokens, scatters its output). The word embedding's and
      the head's (``embedding_messages``, ``head_messages`` of the cost record) on the end stages.
    - CP, a layer, by ``cp_comm_type``: ``all_gather`` all-gathers the keys and values of the whole sequence
      (forward) and reduce-scatters their gradients; ``a2a`` sends queries, keys, values and the context
      all-to-all, forward and backward; ``p2p`` passes its keys and values around the ring ``c - 1`` times,
      forward and backward, each exchange beside a ring step's attention (only its time beyond that is
      exposed), and sends their fp32 gradients to their owners all-to-all.
    - EP, a MoE layer: the routed rows all-to-all to the experts' ranks and back, forward and backward (the
      ``allgather`` dispatcher: the tokens all-gathered, the slots reduce-scattered back, and the reverse).
    - PP: each model chunk's output sent on and its input gradient back (not past the model's ends); the tied
      word embedding's gradient all-reduced by the first and last stage once a step.
    - DP (a step): the gradients all-reduced, or with ZeRO-1 reduce-scattered and the parameters all-gathered,
      the dense ones over ``d c`` ranks, the experts' over their ``edp``.
    """
    t, p, d, v, c, ep = layout.tp, layout.pp, layout.dp, layout.vp or 1, layout.cp, layout.ep
    e, s, b, h = m.param_bytes, m.seq_length, m.micro_batch_size, m.hidden_size
    dpn, sp = devices_per_node, layout.sequence_parallel
    tokens = s / c * b
    x = e * tokens * h
    layers, r = sum(stage_layers(m, p, stage, v)), recomputed_share(m, layout, stage)
    n = layers * (1 + r)  # the layers' forwards, recomputed ones again
    experts = getattr(m, "num_moe_experts", None)
    k = getattr(m, "moe_router_topk", 0)
    out: list[Message] = []

    def add(part: str, kind: str, nbytes: float, ranks: int, times: float, crosses: bool, **kw: Any) -> None:
        if times and ranks > 1:
            out.append(Message(part=part, kind=kind, nbytes=nbytes, ranks=ranks, times=times, crosses_nodes=crosses,
                               **kw))

    tp_x = t > dpn
    if t > 1:
        # the attention, and a dense MLP or a MoE layer's shared experts: a row- and a column-parallel pair each
        pairs = 1 + (1 if not experts or getattr(m, "moe_shared_expert_intermediate_size", None) else 0)
        # the column layers' input gradients, but the first layer's qkv's under LoRA: the frozen embedding below
        # needs none
        inputs = pairs * layers - (1 if stage == 0 and adapters_only(m) else 0)
        if sp:
            add("tp", "all_gather", x, t, pairs * (n + layers), tp_x)  # column inputs; row outputs' gradients
            add("tp", "reduce_scatter", x, t, pairs * n + inputs, tp_x)  # row outputs; column inputs' gradients
            regathered = m.regathered_inputs if isinstance(m, TransformerCost) else 2
            add("tp", "all_gather", x, t, regathered * layers, tp_x, hidden=fw.overlap_sp_gather)
        else:
            add("tp", "all_reduce", x, t, pairs * n + inputs, tp_x)
        if adapters_only(m):  # the adapters' [tokens, r] (lora.LoRAAdapter); under SP a column one gathers its A too
            a, w = e * tokens * m.lora_rank, e * m.lora_rank * h
            for name in m.lora_targets:
                if name in ("linear_qkv", "linear_fc1") and sp:
                    add("tp", "all_gather", a, t, n, tp_x)
                    add("tp", "reduce_scatter", a, t, layers, tp_x)
                    add("tp", "all_gather", w, t, n, tp_x)
                    add("tp", "reduce_scatter", w, t, layers, tp_x)
                elif name in ("linear_qkv", "linear_fc1"):
                    add("tp", "all_gather", a, t, n, tp_x)
                    add("tp", "all_reduce", a, t, layers, tp_x)
                elif sp:
                    add("tp", "reduce_scatter", a, t, n, tp_x)
                    add("tp", "all_gather", a, t, layers, tp_x)
                else:
                    add("tp", "all_reduce", a, t, n, tp_x)
        if experts:  # the experts' partial outputs weighed, summed, reduced; the weights' and the tokens' gradients
            add("tp", "all_reduce", 4 * k * tokens, t, layers, tp_x)
            if sp:  # the tokens and their routing gathered (k fp32 weights, int64 expert ids, whether each is kept)
                add("tp", "all_gather", x, t, n + layers, tp_x)
                add("tp", "reduce_scatter", x, t, n + layers, tp_x)
                capacity = getattr(m, "moe_expert_capacity_factor", None)
                add("tp", "all_gather", (12 + (1 if capacity else 0)) * k * tokens, t, n, tp_x)
            else:
                add("tp", "all_reduce", x, t, n + layers, tp_x)
        if sp and hasattr(m, "sequence_parallel_parameters"):  # their gradients summed once a step
            add("tp", "all_reduce", m.sequence_parallel_parameters(p, stage) * fw.grad_reduce_bytes, t, 1, tp_x,
                per_step=True)
        ends = []
        if stage == 0:
            ends += m.embedding_messages(t, sp, tokens) if hasattr(m, "embedding_messages") else [("all_reduce", x)]
        if stage == p - 1 and hasattr(m, "head_messages"):
            ends += m.head_messages(t, sp, tokens)
        for kind, nbytes, *again in ends:  # a gather for a weight gradient runs beside the input gradient's GEMM
            add("tp", kind, nbytes, t, 1, tp_x, hidden=bool(again and again[0]) and fw.overlap_sp_gather)
    token_ranks = c * (t if sp else 1)  # the ranks holding a microbatch's tokens, over which a capacity is chosen
    if experts and getattr(m, "moe_expert_capacity_factor", None) and token_ranks > 1:  # their routing gathered
        add("cp" if c > 1 else "tp", "all_gather", 12 * k * s * b, token_ranks, n, t * c > dpn)
    if c > 1:
        cp_x = t * c > dpn
        g, dh = m.groups / t, m.head_dim
        kind = getattr(m, "cp_comm_type", "all_gather")
        if kind == "a2a":
            heads = m.num_attention_heads / t
            kv_heads = g if g % c == 0 else heads  # fewer key/value heads than CP ranks: repeated for each group
            add("cp", "all_to_all", e * tokens * heads * dh, c, 2 * (n + layers), cp_x)  # queries; the context
            add("cp", "all_to_all", e * tokens * kv_heads * dh, c, 2 * (n + layers), cp_x)  # keys; values
        elif kind == "p2p":
            kv = 2 * e * tokens * g * dh  # this rank's keys and values, around the ring
            # each exchange runs beside a ring step's attention (transformer/ring_attention.py posts it first):
            # two [C, C] blocks of n/t heads are visible at a step after the first, C = s / 2c; forward Q K^T and
            # P V, backward those two again and three more (dP, dQ, dK; dV)
            block = 2 * (s / (2 * c)) ** 2 * dh * m.num_attention_heads / t * b  # one product of one block
            add("cp", "send", kv, 2, (c - 1) * n, cp_x, p2p=True, beside_flops=2 * 2 * block, beside_16_bit=e == 2)
            add("cp", "send", kv, 2, (c - 1) * layers, cp_x, p2p=True, beside_flops=2 * 5 * block,
                beside_16_bit=e == 2)
            add("cp", "all_to_all", 2 * 4 * s * b * g * dh, c, layers, cp_x)  # fp32 gradients, each block's owner
        else:
            kv = 2 * e * s * b * g * dh  # the whole sequence's keys and values
            add("cp", "all_gather", kv, c, n, cp_x)
            add("cp", "reduce_scatter", kv, c, layers, cp_x)
    if experts and ep > 1:  # expert TP = TP fastest, then EP
        ep_x = t * ep > dpn
        if getattr(m, "moe_token_dispatcher_type", "alltoall") == "allgather":
            # every rank's tokens and int64 sort keys gathered, the slots reduce-scattered back; gradients reversed
            add("ep", "all_gather", ep * x, ep, n, ep_x)
            add("ep", "all_gather", ep * 8 * k * tokens, ep, n, ep_x)
            add("ep", "reduce_scatter", ep * k * x, ep, n, ep_x)
            add("ep", "reduce_scatter", ep * x, ep, layers, ep_x)
            add("ep", "all_gather", ep * k * x, ep, layers, ep_x)
        else:  # the rows each way, forward and backward, after the int64 counts a forward
            add("ep", "all_to_all", k * x, ep, 2 * (n + layers), ep_x)
            add("ep", "all_to_all", 8 * experts, ep, n, ep_x)
    if p > 1:
        forward, backward = _chunks_sending(p, v, stage)
        sent = x / (t if (sp or fw.p2p_scatter_gather) else 1)
        add("pp", "send", sent, 2, forward + backward, t * d * p > dpn, p2p=True)
        if stage in (0, p - 1) and not getattr(m, "untie_embeddings_and_output_weights", False) and not adapters_only(m):
            add("pp", "all_reduce", m.padded_vocab(t) // t * h * fw.grad_reduce_bytes, 2, 1, t * d * p > dpn,
                per_step=True)
    params = trained_parameters(m, layout, stage, schedule)
    expert_params = m.stage_expert_parameters(t, ep, p, stage) if experts and not adapters_only(m) else 0  # LoRA: frozen
    for count, ranks, crosses in ((params - expert_params, d * c, t * d * c > dpn),
                                  (expert_params, layout.expert_dp, t * c * d > dpn)):
        if not count:
            continue
        if layout.zero1:
            add("dp", "reduce_scatter", count * fw.grad_reduce_bytes, ranks, 1, crosses, per_step=True)
            add("dp", "all_gather", count * e, ranks, 1, crosses, per_step=True)
        else:
            add("dp", "all_reduce", count * fw.grad_reduce_bytes, ranks, 1, crosses, per_step=True)
    return out


def stage_traffic(m: StepCost, layout: ParallelDims, stage: int, fw: Framework = Framework(), *,
                  schedule: str | PipelineSchedule = AUTO) -> dict[str, float]:
    """Bytes a rank of ``stage`` sends in one step, by part (``tp``, ``cp``, ``ep``, ``pp``, ``dp``): its
    :func:`stage_messages`, all microbatches."""
    microbatches = m.global_batch_size // (m.micro_batch_size * layout.dp)
    sent = dict.fromkeys(("tp", "cp", "ep", "pp", "dp"), 0.0)
    for msg in stage_messages(m, layout, stage, fw, schedule=schedule):
        sent[msg.part] += msg.sent * (1 if msg.per_step else microbatches)
    return sent
