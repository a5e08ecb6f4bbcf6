"""GPTModel: embedding -> TransformerBlock of causal layers -> final norm -> output layer (vocab-parallel).

megatron-core's ``GPTModel`` with the local spec, a :class:`~lightning_megatron.language.LanguageModule`
(the chunk's place, vocabulary, tied output layer, parameter facts and pipeline hooks) built per pipeline chunk:

    tokens [b, s] -> word embeddings (vocab-parallel) [+ learned positions] -> dropout   [s, b, h]
                  -> layers (causal self-attention, MLP; pre-norm) -> final norm          [s, b, h]
                  -> output layer (tied to the word embeddings, or its own weight)        [s, b, V_pad/t]
                  -> vocab-parallel cross entropy against ``labels`` (the shifted tokens)  [b, s]

Shapes: activations are [s, b, h] inside ([s/t, b, h] outside the TP regions under sequence
parallelism: the embedding scatters, the output layer all-gathers its input); logits [b, s, V_pad/t]
are never gathered. Position embeddings: ``learned_absolute`` (GPT-2), ``rope`` (Llama: rotary
frequencies for the full sequence, passed to every layer's attention, which applies them to the
full-sequence q and k after ``linear_qkv``'s all-gather) or ``none``.

Parameter names are megatron-core's: ``embedding.word_embeddings.weight``,
``embedding.position_embeddings.weight``, ``decoder.layers.{i}.*`` (local index in a chunk; the
LightningModule renames to the global one), ``decoder.final_layernorm.*``, ``output_layer.weight``
(a chunk that ends the model and has no embedding holds the tied copy there, drawn from the
embedding's own stream so both copies start identical; absent when tied on a single stage).

Layout independence: every submodule is built inside an RNG stream keyed by its name, the parallel
layers draw full fp32 master weights and keep their slice: any TP x PP x VP starts from the same numbers.

No Lightning imports here.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from lightning_megatron.language.model import POSITION_EMBEDDING_TYPES, LanguageModelEmbedding, LanguageModule
from lightning_megatron.parallel_state import Group
from lightning_megatron.transformer import ModuleSpec, TransformerBlock, TransformerConfig, get_spec
from lightning_megatron.transformer.attention import document_attention_mask
from lightning_megatron.transformer.context_parallel import ContextParallel
from lightning_megatron.transformer.rotary import RotaryTable
from lightning_megatron.transformer.moe import ExpertGroups

__all__ = ["GPTModel", "POSITION_EMBEDDING_TYPES", "gpt_loss"]

PositionEmbeddingType = Literal["learned_absolute", "rope", "none"]


def _resolve_spec(spec: ModuleSpec | str) -> ModuleSpec:
    if isinstance(spec, str):
        import lightning_megatron.models.gpt.specs  # noqa: F401  (registers the built-in decoder specs)

        return get_spec(spec)
    return spec


class GPTModel(LanguageModule):
    """A causal decoder LM built from a layer spec (a ModuleSpec or a registered name), for one pipeline chunk.

    Args:
        config: sizes and options; ``config.tensor_model_parallel_size`` must equal the size of ``tp_group``.
        spec: layer spec or its registered name (``gpt_layer_spec``, ``llama_layer_spec``); pre-norm
            (the block ends with the final norm).
        vocab_size: the real vocabulary; embedding and logits are padded to
            ``pad_vocab_size(vocab_size, t, make_vocab_size_divisible_by)`` (``self.padded_vocab_size``).
        max_sequence_length: rows of the learned positions; the longest sequence for rope.
        position_embedding_type: ``"learned_absolute"`` (GPT-2), ``"rope"`` (Llama) or ``"none"``.
        share_embeddings_and_output_weights: the output layer is the word embedding (GPT-2) or has
            its own weight (Llama: ``untie_embeddings_and_output_weights``).
        layer_range: GLOBAL indices of the layers this chunk builds (None: all).
        pre_process / post_process: this chunk owns the embedding / the output layer and the loss.
        seed: the base of every submodule's init stream.
        expert_groups: the process groups of mixture-of-experts layers (``config.num_moe_experts``), for a
            spec whose MLP slot is :class:`~lightning_megatron.transformer.moe.MoELayer`; None: one rank.
    """

    block_name = "decoder"

    def __init__(self, config: TransformerConfig, spec: ModuleSpec | str, vocab_size: int, max_sequence_length: int,
                 *, tp_group: Group = None,
                 position_embedding_type: PositionEmbeddingType = "learned_absolute",
                 share_embeddings_and_output_weights: bool = True, pre_process: bool = True,
                 post_process: bool = True, layer_range: range | None = None, make_vocab_size_divisible_by: int = 128,
                 seed: int = 1234, expert_groups: ExpertGroups | None = None) -> None:
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type={position_embedding_type!r} must be one of "
                             f"{POSITION_EMBEDDING_TYPES}")
        super().__init__(config, vocab_size, max_sequence_length, tp_group=tp_group, pre_process=pre_process,
                         post_process=post_process, layer_range=layer_range,
                         share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                         make_vocab_size_divisible_by=make_vocab_size_divisible_by, seed=seed)
        spec = _resolve_spec(spec)
        self.spec = spec
        self.position_embedding_type = position_embedding_type

        if pre_process:
            self.embedding = LanguageModelEmbedding(config, self.padded_vocab_size, max_sequence_length,
                                                    tp_group=tp_group, seed=seed,
                                                    learned_positions=position_embedding_type == "learned_absolute")
        # Not a submodule: Lightning's bf16-true casts a module's floating buffers, and inv_freq in bf16
        # would turn position 2048's angles by radians. The fp32 table is made per length and device.
        self._rotary = (self._make_rotary(),) if position_embedding_type == "rope" else ()
        self._rotary_table: torch.Tensor | None = None
        self._shared_rotary: tuple[tuple[int, int, torch.device], RotaryTable] | None = None
        self.decoder = TransformerBlock(config, spec, tp_group=tp_group, layer_range=self.layer_range,
                                        pre_process=pre_process, post_process=post_process, post_layer_norm=True,
                                        seed=seed, key_prefix="decoder.layers",
                                        expert_groups=expert_groups if config.num_moe_experts else None)
        if post_process:
            self.build_output_layer(bias=False)
        self.finish_parameters()

    def _make_rotary(self) -> nn.Module:
        from lightning_megatron.transformer.rotary import RotaryEmbedding

        c = self.config
        return RotaryEmbedding(c.kv_channels, c.rotary_percent, c.rotary_base,
                               c.rope_scaling_factor if c.rope_scaling else None)

    def rotary_pos_emb(self, seq_length: int, device: torch.device, offset: int = 0) -> torch.Tensor:
        """The rope angle table [s, 1, 1, d_rot] (fp32) of positions ``offset .. offset + s``, for the
        whole sequence (also under sequence parallelism: q and k are full-sequence in attention)."""
        table = self._rotary_table
        if table is None or table.device != device or table.size(0) < offset + seq_length:
            table = self._rotary[0](max(offset + seq_length, self.max_sequence_length)).to(device)
            self._rotary_table = table
        return table[offset: offset + seq_length]

    def _decode(self, hidden_states: torch.Tensor | None, tokens: torch.Tensor, position_ids: torch.Tensor | None,
                position_offset: int, inference_context: Any, attention_mask: torch.Tensor | None,
                context_parallel: ContextParallel | None) -> torch.Tensor:
        kwargs: dict[str, Any] = {} if inference_context is None else {"inference_context": inference_context}
        if context_parallel is not None:
            kwargs["context_parallel"] = context_parallel
        if self._rotary:
            if position_ids is None:
                kwargs["rotary_pos_emb"] = self._shared_rotary_table(tokens.size(1), tokens.device, position_offset)
            else:  # each sample's own positions (restarting per packed document): [s, b, 1, d_rot]
                table = self.rotary_pos_emb(self.max_sequence_length, tokens.device)[:, 0, 0]  # no host sync
                kwargs["rotary_pos_emb"] = RotaryTable(table[position_ids.t()].unsqueeze(2))
        return self.decoder(hidden_states, attention_mask, **kwargs)

    def _shared_rotary_table(self, seq_length: int, device: torch.device, offset: int) -> RotaryTable:
        """The :class:`RotaryTable` of positions ``offset .. offset + s``, kept while the forwards ask for the same
        positions (every training step: its cos and sin made once a run; the table keeps what inference mode
        makes apart)."""
        key = (offset, seq_length, device)
        if self._shared_rotary is None or self._shared_rotary[0] != key:
            self._shared_rotary = key, RotaryTable(self.rotary_pos_emb(seq_length, device, offset))
        return self._shared_rotary[1]

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, *, position_offset: int = 0,
                inference_context: Any = None, document_ids: torch.Tensor | None = None,
                context_parallel: ContextParallel | None = None) -> torch.Tensor:
        """``tokens`` [b, s] (on every chunk: it gives the sequence length); returns

        - ``post_process=False``: hidden states [s, b, h] (input of the next stage);
        - ``labels`` None: logits [b, s, V_padded/t] (this rank's vocabulary columns);
        - ``labels`` [b, s] (the next tokens): the per-token cross entropy [b, s] (fp32).

        ``position_ids`` [b, s]: None is ``arange(s)`` (the GPT dataset's positions) shifted by
        ``position_offset``, the position of ``tokens[:, 0]`` when generating with a KV cache
        (``inference_context``, :func:`lightning_megatron.generation.generate`), or, when the cache holds
        left-padded prompts, each row's own positions (:meth:`InferenceContext.position_ids
        <lightning_megatron.transformer.inference.InferenceContext.position_ids>`, counted from the row's
        first real token; the cache masks the padding in attention). Given, they are also the rotary
        positions (packed samples: Megatron's ``reset_position_ids``).

        ``document_ids`` [b, s]: packed samples (Megatron's ``reset_attention_mask``): a token attends
        only to the earlier tokens of its own document (:func:`document_attention_mask`).

        ``context_parallel``: ``tokens`` are this rank's part of the sequence and ``position_ids`` their real
        positions (:func:`~lightning_megatron.transformer.context_parallel.split_batch`, which also folds
        the documents into its mask); attention runs over the CP group.
        """
        if context_parallel is not None and (position_ids is None or document_ids is not None):
            raise ValueError("context parallelism: give this rank's position_ids and no document_ids (split_batch "
                             "makes both)")
        s = tokens.size(1)
        if position_ids is not None and position_offset:
            raise ValueError("position_ids and position_offset: give one (the offset shifts the default positions)")
        if position_offset + s > self.max_sequence_length:
            raise ValueError(f"positions up to {position_offset + s} exceed max_sequence_length="
                             f"{self.max_sequence_length}; raise max_sequence_length")
        if position_ids is None and inference_context is not None:
            position_ids = inference_context.position_ids(s)  # left-padded prompts: each row's own; else None
        given_positions = position_ids
        hidden_states = None
        if self.pre_process:
            if position_ids is None and self.embedding.position_embeddings is not None:
                position_ids = torch.arange(position_offset, position_offset + s, device=tokens.device)
                position_ids = position_ids.unsqueeze(0).expand_as(tokens)
            hidden_states = self.embedding(tokens, position_ids)
        mask = None if document_ids is None else document_attention_mask(document_ids)
        hidden_states = self._decode(hidden_states, tokens, given_positions, position_offset, inference_context, mask,
                                     context_parallel)
        if not self.post_process:
            return hidden_states
        logits, _ = self.output_layer(hidden_states, weight=self.output_weight())  # [s, b, V/t]
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, V/t]
        # Megatron's order: the labels go to [s, b], not the logits (the step's largest tensor) to [b, s], which
        # would copy them forward and again in the backward.
        return self.compute_language_model_loss(labels.t(), logits).t().contiguous()


def gpt_loss(loss_per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The LM loss of a microbatch: ``sum(loss * mask) / sum(mask)`` over its tokens (fp32), the
    normalisation of BERT's masked-LM loss, so every layout (same microbatches) equals one process."""
    mask = loss_mask.float()
    return (loss_per_token.float() * mask).sum() / mask.sum().clamp(min=1.0)
