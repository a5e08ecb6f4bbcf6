"""Self-attention with heads split across TP ranks, and the core dot-product attention.

For one head with queries Q, keys K, values V ([s, d] each):

    S = Q K^T / sqrt(d)          scores, masked keys set to -inf
    A = softmax(S)               row-wise
    O = dropout(A) V

Backward of the softmax, row by row (a_i is row i of A, g_i = dL/da_i):

    dL/ds_i = a_i * (g_i - <g_i, a_i>)        i.e.  dS = A * (dA - rowsum(dA * A))

so the gradient only needs A (or, as Flash-Attention does, O and dO: rowsum(dA * A) = rowsum(dO * O)).

Grouped-query attention (``config.num_query_groups`` = g key/value heads for n query heads, g | n):
query heads j*n/g .. (j+1)*n/g - 1 share key/value head j (Hugging Face's ``repeat_kv`` order).
g = n is multi-head attention, g = 1 multi-query attention.

TP layout: ``linear_qkv`` is column-parallel with output width (n + 2g) * d laid out group-major as
megatron-core does, [group 0: its n/g query heads, k, v | group 1: ... | ...], so a contiguous 1/t
slice of its rows (what a TP rank keeps) holds g/t whole groups with their queries, key and value
(g a multiple of t). With g = n this is the head-major [head 0: q, k, v | head 1: q, k, v | ...].
Each rank runs attention on its n/t query heads; ``linear_proj`` is row-parallel and sums the heads'
contributions (one all-reduce forward).

Fewer key/value heads than ranks (g < t, t a multiple of g), as megatron-core does: the row slices
cut through groups, so each rank all-gathers the qkv activations (backward: reduce-scatter, which
sums the gradients of the key/value head its t/g ranks share), keeps its group j = r // (t/g), and of
that group's query heads the (r mod (t/g))-th n/t: overall query heads r*n/t .. (r+1)*n/t - 1, the
ones its ``linear_proj`` columns expect. The weights stay contiguous row shards of the full tensor.

Rotary position embeddings (:mod:`lightning_megatron.transformer.rotary`) rotate q and k after their
optional norms when ``forward(..., rotary_pos_emb=freqs)`` is given. Causal attention
(``AttnMaskType.causal``, no mask tensor) calls SDPA with ``is_causal=True``.

Dropout on the attention probabilities uses the model-parallel RNG stream: each rank holds
different heads, so their masks must be independent, yet reproducible under recomputation.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from lightning_megatron.parallel_state import group_rank, group_size
from lightning_megatron.tensor_parallel import (
    divide,
    gather_from_sequence_parallel_region,
    get_rng_tracker,
    init_method_normal,
    recompute,
    scaled_init_method_normal,
    set_param_facts,
)
from lightning_megatron.transformer.config import TransformerConfig
from lightning_megatron.transformer.context_parallel import ContextParallel
from lightning_megatron.transformer.dropout import dropout
from lightning_megatron.transformer.inference import InferenceContext
from lightning_megatron.transformer.kernels import DEFAULT_KERNELS, Kernels
from lightning_megatron.transformer.norms import get_norm_class
from lightning_megatron.transformer.rotary import RotaryTable, apply_rotary_pos_emb, apply_rotary_pos_emb_heads
from lightning_megatron.transformer.spec import ModuleSpec, build_module
from lightning_megatron.transformer.utils import AttnMaskType, IdentityOp, owned

__all__ = ["SelfAttentionSubmodules", "SelfAttention", "DotProductAttention", "document_attention_mask"]

Spec = ModuleSpec | type


@dataclass(kw_only=True)
class SelfAttentionSubmodules:
    """Submodule slots of :class:`SelfAttention` (Megatron's names)."""

    linear_qkv: Spec
    """Up-projection to [q, k, v] of every head: column-parallel."""
    core_attention: Spec
    """softmax(QK^T/sqrt(d))V on this rank's heads."""
    linear_proj: Spec
    """Down-projection back to the hidden size: row-parallel."""
    q_layernorm: Spec = IdentityOp
    """Optional norm on the queries (per head); identity for BERT."""
    k_layernorm: Spec = IdentityOp
    """Optional norm on the keys (per head); identity for BERT."""


def document_attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed samples: ``document_ids`` [b, s] (which document each token belongs
    to, :func:`lightning_megatron.data.packing.document_ids`) -> bool [b, 1, s, s], True where a key lies in
    another document than the query (hidden). Causal attention adds its triangle on top, so each document
    attends as if it were alone. Materialised: b s^2 bytes per microbatch."""
    return (document_ids[:, None, :, None] != document_ids[:, None, None, :])


class DotProductAttention(nn.Module):
    """Core attention on this rank's heads: q [s, b, n/t, d], k, v [s, b, g/t, d] -> context [s, b, n/t * d].

    With fewer key/value heads than query heads (grouped-query attention) each key/value head serves
    n/g consecutive query heads: SDPA gets ``enable_gqa=True``; the unfused path multiplies each group's n/g
    query heads, stacked along the sequence ([b g, n/g s, d]), by its key and value head once, without
    repeating k and v (copies forward, their sums backward).

    ``attention_mask``: bool, broadcastable to [b, n/t, s, s], True where a key is hidden (padding).
    The "sdpa" backend calls ``torch.nn.functional.scaled_dot_product_attention``; "unfused" spells
    the math out (softmax in fp32 if asked), which the tests use as the reference. "auto" (the
    default) asks :attr:`kernels` (:class:`~lightning_megatron.transformer.kernels.Kernels`): SDPA,
    which runs fused (flash / memory-efficient) kernels on GPUs. The opt-in CPU tuning's kernels
    choose "unfused" on CPU where that is faster (bf16 or dropout; see :mod:`lightning_megatron.cpu`).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 *, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config, self.layer_number, self.attn_mask_type = config, layer_number, attn_mask_type
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels)
        self.kernels: Kernels = DEFAULT_KERNELS
        # Only a model with one TP rank by both its group and its config may leave the model-parallel stream.
        self.tp_size = max(group_size(tp_group), config.tensor_model_parallel_size)

    def _dropout_rng(self) -> contextlib.AbstractContextManager:
        # Under sequence parallelism the whole block already runs in the model-parallel stream (TransformerBlock
        # forks it): a fork would swap nothing (RNGStatesTracker.fork), and inside a compiled layer break its graph.
        if self.config.sequence_parallel:
            return contextlib.nullcontext()
        # The stream keeps TP ranks from dropping their heads in lock-step. With one TP rank there is none to
        # differ from, and a layer being compiled stays in the default stream: the fork's swaps of the generators'
        # states are not traceable (a graph break before and after the dropout), and its masks come from the
        # compiled graph's own random numbers anyway. Eager keeps the fork (the same bits at every TP size).
        if self.tp_size == 1 and torch.compiler.is_compiling():
            return contextlib.nullcontext()
        return get_rng_tracker().fork()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, *, causal: bool | None = None) -> torch.Tensor:
        """``causal``: None, the module's mask type; False when ``attention_mask`` is the whole mask (context
        parallelism: the queries are not the last ``s`` of the keys)."""
        s, b, heads, d = query.shape
        sk = key.shape[0]  # > s with a KV cache: the queries are the last s of the sk positions
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n/t, s, d], k/v [b, g/t, sk, d]
        gqa = k.shape[1] != heads
        if causal is None:
            causal = self.attn_mask_type == AttnMaskType.causal
        if self.attn_mask_type == AttnMaskType.no_mask:
            attention_mask = None
        p = self.config.attention_dropout if self.training else 0.0
        if self.kernels.use_sdpa(q, p, self.config.attention_backend):
            # SDPA takes True = "may attend"; our mask is True = "hidden".
            keep = None if attention_mask is None else ~attention_mask
            # SDPA's is_causal aligns the triangle top-left and does not combine with a mask. Bottom-right aligned
            # (queries the last s of sk keys: a cache, a context-parallel chunk) without a mask of our own: torch's
            # CausalBias, which a GPU's memory-efficient kernel applies without an [s, sk] mask to keep for the
            # backward (the CPU's kernel is given it made); with a mask, the triangle built into it. One query sees
            # every key.
            if causal and keep is None and sk != s and s > 1 and not torch.compiler.is_compiling():
                keep = causal_lower_right(s, sk)
            elif causal and (keep is not None or sk != s) and s > 1:
                lower = torch.ones(s, sk, dtype=torch.bool, device=q.device).tril(sk - s)
                keep = lower if keep is None else keep & lower
            rng = self._dropout_rng() if p > 0 else contextlib.nullcontext()
            extra = {"enable_gqa": True} if gqa else {}
            with rng:
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p,
                                                         is_causal=causal and keep is None and sk == s, **extra)
        else:
            q, k, v = self.kernels.attention_operands(q, k, v)
            context = self._unfused(q, k, v, attention_mask, causal, p)
        return context.permute(2, 0, 1, 3).reshape(s, b, heads * d)  # [s, b, n/t * d]

    def _unfused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None,
                 causal: bool, p: float) -> torch.Tensor:
        # Megatron's order: S = alpha * Q K^T in the activation dtype (fp32 accumulation, one
        # rounding), softmax in fp32 when asked, probabilities back in the activation dtype. Each of the g
        # key/value heads with its n/g query heads' rows stacked: [b g, n/g s, sk] is [b, n, s, sk] in memory.
        b, n, s, d = q.shape
        g, sk = k.shape[1], k.shape[2]
        scores = torch.baddbmm(q.new_empty(b * g, n // g * s, sk), q.reshape(b * g, n // g * s, d),
                               k.reshape(b * g, sk, d).transpose(1, 2), beta=0.0, alpha=self.softmax_scale)
        if causal:
            upper = torch.ones(s, sk, dtype=torch.bool, device=scores.device).triu(1 + sk - s)
            attention_mask = upper if attention_mask is None else attention_mask | upper
        if attention_mask is not None:
            scores = _HideScores.apply(scores, attention_mask, (b, n, s, sk))
        probs = self.kernels.softmax(scores.view(b, n, s, sk), self.config.attention_softmax_in_fp32)
        if p > 0:
            with self._dropout_rng():
                probs = dropout(probs, p, kernels=self.kernels)
        return torch.matmul(probs.reshape(b * g, n // g * s, sk), v.reshape(b * g, sk, d)).view(b, n, s, d)


class _HideScores(torch.autograd.Function):
    """``scores.view(shape).masked_fill_(hidden, -inf)`` in place, whose backward passes the gradient
    through unmasked.

    The scores are the unfused path's own fresh tensor, so filling them in place saves the copy an
    out-of-place ``masked_fill`` makes; and the softmax that follows gives a hidden score's gradient as its
    probability (exactly 0) times a finite factor, so masking that gradient again, as ``masked_fill``'s
    backward does, is a second pass over the scores that changes nothing (the tests compare the bits).
    It takes the batched matmul's output itself and views it as ``shape`` (the mask's [b, n, s, sk]) inside:
    a view filled in place would make autograd rebase it, a copy of the scores and a zero-filled scatter of
    their gradient in every backward."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, hidden: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        ctx.mark_dirty(scores)
        scores.view(shape).masked_fill_(hidden, float("-inf"))
        return scores  # the very tensor (torch.compile traces mark_dirty only so)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def _apart(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key, value)``, copied out of the tensor they are views of (linear_qkv's output, or its all-gather) when the
    queries are not in it (copied to merge a group's heads, or rotated on their own): the attention keeps the
    three for its backward (a q/k norm its input), and a view would keep all of that tensor, ``n d`` a token or
    more a layer beside ``(2n + 2g) d``. None is copied when all three are views of one tensor (one query head a
    group), nor while no gradient is recorded, nor in a compiled graph (whose partitioner chooses what it keeps)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return key, value
    if query.untyped_storage().data_ptr() == value.untyped_storage().data_ptr():
        return key, value
    return owned(key), owned(value)


class SelfAttention(nn.Module):
    """Multi-head self-attention: [s, b, h] -> (output [s, b, h], bias [h] or None for the bda).

    Under sequence parallelism the input is [s/t, b, h]: linear_qkv all-gathers it and linear_proj
    reduce-scatters its output back to [s/t, b, h].
    """

    def __init__(self, config: TransformerConfig, submodules: SelfAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.padding, *,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config, self.layer_number = config, layer_number
        world = group_size(tp_group)
        d, n, g = config.kv_channels, config.num_attention_heads, config.num_query_groups
        self.hidden_size_per_attention_head = d
        self.num_attention_heads_per_partition = divide(n, world, "num_attention_heads")
        # g < t: the t/g ranks of a group share its key/value head (see the module docstring).
        self.num_query_groups_per_partition = 1 if g < world else divide(g, world, "num_query_groups")
        self.tp_group, self.tp_rank, self.tp_size = tp_group, group_rank(tp_group), world
        projection_size = n * d
        common = dict(tp_group=tp_group, bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
                      params_dtype=config.params_dtype)
        # add_qkv_bias: a bias on q, k and v only (Qwen2), the projection keeping add_bias_linear's.
        self.linear_qkv = build_module(submodules.linear_qkv, config.hidden_size, (n + 2 * g) * d,
                                       gather_output=False, init_method=init_method_normal(config.init_method_std),
                                       **{**common, "bias": config.add_bias_linear or config.add_qkv_bias})
        self.core_attention = build_module(submodules.core_attention, config=config, layer_number=layer_number,
                                           attn_mask_type=attn_mask_type, tp_group=tp_group)
        # The bias of the row-parallel projection is added by the bias-dropout-add after the reduce.
        self.linear_proj = build_module(submodules.linear_proj, projection_size, config.hidden_size,
                                        input_is_parallel=True, skip_bias_add=True,
                                        init_method=scaled_init_method_normal(config.init_method_std,
                                                                              config.num_layers),
                                        **common)
        # Norms of each head's queries and keys: the spec's, or with qk_layernorm the config's norm in an identity
        # slot. Each TP rank normalizes its own heads (or, with fewer groups than ranks, its queries' share of a
        # key head), so their gradients are partial: summed over TP as a sequence-parallel norm's are.
        slots = [submodules.q_layernorm, submodules.k_layernorm]
        if config.qk_layernorm:
            slots = [get_norm_class(config) if slot is IdentityOp else slot for slot in slots]
        self.q_layernorm, self.k_layernorm = (build_module(slot, config=config, hidden_size=d,
                                                           eps=config.layernorm_epsilon) for slot in slots)
        for param in (*self.q_layernorm.parameters(), *self.k_layernorm.parameters()):
            set_param_facts(param, sequence_parallel=True)

    def _query_key_value(self, hidden_states: torch.Tensor, rotary_pos_emb: RotaryTable | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """``(query, key, value, rotated)``: with ``rotary_pos_emb``, no q/k norms (which come before RoPE) and
        whole groups on this rank, the query and key heads are rotated here, and ``rotated`` is True. With one query
        head a group, or one group on this rank, in one pass over linear_qkv's group-major output
        (:func:`~lightning_megatron.transformer.rotary.apply_rotary_pos_emb_heads`), whose views the three are;
        otherwise (grouped-query attention) each from its heads in that output into a tensor of its own (the queries
        without the copy that merging a group's heads with the groups makes; the values copied out by
        :func:`_apart`): the tensors the attention keeps, ``(2n + 2g) d`` a token, for 16 more ops a layer than one
        pass."""
        mixed, _ = self.linear_qkv(hidden_states)  # [s, b, g/t * (n/g + 2) * d], group-major
        s, b = mixed.shape[:2]
        d, groups = self.hidden_size_per_attention_head, self.num_query_groups_per_partition
        n, g, t = self.config.num_attention_heads, self.config.num_query_groups, self.tp_size
        if g < t:
            # All-gather along the last dim with a reduce-scatter backward: the sequence-parallel
            # gather does exactly that along dim 0, so move the last dim there and back.
            full = gather_from_sequence_parallel_region(mixed.movedim(-1, 0).contiguous(), self.tp_group, True)
            width = (n // g + 2) * d
            j = self.tp_rank // (t // g)
            mixed = full.movedim(0, -1)[..., j * width:(j + 1) * width]
        per_group = n // g if g < t else self.num_attention_heads_per_partition // groups  # query heads per group
        rotated = (rotary_pos_emb is not None and g >= t and isinstance(self.q_layernorm, IdentityOp)
                   and isinstance(self.k_layernorm, IdentityOp))
        if rotated and per_group > 1 and groups > 1:  # each into a tensor of its own (the values by _apart)
            query, key, value = mixed.reshape(s, b, groups, per_group + 2, d).split([per_group, 1, 1], dim=-2)
            query = apply_rotary_pos_emb(query, rotary_pos_emb).view(s, b, groups * per_group, d)
            key = apply_rotary_pos_emb(key, rotary_pos_emb).view(s, b, groups, d)
            return query, key, value.reshape(s, b, groups, d), rotated
        if rotated:  # one query head a group, or one group: one pass, the three views of its output
            mixed = apply_rotary_pos_emb_heads(mixed.reshape(s, b, groups, per_group + 2, d), rotary_pos_emb,
                                               per_group + 1)
        mixed = mixed.reshape(s, b, groups, (per_group + 2) * d)
        query, key, value = torch.split(mixed, [per_group * d, d, d], dim=-1)
        query = query.reshape(s, b, groups * per_group, d)
        if g < t:
            mine = self.num_attention_heads_per_partition
            i = self.tp_rank % (t // g)
            query = query[:, :, i * mine:(i + 1) * mine]
        return query, key, value, rotated

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, *,
                rotary_pos_emb: torch.Tensor | RotaryTable | None = None,
                inference_context: InferenceContext | None = None,
                context_parallel: ContextParallel | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``rotary_pos_emb``: the RoPE angle table [s, 1, 1, d_rot] of this forward's positions (the
        full sequence, or the new tokens with a KV cache; a :class:`~lightning_megatron.transformer.rotary.
        RotaryTable`, whose cos and sin the model's layers share), or None. ``inference_context``: the KV
        cache (:class:`~lightning_megatron.transformer.inference.InferenceContext`): this forward's
        keys and values are appended and the queries attend to every cached position (but the padding of
        left-padded prompts: the context's :meth:`~InferenceContext.attention_mask`).
        ``context_parallel``: this rank holds part of the sequence
        (:mod:`~lightning_megatron.transformer.context_parallel`): the keys and values are gathered over
        the CP group and its mask replaces ``attention_mask``."""
        if inference_context is not None and self.config.sequence_parallel:
            raise ValueError("a KV cache (inference_context) with sequence_parallel=True is not supported: one new "
                             "token cannot be split over the sequence; generate with a model built with "
                             "sequence_parallel=False")
        if inference_context is not None and context_parallel is not None:
            raise ValueError("a KV cache (inference_context) with context parallelism is not supported: generate "
                             "with a model built without it (checkpoints do not depend on the layout)")
        if inference_context is not None and attention_mask is not None:
            raise ValueError("a KV cache (inference_context) with an attention_mask is not supported: the cache holds "
                             "the padding of prompts of unequal length (InferenceContext(left_padding=...)) and "
                             "makes the mask; pass attention_mask=None")
        if rotary_pos_emb is not None:
            rotary_pos_emb = RotaryTable.of(rotary_pos_emb)
        # [s, b, n/t, d]; key, value [s, b, g/t, d]
        query, key, value, rotated = self._query_key_value(hidden_states, rotary_pos_emb)
        key, value = _apart(query, key, value)
        query, key = self.q_layernorm(query), self.k_layernorm(key)
        if rotary_pos_emb is not None and not rotated:
            query, key = apply_rotary_pos_emb(query, rotary_pos_emb), apply_rotary_pos_emb(key, rotary_pos_emb)
        if context_parallel is not None:  # over the CP group: gathered keys and values, or heads for sequence
            attend = functools.partial(context_parallel.attention, self.core_attention,
                                       comm_type=self.config.cp_comm_type)
            if self.config.recompute_granularity == "selective":
                return self.linear_proj(recompute(attend, query, key, value))
            return self.linear_proj(attend(query, key, value))
        if inference_context is not None:
            key, value = inference_context.append(self.layer_number, key, value)  # [offset + s, b, g/t, d]
            padding = inference_context.attention_mask(query.shape[0])  # left-padded prompts: [b, 1, s, offset + s]
            context = self.core_attention(query, key, value, None if padding is None else padding[: query.shape[1]])
        elif self.config.recompute_granularity == "selective":
            # Core attention holds the O(s^2) activations (scores, probs, dropout mask) and is cheap
            # to recompute compared with the matmuls around it: Megatron's selective recomputation.
            context = recompute(self.core_attention, query, key, value, attention_mask)
        else:
            context = self.core_attention(query, key, value, attention_mask)
        return self.linear_proj(context)
