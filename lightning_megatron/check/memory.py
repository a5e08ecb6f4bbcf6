"""Closed-form bytes per rank of a layout: parameters, gradients, optimizer state, activations.

Two halves. The model declares its own costs (:class:`~lightning_megatron.protocols.MemoryCost`:
parameters per stage, activation bytes per layer and microbatch, what the first and last stage add);
:class:`ModelShape` is that declaration for transformer encoders (BERT), and a model family with other
layers returns its own from its module's ``estimate_shape``. :func:`estimate_stage` adds the layout's
part for any model: fp32 gradients and optimizer state from the parameter count, ZeRO-1 shards, and
the microbatches in flight under the pipeline schedule (its ``in_flight``:
:mod:`lightning_megatron.pipeline.registry`).

The formulas (derivation in docs/memory.md, section "Predicting memory per rank") count what this
library allocates, tensor by tensor; ``lightning-megatron check --estimate-memory`` prints them next
to the bytes a check run measured, and ``--gpus N --gpu-memory 80GB`` lists the layouts that fit.
Pure arithmetic: no torch, no process groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.pipeline.registry import AUTO, PipelineSchedule, get_schedule

if TYPE_CHECKING:
    from typing_extensions import Self

    from lightning_megatron.language.config import LanguageModelConfig
    from lightning_megatron.protocols import MemoryCost

__all__ = ["ModelShape", "MemoryEstimate", "LayoutSearch", "candidate_layouts", "search_layouts", "estimate_memory",
           "estimate_stage", "layout_schedule"]

DEFAULT_DROPOUT = 0.1
"""``BertConfig``'s default ``hidden_dropout`` and ``attention_dropout`` (a test keeps them equal)."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes the formulas need (a BertConfig's fields plus the batch: :meth:`from_config`)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None = None
    """None: 4 x hidden_size."""
    vocab_size: int = 30522
    make_vocab_size_divisible_by: int = 128
    max_sequence_length: int = 512
    """Learned position embeddings (rows)."""
    seq_length: int = 128
    """Tokens per sample in the batch."""
    micro_batch_size: int = 8
    global_batch_size: int = 32
    masked_lm_prob: float = 0.15
    """Fraction of tokens in the LM head (it runs on the masked tokens only)."""
    params_dtype: str = "float32"
    optimizer: str = "adamw"
    post_norm: bool = False
    """Hugging Face-style post-norm spec (an embedding LayerNorm instead of the final one)."""
    rmsnorm: bool = False
    """Norms without bias."""
    recompute: bool = False
    """Full activation recomputation (only each layer's input is kept)."""
    attention_backend: str = "auto"
    """"sdpa" (fused: saves a log-sum-exp), "unfused" (saves the [b, a, s, s] probabilities) or "auto"."""
    on_cpu: bool = False
    """With "auto": CPU runs 16-bit attention unfused (fp32 without dropout: sdpa); accelerators sdpa."""
    hidden_dropout: float = DEFAULT_DROPOUT
    """Dropout after the embeddings and in both bias-dropout-adds of every layer (a saved mask each)."""
    attention_dropout: float = DEFAULT_DROPOUT
    """Dropout of the attention probabilities (a saved mask on the unfused path; fused sdpa saves none)."""

    family: str = "bert"
    """"bert": the LM head (with its dense layer) runs on the masked tokens; "gpt": on every token,
    without the dense layer (step-time estimates of decoder configurations, docs/check.md)."""

    @classmethod
    def from_config(cls, config: LanguageModelConfig, **shape: Any) -> Self:
        """The sizes of a model's config record (a ``LanguageModelConfig``: ``BertConfig``, ``GPTConfig``),
        with ``shape`` the rest (the batch, the resolved ``vocab_size``, the optimizer, ...)."""
        sizes = dict(num_layers=config.num_layers, hidden_size=config.hidden_size,
                     num_attention_heads=config.num_attention_heads, ffn_hidden_size=config.ffn_hidden_size,
                     vocab_size=config.vocab_size, make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
                     max_sequence_length=config.max_sequence_length,
                     params_dtype=str(config.params_dtype).removeprefix("torch."),
                     recompute=config.recompute_granularity == "full", attention_backend=config.attention_backend,
                     hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout)
        return cls(**{**sizes, **shape})

    def __post_init__(self) -> None:
        if self.family not in ("bert", "gpt"):
            raise ValueError(f"family={self.family!r} must be 'bert' or 'gpt'")
        for name, p in (("hidden_dropout", self.hidden_dropout), ("attention_dropout", self.attention_dropout)):
            if not 0 <= p < 1:
                raise ValueError(f"{name}={p} must be in [0, 1)")

    @property
    def head_fraction(self) -> float:
        """Fraction of the tokens that go through the LM head."""
        return 1.0 if self.family == "gpt" else self.masked_lm_prob

    @property
    def head_dense(self) -> bool:
        return self.family != "gpt"

    @property
    def unfused_attention(self) -> bool:
        if self.attention_backend != "auto":
            return self.attention_backend == "unfused"
        return self.on_cpu and (self.param_bytes != 4 or self.attention_dropout > 0)

    @property
    def mask_bytes(self) -> int:
        """Bytes per element of a saved dropout mask: ``F.dropout``'s bool mask; the CPU kernel's 0/1 in
        the activation dtype (lightning_megatron.cpu)."""
        return self.param_bytes if self.on_cpu else 1

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def param_bytes(self) -> int:
        return 4 if self.params_dtype in ("float32", "fp32") else 2

    def padded_vocab(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / multiple) * multiple

    # ------------------------------------------------------------ protocols.MemoryCost

    def stage_parameters(self, tp: int, pp: int, stage: int) -> int:
        return _stage_params(self, tp, pp, stage, self.num_layers // pp)

    def layer_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        return _layer_activations(self, tp, sequence_parallel)

    def layer_input_bytes(self, tp: int, sequence_parallel: bool) -> float:
        return self.param_bytes * self.seq_length * self.micro_batch_size * self.hidden_size / (
            tp if sequence_parallel else 1)

    def first_stage_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        """The embedding dropout's mask."""
        if self.hidden_dropout <= 0:
            return 0.0
        return self.mask_bytes * self.seq_length * self.micro_batch_size * self.hidden_size / (
            tp if sequence_parallel else 1)

    def last_stage_activation_bytes(self, tp: int) -> float:
        return _head_activations(self, tp)

    def tensor_parallel_problem(self, tp: int) -> str | None:
        if self.num_attention_heads % tp or self.ffn % tp:
            return f"TP={tp} does not divide {self.num_attention_heads} heads / FFN {self.ffn}"
        return None

    def describe(self) -> str:
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, {self.num_attention_heads} heads, ffn "
                f"{self.ffn}, vocab {self.vocab_size}, seq {self.seq_length}, micro batch {self.micro_batch_size}, "
                f"global batch {self.global_batch_size}, {self.params_dtype}, {self.optimizer}"
                f"{', full recompute' if self.recompute else ''}, dropout {self.hidden_dropout:g}/"
                f"{self.attention_dropout:g}")


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


