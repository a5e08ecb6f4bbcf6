"""Predicted step time, tokens/s and MFU of a layout: FLOPs, bytes moved and device rates.

Pure arithmetic (no torch, no process groups), in the notation of docs/memory.md: ``L`` layers,
``h`` hidden, ``f`` FFN, ``a`` heads, ``s`` tokens per sample, ``b`` micro batch, ``G`` global batch,
layout ``t`` (TP), ``p`` (PP), ``v`` (virtual stages), ``d`` (DP), ``m = G/(b d)`` microbatches.

One microbatch on the slowest pipeline stage takes

    T_mb = F_stage / (peak x gemm_eff) + B_stage / (hbm x mem_eff) + V_stage / vocab
           + A_stage / (m hbm x mem_eff) + TP_comm + CP_comm + EP_comm + PP_p2p

(GEMM FLOPs, memory-bound elementwise bytes of the layers, the passes over vocabulary-sized tensors
of the first and last stage, the gradient accumulation into the fp32 main grads, the exposed
tensor-, context- and expert-parallel collectives and the pipeline sends; the slowest stage's), and the step

    T_step = m T_mb + f/(1 - f) m T_other  +  tied-embedding all-reduce  +  DP_exposed  +  T_optimizer

(with ``defer_embedding_wgrad_compute`` the last stage's ``T_mb`` leaves out the output layer's weight gradient of
the microbatches that wait for the flush, and the flush's ``W`` of them adds what the drain does not hide:
``max(0, W T_wgrad - 2/3 bubble)``; with the CPU tuning's ``weight_grads_per_step`` every stage's ``T_mb`` leaves out
its layers' weight gradients too, all ``m`` wait, and a stage ``s`` hides its drain behind ``s/(p - 1)`` of that:
the step ends with the longest exposed one, the first stage's whole drain or the last's beyond ``2/3 bubble``)

with ``f`` the pipeline schedule's bubble, the idle fraction of the pipelined time (its ``bubble``:
:mod:`lightning_megatron.pipeline.registry`; 1F1B ``(p - 1)/(m + p - 1)``, interleaved
``(p - 1)/(v m + p - 1)``, so the idle time is ``(p - 1)/v T_other``), and ``T_other`` the mean
microbatch time of the other stages (the slowest runs back to back; the pipe fills with the others'
forwards and drains with their backwards: the last stage, which holds the head, waits for lighter ones). Collectives are ring
algorithms: an all-reduce of ``n`` bytes over ``k`` ranks moves ``2 (k-1)/k n`` bytes per rank, an
all-gather, reduce-scatter or all-to-all ``(k-1)/k n``; time = bytes / (link bandwidth x link_eff) +
latency, over NVLink inside a node and InfiniBand between nodes. On a GPU the host queues the kernels
ahead of the device, so the step takes the longer of that and the host's dispatch, ``host_op`` seconds an op
(:attr:`Device.host_op`) times the ops the busiest rank dispatches (:class:`HostOps`).

Context parallelism (``c`` ranks) gives each rank ``s/c`` of every sample's tokens: the FLOPs, the
elementwise and logit bytes and the TP and pipeline messages of a rank are ``1/c`` of CP=1's (the
causal chunks are balanced). Every collective and send of a stage's rank is one :class:`Message`
(:func:`stage_messages`: TP's, CP's by ``cp_comm_type``, EP's all-to-alls, the pipeline's sends, DP's
reductions), timed as the ring algorithm moves it; :func:`stage_traffic` gives their bytes, which
``check --estimate-memory --estimate-time`` compares with what a run's ranks send
(:mod:`lightning_megatron.check.traffic`). Derivation and validation: docs/check.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_megatron.check.communication import Message, stage_messages, stage_traffic
from lightning_megatron.check.records import (MEASURED, STEP_OPS, Device, Efficiency, Framework, HostOps,
                                              collective_time, link_rate)
from lightning_megatron.cost.memory import (adapters_only, layout_schedule, recomputed_share, stage_layers,
                                            trained_parameters)
from lightning_megatron.cost.flops import layer_flops, layer_shape, model_flops
from lightning_megatron.cost.protocols import StepCost
from lightning_megatron.cost.transformer import TransformerCost
from lightning_megatron.flops import transformer_flops
from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.pipeline.registry import AUTO, PipelineSchedule

# the records, the messages and the FLOP counts it takes are re-exported: the model's names, where the docs and
# callers find them
__all__ = ["Device", "Efficiency", "Framework", "HostOps", "MEASURED", "Message", "STEP_OPS", "StepTime",
           "adapter_bytes", "collective_time", "deferred_head_flops", "elementwise_bytes", "estimate_time",
           "grad_accumulation_bytes", "layer_flops", "link_rate", "model_flops", "recomputed_share", "stage_flops",
           "stage_messages", "stage_traffic", "step_weight_parameters", "vocab_bytes"]


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Predicted seconds of one optimizer step of a layout, by part."""

    layout: str
    compute: float
    """GEMMs, elementwise kernels, vocabulary passes and gradient accumulation of every microbatch on the
    slowest stage (bubble excluded), and the part of the weight gradients deferred to the pipeline flush (the output
    layer's with ``defer_embedding_wgrad_compute``, :func:`deferred_head_flops`; every linear layer's with the CPU
    tuning's ``weight_grads_per_step``, :func:`step_weight_parameters`) that the flush's drain does not hide."""
    tp_comm: float
    """Tensor-parallel collectives on the critical path (all microbatches; under SP, once a step, the sum of the
    gradients of the parameters that saw a chunk of the sequence)."""
    pp_comm: float
    """Pipeline sends on the critical path (all microbatches) and the tied word embedding's gradient
    all-reduce between the first and last stage (once a step)."""
    bubble: float
    """Pipeline fill and drain: (p - 1)/v microbatch times."""
    dp_comm: float
    """Exposed data-parallel gradient reduction, the mean it takes (a pass over the reduced fp32 gradients), and
    ZeRO-1's parameter all-gather."""
    optimizer: float
    tokens: int
    """Tokens per step (all replicas)."""
    model_flops: float
    """FLOPs of the step without recomputation (what MFU counts)."""
    world_size: int
    peak: float
    """Peak FLOP/s per device that MFU divides by."""
    cp_comm: float = 0.0
    """Context parallelism's collectives and sends (``cp_comm_type``'s; all microbatches)."""
    ep_comm: float = 0.0
    """Expert-parallel all-to-alls of the routed rows (all microbatches)."""
    vocab: float = 0.0
    """Of ``compute``: the passes over vocabulary-sized tensors (:func:`vocab_bytes`), all microbatches."""
    accumulate: float = 0.0
    """Of ``compute``: adding each microbatch's gradients into the fp32 main grads (:func:`grad_accumulation_bytes`)."""
    host: float = 0.0
    """The busiest rank's host dispatching the step's ops (:class:`HostOps` x :attr:`Device.host_op`); 0 where not
    modelled."""

    @property
    def device(self) -> float:
        """The device's part: compute, exposed communication, bubble and optimizer."""
        return (self.compute + self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm + self.bubble + self.dp_comm
                + self.optimizer)

    @property
    def total(self) -> float:
        """The longer of the device's work and the host's dispatch (the host queues kernels ahead of the device)."""
        return max(self.device, self.host)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total

    @property
    def tflops_per_device(self) -> float:
        return self.model_flops / self.total / self.world_size / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.total / self.world_size / self.peak


