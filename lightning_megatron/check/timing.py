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
from typing import Any

from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.cost.memory import estimate_stage, layout_schedule, stage_layers
from lightning_megatron.cost.protocols import StepCost
from lightning_megatron.cost.transformer import TransformerCost
from lightning_megatron.flops import transformer_flops
from lightning_megatron.pipeline.registry import AUTO, PipelineSchedule

__all__ = ["Device", "Efficiency", "Framework", "HostOps", "Message", "STEP_OPS", "StepTime",
           "adapter_bytes", "collective_time", "elementwise_bytes", "estimate_time", "grad_accumulation_bytes",
           "layer_flops", "model_flops", "stage_flops", "stage_messages", "stage_traffic", "vocab_bytes"]


@dataclass(frozen=True, kw_only=True)
class Device:
    """Rates of one accelerator and its links (datasheet figures or measured: see ``devices``)."""

    name: str
    flops_16: float
    """Dense bf16/fp16 FLOP/s (no sparsity)."""
    flops_32: float
    """Dense fp32 FLOP/s (what fp32 matmuls get without TF32)."""
    hbm: float
    """Memory bandwidth, bytes/s."""
    link_intra: float
    """Bandwidth per device within a node, one direction, bytes/s (NVLink)."""
    link_inter: float
    """Bandwidth per device between nodes, bytes/s (the node's InfiniBand / devices per node)."""
    devices_per_node: int = 8
    latency_intra: float = 10e-6
    """Seconds per collective or send within a node."""
    latency_inter: float = 20e-6
    """Seconds per collective or send between nodes."""
    p2p: float | None = None
    """Bandwidth of pipeline sends when they take another path than the collectives (a host whose
    collectives go through shared memory and sends through gloo); None: the group's link."""
    p2p_latency: float = 0.0
    """Seconds per send on that path."""
    elementwise: float | None = None
    """Bytes/s the model's memory-bound kernels reach, as counted by :func:`elementwise_bytes` (None:
    ``hbm``). A CPU's norms, GELU, softmax and dropout run far below its copy bandwidth: measured on
    this machine from one transformer layer (``devices.measure_this_machine``)."""
    vocab: float | None = None
    """Bytes/s of the passes over vocabulary-sized tensors, as counted by :func:`vocab_bytes` (None:
    ``hbm``). On a CPU the LM head's GEMMs with few rows (the masked tokens) against the [V, h]
    weight run far below the GEMM rate and the dense embedding gradient is written into fresh memory:
    measured on this machine from the model's embedding, heads and loss (``devices.measure_this_machine``)."""
    host_op: float | None = None
    """Seconds of host time per aten op the training step dispatches (Python, autograd, the kernel's launch):
    an accelerator runs its kernels while the host queues the next ones, so a step takes at least its ops times
    this (:class:`HostOps`). None: the host runs the kernels itself (a CPU; their dispatch is inside the measured
    rates)."""
    cores: int | None = None
    """A host without accelerators: the rates are per core, and each of a layout's ranks gets
    ``cores / world_size`` cores (threads when fewer ranks than cores, time slices when more)."""
    source: str = ""


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Achievable fractions of the datasheet rates (1.0 for measured rates)."""

    gemm: float = 0.7
    """Of the dense peak, for the model's GEMMs (large cuBLAS GEMMs reach ~0.75-0.85; attention less)."""
    memory: float = 0.8
    """Of the HBM bandwidth, for elementwise kernels."""
    link: float = 0.8
    """Of the link bandwidth, for NCCL collectives (bus bandwidth over link bandwidth)."""

    def __post_init__(self) -> None:
        for name, value in (("gemm", self.gemm), ("memory", self.memory), ("link", self.link)):
            if not 0 < value <= 1:
                raise ValueError(f"efficiency {name}={value} must be in (0, 1] (a fraction of the device's rate)")


MEASURED = Efficiency(gemm=1.0, memory=1.0, link=1.0)

STEP_OPS = 350
"""Host work once an optimizer step, in ops at the training step's host time per op: the wrapper's flat step,
zero-grad, Lightning's loop and its logging (``benchmarks/host_step.py``'s phases; docs/check.md, "Host")."""