def _stage_params(m: ModelShape, t: int, pp: int, stage: int, layers: int) -> int:
    h, f = m.hidden_size, m.ffn
    norm = h if m.rmsnorm else 2 * h
    v = m.padded_vocab(t)
    # Per layer: qkv, proj, fc1, fc2 weights split over t; qkv and fc1 biases split; proj and fc2
    # biases and the two norms replicated.
    n = layers * ((4 * h * h + 2 * h * f) // t + (3 * h + f) // t + 2 * h + 2 * norm)
    if stage == 0:
        n += v // t * h + m.max_sequence_length * h + 2 * h + (norm if m.post_norm else 0)
    if stage == pp - 1:
        n += (0 if m.post_norm else norm)  # final norm
        n += h * h + h + norm + v // t  # LM head dense + norm, output bias (vocab-parallel)
        n += h * h + h + 2 * h + 2  # pooler, binary head
        if pp > 1:
            n += v // t * h  # the last stage's copy of the tied word embedding
    return n


def _layer_activations(m: ModelShape, t: int, sp: bool) -> float:
    """Bytes saved for backward by one layer for one microbatch (see docs/memory.md)."""
    s, b, h, f, a = m.seq_length, m.micro_batch_size, m.hidden_size, m.ffn, m.num_attention_heads
    e = m.param_bytes
    replicated = 4 * h / (t if sp else 1)  # both norms' inputs and outputs
    parallel = (4 * h + 2 * f) / t  # q, k, v and the attention output; fc1 output and GeLU output
    stats = 4 * 4 * s * b / (t if sp else 1)  # fp32 mean/rstd of the two norms
    # sdpa keeps the attention's log-sum-exp (fp32); the unfused path its probabilities [b, a/t, s, s]
    attention = e * b * a * s * s / t if m.unfused_attention else 4 * b * a * s / t
    masks = 0.0
    if m.hidden_dropout > 0:  # the two bias-dropout-adds
        masks += 2 * m.mask_bytes * s * b * h / (t if sp else 1)
    if m.attention_dropout > 0 and m.unfused_attention:  # its mask and the dropped probabilities
        masks += (m.mask_bytes + e) * b * a * s * s / t
    return e * s * b * (replicated + parallel) + stats + attention + masks


def _head_activations(m: ModelShape, t: int) -> float:
    s, b, h, e = m.seq_length, m.micro_batch_size, m.hidden_size, m.param_bytes
    n = m.masked_lm_prob * s * b
    return e * (s * b * h + 5 * n * h + n * m.padded_vocab(t) / t + 2 * b * h) + 8 * s * b


def layout_schedule(layout: ParallelDims, schedule: str | PipelineSchedule = AUTO) -> PipelineSchedule:
    """The pipeline schedule ``layout`` runs: ``schedule`` by name (``"auto"``: the layout's own), or as given."""
    if isinstance(schedule, PipelineSchedule):
        return schedule
    return get_schedule(schedule, layout.pp, layout.vp)


def estimate_stage(m: MemoryCost, layout: ParallelDims, stage: int, *,
                   schedule: str | PipelineSchedule = AUTO) -> MemoryEstimate:
    """Bytes on a rank of pipeline stage ``stage`` of ``layout`` for the model whose costs are ``m``,
    under the pipeline ``schedule`` (a registered name, ``"auto"``: the layout's)."""
    t, pp, d, vp = layout.tp, layout.pp, layout.dp, layout.vp or 1
    if m.num_layers % (pp * vp):
        raise ValueError(f"num_layers={m.num_layers} is not divisible by pp x vp = {pp * vp}")
    microbatches = m.global_batch_size // (m.micro_batch_size * d)
    if microbatches < 1 or m.global_batch_size % (m.micro_batch_size * d):
        raise ValueError(f"global batch {m.global_batch_size} is not divisible by micro batch "
                         f"{m.micro_batch_size} x dp {d}")
    per_chunk = m.num_layers // (pp * vp)
    n = m.stage_parameters(t, pp, stage)
    e = m.param_bytes
    shard = math.ceil(n / d)
    grads = 4 * shard * d if layout.zero1 else 4 * n  # fp32 main grads (ZeRO-1: one padded flat buffer)
    moments = 8 if m.optimizer in ("adam", "adamw") else 4
    main = 4 if (e != 4 or layout.zero1) else 0  # fp32 main copy: 16-bit params, or the ZeRO-1 shard
    opt = (moments + main) * (shard if layout.zero1 else n)
    chunks = layout_schedule(layout, schedule).in_flight(pp, layout.vp, stage, microbatches)
    sp = layout.sequence_parallel
    layer = m.layer_activation_bytes(t, sp)
    head = m.last_stage_activation_bytes(t) if stage == pp - 1 else 0.0
    if m.recompute:
        # Each layer keeps only its input. The peak is the forward's (with the head) or, in the
        # backward, after the head's backward, one layer's activations computed again.
        act = chunks * per_chunk * m.layer_input_bytes(t, sp) + max(head, layer)
    else:
        act = chunks * per_chunk * layer + head
    if stage == 0:  # e.g. the embedding dropout's mask, once per first-chunk forward
        act += -(-chunks // vp) * m.first_stage_activation_bytes(t, sp)
    return MemoryEstimate(layout=layout.name, params=n, param_bytes=e * n, grad_bytes=grads, optimizer_bytes=opt,
                          activation_bytes=int(act), stage=stage)


def estimate_memory(m: MemoryCost, layout: ParallelDims, *, schedule: str | PipelineSchedule = AUTO) -> MemoryEstimate:
    """Bytes on the fullest rank of ``layout`` (the pipeline stage with the largest total)."""
    return max((estimate_stage(m, layout, s, schedule=schedule) for s in range(layout.pp)),
               key=lambda e: e.total_bytes)


@dataclass(frozen=True, kw_only=True)
class LayoutSearch:
    """The layouts of N ranks a model allows, and what was left out and why."""

    layouts: list[ParallelDims]
    skipped: dict[str, int]
    """Reason -> how many TP x PP (x VP) x DP combinations it excluded."""


def _divisors(n: int) -> list[int]:
    return [x for x in range(1, n + 1) if n % x == 0]


def search_layouts(m: MemoryCost, gpus: int, max_tp: int = 8, max_vp: int | None = None) -> LayoutSearch:
    """Every TP x PP (x VP) x DP of ``gpus`` ranks, with and without SP and ZeRO-1, that the model's
    sizes and the batch allow; each excluded combination is counted under its reason.

    VP: every v >= 2 (up to ``max_vp``) dividing the layers per stage; the interleaved schedule needs
    the microbatches per step divisible by PP.
    """
    out: list[ParallelDims] = []
    skipped: dict[str, int] = {}

    def skip(reason: str, n: int = 1) -> None:
        skipped[reason] = skipped.get(reason, 0) + n

    G, b = m.global_batch_size, m.micro_batch_size
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
            d = gpus // (t * pp)
            if m.num_layers % pp:
                skip(f"PP={pp} does not divide {m.num_layers} layers")
                continue
            if G % (b * d):
                skip(f"DP={d} does not divide global batch {G} into micro batches of {b}")
                continue
            microbatches = G // (b * d)
            vps: list[int | None] = [None]
            if pp > 1:
                for v in _divisors(m.num_layers // pp)[1:]:
                    if max_vp is not None and v > max_vp:
                        continue
                    if microbatches % pp:
                        skip(f"VP with PP={pp}: the microbatches per step (G / (b x DP)) are not divisible by PP")
                    else:
                        vps.append(v)
            for v in vps:
                for sp in ((False, True) if t > 1 else (False,)):
                    for zero1 in ((False, True) if d > 1 else (False,)):
                        out.append(ParallelDims(tp=t, pp=pp, vp=v, dp=d, sequence_parallel=sp, zero1=zero1))
    return LayoutSearch(layouts=out, skipped=skipped)


def candidate_layouts(m: MemoryCost, gpus: int, max_tp: int = 8) -> list[ParallelDims]:
    """The layouts of :func:`search_layouts` (without the reasons for the ones left out)."""
    return search_layouts(m, gpus, max_tp).layouts