def padding_flops(m: StepCost, layers: int, tokens: float, *, recompute: bool | None = None,
                  rows: float | None = None) -> float:
    """FLOPs of the rows experts padded to their capacity run beyond the balanced ones (``f - 1`` times ``k`` rows a
    token, :attr:`~lightning_megatron.cost.TransformerCost.expert_rows_factor`; ``rows``: that many times ``k``
    instead), all TP ranks together; 0 without padding."""
    factor = getattr(m, "expert_rows_factor", 1.0)
    if factor == 1:
        return 0.0
    assert isinstance(m, TransformerCost)
    shape = dict(num_layers=layers, hidden_size=m.hidden_size, seq_length=m.seq_length, tokens=tokens, head_tokens=0,
                 vocab_size=0, recompute=m.recompute if recompute is None else recompute, **layer_shape(m))
    routed = (factor - 1 if rows is None else rows) * m.moe_router_topk * m.expert_ffn
    return transformer_flops(ffn_hidden_size=routed, **shape) - transformer_flops(ffn_hidden_size=0, **shape)


def stage_flops(m: StepCost, layout: ParallelDims, stage: int, *, head: bool = True) -> float:
    """FLOPs of one microbatch (forward, backward, recomputation) on one rank of ``stage`` (without
    the LM head's: ``head=False``); a context-parallel rank does ``1/cp`` of them. Under LoRA the output
    layer is frozen: its forward and input-gradient GEMMs, no weight gradient. Experts padded to their capacity
    (:attr:`~lightning_megatron.cost.TransformerCost.expert_rows_factor`) run the padding's GEMMs too (not counted
    by :func:`model_flops`, the MFU's)."""
    t, p = layout.tp, layout.pp
    tokens = m.micro_batch_size * m.seq_length
    r, n, c = recomputed_share(m, layout, stage), sum(stage_layers(m, p, stage, layout.vp)), layout.cp
    # a CP rank runs 1/c of the FLOPs; experts padded to their capacity, the whole microbatch's on every CP rank
    layers = sum(share * (layer_flops(m, n, tokens, t, recompute=again) + padding_flops(m, n, tokens, recompute=again)
                          + (c - 1) * padding_flops(m, n, tokens, recompute=again,
                                                    rows=getattr(m, "expert_rows_factor", 1.0)))
                 for share, again in ((1 - r, False), (r, True)) if share)
    head_flops = 0.0
    if head and stage == p - 1:
        head_flops = transformer_flops(num_layers=0, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn,
                                 seq_length=m.seq_length, tokens=tokens, head_tokens=m.head_fraction * tokens,
                                 vocab_size=m.padded_vocab(t), head_dense=m.head_dense)
        if adapters_only(m):
            head_flops *= 2 / 3
    return (layers + head_flops) / (t * layout.cp)


