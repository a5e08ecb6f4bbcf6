"""LanguageModule: what every language model's pipeline chunk has (megatron-core's ``LanguageModule``).

A family's chunk (``BertModel``, ``GPTModel``) subclasses :class:`LanguageModule` and builds its own
transformer block and heads; the base holds, once:

- the checks of a chunk's place (``tp_group`` against ``config.tensor_model_parallel_size``, a
  ``layer_range`` that starts at layer 0 on the first chunk and ends at ``num_layers`` on the last);
- the vocabulary: the real ``vocab_size`` and ``padded_vocab_size = pad_vocab_size(V, t, m)``;
- :class:`LanguageModelEmbedding` (vocab-parallel word embeddings [+ learned positions] [+ token
  types] [-> norm] -> dropout), built by the family with the options it needs;
- the output layer (:meth:`build_output_layer`): column-parallel over the padded vocabulary, tied to
  the word embedding or its own weight, a last stage's tied copy drawn from the embedding's own
  stream, the deferred weight gradient of megatron-core's ``defer_embedding_wgrad_compute``;
- the parameter facts (:meth:`finish_parameters`): ``shared_embedding`` on the tied word embedding (its
  gradient is summed over the embedding group), ``real_vocab_size`` on the vocab-padded tensors
  (checkpoints keep the real rows), every other parameter replicated across TP;
- ``compute_language_model_loss`` (the vocab-parallel cross entropy against the real vocabulary),
  ``set_input_tensor`` (the pipeline's input of a chunk without the embedding), ``compile_layers``
  (regional ``torch.compile``) and ``compile_loss``, and :meth:`global_named_parameters` (names with global layer
  numbers).

Shapes: tokens [b, s]; activations [s, b, h] ([s/t, b, h] outside the TP regions under sequence
parallelism); logits vocab-parallel, [.., V_padded / t]. Every submodule is built inside an RNG stream
keyed by its name (``seeded(seed, "embedding.word_embeddings")``), so any layout starts from the same
numbers. No Lightning imports here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_megatron.parallel_state import Group, group_size
from lightning_megatron.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    mark_replicated,
    pad_vocab_size,
    recomputing_cross_entropy,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    set_param_facts,
    vocab_parallel_cross_entropy,
)
from lightning_megatron.tensor_parallel.backward import defer_output_layer_weight_grad
from lightning_megatron.tensor_parallel.embedding import Embedding
from lightning_megatron.tensor_parallel.random import get_rng_tracker
from lightning_megatron.transformer import (
    DEFAULT_KERNELS,
    Dropout,
    ModuleSpec,
    TransformerBlock,
    TransformerConfig,
    TransformerLayer,
    build_module,
    seeded,
)
from lightning_megatron.transformer.utils import owned

__all__ = ["LanguageModelEmbedding", "LanguageModule", "POSITION_EMBEDDING_TYPES"]

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
"""How a language model places its tokens: a learned table added to the word embedding (``learned_absolute``),
rotary embeddings in every layer's attention (``rope``), or nothing (``none``). Its cost record
(``cost.TransformerCost.position_embedding_type``) takes the same names."""


class LanguageModelEmbedding(nn.Module):
    """word (vocab-parallel) [+ learned position] [+ token type] -> [norm] -> dropout. [b, s] -> [s, b, h].

    Under sequence parallelism the sum is scattered along s first (the word embedding alone: its vocab-parallel
    partial sums reduce-scattered), so the norm and the dropout run on [s/t, b, h], and the dropout draws from the
    per-rank model-parallel stream (different chunks per rank). ``norm``: BERT's post-norm specs (Hugging Face's
    ``embeddings.LayerNorm``); GPT has none.
    """

    def __init__(self, config: TransformerConfig, padded_vocab_size: int, max_sequence_length: int, *,
                 tp_group: Group, seed: int, learned_positions: bool = True, num_tokentypes: int = 0,
                 norm: ModuleSpec | type | None = None) -> None:
        super().__init__()
        self.config, self.tp_group = config, tp_group
        init = init_method_normal(config.init_method_std)
        with seeded(seed, "embedding.word_embeddings"):
            self.word_embeddings = VocabParallelEmbedding(padded_vocab_size, config.hidden_size, tp_group=tp_group,
                                                          init_method=init, params_dtype=config.params_dtype)
        self.position_embeddings = None
        if learned_positions:
            with seeded(seed, "embedding.position_embeddings"):
                self.position_embeddings = Embedding(max_sequence_length, config.hidden_size,
                                                     dtype=config.params_dtype)
                init(self.position_embeddings.weight.data)
        self.tokentype_embeddings = None
        if num_tokentypes > 0:
            with seeded(seed, "embedding.tokentype_embeddings"):
                self.tokentype_embeddings = Embedding(num_tokentypes, config.hidden_size, dtype=config.params_dtype)
                init(self.tokentype_embeddings.weight.data)
        self.layernorm = None if norm is None else build_module(norm, config=config, hidden_size=config.hidden_size,
                                                                eps=config.layernorm_epsilon)
        self.embedding_dropout = Dropout(config.hidden_dropout)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        if token_types is not None and self.tokentype_embeddings is None:
            raise ValueError("token_types given but the model was built with num_tokentypes=0")
        sp = self.config.sequence_parallel
        if sp and self.position_embeddings is None and self.tokentype_embeddings is None:
            # the word embedding alone: its TP ranks' partial sums reduce-scattered straight into SP's chunks (the
            # backward all-gathers their gradients): half the bytes of an all-reduce and a scatter (megatron-core's
            # way; with position or token-type rows added, replicated on every rank, it all-reduces first too)
            partial = self.word_embeddings(tokens, reduce=False).transpose(0, 1).contiguous()  # [s, b, h]
            embeddings = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # [s/t, b, h], its own
        else:
            embeddings = self.word_embeddings(tokens)  # [b, s, h]
            if self.position_embeddings is not None:
                embeddings = embeddings + self.position_embeddings(position_ids)
            if self.tokentype_embeddings is not None:
                if token_types is None:
                    token_types = torch.zeros_like(tokens)
                embeddings = embeddings + self.tokentype_embeddings(token_types)
            embeddings = embeddings.transpose(0, 1).contiguous()  # [s, b, h]
            if sp:
                embeddings = scatter_to_sequence_parallel_region(embeddings, self.tp_group)  # [s/t, b, h]
                if torch.is_grad_enabled() and (self.layernorm is not None or not self.training
                                                or self.embedding_dropout.p == 0):
                    # a chunk of the whole: the norm, or the first layer's, would keep all of it for the backward
                    embeddings = owned(embeddings)
        if self.layernorm is not None:
            embeddings = self.layernorm(embeddings)
        if sp and self.training and self.embedding_dropout.p > 0:
            with get_rng_tracker().fork():
                return self.embedding_dropout(embeddings)
        return self.embedding_dropout(embeddings)


class LanguageModule(nn.Module):
    """One pipeline chunk of a language model (module docstring); a family builds, in order, the
    ``embedding`` (``pre_process``), its transformer block (named :attr:`block_name`), its heads and
    :meth:`build_output_layer` (``post_process``), then calls :meth:`finish_parameters`.

    Args:
        config: sizes and options; ``config.tensor_model_parallel_size`` must equal the size of ``tp_group``.
        vocab_size: the real vocabulary; embedding and logits are padded to ``self.padded_vocab_size``.
        max_sequence_length: rows of the learned positions (the longest sequence).
        layer_range: GLOBAL indices of the layers this chunk builds (None: all).
        pre_process / post_process: this chunk owns the embedding / the output layer and the loss.
        share_embeddings_and_output_weights: the output layer is the word embedding (tied) or has its own weight.
        make_vocab_size_divisible_by: the padding multiple (times the TP size).
        seed: the base of every submodule's init stream.
    """

    block_name: str = "decoder"
    """The attribute holding the chunk's ``TransformerBlock`` (``encoder`` in BERT, ``decoder`` in GPT):
    the prefix of the layers' names, ``<block_name>.layers.<i>``."""

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int, *,
                 tp_group: Group = None, pre_process: bool = True, post_process: bool = True,
                 layer_range: range | None = None, share_embeddings_and_output_weights: bool = True,
                 make_vocab_size_divisible_by: int = 128, seed: int = 1234) -> None:
        super().__init__()
        t = group_size(tp_group)
        if t != config.tensor_model_parallel_size:
            raise ValueError(f"tensor_model_parallel_size={config.tensor_model_parallel_size} in the config but the "
                             f"tp_group has {t} ranks; set config.tensor_model_parallel_size={t}")
        layer_range = range(config.num_layers) if layer_range is None else layer_range
        if pre_process and layer_range.start != 0:
            raise ValueError(f"layer_range={layer_range}: the chunk with pre_process=True must start at layer 0")
        if post_process and layer_range.stop != config.num_layers:
            raise ValueError(f"layer_range={layer_range}: the chunk with post_process=True must end at "
                             f"num_layers={config.num_layers}")
        self.config, self.tp_group, self.seed = config, tp_group, seed
        self.layer_range = layer_range
        self.vocab_size = vocab_size
        self.padded_vocab_size = pad_vocab_size(vocab_size, t, make_vocab_size_divisible_by)
        self.max_sequence_length = max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.kernels = DEFAULT_KERNELS  # the loss's (Kernels.loss_rows); a platform's with set_kernels
        self._compiled_loss: Callable[..., torch.Tensor] | None = None  # compile_loss's

    # ------------------------------------------------------------------ building

    def build_output_layer(self, *, bias: bool) -> None:
        """``self.output_layer``: [h] -> [V_padded / t] logits, column-parallel (the chunk that ends the model).

        Tied, the embedding's weight is passed in forward (:meth:`output_weight`), unless this chunk has
        no embedding (a pipeline last stage): then it owns a copy drawn from the embedding's own stream,
        so both copies start identical."""
        config = self.config
        owns_weight = not (self.pre_process and self.share_embeddings_and_output_weights)
        key = "embedding.word_embeddings" if self.share_embeddings_and_output_weights else "output_layer"
        with seeded(self.seed, key):
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, tp_group=self.tp_group, bias=bias, gather_output=False,
                init_method=init_method_normal(config.init_method_std), sequence_parallel=config.sequence_parallel,
                params_dtype=config.params_dtype, skip_weight_param_allocation=not owns_weight)
        defer_output_layer_weight_grad(self.output_layer, config.defer_embedding_wgrad_compute,
                                       pre_process=self.pre_process, limit=config.wgrad_deferral_limit)

    def finish_parameters(self) -> None:
        """The parameter facts of a built chunk: the tied word embedding is ``shared_embedding`` (the
        strategy all-reduces its gradient over the embedding group: first + last stage), the vocab-padded
        tensors carry ``real_vocab_size`` (checkpoints store only the real rows: the padding depends on
        TP), and every other parameter is replicated across TP (norms, positions, heads)."""
        if self.share_embeddings_and_output_weights and (self.pre_process or self.post_process):
            set_param_facts(self.shared_embedding_or_output_weight(), shared_embedding=True)
        mark_replicated(self.parameters())
        padded = []
        if self.pre_process:
            padded.append(self.embedding.word_embeddings.weight)
        if self.post_process:
            padded += [t for t in (self.output_layer.weight, self.output_layer.bias) if t is not None]
        for t in padded:  # the parallel layers set partition_dim 0 (the vocabulary's dimension)
            set_param_facts(t, real_vocab_size=self.vocab_size)

    # ------------------------------------------------------------------ what every chunk does

    def shared_embedding_or_output_weight(self) -> nn.Parameter:
        """The word-embedding weight [V_padded/t, h] this chunk holds (its own copy on a last stage)."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process and self.output_layer.weight is not None:
            return self.output_layer.weight
        raise ValueError("this chunk holds no word embedding (pre_process=False and post_process=False)")

    def output_weight(self) -> torch.Tensor | None:
        """The weight the output layer is called with: the word embedding when tied, else None (its own)."""
        return self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy of vocab-parallel ``logits`` [.., V_padded/t] against ``labels`` [..]
        (fp32; the padded columns never count): megatron-core's loss hook."""
        if self._compiled_loss is not None:
            return self._compiled_loss(logits, labels, vocab_size=self.vocab_size)
        return vocab_parallel_cross_entropy(logits, labels, tp_group=self.tp_group, vocab_size=self.vocab_size,
                                            rows_per_piece=self.kernels.loss_rows(logits))

    @property
    def transformer_block(self) -> TransformerBlock:
        """The chunk's layers (``self.<block_name>``)."""
        return self.get_submodule(self.block_name)

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """Pipeline hook: the [s, b, h] input of a chunk with ``pre_process=False``."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0] if input_tensor else None
        self.transformer_block.set_input_tensor(input_tensor)

    def compile_layers(self, **options: Any) -> int:
        """Regional compilation: ``torch.compile`` the forward of every transformer layer in place.

        Layers share their code and shapes, so the compiled graph is reused across them (a few
        seconds of compilation instead of minutes for the whole model). Returns the number of layers.
        """
        layers = [m for m in self.modules() if isinstance(m, TransformerLayer)]
        for layer in layers:
            layer.compile(**options)
        return len(layers)

    def compile_loss(self, **options: Any) -> bool:
        """With one TP rank, :meth:`compute_language_model_loss` from now on runs
        :func:`~lightning_megatron.tensor_parallel.cross_entropy.recomputing_cross_entropy` under ``torch.compile``
        (``options``): the compiler fuses its passes over the logits, and the backward recomputes the softmax from
        the logits instead of keeping an fp32 copy of them. With more TP ranks the vocab-parallel function stays
        (its collectives). Returns whether the loss is compiled."""
        if group_size(self.tp_group) > 1:
            return False
        self._compiled_loss = torch.compile(recomputing_cross_entropy, **options)
        return True

    def global_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``named_parameters()`` under layout-independent names: a layer's local index in this chunk
        becomes its global number (``decoder.layers.3.*``), and a local expert its global index
        (``mlp.experts.local_experts.5.*``): what makes checkpoints reshardable over PP and EP."""
        first_expert = next((m.experts.first_expert for m in self.modules() if hasattr(m, "experts")
                             and hasattr(m.experts, "first_expert")), 0)
        layer = re.compile(rf"{re.escape(self.block_name)}\.layers\.(\d+)\.(.*)")
        expert = re.compile(r"(.*\.experts\.local_experts\.)(\d+)(\..*)")
        start = self.layer_range.start
        for name, p in self.named_parameters():
            m = layer.match(name)
            if m:
                name = f"{self.block_name}.layers.{start + int(m.group(1))}.{m.group(2)}"
                e = expert.match(name)
                if e:  # this EP rank's local expert i is global expert first_expert + i
                    name = f"{e.group(1)}{first_expert + int(e.group(2))}{e.group(3)}"
            yield name, p
