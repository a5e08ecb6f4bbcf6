"""The costs of transformer layers, from a model's config record: :class:`TransformerCost`.

A layer on one TP rank (megatron-core's layout, any width of key/value groups, plain or gated MLP):

- parameters: ``linear_qkv`` (n + 2g) d h / t, ``linear_proj`` n d h / t, ``linear_fc1`` m f h / t
  (m = 2 for a gated MLP: [gate; up]), ``linear_fc2`` f h / t; biases when ``add_bias_linear`` (qkv and
  fc1 split, proj and fc2 replicated); two norms (h for RMSNorm, 2h for LayerNorm);
- activations per microbatch: both norms' inputs and outputs, q, k, v and the attention output, the
  MLP's intermediate tensors, the norms' fp32 statistics, the attention's softmax (unfused) or
  log-sum-exp (fused), the dropout masks (derivation in docs/memory.md).

The ends are a decoder's (the word embedding and learned positions on the first stage, the final norm
and the output layer on every token on the last, tied or not); a family whose ends differ overrides
:meth:`~TransformerCost.stage_parameters`, :meth:`~TransformerCost.last_stage_activation_bytes`,
:attr:`~TransformerCost.head_fraction` / :attr:`~TransformerCost.head_dense` in its
``models/<family>/cost.py``, and says which layer it builds (:meth:`~TransformerCost.layer_spec`).
Arithmetic only; torch is imported when a layer is built for timing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_megatron.cost.pieces import ModelPieces

if TYPE_CHECKING:
    from typing_extensions import Self

    from lightning_megatron.transformer.config import TransformerConfig

__all__ = ["DEFAULT_DROPOUT", "TransformerCost"]

DEFAULT_DROPOUT = 0.1
"""The config records' default ``hidden_dropout`` and ``attention_dropout`` (a test keeps them equal)."""