def elementwise_bytes(m: StepCost, layout: ParallelDims, fw: Framework) -> float:
    """HBM bytes of the memory-bound kernels of one layer, one token, forward, on one rank:
    both norms (read + write h), bias-GeLU (f), two bias-dropout-adds (read x and the residual, write
    the sum and the mask), and without fused attention the softmax (read + write ``a s``) and its
    dropout (read, write, mask); a mask element is ``StepCost.mask_bytes``. A mixture of experts' layer
    (``f`` its active width) also moves its ``k`` routed rows per token: the all-to-all dispatcher gathers
    them in expert order (read and write ``k h``), puts the experts' outputs back into ``[n, k, h]`` slots
    (zeros, then an index copy: ``4 k h``), weighs (``2 k h``) and sums them (read ``k h``, write ``h``):
    ``(9 k + 1) h``, and ``4 k h`` more at EP > 1 (the received rows regrouped by local expert and back);
    every TP rank dispatches its TP group's tokens. The backward moves about twice as much.

    A decoder's layer (a :class:`TransformerCost`) counts what its own ops move, forward and backward, as a
    third of the sum (the caller's 3 passes): a gated MLP's ``act(gate) * up``
    (:func:`~lightning_megatron.transformer.utils.gated_activation`) 5 f forward and 11 f backward (``act(gate)``
    computed again) instead of bias-GeLU's f; rotary embeddings (``position_embedding_type: rope``) 7 elements
    of each query and key forward and 7 backward, ``14 (a + g) d / t``. ``tests/test_estimate.py`` checks both
    against the bytes their ops read and write at dispatch."""
    e, h, f, a, s = m.param_bytes, m.hidden_size, m.ffn, m.num_attention_heads, m.seq_length
    t = layout.tp
    ts = t if layout.sequence_parallel else 1
    drop = m.mask_bytes if m.hidden_dropout > 0 else 0
    gated = isinstance(m, TransformerCost) and m.gated_linear_unit
    n = (4 * h * e + 2 * (3 * e + drop) * h) / ts + (16 / 3 if gated else 2) * f * e / t
    if isinstance(m, TransformerCost) and m.rotary:
        n += 14 / 3 * (a + m.groups) * m.head_dim * e / t
    if not fw.fused_attention:
        n += (2 * e + (2 * e + m.mask_bytes if m.attention_dropout > 0 else 0)) * a * s / t
    if getattr(m, "num_moe_experts", None):
        k = m.moe_router_topk  # type: ignore[attr-defined]
        n += (9 * k + 1 + (4 * k if layout.ep > 1 else 0)) * h * e
    return n


