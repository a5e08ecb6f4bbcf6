"""DecoderShape: the decoder's costs for ``lightning-megatron check --estimate-memory`` (no model is built).

A :class:`~lightning_megatron.check.memory.ModelShape` (the encoder's sizes and the layout-side
formulas) with what a decoder layer and its ends hold instead (:class:`~lightning_megatron.protocols.MemoryCost`):

- per layer on a TP rank: ``linear_qkv`` (n + 2g) d h / t, ``linear_proj`` n d h / t, ``linear_fc1``
  m f h / t (m = 2 with a gated MLP: [gate; up]), ``linear_fc2`` f h / t; biases when ``add_bias_linear``
  (qkv and fc1 split, proj and fc2 replicated); two norms (h for RMSNorm, 2h for LayerNorm);
- first stage: the vocab-parallel word embedding V/t x h (+ learned positions s_max x h);
- last stage: the final norm and the output layer V/t x h when untied, or, tied, the last stage's copy
  of the word embedding when it is not also the first; no pooler, no head dense layer;
- activations per layer: the masked-LM head of BERT is replaced by the output layer on every token
  (its input, the vocab-parallel logits and their fp32 softmax).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_megatron.check.memory import ModelShape

if TYPE_CHECKING:
    from typing_extensions import Self

    from lightning_megatron.models.gpt.config import GPTConfig

__all__ = ["DecoderShape"]


@dataclass(frozen=True, kw_only=True)
class DecoderShape(ModelShape):
    """A decoder's sizes (GPTLightningModule's config record plus the batch)."""

    num_query_groups: int | None = None
    """Key/value heads (None: one per query head)."""
    kv_channels: int | None = None
    """Per-head width d (None: hidden_size / num_attention_heads)."""
    gated_linear_unit: bool = False
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    learned_positions: bool = True
    family: str = "gpt"

    @classmethod
    def from_config(cls, config: GPTConfig, **shape: Any) -> Self:  # type: ignore[override]
        """:meth:`ModelShape.from_config` with the decoder's fields of a ``GPTConfig``."""
        decoder = dict(num_query_groups=config.num_query_groups, kv_channels=config.kv_channels,
                       gated_linear_unit=config.gated_linear_unit, add_bias_linear=config.add_bias_linear,
                       untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
                       learned_positions=config.position_embedding_type == "learned_absolute")
        return super().from_config(config, **{**decoder, **shape})

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def layer_parameters(self, tp: int) -> int:
        """Parameter elements of one layer on one TP rank."""
        h, f, d, n, g = self.hidden_size, self.ffn, self.head_dim, self.num_attention_heads, self.groups
        m = 2 if self.gated_linear_unit else 1
        norm = h if self.rmsnorm else 2 * h
        n_w = ((n + 2 * g) * d * h + n * d * h + m * f * h + f * h) // tp
        n_b = ((n + 2 * g) * d + m * f) // tp + 2 * h if self.add_bias_linear else 0
        return n_w + n_b + 2 * norm

    def stage_parameters(self, tp: int, pp: int, stage: int) -> int:
        h = self.hidden_size
        embedding = self.padded_vocab(tp) // tp * h
        n = self.num_layers // pp * self.layer_parameters(tp)
        if stage == 0:
            n += embedding + (self.max_sequence_length * h if self.learned_positions else 0)
        if stage == pp - 1:
            n += h if self.rmsnorm else 2 * h  # final norm
            if self.untie_embeddings_and_output_weights or pp > 1:
                n += embedding  # the output layer, or the last stage's copy of the tied embedding
        return n

    def layer_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        s, b, h, f = self.seq_length, self.micro_batch_size, self.hidden_size, self.ffn
        d, n, g, e = self.head_dim, self.num_attention_heads, self.groups, self.param_bytes
        sp = tp if sequence_parallel else 1
        replicated = 4 * h / sp  # both norms' inputs and outputs
        # q, k, v and the attention output; fc1's output(s), the activation (and the gated product)
        parallel = ((2 * n + 2 * g) * d + (4 * f if self.gated_linear_unit else 2 * f)) / tp
        stats = 4 * 4 * s * b / sp
        attention = e * b * n * s * s / tp if self.unfused_attention else 4 * b * n * s / tp
        masks = 0.0
        if self.hidden_dropout > 0:
            masks += 2 * self.mask_bytes * s * b * h / sp
        if self.attention_dropout > 0 and self.unfused_attention:
            masks += (self.mask_bytes + e) * b * n * s * s / tp
        return e * s * b * (replicated + parallel) + stats + attention + masks

    def last_stage_activation_bytes(self, tp: int) -> float:
        """The final norm's output, the vocab-parallel logits and the cross entropy's fp32 softmax."""
        s, b, h, e = self.seq_length, self.micro_batch_size, self.hidden_size, self.param_bytes
        v = self.padded_vocab(tp) / tp
        return e * s * b * (h + v) + 4 * s * b * v + 8 * s * b

    def tensor_parallel_problem(self, tp: int) -> str | None:
        g = self.groups
        if self.num_attention_heads % tp or self.ffn % tp:
            return f"TP={tp} does not divide {self.num_attention_heads} heads / FFN {self.ffn}"
        if g % tp and tp % g:
            return f"TP={tp} is neither a multiple nor a divisor of {g} key/value groups"
        return None

    def describe(self) -> str:
        shape = "SwiGLU" if self.gated_linear_unit else "MLP"
        return (f"decoder: {self.num_layers} layers, hidden {self.hidden_size}, {self.num_attention_heads} heads in "
                f"{self.groups} key/value groups, {shape} {self.ffn}, vocab {self.vocab_size} "
                f"({'untied' if self.untie_embeddings_and_output_weights else 'tied'}), seq {self.seq_length}, "
                f"micro batch {self.micro_batch_size}, global batch {self.global_batch_size}, {self.params_dtype}, "
                f"{self.optimizer}{', full recompute' if self.recompute else ''}, dropout {self.hidden_dropout:g}/"
                f"{self.attention_dropout:g}")
