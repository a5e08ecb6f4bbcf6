"""GPTModel: embedding -> TransformerBlock of causal layers -> final norm -> output layer (vocab-parallel).

megatron-core's ``GPTModel`` with the local spec, built per pipeline chunk as our ``BertModel``:

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
import torch.distributed as dist
from torch import nn

from lightning_megatron.parallel_state import group_size
from lightning_megatron.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    mark_replicated,
    pad_vocab_size,
    scatter_to_sequence_parallel_region,
    set_param_facts,
    vocab_parallel_cross_entropy,
)
from lightning_megatron.tensor_parallel.backward import defer_output_layer_weight_grad
from lightning_megatron.tensor_parallel.random import get_rng_tracker
from lightning_megatron.transformer import (
    Dropout,
    ModuleSpec,
    TransformerBlock,
    TransformerConfig,
    TransformerLayer,
    get_spec,
    seeded,
)

__all__ = ["GPTEmbedding", "GPTModel", "POSITION_EMBEDDING_TYPES", "gpt_loss"]

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
PositionEmbeddingType = Literal["learned_absolute", "rope", "none"]


def _resolve_spec(spec: ModuleSpec | str) -> ModuleSpec:
    if isinstance(spec, str):
        import lightning_megatron.models.gpt.specs  # noqa: F401  (registers the built-in decoder specs)

        return get_spec(spec)
    return spec


class GPTEmbedding(nn.Module):
    """word (vocab-parallel) [+ learned absolute position] -> dropout. [b, s] -> [s, b, h].

    Under sequence parallelism the sum is scattered along s first, so dropout runs on [s/t, b, h]
    and draws from the per-rank model-parallel stream.
    """

    def __init__(self, config: TransformerConfig, padded_vocab_size: int, max_sequence_length: int, *,
                 tp_group: dist.ProcessGroup | None, learned_positions: bool, seed: int) -> None:
        super().__init__()
        self.config, self.tp_group = config, tp_group
        init = init_method_normal(config.init_method_std)
        with seeded(seed, "embedding.word_embeddings"):
            self.word_embeddings = VocabParallelEmbedding(padded_vocab_size, config.hidden_size, tp_group=tp_group,
                                                          init_method=init, params_dtype=config.params_dtype)
        self.position_embeddings = None
        if learned_positions:
            with seeded(seed, "embedding.position_embeddings"):
                self.position_embeddings = nn.Embedding(max_sequence_length, config.hidden_size,
                                                        dtype=config.params_dtype)
                init(self.position_embeddings.weight.data)
        self.embedding_dropout = Dropout(config.hidden_dropout)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        embeddings = self.word_embeddings(tokens)  # [b, s, h]
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = embeddings.transpose(0, 1).contiguous()  # [s, b, h]
        if self.config.sequence_parallel:
            embeddings = scatter_to_sequence_parallel_region(embeddings, self.tp_group)  # [s/t, b, h]
            if self.training and self.embedding_dropout.p > 0:
                with get_rng_tracker().fork():
                    return self.embedding_dropout(embeddings)
        return self.embedding_dropout(embeddings)


class GPTModel(nn.Module):
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
    """

    def __init__(self, config: TransformerConfig, spec: ModuleSpec | str, vocab_size: int, max_sequence_length: int,
                 *, tp_group: dist.ProcessGroup | None = None,
                 position_embedding_type: PositionEmbeddingType = "learned_absolute",
                 share_embeddings_and_output_weights: bool = True, pre_process: bool = True,
                 post_process: bool = True, layer_range: range | None = None, make_vocab_size_divisible_by: int = 128,
                 seed: int = 1234) -> None:
        super().__init__()
        t = group_size(tp_group)
        if t != config.tensor_model_parallel_size:
            raise ValueError(f"tensor_model_parallel_size={config.tensor_model_parallel_size} in the config but the "
                             f"tp_group has {t} ranks; set config.tensor_model_parallel_size={t}")
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type={position_embedding_type!r} must be one of "
                             f"{POSITION_EMBEDDING_TYPES}")
        layer_range = range(config.num_layers) if layer_range is None else layer_range
        if pre_process and layer_range.start != 0:
            raise ValueError(f"layer_range={layer_range}: the chunk with pre_process=True must start at layer 0")
        if post_process and layer_range.stop != config.num_layers:
            raise ValueError(f"layer_range={layer_range}: the chunk with post_process=True must end at "
                             f"num_layers={config.num_layers}")
        spec = _resolve_spec(spec)
        self.config, self.spec, self.tp_group = config, spec, tp_group
        self.vocab_size = vocab_size
        self.padded_vocab_size = pad_vocab_size(vocab_size, t, make_vocab_size_divisible_by)
        self.max_sequence_length = max_sequence_length
        self.position_embedding_type = position_embedding_type
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights

        if pre_process:
            self.embedding = GPTEmbedding(config, self.padded_vocab_size, max_sequence_length, tp_group=tp_group,
                                          learned_positions=position_embedding_type == "learned_absolute", seed=seed)
        # Not a submodule: Lightning's bf16-true casts a module's floating buffers, and inv_freq in bf16
        # would turn position 2048's angles by radians. The fp32 table is made per length and device.
        self._rotary = (self._make_rotary(),) if position_embedding_type == "rope" else ()
        self._rotary_table: torch.Tensor | None = None
        self.decoder = TransformerBlock(config, spec, tp_group=tp_group, layer_range=layer_range,
                                        pre_process=pre_process, post_process=post_process, post_layer_norm=True,
                                        seed=seed, key_prefix="decoder.layers")
        if post_process:
            # Tied: the embedding's weight is passed in forward, unless this chunk has no embedding
            # (pipeline last stage): then it owns a copy drawn from the embedding's own stream.
            owns_weight = not (pre_process and share_embeddings_and_output_weights)
            key = "embedding.word_embeddings" if share_embeddings_and_output_weights else "output_layer"
            with seeded(seed, key):
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, self.padded_vocab_size, tp_group=tp_group, bias=False, gather_output=False,
                    init_method=init_method_normal(config.init_method_std), sequence_parallel=config.sequence_parallel,
                    params_dtype=config.params_dtype, skip_weight_param_allocation=not owns_weight)
            defer_output_layer_weight_grad(self.output_layer, config.defer_embedding_wgrad_compute,
                                           pre_process=pre_process)
        if share_embeddings_and_output_weights and (pre_process or post_process):
            # The strategy all-reduces this grad over the embedding group (first + last stage).
            set_param_facts(self.shared_embedding_or_output_weight(), shared_embedding=True)
        mark_replicated(self.parameters())  # the rest (norms, position embeddings) replicated over TP

    def _make_rotary(self) -> nn.Module:
        from lightning_megatron.transformer.rotary import RotaryEmbedding

        return RotaryEmbedding(self.config.kv_channels, self.config.rotary_percent, self.config.rotary_base)

    def rotary_pos_emb(self, seq_length: int, device: torch.device, offset: int = 0) -> torch.Tensor:
        """The rope angle table [s, 1, 1, d_rot] (fp32) of positions ``offset .. offset + s``, for the
        whole sequence (also under sequence parallelism: q and k are full-sequence in attention)."""
        table = self._rotary_table
        if table is None or table.device != device or table.size(0) < offset + seq_length:
            table = self._rotary[0](max(offset + seq_length, self.max_sequence_length)).to(device)
            self._rotary_table = table
        return table[offset: offset + seq_length]

    def shared_embedding_or_output_weight(self) -> nn.Parameter:
        """The word-embedding weight [V_padded/t, h] this chunk holds (its own copy on a last stage)."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process and self.output_layer.weight is not None:
            return self.output_layer.weight
        raise ValueError("this chunk holds no word embedding (pre_process=False and post_process=False)")

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """Pipeline hook: the [s, b, h] input of a chunk with ``pre_process=False``."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0] if input_tensor else None
        self.decoder.set_input_tensor(input_tensor)

    def compile_layers(self, **options: Any) -> int:
        """Regional compilation: ``torch.compile`` every transformer layer's forward in place."""
        layers = [m for m in self.modules() if isinstance(m, TransformerLayer)]
        for layer in layers:
            layer.compile(**options)
        return len(layers)

    def _decode(self, hidden_states: torch.Tensor | None, tokens: torch.Tensor, position_offset: int,
                inference_context: Any) -> torch.Tensor:
        kwargs: dict[str, Any] = {} if inference_context is None else {"inference_context": inference_context}
        if self._rotary:
            kwargs["rotary_pos_emb"] = self.rotary_pos_emb(tokens.size(1), tokens.device, position_offset)
        return self.decoder(hidden_states, None, **kwargs)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, *, position_offset: int = 0,
                inference_context: Any = None) -> torch.Tensor:
        """``tokens`` [b, s] (on every chunk: it gives the sequence length); returns

        - ``post_process=False``: hidden states [s, b, h] (input of the next stage);
        - ``labels`` None: logits [b, s, V_padded/t] (this rank's vocabulary columns);
        - ``labels`` [b, s] (the next tokens): the per-token cross entropy [b, s] (fp32).

        ``position_ids`` [b, s]: None is ``arange(s)`` (the GPT dataset's positions) shifted by
        ``position_offset``, the position of ``tokens[:, 0]`` when generating with a KV cache
        (``inference_context``, :func:`lightning_megatron.generation.generate`).
        """
        s = tokens.size(1)
        if position_offset + s > self.max_sequence_length:
            raise ValueError(f"positions up to {position_offset + s} exceed max_sequence_length="
                             f"{self.max_sequence_length}; raise max_sequence_length")
        hidden_states = None
        if self.pre_process:
            if position_ids is None and self.embedding.position_embeddings is not None:
                position_ids = torch.arange(position_offset, position_offset + s, device=tokens.device)
                position_ids = position_ids.unsqueeze(0).expand_as(tokens)
            hidden_states = self.embedding(tokens, position_ids)
        hidden_states = self._decode(hidden_states, tokens, position_offset, inference_context)
        if not self.post_process:
            return hidden_states
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=weight)  # [s, b, V/t]
        logits = logits.transpose(0, 1).contiguous()  # [b, s, V/t]
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, tp_group=self.tp_group, vocab_size=self.vocab_size)


def gpt_loss(loss_per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The LM loss of a microbatch: ``sum(loss * mask) / sum(mask)`` over its tokens (fp32), the
    normalisation of BERT's masked-LM loss, so every layout (same microbatches) equals one process."""
    mask = loss_mask.float()
    return (loss_per_token.float() * mask).sum() / mask.sum().clamp(min=1.0)