def adapter_bytes(m: StepCost, layout: ParallelDims) -> float:
    """Bytes of one layer's LoRA adapters per token, forward and backward, on one rank (0 without LoRA). An
    adapter beside a projection of ``i`` inputs and ``o`` outputs on this rank (column-parallel: the whole input,
    ``o/t`` outputs; row-parallel: ``i/t`` inputs, the whole output) reads its input in the thin A GEMM (``i``)
    and accumulates its output into the base's in the B GEMM (``addmm``: read and write ``o``) forward;
    backward it reads the output gradient in both B GEMMs (``2 o``), reads the input for A's gradient, writes
    the input gradient and adds it into the base's (``5 i``): ``6 i + 4 o`` elements (the ``[tokens, r]``
    intermediates are negligible). Bound by memory, not by their ``6 r (i + o)`` FLOPs."""
    if not adapters_only(m):
        return 0.0
    assert isinstance(m, TransformerCost)
    t, h, f = layout.tp, m.hidden_size, m.ffn
    mlp = 2 * f if m.gated_linear_unit else f
    qkv = (m.num_attention_heads + 2 * m.groups) * m.head_dim
    sides = {"linear_qkv": (h, qkv // t), "linear_proj": (m.num_attention_heads * m.head_dim // t, h),
             "linear_fc1": (h, mlp // t), "linear_fc2": (f // t, h)}
    return float(sum(6 * sides[n][0] + 4 * sides[n][1] for n in m.lora_targets) * m.param_bytes)


def vocab_bytes(m: StepCost, layout: ParallelDims, stage: int) -> float:
    """Bytes of one microbatch's passes over vocabulary-sized tensors on one rank of ``stage``, forward
    and backward, which :func:`stage_flops` counts only as GEMM FLOPs. With ``W = V/t h e`` (the rank's
    word-embedding shard) and ``n`` head tokens: the first stage's embedding backward writes a dense
    [V/t, h] gradient (W; the token rows added into it are negligible); the last stage's LM head reads
    the tied weight in its forward and its input-gradient GEMM and writes its weight gradient (3W),
    and its fp32 logits [n, V/t] pass 6 times (written; read by the cross entropy's max and exp, its
    softmax written; backward: read, the logits' gradient written); a rank holding both uses of the
    tied weight (no pipelining) sums their two gradients (read 2W, write W). Under LoRA both are frozen: no
    gradient is written, the head reads its weight twice (2W).

    Negligible on a GPU (a few GB at HBM speed against a large GEMM); on a CPU the head's GEMMs have
    few rows (BERT: the masked tokens), which makes them bound by these bytes, not by their FLOPs."""
    t, p = layout.tp, layout.pp
    w = m.padded_vocab(t) // t * m.hidden_size * m.param_bytes
    frozen = adapters_only(m)
    n = 0.0
    if stage == 0 and not frozen:
        n += w
    if stage == p - 1:  # a context-parallel rank's logits: its s/cp tokens
        n += (2 if frozen else 3) * w
        n += 6 * m.head_fraction * m.seq_length / layout.cp * m.micro_batch_size * (m.padded_vocab(t) // t) * 4
    if p == 1 and not frozen and not getattr(m, "untie_embeddings_and_output_weights", False):
        n += 3 * w
    return n


def deferred_head_flops(m: StepCost, layout: ParallelDims, *, per_step: bool = False) -> float:
    """FLOPs of the output layer's weight gradient of one microbatch on a last-stage rank when the model defers it to
    the pipeline flush (``defer_embedding_wgrad_compute`` with pipeline parallelism; megatron-core's name), else 0:
    ``2 n h V/t`` for the ``n`` head tokens of the rank's ``s/cp`` (a third of the head's :func:`stage_flops`, the dense
    layer before a BERT head excepted). With ``per_step`` (the CPU tuning's ``weight_grads_per_step``,
    :attr:`Framework.weight_grads_per_step`) whenever the output layer owns its weight: on a pipeline's last stage, or
    untied (a tied one without PP uses the embedding's, whose two gradients autograd sums). Frozen under LoRA: nothing
    deferred."""
    if adapters_only(m):
        return 0.0
    if per_step:
        deferred = layout.pp > 1 or getattr(m, "untie_embeddings_and_output_weights", False)
    else:
        deferred = getattr(m, "defer_embedding_wgrad_compute", False) and layout.pp > 1
    if not deferred:
        return 0.0
    tokens = m.head_fraction * m.seq_length * m.micro_batch_size
    return 2 * tokens * m.hidden_size * m.padded_vocab(layout.tp) / (layout.tp * layout.cp)


def step_weight_parameters(m: StepCost, layout: ParallelDims, stage: int) -> float:
    """Weights of the column- and row-parallel layers of a rank of ``stage`` whose gradients the CPU tuning's
    ``weight_grads_per_step`` (:attr:`Framework.weight_grads_per_step`) computes once per step: each layer's qkv,
    projection and MLP weights over ``t`` (a mixture of experts' layer: its shared experts'; the routed experts are not
    such layers); the output layer's is :func:`deferred_head_flops`'s. None under LoRA (the bases are frozen, the
    adapters are not such layers). A weight's gradient is ``2`` FLOPs per token of it."""
    if adapters_only(m):
        return 0.0
    ffn = m.ffn
    if getattr(m, "num_moe_experts", None):
        ffn = getattr(m, "moe_shared_expert_intermediate_size", None) or 0
    per_token = transformer_flops(num_layers=sum(stage_layers(m, layout.pp, stage, layout.vp)),
                                  hidden_size=m.hidden_size, ffn_hidden_size=ffn, seq_length=0, tokens=1,
                                  head_tokens=0, vocab_size=0, **layer_shape(m))
    return per_token / 6 / layout.tp


def grad_accumulation_bytes(params: int, grad_bytes: int, microbatches: int, fw: Framework) -> float:
    """Bytes per step of adding the microbatches' gradients into the fp32 main grads on a rank holding
    ``params`` parameters whose ``.grad`` has ``grad_bytes`` per element: the GradBuffer's hook copies
    the first microbatch's (read ``e``, write 4) and adds each later one (read ``e``, read and write
    4): ``params (m (e + 4) + (m - 1) 4)``; 0 when the GEMMs accumulate themselves
    (``Framework.fused_grad_accumulation``). A memory-bound pass over the rank's parameters per
    microbatch, at the copy rate."""
    if fw.fused_grad_accumulation:
        return 0.0
    return float(params * (microbatches * (grad_bytes + 4) + (microbatches - 1) * 4))


def estimate_time(m: StepCost, layout: ParallelDims, dev: Device, eff: Efficiency = Efficiency(),
                  fw: Framework = Framework(), *, schedule: str | PipelineSchedule = AUTO) -> StepTime:
    """Predicted :class:`StepTime` of one optimizer step of ``m`` at ``layout`` on ``dev`` devices under
    the pipeline ``schedule`` (a registered name, ``"auto"``: the layout's)."""
    t, p, d, v, c = layout.tp, layout.pp, layout.dp, layout.vp or 1, layout.cp
    e, s, b, h = m.param_bytes, m.seq_length, m.micro_batch_size, m.hidden_size
    microbatches = m.global_batch_size // (b * d)
    share = 1.0 if dev.cores is None else dev.cores / layout.world_size
    threads = dev.kernel_cores(share)  # a CPU rank's intra-op threads do not add up linearly
    peak = dev.flops_16 if e == 2 else dev.flops_32
    gemm_rate, mem_rate = peak * eff.gemm * threads, dev.hbm * eff.memory * share
    kernel_rate = (dev.elementwise or dev.hbm) * eff.memory * threads
    vocab_rate = (dev.vocab or dev.hbm) * eff.memory * threads
    # the output layer's deferred weight gradient of a microbatch (its GEMM, its [V/t, h] gradient written), and how
    # many microbatches' wait for the flush: all of them, or the model's wgrad_deferral_limit; the CPU tuning's
    # weight_grads_per_step defers the layers' weight gradients of all of them too (one GEMM per weight)
    per_step, head_weights = fw.weight_grads_per_step, m.padded_vocab(t) // t * h
    head_mb = deferred_head_flops(m, layout, per_step=per_step) / gemm_rate
    if head_mb:
        head_mb += head_weights * e / vocab_rate
    limit = 0 if per_step else getattr(m, "wgrad_deferral_limit", 0)
    waiting = min(limit, microbatches) if limit else microbatches
    # per layer of a stage (the stages' layers as the model splits them: stage_layers), then each stage's
    layer_bytes = (elementwise_bytes(m, layout, fw) + adapter_bytes(m, layout) / 3) * s / c * b  # LoRA's adapters
    # each stage: its GEMMs, layers' elementwise kernels, vocabulary passes and grad accumulation, and its
    # collectives and sends a microbatch (stage_messages); the slowest stage sets the pace
    stages, messages, drains = [], {}, []
    for stage in range(p):
        layers, r = sum(stage_layers(m, p, stage, layout.vp)), recomputed_share(m, layout, stage)
        elementwise = layer_bytes * layers * (3 + r) / kernel_rate  # forward, backward (~2x), recomputed forward
        vocab_s = vocab_bytes(m, layout, stage) / vocab_rate
        params_s = trained_parameters(m, layout, stage, schedule)
        # a microbatch's weight gradients waiting for the flush leave the steady state (with a limit, the older ones
        # are drained within it); gradients computed once a step are added into main_grad once, at the flush
        weights = step_weight_parameters(m, layout, stage) if per_step else 0.0
        deferred_s = 2 * s / c * b * weights / gemm_rate + (head_mb if stage == p - 1 else 0.0)
        once = weights + (head_weights if stage == p - 1 and head_mb and per_step else 0)
        each_s = grad_accumulation_bytes(params_s - once, e, microbatches, fw) / mem_rate
        once_s = grad_accumulation_bytes(once, e, 1, fw) / mem_rate if once else 0.0
        accumulate_s = each_s + once_s
        total = (stage_flops(m, layout, stage) / gemm_rate + elementwise + vocab_s + each_s / microbatches
                 - deferred_s * waiting / microbatches)
        drains.append(deferred_s * waiting + once_s)
        messages[stage] = stage_messages(m, layout, stage, fw, devices_per_node=dev.devices_per_node,
                                         schedule=schedule)
        comm = tuple(sum(x.seconds(dev, eff) for x in messages[stage] if x.part == part and not x.per_step)
                     for part in ("tp", "cp", "ep", "pp"))
        stages.append((total + sum(comm), total, vocab_s, accumulate_s, comm))
    _, compute_mb, vocab_mb, accumulate, (tp_mb, cp_mb, ep_mb, pp_mb) = max(stages)
    comm_mb = tp_mb + cp_mb + ep_mb + pp_mb
    t_mb = compute_mb + comm_mb
    # The bubble: the schedule's idle fraction of the pipelined time, in microbatches of the other stages (the
    # slowest runs back to back; 1F1B waits once for each other stage's forward filling the pipe and backward
    # draining it: with a first stage lighter than the last, which holds the head, less than a slowest one's).
    idle = layout_schedule(layout, schedule).bubble(p, layout.vp, microbatches)  # of the pipelined time
    others = sorted(total for _, total, _, _, _ in stages)[:-1]
    t_other = sum(others) / len(others) + comm_mb if others else t_mb
    bubble = idle / (1 - idle) * microbatches * t_other
    # each rank computes its deferred weight gradients after its last backward pass: the last stage's while the
    # earlier stages still run theirs (the bubble's drain, about 2/3 of it: a backward is ~2/3 of a microbatch), a
    # stage s's while the s stages before it do (s/(p-1) of the drain), the first stage's after the schedule: the
    # step ends with the stage whose drain is exposed longest
    hidden = [2.0 / 3.0 * bubble * stage / (p - 1) if p > 1 else 0.0 for stage in range(p)]
    flush = max(0.0, *(drain - hide for drain, hide in zip(drains, hidden)))
    # once a step: the tied word embedding's gradient (first and last stage), and DP on the fullest stage:
    # ZeRO-1 reduce-scatters the grads and all-gathers the params
    tied, sp_grads = (max(sum(x.seconds(dev, eff) for x in msgs if x.part == part and x.per_step)
                          for msgs in messages.values()) for part in ("pp", "tp"))
    params, fullest = max((trained_parameters(m, layout, stage, schedule), stage) for stage in range(p))
    dp = [x for x in messages[fullest] if x.part == "dp"]
    reduce = sum(x.seconds(dev, eff) for x in dp if x.kind != "all_gather")
    gather = sum(x.seconds(dev, eff) for x in dp if x.kind == "all_gather")
    if fw.overlap_grad_reduce:  # hidden behind the last microbatch's backward
        reduce = max(0.0, reduce - 2.0 / 3.0 * compute_mb)
    if fw.overlap_param_gather:  # hidden behind the next step's first forward
        gather = max(0.0, gather - 1.0 / 3.0 * compute_mb)
    experts = getattr(m, "num_moe_experts", None)
    expert_params = m.stage_expert_parameters(t, layout.ep, p, fullest) if experts and not adapters_only(m) else 0
    replicas = ((params - expert_params, d * c), (expert_params, layout.expert_dp))
    owned = sum(n / k for n, k in replicas) if layout.zero1 else params
    optimizer = owned * fw.optimizer_bytes_per_param(e) / mem_rate
    # the DP mean: each reduced fp32 gradient divided by the DP x CP size in place, read and written (GradBuffer's
    # finish; a rank's shard under ZeRO-1)
    mean = owned * 8 / mem_rate if d * c > 1 else 0.0
    host = 0.0
    if dev.host_op is not None and fw.host_ops is not None:  # the busiest host: the last stage's, with the ends
        ops = fw.host_ops
        layer_ops = ops.layer * (1 + recomputed_share(m, layout, p - 1) / 3)  # recomputed: a third of fwd + bwd
        host = (microbatches * (sum(stage_layers(m, p, p - 1, layout.vp)) * layer_ops + ops.ends) + ops.step) \
            * dev.host_op
    return StepTime(layout=layout.name, compute=microbatches * compute_mb + flush,
                    tp_comm=microbatches * tp_mb + sp_grads,
                    cp_comm=microbatches * cp_mb, ep_comm=microbatches * ep_mb, pp_comm=microbatches * pp_mb + tied,
                    bubble=bubble, dp_comm=reduce + gather + mean, optimizer=optimizer,
                    tokens=m.global_batch_size * s, model_flops=model_flops(m), world_size=layout.world_size,
                    peak=peak * share, vocab=microbatches * vocab_mb, accumulate=accumulate, host=host)