@dataclass(frozen=True, kw_only=True)
class HostOps:
    """The aten ops (views included) one rank's host dispatches for a step of the model, counted on a small copy
    of it (:func:`lightning_megatron.check.host_ops.count_host_ops`: its two-layer model's ops less its one-layer
    model's): they do not depend on the width, the sequence or the batch. Not counted: the TP, CP and EP
    collectives' few ops per layer."""

    layer: int
    """One layer's forward and backward of one microbatch, and the GradBuffer hook's op per trained parameter."""
    ends: int
    """The embeddings, heads and loss of one microbatch, their hook ops included (counted on the last stage)."""
    step: int = STEP_OPS
    """Once a step: :data:`STEP_OPS`."""


@dataclass(frozen=True, kw_only=True)
class Framework:
    """What the training code does that changes the time (defaults: this library's)."""

    grad_reduce_bytes: int = 4
    """Bytes per gradient element in the DP reduction (fp32 ``main_grad`` here)."""
    overlap_grad_reduce: bool = True
    """DP reduction started during the last microbatch's backward (``MegatronStrategy(overlap_grad_reduce)``,
    on by default except with the CPU tuning's synchronous shared-memory collectives)."""
    overlap_param_gather: bool = False
    """ZeRO-1 parameter all-gather hidden behind the next forward."""
    overlap_sp_gather: bool = True
    """Under sequence parallelism the backward gathers the qkv and fc1 layers' inputs again
    (:mod:`~lightning_megatron.tensor_parallel.layers`) while their input gradients' GEMMs run: hidden with
    asynchronous collectives (NCCL, gloo), exposed with the CPU tuning's synchronous shared-memory ones."""
    p2p_scatter_gather: bool = False
    """Megatron's scatter/gather of pipeline sends between nodes: each TP rank sends 1/t."""
    fused_attention: bool = True
    """Attention without [b, a, s, s] tensors in memory (flash / memory-efficient sdpa)."""
    optimizer_bytes: int | None = None
    """Bytes read + written per trained parameter by the optimizer step; None: this library's wrappers
    (:meth:`optimizer_bytes_per_param`)."""
    fused_grad_accumulation: bool = False
    """The weight-gradient GEMMs add into the fp32 ``main_grad`` themselves (megatron-core's
    ``gradient_accumulation_fusion``). Off here: each microbatch's backward writes ``param.grad`` and
    the GradBuffer's hook adds it into ``main_grad`` (:func:`grad_accumulation_bytes`)."""
    host_ops: HostOps | None = None
    """What the host dispatches per step, for a device with a :attr:`Device.host_op` (None: not modelled)."""

    def optimizer_bytes_per_param(self, param_bytes: int) -> int:
        """``optimizer_bytes``, or what the wrappers move per parameter of ``param_bytes``-byte params: Adam over
        the fp32 (main) params reads the param, its grad and both moments and writes the param and the moments
        (28), the norm reads the grads (4), and with 16-bit params the fp32 main params are copied back into them
        (read 4, write ``param_bytes``): 32 in fp32, 38 in bf16."""
        if self.optimizer_bytes is not None:
            return self.optimizer_bytes
        return 32 + (4 + param_bytes if param_bytes < 4 else 0)


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Predicted seconds of one optimizer step of a layout, by part."""

    layout: str
    compute: float
    """GEMMs, elementwise kernels, vocabulary passes and gradient accumulation of every microbatch on the
    slowest stage (bubble excluded)."""
    tp_comm: float
    """Tensor-parallel collectives on the critical path (all microbatches; under SP, once a step, the sum of the
    gradients of the parameters that saw a chunk of the sequence)."""
    pp_comm: float
    """Pipeline sends on the critical path (all microbatches) and the tied word embedding's gradient
    all-reduce between the first and last stage (once a step)."""
    bubble: float
    """Pipeline fill and drain: (p - 1)/v microbatch times."""
    dp_comm: float
    """Exposed data-parallel gradient reduction (and ZeRO-1 parameter all-gather)."""
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


def collective_time(kind: str, nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring collective of ``nbytes`` (the full tensor) over ``ranks`` ranks:
    all_reduce ``2(k-1)/k n / bw``, all_gather / reduce_scatter / all_to_all ``(k-1)/k n / bw`` (an
    all-to-all's ``n``: what one rank sends, itself included), send ``n / bw``; plus ``latency``; 0 on
    one rank."""
    if kind == "send":
        return nbytes / bandwidth + latency
    if ranks == 1:
        return 0.0
    factor = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}[kind]
    return factor * (ranks - 1) / ranks * nbytes / bandwidth + latency