@dataclass(frozen=True, kw_only=True)
class TransformerCost(ModelPieces):
    """The sizes the cost formulas need (a config record's fields plus the batch: :meth:`from_config`);
    implements :class:`~lightning_megatron.cost.protocols.StepCost`."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None = None
    """None: 4 x hidden_size."""
    num_query_groups: int | None = None
    """Key/value heads (None: one per query head)."""
    kv_channels: int | None = None
    """Per-head width d (None: hidden_size / num_attention_heads)."""
    gated_linear_unit: bool = False
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` (a table on the first stage), ``rope`` (rotary embeddings in every layer's attention)
    or ``none``: a config's own value (GPTConfig's names), so that each is costed as it runs."""
    vocab_size: int = 30522
    make_vocab_size_divisible_by: int = 128
    max_sequence_length: int = 512
    """Learned position embeddings (rows)."""
    seq_length: int = 128
    """Tokens per sample in the batch."""
    micro_batch_size: int = 8
    global_batch_size: int = 32
    params_dtype: str = "float32"
    optimizer: str = "adamw"
    rmsnorm: bool = False
    """Norms without bias."""
    cp_comm_type: str = "all_gather"
    """How context parallelism's attention communicates (``all_gather``, ``a2a``, ``p2p``: what each keeps,
    :meth:`context_parallel_bytes`)."""
    composite_rmsnorm: bool = False
    """With ``rmsnorm``: torch's RMSNorm runs as its composite of ops (a device without its fused kernel: the CPU,
    where check runs measure), which keeps an fp32 copy of its input and the fp32 normalized input, 8 bytes an
    element, where the fused kernel (a GPU's) keeps the input and its fp32 statistic."""
    recompute: bool = False
    """Full activation recomputation (only each layer's input is kept)."""
    recompute_method: str | None = None
    """With ``recompute``: "uniform" (groups of :attr:`recompute_num_layers` layers of a chunk, each keeping its
    input) or "block" (the first :attr:`recompute_num_layers` layers of a chunk, the rest keeping everything);
    None: one-layer groups."""
    recompute_num_layers: int | None = None
    selective_recompute: bool = False
    """Selective recomputation (megatron-core's): the core attention runs again in the backward, so a layer keeps
    neither its probabilities (unfused) or log-sum-exp (sdpa) nor its dropout's mask, and the backward holds one
    layer's replayed (:meth:`replay_peak_bytes`)."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Layers of the first pipeline stage (None: an even split; :mod:`lightning_megatron.pipeline.layout`)."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Layers of the last pipeline stage, which also holds the head (None: an even split)."""
    defer_embedding_wgrad_compute: bool = False
    """The output layer's weight gradient at the pipeline flush: each microbatch's output gradient and input kept
    until then (:meth:`deferred_output_bytes`)."""
    wgrad_deferral_limit: int = 0
    """With :attr:`defer_embedding_wgrad_compute`, the most microbatches kept until the flush (0: all)."""
    attention_softmax_in_fp32: bool = True
    """The unfused attention's softmax in fp32 (a 16-bit model's keeps those probabilities beside their 16-bit cast:
    :attr:`probability_bytes`)."""
    attention_backend: str = "auto"
    """"sdpa" (fused: saves a log-sum-exp), "unfused" (saves the [b, a, s, s] probabilities) or "auto"."""
    on_cpu: bool = False
    """The opt-in CPU tuning's kernels (:class:`~lightning_megatron.cpu.CPUTuning`, what ``--device this`` times):
    with "auto", 16-bit attention and attention with dropout run unfused, and dropout keeps its masks in the
    activation dtype. False: the library's kernels on every device, the CPU's without the tuning included (sdpa,
    bool masks)."""
    hidden_dropout: float = DEFAULT_DROPOUT
    """Dropout after the embeddings and in both bias-dropout-adds of every layer (a saved mask each)."""
    attention_dropout: float = DEFAULT_DROPOUT
    """Dropout of the attention probabilities (a saved mask on the unfused path; fused sdpa saves none)."""
    num_moe_experts: int | None = None
    """Mixture of experts: routed experts per layer (None: a dense MLP)."""
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    """Each expert's width (None: ``ffn_hidden_size``)."""
    moe_shared_expert_intermediate_size: int | None = None
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity factor ``f``: every expert runs on its capacity, ``f`` times the balanced rows
    (:attr:`expert_rows_factor`)."""
    moe_token_dispatcher_type: str = "alltoall"
    """How the routed rows reach the experts' EP ranks: ``alltoall`` (the rows each way) or ``allgather`` (every
    rank's tokens gathered, the slots reduce-scattered back)."""
    lora_rank: int = 0
    """LoRA adapters' rank (0: none, every parameter trains); with adapters only they have gradients and
    optimizer state, the frozen base its weights alone."""
    lora_targets: tuple[str, ...] = ()
    """The projections with adapters (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' inputs (a saved mask each, and the dropped input A keeps)."""
    compiled_loss: bool = False
    """``compile=True``: at one TP rank the loss keeps its logits for the backward, not an fp32 softmax
    (:meth:`~lightning_megatron.language.LanguageModule.compile_loss`)."""

    @classmethod
    def from_config(cls, config: TransformerConfig, **shape: Any) -> Self:
        """The sizes of a model's config record (a ``TransformerConfig``: ``BertConfig``, ``GPTConfig``, yours),
        with ``shape`` the rest (the batch, the resolved ``vocab_size``, the optimizer, ...)."""
        sizes = dict(num_layers=config.num_layers, hidden_size=config.hidden_size,
                     num_attention_heads=config.num_attention_heads, ffn_hidden_size=config.ffn_hidden_size,
                     num_query_groups=config.num_query_groups, kv_channels=config.kv_channels,
                     gated_linear_unit=config.gated_linear_unit, add_bias_linear=config.add_bias_linear,
                     params_dtype=str(config.params_dtype).removeprefix("torch."),
                     recompute=config.recompute_granularity == "full", attention_backend=config.attention_backend,
                     selective_recompute=config.recompute_granularity == "selective",
                     attention_softmax_in_fp32=config.attention_softmax_in_fp32,
                     recompute_method=config.recompute_method, recompute_num_layers=config.recompute_num_layers,
                     num_layers_in_first_pipeline_stage=config.num_layers_in_first_pipeline_stage,
                     num_layers_in_last_pipeline_stage=config.num_layers_in_last_pipeline_stage,
                     defer_embedding_wgrad_compute=config.defer_embedding_wgrad_compute,
                     wgrad_deferral_limit=config.wgrad_deferral_limit,
                     hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
                     cp_comm_type=config.cp_comm_type)
        if getattr(config, "num_moe_experts", None):
            sizes.update(num_moe_experts=config.num_moe_experts, moe_router_topk=config.moe_router_topk,
                         moe_ffn_hidden_size=config.moe_ffn_hidden_size,
                         moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
                         moe_expert_capacity_factor=config.moe_expert_capacity_factor,
                         moe_pad_expert_input_to_capacity=config.moe_pad_expert_input_to_capacity,
                         moe_token_dispatcher_type=config.moe_token_dispatcher_type)
        for name in ("vocab_size", "make_vocab_size_divisible_by", "max_sequence_length"):
            if getattr(config, name, None) is not None:
                sizes[name] = getattr(config, name)
        return cls(**{**sizes, **shape})

    def __post_init__(self) -> None:
        from lightning_megatron.language.model import POSITION_EMBEDDING_TYPES

        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type={self.position_embedding_type!r} must be one of "
                             f"{POSITION_EMBEDDING_TYPES}")
        for name, p in (("hidden_dropout", self.hidden_dropout), ("attention_dropout", self.attention_dropout)):
            if not 0 <= p < 1:
                raise ValueError(f"{name}={p} must be in [0, 1)")

    # ------------------------------------------------------------ sizes

    @property
    def learned_positions(self) -> bool:
        """A learned position table on the first stage."""
        return self.position_embedding_type == "learned_absolute"

    @property
    def rotary(self) -> bool:
        """Rotary embeddings applied to every layer's queries and keys."""
        return self.position_embedding_type == "rope"

    @property
    def head_fraction(self) -> float:
        """Fraction of the tokens that go through the output layer: all of them."""
        return 1.0

    @property
    def head_dense(self) -> bool:
        """No dense layer before the output layer."""
        return False

    @property
    def unfused_attention(self) -> bool:
        if self.attention_backend != "auto":
            return self.attention_backend == "unfused"
        return self.on_cpu and (self.param_bytes != 4 or self.attention_dropout > 0)

    @property
    def probability_bytes(self) -> int:
        """Bytes an attention probability the unfused attention keeps: its activation dtype's, and a 16-bit model's
        softmax in fp32 (:attr:`attention_softmax_in_fp32`) keeps the fp32 ones too (the CPU tuning's softmax is in
        the activation dtype, :attr:`on_cpu`)."""
        e = self.param_bytes
        return e + (4 if e != 4 and self.attention_softmax_in_fp32 and not self.on_cpu else 0)

    @property
    def regathered_inputs(self) -> int:
        """Of a layer's column-parallel layers (qkv, the dense MLP's fc1, a MoE layer's shared experts' fc1), those
        whose backward under sequence parallelism gathers their input again
        (:mod:`~lightning_megatron.tensor_parallel.layers`): all when they train (the routed experts gather no
        input: the MoE layer gathers its tokens once); none under LoRA (the frozen layers compute no weight
        gradient, an adapter computes A's from this rank's part of the sequence,
        :mod:`~lightning_megatron.transformer.lora`)."""
        if self.lora_rank:
            return 0
        return 1 + (1 if not self.num_moe_experts or self.moe_shared_expert_intermediate_size else 0)

    # ------------------------------------------------------------ communication at the model's ends

    def embedding_messages(self, tp: int, sequence_parallel: bool, tokens: float) -> list[tuple[str, float]]:
        """The word embedding's tensor-parallel collectives on a microbatch of ``tokens`` tokens, as ``(kind, bytes
        of the whole tensor)`` (:func:`~lightning_megatron.check.records.collective_time`'s): the vocab-parallel
        lookup all-reduced, under SP then scattered into SP's chunks (the backward all-gathers the chunks'
        gradients), or, with no learned position (or token-type) rows added, reduce-scattered into them instead
        (:class:`~lightning_megatron.language.model.LanguageModelEmbedding`); none at one TP rank."""
        if tp == 1:
            return []
        act = self.param_bytes * tokens * self.hidden_size
        if not sequence_parallel:
            return [("all_reduce", act)]
        gradient = [] if self.lora_rank else [("all_gather", act)]  # frozen under LoRA: no gradient comes back
        return [("all_reduce" if self.replicated_embedding_rows else "reduce_scatter", act)] + gradient

    def sequence_parallel_parameters(self, pp: int, stage: int) -> int:
        """Trained parameter elements of ``stage`` replicated over TP that see only a rank's chunk of the sequence
        under SP, whose gradients the TP ranks sum once a step: the norms, the row-parallel layers' biases, a MoE
        layer's router (and its shared experts' gate, not counted: a vector), the final norm. Under LoRA (the base
        frozen) the B of each adapter beside a row-parallel projection (``[h, r]``, applied to the rank's chunk)."""
        if self.lora_rank:
            rows = sum(name in ("linear_proj", "linear_fc2") for name in self.lora_targets)
            return self.stage_layer_count(pp, stage) * rows * self.hidden_size * self.lora_rank
        return (self.stage_layer_count(pp, stage) * self.sequence_parallel_layer_parameters
                + (self.norm_parameters if stage == pp - 1 else 0))

    @property
    def sequence_parallel_layer_parameters(self) -> int:
        """Of one layer's parameters, those :meth:`sequence_parallel_parameters` counts."""
        h = self.hidden_size
        biases = (1 if self.num_moe_experts else 2) * h if self.add_bias_linear else 0
        return 2 * self.norm_parameters + biases + (self.num_moe_experts or 0) * h

    @property
    def replicated_embedding_rows(self) -> bool:
        """Rows added to the word embedding's that every TP rank holds whole: learned positions."""
        return self.learned_positions

    def head_messages(self, tp: int, sequence_parallel: bool, tokens: float) -> list[tuple[Any, ...]]:
        """The output layer's and the vocab-parallel loss's tensor-parallel collectives on a microbatch of
        ``tokens`` tokens, as :meth:`embedding_messages`'s (a third element True: a gather of an input again for a
        weight gradient, which runs beside the input gradient's GEMM): under SP the column-parallel output layer
        gathers its input (forward), gathers it again for its weight gradient when it trains and reduce-scatters
        its input gradient; without SP it all-reduces
        its input gradient (backward); the cross entropy all-reduces three fp32 values a token (the logits' max,
        the sum of exponentials, the target's logit). None at one TP rank."""
        if tp == 1:
            return []
        n = self.head_fraction * tokens
        act = self.param_bytes * n * self.hidden_size
        loss = [("all_reduce", 4.0 * n)] * 3
        if not sequence_parallel:
            return [("all_reduce", act)] + loss
        again = [] if self.lora_rank else [("all_gather", act, True)]
        return [("all_gather", act)] + again + [("reduce_scatter", act)] + loss

    def keeps_input(self, name: str) -> bool:
        """Whether the projection ``name`` (``linear_qkv``, ``linear_fc1``, ``linear_fc2``) keeps its input for a
        weight gradient, its own or its LoRA adapter's A: a frozen one without an adapter keeps none."""
        return not self.lora_rank or name in self.lora_targets

    @property
    def mask_bytes(self) -> int:
        """Bytes per element of a saved dropout mask: ``F.dropout``'s bool mask; the CPU kernel's 0/1 in
        the activation dtype (lightning_megatron.cpu)."""
        return self.param_bytes if self.on_cpu else 1

    @property
    def ffn(self) -> int:
        """The MLP's width a token passes through: a mixture of experts' active width (k experts and the
        shared ones), what its compute and activations scale with under balanced routing (megatron-core's FLOP
        count: the router's [h, E] matmul not counted)."""
        if self.num_moe_experts:
            return self.moe_router_topk * self.expert_ffn + (self.moe_shared_expert_intermediate_size or 0)
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def expert_rows_factor(self) -> float:
        """The routed experts' rows against balanced routing's ``k`` a token: the capacity factor when they are
        padded to their capacity, else 1 (balanced; a capacity that drops rows only lowers it)."""
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor:
            return self.moe_expert_capacity_factor
        return 1.0

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def param_bytes(self) -> int:
        return 4 if self.params_dtype in ("float32", "fp32") else 2

    @property
    def norm_parameters(self) -> int:
        """One norm's parameters (RMSNorm: a weight; LayerNorm: weight and bias)."""
        return self.hidden_size if self.rmsnorm else 2 * self.hidden_size

    def padded_vocab(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / multiple) * multiple

    # ------------------------------------------------------------ MemoryCost

    def layer_parameters(self, tp: int) -> int:
        """Parameter elements of one layer on one TP rank (a mixture of experts: all but the routed experts,
        :meth:`expert_layer_parameters`)."""
        h, f, d, n, g = self.hidden_size, self.ffn, self.head_dim, self.num_attention_heads, self.groups
        m = 2 if self.gated_linear_unit else 1
        if self.num_moe_experts:  # the router (replicated) and the shared experts (split over TP)
            shared = self.moe_shared_expert_intermediate_size or 0
            return ((n + 2 * g) * d * h + n * d * h + 3 * shared * h) // tp + self.num_moe_experts * h + \
                2 * self.norm_parameters
        n_w = ((n + 2 * g) * d * h + n * d * h + m * f * h + f * h) // tp
        n_b = ((n + 2 * g) * d + m * f) // tp + 2 * h if self.add_bias_linear else 0
        return n_w + n_b + 2 * self.norm_parameters

    def expert_layer_parameters(self, tp: int, ep: int) -> int:
        """The routed experts of one layer on one rank: ``E / ep`` SwiGLU experts split over TP (0: dense)."""
        if not self.num_moe_experts:
            return 0
        return self.num_moe_experts // ep * 3 * self.expert_ffn * self.hidden_size // tp

    def lora_layer_parameters(self, tp: int) -> int:
        """One layer's LoRA adapters on one TP rank (lightning_megatron.transformer.lora): on a column-parallel
        projection A [r/t, in] and B [out/t, r]; on a row-parallel one A [r, in/t] and B [out, r] (replicated)."""
        r, h, f, d, n, g = self.lora_rank, self.hidden_size, self.ffn, self.head_dim, self.num_attention_heads, self.groups
        m = 2 if self.gated_linear_unit else 1
        sizes = {"linear_qkv": r * h // tp + (n + 2 * g) * d // tp * r, "linear_proj": r * n * d // tp + h * r,
                 "linear_fc1": r * h // tp + m * f // tp * r, "linear_fc2": r * f // tp + h * r}
        return sum(sizes[t] for t in self.lora_targets) if r else 0

    def stage_trainable_parameters(self, tp: int, pp: int, stage: int) -> int | None:
        """Parameter elements with gradients and optimizer state on one rank of ``stage``: the LoRA adapters
        (also counted in :meth:`stage_parameters`), or None when every parameter trains."""
        return self.stage_layer_count(pp, stage) * self.lora_layer_parameters(tp) if self.lora_rank else None

    def stage_expert_parameters(self, tp: int, ep: int, pp: int, stage: int = 0) -> int:
        """The routed experts of pipeline stage ``stage`` on one rank."""
        return self.stage_layer_count(pp, stage) * self.expert_layer_parameters(tp, ep)

    def stage_layer_count(self, pp: int, stage: int) -> int:
        """The layers of pipeline stage ``stage`` (:func:`~lightning_megatron.cost.memory.stage_layers`: uneven
        where ``pp`` does not divide them, and :attr:`num_layers_in_first_pipeline_stage` / last)."""
        from lightning_megatron.cost.memory import stage_layers

        return sum(stage_layers(self, pp, stage))

    def stage_parameters(self, tp: int, pp: int, stage: int) -> int:
        h = self.hidden_size
        embedding = self.padded_vocab(tp) // tp * h
        n = self.stage_layer_count(pp, stage) * (self.layer_parameters(tp) + self.lora_layer_parameters(tp))
        if stage == 0:
            n += embedding + (self.max_sequence_length * h if self.learned_positions else 0)
        if stage == pp - 1:
            n += self.norm_parameters  # final norm
            if self.untie_embeddings_and_output_weights or pp > 1:
                n += embedding  # the output layer, or the last stage's copy of the tied embedding
        return n

    def layer_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        s, b, h, f = self.seq_length, self.micro_batch_size, self.hidden_size, self.ffn
        d, n, g, e = self.head_dim, self.num_attention_heads, self.groups, self.param_bytes
        sp = tp if sequence_parallel else 1
        if self.num_moe_experts:  # the routed experts' part is routed_expert_bytes (below); a shared expert's here
            f -= self.moe_router_topk * self.expert_ffn
        # both norms' inputs and outputs, the outputs the qkv and fc1 inputs, kept for a weight gradient (under SP
        # those layers keep their part of the sequence, gathered again in the backward; LoRA: only an adapted
        # frozen layer keeps it, its part too)
        replicated = (2 + self.keeps_input("linear_qkv") + self.keeps_input("linear_fc1")) * h / sp
        # q, k, v and the attention output; fc1's output and the activation (fc2's input); gated: fc1's
        # [gate, up] and the product (act(gate) is computed again in the backward:
        # transformer.utils.gated_activation)
        parallel = ((2 * n + 2 * g) * d + (2 * f if self.gated_linear_unit else f)
                    + (f if self.keeps_input("linear_fc2") else 0)) / tp
        # LoRA: B's input a [s, b, r] for each adapter (a row-parallel one's its part under SP), and under SP a
        # column-parallel adapter's A with its rows gathered [r, h] (what its input's gradient multiplies)
        column = sum(name in self.lora_targets for name in ("linear_qkv", "linear_fc1"))
        adapters = (column + (len(self.lora_targets) - column) / sp) * s * b * self.lora_rank
        adapters += column * self.lora_rank * h if sp > 1 else 0
        if self.lora_rank and self.lora_dropout > 0:
            # each adapter's dropout keeps its mask, and A the dropped input in place of the input itself, which
            # the attention's context (linear_proj's input) is kept by anyway
            widths = {"linear_qkv": h / sp, "linear_fc1": h / sp, "linear_proj": n * d / tp, "linear_fc2": f / tp}
            kept = sum(widths[name] for name in self.lora_targets)
            masks_and_copies = self.mask_bytes * kept + (e * n * d / tp if "linear_proj" in self.lora_targets else 0)
        else:
            masks_and_copies = 0.0
        stats = (1 if self.rmsnorm else 2) * 2 * 4 * s * b / sp  # fp32 rstd (and mean) of the two norms
        norm_copies = 2 * self.norm_copy_bytes * s * b * h / sp  # the composite RMSNorm's fp32 copies
        moe = 0.0
        if self.num_moe_experts:  # lightning_megatron.transformer.moe
            k, experts = self.moe_router_topk, self.num_moe_experts
            # the slots [s b, k, h] the routing weights' gradient reads: every token's on each TP rank (gathered
            # under SP); the routed experts' rows and hidden activations
            moe = e * s * b * k * h + self.routed_expert_bytes(tp)
            # the router's fp32 scores and weights and int64 choices (this rank's tokens), the dispatch's two int64
            # orders, the weights cast to a 16-bit activation dtype
            moe += (4 * experts + 12 * k) * s * b / sp + (16 + (e if e != 4 else 0)) * k * s * b
        # the core attention's own (none under selective recomputation: it runs again in the backward)
        attention = 0.0 if self.selective_recompute else self.replayed_attention_bytes(tp)
        masks = 0.0
        if self.hidden_dropout > 0:  # the two bias-dropout-adds
            masks += 2 * self.mask_bytes * s * b * h / sp
        masks += s * b * masks_and_copies
        return e * s * b * (replicated + parallel) + e * adapters + stats + norm_copies + attention + masks + moe

    def replay_peak_bytes(self, tp: int, sequence_parallel: bool) -> float:
        """Under selective recomputation, what the backward holds beyond the kept layers when it replays a layer's
        core attention: :meth:`replayed_attention_bytes`, less what that layer's MLP and output projection kept
        (their backward, which comes first, has freed it: the pre-MLP norm's input, fc1's input and output, fc2's
        input, linear_proj's input: the context)."""
        s, b, h, f, e = self.seq_length, self.micro_batch_size, self.hidden_size, self.ffn, self.param_bytes
        sp = tp if sequence_parallel else 1
        mlp = ((1 + self.keeps_input("linear_fc1")) * h / sp
               + ((2 * f if self.gated_linear_unit else f) + (f if self.keeps_input("linear_fc2") else 0)
                  + self.num_attention_heads * self.head_dim) / tp)
        return max(0.0, self.replayed_attention_bytes(tp) - e * s * b * mlp)

    def replayed_attention_bytes(self, tp: int = 1) -> float:
        """What one layer's core attention keeps on a TP rank: sdpa its log-sum-exp (fp32), the unfused path its
        probabilities ``[b, a/t, s, s]`` and, with attention dropout, the mask and the dropped probabilities."""
        s, b, n, e = self.seq_length, self.micro_batch_size, self.num_attention_heads, self.param_bytes
        if not self.unfused_attention:
            return 4 * b * n * s / tp
        kept = self.probability_bytes * b * n * s * s / tp
        if self.attention_dropout > 0:
            kept += (self.mask_bytes + e) * b * n * s * s / tp
        return kept

    def routed_expert_bytes(self, tp: int) -> float:
        """What a mixture's routed experts keep on a TP rank: their rows ``[s b k, h]`` (their first layer's input:
        every token's, gathered under SP, ``k`` rows each on average) and hidden activations, as a dense MLP's of
        width ``k F`` keeps them; ``f`` times that when padded to their capacity (:attr:`expert_rows_factor`)."""
        if not self.num_moe_experts:
            return 0.0
        hidden = (2 if self.gated_linear_unit else 1) + (1 if self.keeps_input("linear_fc2") else 0)
        rows = self.seq_length * self.micro_batch_size * self.moe_router_topk * self.expert_rows_factor
        return self.param_bytes * rows * (self.hidden_size + hidden * self.expert_ffn / tp)

    @property
    def norm_copy_bytes(self) -> int:
        """Bytes an element a norm keeps beyond its input's (:attr:`composite_rmsnorm`: ``8 - e``; 0 otherwise)."""
        return 8 - self.param_bytes if self.rmsnorm and self.composite_rmsnorm else 0

    def context_parallel_bytes(self, tp: int, cp: int) -> float:
        """What one layer keeps beyond its 1/cp share under context parallelism
        (:mod:`~lightning_megatron.transformer.context_parallel`): its attention's output beside the context the
        projection keeps (``all_gather``: each of the two chunks'; ``a2a``: the whole sequence of ``1/cp`` of the
        heads; ``p2p``: the ring's), ``(s/cp) b n/t d``, and with ``all_gather`` the other ranks' keys and values,
        ``2 (s - s/cp) b g/t d``, which its attention saves (measured with ``check --estimate-memory``,
        docs/long_context.md)."""
        s, b, e, d = self.seq_length, self.micro_batch_size, self.param_bytes, self.head_dim
        gathered = 2 * (s - s / cp) * b * self.groups * d if self.cp_comm_type == "all_gather" else 0.0
        # experts padded to their capacity: the capacity is the whole microbatch's, on every CP rank
        padded = (1 - 1 / cp) * self.routed_expert_bytes(tp) if self.expert_rows_factor != 1 else 0.0
        return (gathered + s / cp * b * self.num_attention_heads * d) / tp * e + padded

    def layer_input_bytes(self, tp: int, sequence_parallel: bool) -> float:
        return self.param_bytes * self.seq_length * self.micro_batch_size * self.hidden_size / (
            tp if sequence_parallel else 1)

    def first_stage_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        """The embedding dropout's mask."""
        if self.hidden_dropout <= 0:
            return 0.0
        return self.mask_bytes * self.seq_length * self.micro_batch_size * self.hidden_size / (
            tp if sequence_parallel else 1)

    def last_stage_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        """The final norm's input and output (the output layer's input; not under LoRA, the layer frozen; under
        sequence parallelism both this rank's chunk, the output layer gathering its input again for the
        backward, as the layers' column-parallel linears do: measured at TP=2 x PP=2, ``tests/test_context_parallel.py``) and the
        cross entropy's fp32 softmax of the vocab-parallel logits, with its per-token statistics; the logits
        themselves are not kept (measured: ``check --estimate-memory`` on ``recipes/gpt_tiny.yaml``, fp32 and bf16,
        docs/long_context.md, and ``tests/test_estimate.py``). A compiled loss (:attr:`compiled_loss`, one TP
        rank) keeps the logits instead of the softmax."""
        s, b, h, e = self.seq_length, self.micro_batch_size, self.hidden_size, self.param_bytes
        v = self.padded_vocab(tp) / tp
        # LoRA: the frozen output layer keeps no input
        chunk = tp if sequence_parallel else 1
        norm = ((1 if self.lora_rank else 2) * e + self.norm_copy_bytes) * s * b * h / chunk
        return norm + (e if self.compiled_loss and tp == 1 else 4) * s * b * v + 8 * s * b

    def deferred_output_bytes(self, tp: int) -> float:
        """With :attr:`defer_embedding_wgrad_compute`, what the last stage keeps of each microbatch until the flush
        (:mod:`lightning_megatron.tensor_parallel.deferred_wgrad`): the output layer's output gradient
        ``[tokens, V/t]`` and input ``[tokens, h]`` (the head's tokens; under SP the gathered sequence's); 0
        without."""
        if not self.defer_embedding_wgrad_compute:
            return 0.0
        tokens = self.head_fraction * self.seq_length * self.micro_batch_size
        return self.param_bytes * tokens * (self.padded_vocab(tp) / tp + self.hidden_size)

    def tensor_parallel_problem(self, tp: int) -> str | None:
        g = self.groups
        if self.num_attention_heads % tp or self.ffn % tp or self.expert_ffn % tp:
            return f"TP={tp} does not divide {self.num_attention_heads} heads / FFN {self.ffn}"
        if g % tp and tp % g:
            return f"TP={tp} is neither a multiple nor a divisor of {g} key/value groups"
        return None

    def describe(self) -> str:
        shape = "SwiGLU" if self.gated_linear_unit else "MLP"
        if self.num_moe_experts:
            shape = f"{self.num_moe_experts} SwiGLU experts of {self.expert_ffn} (top-{self.moe_router_topk}, active"
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, {self.num_attention_heads} heads in "
                f"{self.groups} key/value groups, {shape} {self.ffn}{')' if self.num_moe_experts else ''}, "
                f"vocab {self.vocab_size} "
                f"({'untied' if self.untie_embeddings_and_output_weights else 'tied'}), seq {self.seq_length}, "
                f"micro batch {self.micro_batch_size}, global batch {self.global_batch_size}, {self.params_dtype}, "
                f"{self.optimizer}{', full recompute' if self.recompute else ''}, dropout {self.hidden_dropout:g}/"
                f"{self.attention_dropout:g}"
                + (f", LoRA r{self.lora_rank} on {'/'.join(self.lora_targets)} (dropout {self.lora_dropout:g})"
                   if self.lora_rank else ""))
