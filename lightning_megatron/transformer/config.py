"""TransformerConfig: the sizes and options of a transformer, validated eagerly.

Every check raises ``ValueError`` naming the offending field and the fix, before any module is built.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_megatron.flops import transformer_flops

__all__ = ["TransformerConfig", "ConfigProblems", "ACTIVATIONS", "NORMALIZATIONS", "PARAMS_DTYPES", "dtype_name", "training_flops"]

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
"""Supported MLP activations: exact erf GELU (Hugging Face "gelu"), tanh-approximated GELU, ReLU, SiLU."""
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
PARAMS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The parameter dtypes by name (as a recipe writes them; the short names are aliases)."""
DtypeName = Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]


def dtype_name(dtype: torch.dtype) -> str:
    """The name a recipe writes for a parameter dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


class ConfigProblems(ValueError):
    """A record that cannot be built; ``problems`` lists each broken rule (its message names the field,
    the value and the fix)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(kw_only=True)
class TransformerConfig:
    """Sizes and options shared by every layer of a transformer (Megatron's field names)."""

    num_layers: int
    """Number of transformer layers in the whole model (all pipeline stages together)."""
    hidden_size: int
    """Width h of the residual stream."""
    num_attention_heads: int
    """Number of attention heads n; each TP rank holds n / t whole heads."""
    num_query_groups: int | None = None
    """Number of key/value heads g of grouped-query attention (None: g = n, plain multi-head attention;
    1: multi-query); g divides n; a TP rank holds g / t whole groups, or, when g < t (t a multiple of
    g, as megatron-core allows), t / g ranks share one group's key/value head."""
    ffn_hidden_size: int | None = None
    """Width of the MLP's hidden layer; None means 4 * hidden_size."""
    kv_channels: int | None = None
    """Per-head width d; None means hidden_size // num_attention_heads."""
    hidden_dropout: float = 0.1
    """Dropout probability on the residual branches and the embeddings."""
    attention_dropout: float = 0.1
    """Dropout probability on the attention probabilities."""
    layernorm_epsilon: float = 1e-5
    """Epsilon added to the variance (LayerNorm) or mean square (RMSNorm)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Norm used by the LM head and by specs that take the norm from the config."""
    activation: Literal["gelu", "gelu_tanh", "relu", "silu"] = "gelu"
    """MLP (and BERT LM-head) activation; "gelu" is the exact erf GELU (Hugging Face "gelu")."""
    gated_linear_unit: bool = False
    """Gated MLP (SwiGLU with activation "silu"): fc1 makes a gate and an up projection of width
    ffn_hidden_size each and the MLP computes act(gate) * up."""
    rotary_base: float = 10000.0
    """Base of the rotary position embedding's frequencies (used when the model applies rotary)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels the rotary embedding rotates (the leading ones)."""
    rope_scaling: bool = False
    """Llama 3.1's frequency scaling of the rotary embedding (megatron-core's ``rope_scaling``, transformers'
    ``rope_type: llama3``): frequencies whose wavelength exceeds the original 8192 positions are divided by
    ``rope_scaling_factor``, those below 8192 / 4 kept, those between interpolated (Meta's low and high
    frequency factors 1 and 4, as megatron-core fixes them)."""
    rope_scaling_factor: float = 8.0
    """The factor of :attr:`rope_scaling` (Llama 3.1: 8, Llama 3.2: 32)."""
    add_bias_linear: bool = True
    """Whether the linear layers of attention and MLP have biases (BERT: yes)."""
    add_qkv_bias: bool = False
    """Give the attention's ``linear_qkv`` a bias even when ``add_bias_linear=False`` (megatron-core's name;
    Qwen2 and Qwen2-MoE: biases on q, k and v only, none on the output projection or the MLP)."""
    qk_layernorm: bool = False
    """Normalize each head's queries and keys (before the rotary embedding) with the norm ``normalization``
    names (megatron-core's ``qk_layernorm``; Qwen3, Qwen3-MoE): the attention's ``q_layernorm`` / ``k_layernorm``
    slots, built with it where the spec leaves them identity."""
    init_method_std: float = 0.02
    """Std of the N(0, std^2) weight init; output projections use std / sqrt(2 * num_layers)."""
    params_dtype: DtypeName | torch.dtype = "float32"
    """Dtype of the parameters: "float32", "bfloat16" or "float16" ("fp32", "bf16", "fp16" too) or the
    torch dtype; a name becomes the dtype (so ``config.params_dtype`` is always a ``torch.dtype``)."""
    tensor_model_parallel_size: int = 1
    """TP size t the model is built for (must equal the size of the tp_group given to the model)."""
    sequence_parallel: bool = False
    """Split activations outside the TP regions along the sequence (needs t > 1 to have any effect)."""
    attention_backend: Literal["auto", "sdpa", "unfused"] = "auto"
    """"sdpa": torch's scaled_dot_product_attention; "unfused": the explicit softmax(QK^T/sqrt(d))V;
    "auto": SDPA on accelerators, on CPU whichever of the two is faster (see DotProductAttention)."""
    attention_softmax_in_fp32: bool = True
    """Unfused backend: compute the softmax in fp32 when the activations are bf16/fp16."""
    cp_comm_type: Literal["all_gather", "a2a", "p2p"] = "all_gather"
    """Attention under context parallelism (megatron-core's name): "all_gather", every rank's queries against
    the gathered keys and values; "a2a" (Ulysses), an all-to-all trading the sequence split for a split of
    the heads (the heads on a TP rank must divide by the CP size) and back; "p2p", ring attention (keys and
    values passed around the group, partial results merged by log-sum-exp; no attention dropout)."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recomputation: "full" (whole layers), "selective" (core attention only) or None."""
    recompute_method: Literal["uniform", "block"] | None = None
    """With "full": "uniform" checkpoints groups of recompute_num_layers layers; "block" checkpoints
    the first recompute_num_layers layers of each pipeline chunk and keeps the rest."""
    recompute_num_layers: int | None = None
    """With "full": layers per checkpointed group ("uniform") or layers checkpointed ("block")."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Layers of the first pipeline stage (None: an even split); the other stages share the rest."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Layers of the last pipeline stage, which also runs the LM head and the loss (None: an even split)."""
    defer_embedding_wgrad_compute: bool = False
    """Compute the output layer's (LM head's) weight gradient of every microbatch at the pipeline flush
    of the last stage instead of in each backward (megatron-core's name): the same numbers, a shorter
    steady state on the last stage, the output gradients of the step's microbatches kept until the
    flush. Needs pipeline parallelism (:mod:`lightning_megatron.tensor_parallel.deferred_wgrad`)."""
    wgrad_deferral_limit: int = 0
    """With :attr:`defer_embedding_wgrad_compute`, the most microbatches whose output-layer weight gradient waits
    (megatron-core's name; 0: all of the step's): the oldest is computed when one more would wait, so the last
    stage keeps at most this many microbatches' output gradients and inputs, and the flush computes them. The same
    numbers at every limit (the gradients reach ``main_grad`` in microbatch order)."""

    num_moe_experts: int | None = None
    """Mixture of experts (:mod:`lightning_megatron.transformer.moe`): the number of routed experts of every
    MoE layer (a spec whose MLP slot is :class:`~lightning_megatron.transformer.moe.MoELayer`); None: dense."""
    moe_router_topk: int = 2
    """Experts each token is routed to (k)."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: "softmax" over the experts, or "sigmoid" per expert (the chosen k renormalised)."""
    moe_router_pre_softmax: bool = False
    """Softmax: False (Mixtral) takes the top k of the logits, then a softmax over those k (equal to
    softmax, top-k, renormalise); True takes the softmax over every expert first and keeps the top k
    probabilities as they are (Qwen2-MoE's ``norm_topk_prob=False``)."""
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """The dtype of the router's logits (megatron-core's): None, the parameters' (a bf16 model's in bf16); "fp32" or
    "fp64": the product taken wider (its gradient reaches the parameter in its own dtype). The scores are taken in
    fp32 at least either way."""
    moe_ffn_hidden_size: int | None = None
    """Hidden width of each routed expert's SwiGLU; None: ``ffn_hidden_size``."""
    moe_shared_expert_intermediate_size: int | None = None
    """Hidden width of the shared experts (one SwiGLU every token passes through); None: none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x w_gate) per token (Qwen2-MoE)."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    """The load-balancing loss (megatron-core's): "aux_loss" over the microbatch's tokens, "seq_aux_loss"
    per sequence, averaged over the sequences, or "none"; weighted by ``moe_aux_loss_coeff``."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss of each layer (0: not added)."""
    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss, mean over tokens of logsumexp(logits)^2 (None: not added)."""
    moe_expert_capacity_factor: float | None = None
    """Token dropping: each expert takes at most ceil(factor * k * tokens / experts) of the tokens its rank
    routes (the most probable ones); None: no dropping."""
    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity factor: pad every expert's input to its capacity (static shapes; the output is the same)."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach the experts under expert parallelism: "alltoall" (each token sent to the ranks of its
    experts) or "allgather" (every EP rank sees every token); the results are bitwise equal."""
    expert_model_parallel_size: int = 1
    """EP size the model is built for: the experts of a layer are split into this many contiguous blocks."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "tensor_model_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:  # every rule below needs these: first, alone
                raise ConfigProblems([f"{name}={value!r} must be a positive integer"])
        # Each rule group on its own: a record with several mistakes names them all in one error.
        problems: list[str] = []
        for rules in (self._resolve_sizes, self._validate_heads, self._validate_query_groups, self._validate_rotary,
                      self._validate_ffn, self._validate_options, self._validate_recompute, self._validate_moe):
            try:
                rules()
            except ValueError as e:
                problems += e.problems if isinstance(e, ConfigProblems) else [str(e)]
        if problems:
            raise ConfigProblems(problems)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            warnings.warn("sequence_parallel=True has no effect with tensor_model_parallel_size=1", stacklevel=3)

    def set_sequence_parallel(self, on: bool) -> bool:
        """Layers that read this record run with (``on``) or without sequence parallelism from now on (generation
        switches it off for a call: the weights do not depend on it); returns the previous setting."""
        previous, self.sequence_parallel = self.sequence_parallel, on
        return previous

    def _resolve_sizes(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; choose a hidden_size that is a multiple of the head count "
                    f"or set kv_channels explicitly")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        elif self.kv_channels < 1:
            raise ValueError(f"kv_channels={self.kv_channels} must be a positive integer or None")

    def _validate_heads(self) -> None:
        t = self.tensor_model_parallel_size
        if self.num_attention_heads % t != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by tensor_model_parallel_size="
                f"{t}; each TP rank must hold whole heads: choose a head count that is a multiple of {t} "
                f"or a TP size that divides {self.num_attention_heads}")

    def _validate_ffn(self) -> None:
        t = self.tensor_model_parallel_size
        if self.ffn_hidden_size < 1:
            raise ValueError(f"ffn_hidden_size={self.ffn_hidden_size} must be a positive integer or None")
        if self.ffn_hidden_size % t != 0:
            raise ValueError(
                f"ffn_hidden_size={self.ffn_hidden_size} is not divisible by tensor_model_parallel_size={t}; "
                f"choose an ffn_hidden_size that is a multiple of {t}")

    def _validate_options(self) -> None:
        problems = []
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                problems.append(f"{name}={p} must be in [0, 1); use 0.0 to turn dropout off")
        if not self.layernorm_epsilon > 0:
            problems.append(f"layernorm_epsilon={self.layernorm_epsilon} must be > 0 (e.g. 1e-5)")
        if not self.init_method_std > 0:
            problems.append(f"init_method_std={self.init_method_std} must be > 0 (e.g. 0.02)")
        if self.normalization not in NORMALIZATIONS:
            problems.append(f"normalization={self.normalization!r} is not supported; use one of {NORMALIZATIONS}")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation={self.activation!r} is not supported; use one of {ACTIVATIONS}")
        if self.cp_comm_type not in ("all_gather", "a2a", "p2p"):
            problems.append(f"cp_comm_type={self.cp_comm_type!r} is not supported; use 'all_gather', 'a2a' or 'p2p'")
        if self.attention_backend not in ("auto", "sdpa", "unfused"):
            problems.append(f"attention_backend={self.attention_backend!r} is not supported; "
                            "use 'auto', 'sdpa' or 'unfused'")
        if isinstance(self.params_dtype, str) and self.params_dtype in PARAMS_DTYPES:
            self.params_dtype = PARAMS_DTYPES[self.params_dtype]
        if self.params_dtype not in set(PARAMS_DTYPES.values()):
            problems.append(f"params_dtype={self.params_dtype!r} is not supported; use one of "
                            f"{sorted(PARAMS_DTYPES)} (or the torch dtype)")
        for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not
                                      0 < value < self.num_layers):
                problems.append(f"{name}={value!r} must be None or an integer in [1, num_layers={self.num_layers})")
        limit = self.wgrad_deferral_limit
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            problems.append(f"wgrad_deferral_limit={limit!r} must be an integer >= 0 (0: every microbatch waits)")
        elif limit and not self.defer_embedding_wgrad_compute:
            problems.append(f"wgrad_deferral_limit={limit} bounds the deferral of defer_embedding_wgrad_compute, "
                            f"which is off: set defer_embedding_wgrad_compute=True or leave the limit at 0")
        if problems:
            raise ConfigProblems(problems)

    def _validate_query_groups(self) -> None:
        n, t, g = self.num_attention_heads, self.tensor_model_parallel_size, self.num_query_groups
        if g is None:
            self.num_query_groups = g = n
        if g == n and n % t != 0:  # one group per head: the heads' own rule (_validate_heads) says it all
            return
        if not isinstance(g, int) or isinstance(g, bool) or g < 1:
            raise ValueError(f"num_query_groups={g!r} must be a positive integer or None (= num_attention_heads)")
        if n % g != 0:
            raise ValueError(f"num_query_groups={g} must be a number that divides num_attention_heads={n} "
                             f"(each key/value head serves n/g query heads)")
        if g % t != 0 and t % g != 0:
            # megatron-core's rule: a TP rank holds g/t whole groups, or (g < t) t/g ranks share one
            # group's key/value head and each takes n/t of its query heads.
            raise ValueError(f"num_query_groups={g} must be a multiple or a divisor of tensor_model_parallel_size={t} "
                             f"(as megatron-core requires): choose num_query_groups among the multiples or "
                             f"divisors of {t}, or a TP size that divides or is a multiple of {g}")
        rows = (n + 2 * g) * (self.kv_channels or 0)
        if self.kv_channels is not None and rows % t != 0:
            raise ValueError(f"linear_qkv has (num_attention_heads + 2 * num_query_groups) * kv_channels = {rows} rows, "
                             f"not divisible by tensor_model_parallel_size={t}; choose kv_channels or the head "
                             f"counts so that it is")

    def _validate_rotary(self) -> None:
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent={self.rotary_percent} must be in (0, 1] (1.0 rotates every channel)")
        # The even number of rotary channels is checked by RotaryEmbedding: models without rotary
        # (BERT) may have an odd head width.
        if not self.rotary_base > 0:
            raise ValueError(f"rotary_base={self.rotary_base} must be > 0 (e.g. 10000.0)")
        if self.rope_scaling and not self.rope_scaling_factor >= 1:
            raise ValueError(f"rope_scaling_factor={self.rope_scaling_factor} must be >= 1 (Llama 3.1: 8.0)")

    def _validate_moe(self) -> None:
        e = self.num_moe_experts
        if e is None:
            return
        problems = []

        def positive(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1

        if not positive(e):
            raise ValueError(f"num_moe_experts={e!r} must be a positive integer or None (a dense MLP)")
        k, ep, t = self.moe_router_topk, self.expert_model_parallel_size, self.tensor_model_parallel_size
        if not positive(k) or k > e:
            problems.append(f"moe_router_topk={k!r} must be an integer in [1, num_moe_experts={e}]")
        if not positive(ep) or e % ep:
            problems.append(f"num_moe_experts={e} is not divisible by expert_model_parallel_size={ep!r}: each EP rank "
                            f"holds a contiguous block of whole experts; choose an EP size that divides {e}")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            value = getattr(self, name)
            if value is None:
                continue
            if not positive(value):
                problems.append(f"{name}={value!r} must be a positive integer")
            elif value % t:
                problems.append(f"{name}={value} is not divisible by tensor_model_parallel_size={t} (the experts are "
                                f"split over TP like the dense MLP); choose a multiple of {t}")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            problems.append("moe_shared_expert_gate=True needs shared experts: set moe_shared_expert_intermediate_size")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            problems.append(f"moe_router_score_function={self.moe_router_score_function!r}: use 'softmax' or 'sigmoid'")
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            problems.append("moe_router_pre_softmax=True applies to moe_router_score_function='softmax' only")
        if k == 1 and self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax:
            # megatron-core refuses it too ("use --moe-router-pre-softmax when topk is 1")
            problems.append("moe_router_topk=1 with moe_router_pre_softmax=False: a softmax over the one chosen logit "
                            "is 1 for every token, and the loss never trains the router; set "
                            "moe_router_pre_softmax=True (the chosen expert's softmax probability over all experts) "
                            "or moe_router_score_function='sigmoid'")
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            problems.append(f"moe_router_dtype={self.moe_router_dtype!r}: use 'fp32', 'fp64' or None (the "
                            f"parameters' dtype)")
        if self.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
            problems.append(f"moe_router_load_balancing_type={self.moe_router_load_balancing_type!r}: use 'aux_loss', "
                            f"'seq_aux_loss' or 'none'")
        if not self.moe_aux_loss_coeff >= 0 or (self.moe_z_loss_coeff is not None and not self.moe_z_loss_coeff >= 0):
            problems.append(f"moe_aux_loss_coeff={self.moe_aux_loss_coeff} and moe_z_loss_coeff={self.moe_z_loss_coeff} "
                            f"must be >= 0")
        factor = self.moe_expert_capacity_factor
        if factor is not None and not factor > 0:
            problems.append(f"moe_expert_capacity_factor={factor} must be > 0 or None (no token dropping)")
        if self.moe_pad_expert_input_to_capacity and factor is None:
            problems.append("moe_pad_expert_input_to_capacity=True needs moe_expert_capacity_factor")
        if self.moe_token_dispatcher_type not in ("alltoall", "allgather"):
            problems.append(f"moe_token_dispatcher_type={self.moe_token_dispatcher_type!r}: use 'alltoall' or "
                            f"'allgather'")
        if self.add_bias_linear:
            problems.append("add_bias_linear=True: the experts here have no biases (as Mixtral's, Qwen-MoE's and "
                            "megatron-core's MoE recipes); set add_bias_linear=False with num_moe_experts")
        if not self.gated_linear_unit:
            problems.append("gated_linear_unit=False: the experts are SwiGLU-shaped; set gated_linear_unit=True "
                            "(and activation='silu') with num_moe_experts")
        if problems:
            raise ConfigProblems(problems)

    def _validate_recompute(self) -> None:
        granularity, method, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity={granularity!r} is not supported; use 'full', 'selective' or None")
        if granularity == "full":
            if method not in ("uniform", "block"):
                raise ValueError(f"recompute_method={method!r}: recompute_granularity='full' needs "
                                 f"recompute_method='uniform' or 'block'")
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"recompute_num_layers={n!r}: recompute_granularity='full' needs a positive "
                                 f"number of layers per checkpoint")
            if n > self.num_layers:
                raise ValueError(f"recompute_num_layers={n} exceeds num_layers={self.num_layers}; "
                                 f"choose at most {self.num_layers}")
        elif method is not None or n is not None:
            raise ValueError(f"recompute_method={method!r} / recompute_num_layers={n!r} only apply to "
                             f"recompute_granularity='full' (got {granularity!r}); set them to None")


def training_flops(config: TransformerConfig, tokens: int, seq_length: int, head_tokens: float | torch.Tensor,
                   vocab_size: int) -> float | torch.Tensor:
    """FLOPs of one training step, Megatron's count (a multiply-add is 2 FLOPs, backward twice the
    forward, recomputation not counted)::

        6 T L (4 h^2 + 2 h f)  +  12 T L s h  +  6 T_head (h V + h^2)

    ``T = tokens`` (per step, all replicas), L layers, h hidden, f ffn hidden, s ``seq_length``, V
    ``vocab_size``: the layers' weight matmuls (qkv 3h^2, projection h^2, MLP 2hf), the attention
    scores and their weighted sum, and an LM head (dense h^2, output layer [h, V]) run on
    ``head_tokens`` tokens (a tensor keeps a device-side count without a host sync). The formula is
    :func:`lightning_megatron.flops.transformer_flops` (shared with ``check --estimate-time``).
    """
    return transformer_flops(num_layers=config.num_layers, hidden_size=config.hidden_size,
                             ffn_hidden_size=config.ffn_hidden_size, seq_length=seq_length, tokens=tokens,
                             head_tokens=head_tokens, vocab_size=vocab_size)