def _layer_shape(m: StepCost) -> dict[str, Any]:
    """What :func:`transformer_flops` takes beyond the sizes, where the cost record has it (a
    :class:`TransformerCost`): the query and key/value projection widths (grouped-query attention)
    and a gated MLP (SwiGLU: three h x f matrices); a plain layer's otherwise."""
    if not isinstance(m, TransformerCost):
        return {}
    return dict(query_projection_size=m.num_attention_heads * m.head_dim, kv_projection_size=m.groups * m.head_dim,
                gated_linear_unit=m.gated_linear_unit)


def model_flops(m: StepCost, *, recompute: bool = False) -> float:
    """FLOPs of one step of ``m`` (all replicas): :func:`lightning_megatron.flops.transformer_flops`
    with the output layer on the model's ``head_fraction`` of the tokens (a masked LM's: the masked ones);
    under LoRA what its step runs (:func:`layer_flops`: no weight gradients of the frozen weights, the
    output layer's included; the adapters'), so that its MFU is not inflated by work it skips."""
    tokens = m.global_batch_size * m.seq_length
    head = transformer_flops(num_layers=0, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn, seq_length=m.seq_length,
                             tokens=tokens, head_tokens=m.head_fraction * tokens, vocab_size=m.padded_vocab(1),
                             head_dense=m.head_dense)
    if _lora(m):
        head *= 2 / 3
    return layer_flops(m, m.num_layers, tokens, recompute=recompute) + head


def _lora(m: StepCost) -> bool:
    """Whether ``m`` trains LoRA adapters on a frozen base (its embeddings and output layer frozen too)."""
    return isinstance(m, TransformerCost) and bool(m.lora_rank)


def layer_flops(m: StepCost, layers: int, tokens: float, tp: int = 1, *, recompute: bool | None = None) -> float:
    """FLOPs of ``layers`` layers over ``tokens`` tokens (forward, backward, recomputation), all TP ranks
    together; under LoRA without the frozen weights' weight-gradient GEMMs (2 of each weight's 6 FLOPs per
    token: the weight matmuls alone are the count at seq_length 0) and with all 6 for each adapter weight
    (``tp`` ranks' adapters: a row-parallel adapter's B is on every rank); ``recompute``: the model's when None."""
    shape = dict(num_layers=layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn, tokens=tokens,
                 head_tokens=0, vocab_size=0, **_layer_shape(m))
    flops = transformer_flops(seq_length=m.seq_length, recompute=m.recompute if recompute is None else recompute,
                              **shape)
    if _lora(m):
        assert isinstance(m, TransformerCost)
        flops -= transformer_flops(seq_length=0, **shape) / 3
        flops += 6 * tokens * layers * m.lora_layer_parameters(tp) * tp
    return flops


def recomputed_share(m: StepCost, layout: ParallelDims, stage: int = 0) -> float:
    """The share of the layers of ``stage`` whose forward runs again in the backward: none without recomputation,
    all with "uniform" groups, the first ``recompute_num_layers`` of each chunk with "block"."""
    if not m.recompute:
        return 0.0
    if getattr(m, "recompute_method", None) != "block":
        return 1.0
    chunks = stage_layers(m, layout.pp, stage, layout.vp)
    k = getattr(m, "recompute_num_layers", None) or 1
    return sum(min(k, n) for n in chunks) / sum(chunks)


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
                 vocab_size=0, recompute=m.recompute if recompute is None else recompute, **_layer_shape(m))
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
        if _lora(m):
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
    if not _lora(m):
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
    frozen = _lora(m)
    n = 0.0
    if stage == 0 and not frozen:
        n += w
    if stage == p - 1:  # a context-parallel rank's logits: its s/cp tokens
        n += (2 if frozen else 3) * w
        n += 6 * m.head_fraction * m.seq_length / layout.cp * m.micro_batch_size * (m.padded_vocab(t) // t) * 4
    if p == 1 and not frozen and not getattr(m, "untie_embeddings_and_output_weights", False):
        n += 3 * w
    return n


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


def _bandwidth(dev: Device, eff: Efficiency, crosses_nodes: bool) -> tuple[float, float]:
    if crosses_nodes:
        return dev.link_inter * eff.link, dev.latency_inter
    return dev.link_intra * eff.link, dev.latency_intra


def _trained_parameters(m: StepCost, layout: ParallelDims, stage: int, schedule: str | PipelineSchedule) -> int:
    """Parameter elements with gradients on a rank of ``stage``: its LoRA adapters, else all of them."""
    trainable = getattr(m, "stage_trainable_parameters", None)
    trained = trainable(layout.tp, layout.pp, stage) if trainable is not None else None
    return estimate_stage(m, layout, stage, schedule=schedule).params if trained is None else trained


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
    per_step: bool = False

    @property
    def sent(self) -> float:
        """Bytes a rank puts on the wire for it, all ``times``."""
        return self.times * collective_time(self.kind, self.nbytes, self.ranks, 1.0, 0.0)

    def seconds(self, dev: Device, eff: Efficiency) -> float:
        """Its time on the critical path, all ``times``."""
        if self.hidden or self.times == 0:
            return 0.0
        bw, lat = _bandwidth(dev, eff, self.crosses_nodes)
        if self.p2p and dev.p2p is not None:
            bw, lat = dev.p2p * eff.link, dev.p2p_latency
        return self.times * collective_time(self.kind, self.nbytes, self.ranks, bw, lat)


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
      forward and backward, and sends their fp32 gradients to their owners all-to-all.
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
        inputs = pairs * layers - (1 if stage == 0 and _lora(m) else 0)
        if sp:
            add("tp", "all_gather", x, t, pairs * (n + layers), tp_x)  # column inputs; row outputs' gradients
            add("tp", "reduce_scatter", x, t, pairs * n + inputs, tp_x)  # row outputs; column inputs' gradients
            regathered = m.regathered_inputs if isinstance(m, TransformerCost) else 2
            add("tp", "all_gather", x, t, regathered * layers, tp_x, hidden=fw.overlap_sp_gather)
        else:
            add("tp", "all_reduce", x, t, pairs * n + inputs, tp_x)
        if _lora(m):  # the adapters' [tokens, r] (lora.LoRAAdapter); under SP a column one gathers its A too
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
            add("cp", "send", kv, 2, (c - 1) * (n + layers), cp_x, p2p=True)
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
        if stage in (0, p - 1) and not getattr(m, "untie_embeddings_and_output_weights", False) and not _lora(m):
            add("pp", "all_reduce", m.padded_vocab(t) // t * h * fw.grad_reduce_bytes, 2, 1, t * d * p > dpn,
                per_step=True)
    params = _trained_parameters(m, layout, stage, schedule)
    expert_params = m.stage_expert_parameters(t, ep, p, stage) if experts and not _lora(m) else 0  # LoRA: frozen
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


def estimate_time(m: StepCost, layout: ParallelDims, dev: Device, eff: Efficiency = Efficiency(),
                  fw: Framework = Framework(), *, schedule: str | PipelineSchedule = AUTO) -> StepTime:
    """Predicted :class:`StepTime` of one optimizer step of ``m`` at ``layout`` on ``dev`` devices under
    the pipeline ``schedule`` (a registered name, ``"auto"``: the layout's)."""
    t, p, d, v, c = layout.tp, layout.pp, layout.dp, layout.vp or 1, layout.cp
    e, s, b, h = m.param_bytes, m.seq_length, m.micro_batch_size, m.hidden_size
    microbatches = m.global_batch_size // (b * d)
    share = 1.0 if dev.cores is None else dev.cores / layout.world_size
    peak = dev.flops_16 if e == 2 else dev.flops_32
    gemm_rate, mem_rate = peak * eff.gemm * share, dev.hbm * eff.memory * share
    kernel_rate = (dev.elementwise or dev.hbm) * eff.memory * share
    vocab_rate = (dev.vocab or dev.hbm) * eff.memory * share
    # per layer of a stage (the stages' layers as the model splits them: stage_layers), then each stage's
    layer_bytes = (elementwise_bytes(m, layout, fw) + adapter_bytes(m, layout) / 3) * s / c * b  # LoRA's adapters
    # each stage: its GEMMs, layers' elementwise kernels, vocabulary passes and grad accumulation, and its
    # collectives and sends a microbatch (stage_messages); the slowest stage sets the pace
    stages, messages = [], {}
    for stage in range(p):
        layers, r = sum(stage_layers(m, p, stage, layout.vp)), recomputed_share(m, layout, stage)
        elementwise = layer_bytes * layers * (3 + r) / kernel_rate  # forward, backward (~2x), recomputed forward
        vocab_s = vocab_bytes(m, layout, stage) / vocab_rate
        params_s = _trained_parameters(m, layout, stage, schedule)
        accumulate_s = grad_accumulation_bytes(params_s, e, microbatches, fw) / mem_rate
        total = stage_flops(m, layout, stage) / gemm_rate + elementwise + vocab_s + accumulate_s / microbatches
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
    # once a step: the tied word embedding's gradient (first and last stage), and DP on the fullest stage:
    # ZeRO-1 reduce-scatters the grads and all-gathers the params
    tied, sp_grads = (max(sum(x.seconds(dev, eff) for x in msgs if x.part == part and x.per_step)
                          for msgs in messages.values()) for part in ("pp", "tp"))
    params, fullest = max((_trained_parameters(m, layout, stage, schedule), stage) for stage in range(p))
    dp = [x for x in messages[fullest] if x.part == "dp"]
    reduce = sum(x.seconds(dev, eff) for x in dp if x.kind != "all_gather")
    gather = sum(x.seconds(dev, eff) for x in dp if x.kind == "all_gather")
    if fw.overlap_grad_reduce:  # hidden behind the last microbatch's backward
        reduce = max(0.0, reduce - 2.0 / 3.0 * compute_mb)
    if fw.overlap_param_gather:  # hidden behind the next step's first forward
        gather = max(0.0, gather - 1.0 / 3.0 * compute_mb)
    experts = getattr(m, "num_moe_experts", None)
    expert_params = m.stage_expert_parameters(t, layout.ep, p, fullest) if experts and not _lora(m) else 0
    replicas = ((params - expert_params, d * c), (expert_params, layout.expert_dp))
    owned = sum(n / k for n, k in replicas) if layout.zero1 else params
    optimizer = owned * fw.optimizer_bytes_per_param(e) / mem_rate
    host = 0.0
    if dev.host_op is not None and fw.host_ops is not None:  # the busiest host: the last stage's, with the ends
        ops = fw.host_ops
        layer_ops = ops.layer * (1 + recomputed_share(m, layout, p - 1) / 3)  # recomputed: a third of fwd + bwd
        host = (microbatches * (sum(stage_layers(m, p, p - 1, layout.vp)) * layer_ops + ops.ends) + ops.step) \
            * dev.host_op
    return StepTime(layout=layout.name, compute=microbatches * compute_mb, tp_comm=microbatches * tp_mb + sp_grads,
                    cp_comm=microbatches * cp_mb, ep_comm=microbatches * ep_mb, pp_comm=microbatches * pp_mb + tied,
                    bubble=bubble, dp_comm=reduce + gather, optimizer=optimizer,
                    tokens=m.global_batch_size * s, model_flops=model_flops(m), world_size=layout.world_size,
                    peak=peak * share, vocab=microbatches * vocab_mb, accumulate=accumulate, host=host)
