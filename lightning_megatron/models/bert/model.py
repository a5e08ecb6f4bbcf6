"""BertModel: embeddings -> TransformerBlock -> (pooler + binary head, LM head tied to the embedding).

Shapes: tokens [b, s]; activations [s, b, h] inside (sequence first, [s/t, b, h] between TP regions
under sequence parallelism); LM logits [b, s, V_padded / t], vocab-parallel (never gathered: the
vocab-parallel cross entropy works on the shards); binary logits [b, 2].

Layout independence: every submodule is built inside an RNG stream keyed by its name
("embedding.word_embeddings", "layers.3", "pooler", ...), and the parallel layers draw full fp32
master weights and keep their slice. A pipeline chunk that builds layers 2..3 therefore gets the
same numbers as the full model, and TP=k shards are slices of TP=1. The last stage's copy of the
tied word embedding is drawn from the first stage's key, so both copies start identical.

No Lightning imports here: the LightningModule wraps this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_megatron.language.model import LanguageModelEmbedding, LanguageModule
from lightning_megatron.parallel_state import Group
from lightning_megatron.tensor_parallel import gather_from_sequence_parallel_region, init_method_normal, pad_vocab_size
from lightning_megatron.transformer import (
    ModuleSpec,
    TransformerBlock,
    TransformerConfig,
    build_module,
    get_activation_func,
    get_spec,
    layer_norm_spec,
    mark_sequence_parallel,
    norm_placement,
    resolve_norm_class,
    seeded,
)

__all__ = ["BertModel", "Pooler", "BertLMHead", "bert_loss", "count_parameters", "bert_attention_mask",
           "masked_positions"]


def _resolve_spec(spec: ModuleSpec | str) -> ModuleSpec:
    if isinstance(spec, str):
        # Importing the package registers the built-in BERT specs.
        import lightning_megatron.models.bert.specs  # noqa: F401

        return get_spec(spec)
    return spec


def masked_positions(mask: torch.Tensor) -> torch.Tensor:
    """The flat (b, s) indices [n] (int64, ascending) where ``mask`` [b, s] is True: the rows the LM head runs
    on. One ``nonzero``: its size depends on the data, so it reads the device (waits for the queued work);
    done once per microbatch, before the forward, and every gather after it is by index."""
    return mask.reshape(-1).nonzero().squeeze(1)


def bert_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] with 1 = real token, 0 = padding -> bool [b, 1, 1, s], True where a KEY is hidden.

    Only keys are masked (as Hugging Face does): pad positions still produce outputs, which the
    loss mask ignores.
    """
    return (attention_mask == 0).view(attention_mask.size(0), 1, 1, attention_mask.size(1))


class Pooler(nn.Module):
    """tanh(W h_0 + b) on the first token: [s, b, h] -> [b, h]. Replicated across TP.

    Under sequence parallelism the first token lives on TP rank 0's chunk: gather that row of every chunk (one
    row a rank; its backward is a split, since every rank computes the same, complete pooler gradient).
    """

    def __init__(self, config: TransformerConfig, tp_group: Group) -> None:
        super().__init__()
        self.config, self.tp_group = config, tp_group
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=config.params_dtype)
        init_method_normal(config.init_method_std)(self.dense.weight.data)
        nn.init.zeros_(self.dense.bias.data)

    def forward(self, hidden_states: torch.Tensor, sequence_index: int = 0) -> torch.Tensor:
        if self.config.sequence_parallel:
            # the token's row of every rank's chunk gathered (one row a rank, not the sequence): the rank whose
            # chunk holds the token gave row ``sequence_index // chunk``
            chunk = hidden_states.shape[0]
            row = sequence_index % chunk
            rows = gather_from_sequence_parallel_region(hidden_states[row:row + 1], self.tp_group,
                                                        tensor_parallel_output_grad=False)
            hidden_states, sequence_index = rows, sequence_index // chunk
        # a copy of the token: the dense layer keeps its input, and a view would keep all of [s, b, h]
        return torch.tanh(self.dense(hidden_states[sequence_index].clone()))


class BertLMHead(nn.Module):
    """norm(act(W x + b)): [s, b, h] -> [s, b, h], before the output layer tied to the embedding.

    Runs on the local sequence chunk under sequence parallelism, so its parameters are marked
    ``sequence_parallel`` (their gradients are summed over TP).
    """

    def __init__(self, config: TransformerConfig, norm: ModuleSpec | type, activation: str | None = None) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=config.params_dtype)
        init_method_normal(config.init_method_std)(self.dense.weight.data)
        nn.init.zeros_(self.dense.bias.data)
        mark_sequence_parallel(self.dense, config.sequence_parallel)
        self.activation_func = get_activation_func(activation or config.activation)
        self.layer_norm = build_module(norm, config=config, hidden_size=config.hidden_size,
                                       eps=config.layernorm_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(self.activation_func(self.dense(hidden_states)))


class BertModel(LanguageModule):
    """BERT built from a layer spec (a ModuleSpec or a registered name), for one pipeline chunk.

    A :class:`~lightning_megatron.language.LanguageModule` (the checks of a chunk's place, the
    vocabulary and its padding, the tied output layer, the parameter facts, ``set_input_tensor``,
    ``compile_layers``); BERT's own: token types, the encoder, the LM head and the pooler + binary head.

    Args:
        config: sizes and options; ``config.tensor_model_parallel_size`` must equal the size of ``tp_group``.
        spec: layer spec or its registered name. Pre-norm specs get a final norm after the last
            layer; post-norm specs get a norm on the embeddings instead (Hugging Face layout).
        vocab_size: the real vocabulary; the embedding and logits are padded to
            ``pad_vocab_size(vocab_size, t, make_vocab_size_divisible_by)`` (``self.padded_vocab_size``).
        max_sequence_length: number of learned positions.
        layer_range: GLOBAL indices of the layers this chunk builds (None: all).
        pre_process / post_process: this chunk owns the embeddings / the heads and the loss.
        seed: the base of every submodule's init stream.
        lm_head_activation: the LM head's activation; None: ``config.activation``. Megatron-LM models
            trained with ``--bias-gelu-fusion`` use ``config.activation="gelu_tanh"`` in the MLP but
            ``lm_head_activation="gelu"`` (exact) in the head.
    """

    block_name = "encoder"

    def __init__(self, config: TransformerConfig, spec: ModuleSpec | str, vocab_size: int, max_sequence_length: int,
                 *, tp_group: Group = None, num_tokentypes: int = 2, add_binary_head: bool = True,
                 pre_process: bool = True, post_process: bool = True,
                 share_embeddings_and_output_weights: bool = True, layer_range: range | None = None,
                 make_vocab_size_divisible_by: int = 128, seed: int = 1234,
                 lm_head_activation: str | None = None) -> None:
        super().__init__(config, vocab_size, max_sequence_length, tp_group=tp_group, pre_process=pre_process,
                         post_process=post_process, layer_range=layer_range,
                         share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                         make_vocab_size_divisible_by=make_vocab_size_divisible_by, seed=seed)
        spec = _resolve_spec(spec)
        self.spec = spec
        self.add_binary_head, self.num_tokentypes = add_binary_head, num_tokentypes
        post_norm = norm_placement(spec) == "post"
        norm = layer_norm_spec(spec)  # the LM head (and the embeddings, if post-norm) use the layers' norm

        if pre_process:
            self.embedding = LanguageModelEmbedding(config, self.padded_vocab_size, max_sequence_length,
                                                    tp_group=tp_group, seed=seed, num_tokentypes=num_tokentypes,
                                                    norm=norm if post_norm else None)
        self.encoder = TransformerBlock(config, spec, tp_group=tp_group, layer_range=self.layer_range,
                                        pre_process=pre_process, post_process=post_process, seed=seed)
        if post_process:
            with seeded(seed, "lm_head"):
                self.lm_head = BertLMHead(config, norm, lm_head_activation)
            self.build_output_layer(bias=True)
            if add_binary_head:
                with seeded(seed, "pooler"):
                    self.pooler = Pooler(config, tp_group)
                with seeded(seed, "binary_head"):
                    self.binary_head = nn.Linear(config.hidden_size, 2, dtype=config.params_dtype)
                    init_method_normal(config.init_method_std)(self.binary_head.weight.data)
                    nn.init.zeros_(self.binary_head.bias.data)
        self.finish_parameters()

    def _masked_lm_logits(self, hidden_states: torch.Tensor, lm_positions: torch.Tensor,
                          weight: torch.Tensor | None) -> torch.Tensor:
        """Logits [n, 1, V/t] of the n selected tokens (``lm_positions`` [n]: :func:`masked_positions`, flat
        (b, s) indices, in that order).

        The rows are gathered by index (``index_select``: no read of the device, and its backward adds each
        row's gradient into zeros, the values of the boolean mask's). Under sequence parallelism the
        selected tokens lie in every rank's sequence chunk: the sequence is all-gathered first (its backward
        reduce-scatters), every rank runs the head on all n tokens, and the output layer is applied without
        its own input all-gather. Its input gradient is then a partial sum over the vocabulary shards (each
        rank holds V/t columns), and stays partial through the head, which is linear in it: the head's
        parameters are marked ``sequence_parallel`` (summed over TP after backward) and the reduce-scatter of
        the gather sums the hidden states' gradient, exactly where the non-selective path sums them.
        """
        full = (gather_from_sequence_parallel_region(hidden_states, self.tp_group, True)
                if self.config.sequence_parallel else hidden_states)  # [s, b, h]
        s, b = full.shape[:2]
        rows = (lm_positions % s) * b + lm_positions.div(s, rounding_mode="floor")  # (b, s) -> row of [s * b, h]
        selected = full.reshape(s * b, -1).index_select(0, rows).unsqueeze(1)  # [n, 1, h]
        if not self.config.sequence_parallel:
            logits, _ = self.output_layer(self.lm_head(selected), weight=weight)
            return logits
        return self.output_layer.apply_weight(self.lm_head(selected), weight)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None, token_types: torch.Tensor | None = None,
                lm_labels: torch.Tensor | None = None, lm_positions: torch.Tensor | None = None,
                return_hidden_states: bool = False, return_pooled: bool = False):
        """See the class docstring for shapes. Returns

        - ``post_process=False``: hidden states [s, b, h] (input of the next stage);
        - ``return_hidden_states=True`` (last chunk): the encoder output [s, b, h] (after the final
          norm, the full sequence on every TP rank), without running the heads;
        - ``return_pooled=True`` (last chunk): the pooler's output [b, h] (a classifier's input), without the
          heads: the first token copied out of the final norm's output (under sequence parallelism its row
          gathered, not the sequence), which is freed;
        - else ``(lm_logits [b, s, V_padded/t], binary_logits [b, 2] | None)``;
        - with ``lm_labels`` [b, s] (-100 = not masked): ``(lm_loss [b, s], binary_logits)``.

        ``lm_positions`` [b, s] bool, or [n] int64 flat (b, s) indices (:func:`masked_positions`, which the
        bool mask is turned into first: one read of the device, before any layer runs): run the LM head only
        at those tokens (the masked ones, ~15%): logits become [n, V_padded/t] for the n selected tokens (and
        ``lm_labels``, if given, is read at those positions, giving ``lm_loss`` [n]). Each token's head is
        independent of the others, so this is the same numbers for the tokens that count in the loss, at a
        fraction of the cost (the head's output layer is a [h, V] matmul per token). Under sequence
        parallelism the sequence is gathered first (see :meth:`_masked_lm_logits`).
        """
        # ``attention_mask=None``: no padding, so attention takes its unmasked (faster, flash) path. The
        # caller knows that from the host-side batch (``BertLightningModule`` flags it before the
        # transfer): testing the device tensor here would synchronize with the host every step.
        mask = None if attention_mask is None else bert_attention_mask(attention_mask)
        if lm_positions is not None and lm_positions.dtype == torch.bool:
            lm_positions = masked_positions(lm_positions)
        hidden_states = None
        if self.pre_process:
            if tokens.size(1) > self.max_sequence_length:  # a shape: no host sync
                raise ValueError(f"a sequence of {tokens.size(1)} tokens exceeds max_sequence_length="
                                 f"{self.max_sequence_length} (the learned positions); cut it to at most that")
            position_ids = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)
            # a model without token types (num_tokentypes 0) leaves the batch's out, as Megatron-LM's BERT step does
            hidden_states = self.embedding(tokens, position_ids, token_types if self.num_tokentypes else None)
        hidden_states = self.encoder(hidden_states, mask)
        if not self.post_process:
            return hidden_states
        if return_pooled:
            if not self.add_binary_head:
                raise ValueError("return_pooled needs the pooler (add_binary_head=True)")
            return self.pooler(hidden_states)
        if return_hidden_states:
            if self.config.sequence_parallel:
                return gather_from_sequence_parallel_region(hidden_states, self.tp_group, False)
            return hidden_states
        binary_logits = self.binary_head(self.pooler(hidden_states)) if self.add_binary_head else None
        weight = self.output_weight()
        if lm_positions is not None:
            logits = self._masked_lm_logits(hidden_states, lm_positions, weight).squeeze(1)  # [n, V/t]
            if lm_labels is None:
                return logits, binary_logits
            return self.compute_language_model_loss(lm_labels.reshape(-1)[lm_positions], logits), binary_logits
        logits, _ = self.output_layer(self.lm_head(hidden_states), weight=weight)  # [s, b, V/t]
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous(), binary_logits  # [b, s, V/t]
        # the labels go to [s, b], not the logits to [b, s] (as GPTModel.forward)
        return self.compute_language_model_loss(lm_labels.t(), logits).t().contiguous(), binary_logits


def bert_loss(lm_loss_per_token: torch.Tensor, loss_mask: torch.Tensor, binary_logits: torch.Tensor | None = None,
              binary_labels: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """MLM loss averaged over masked tokens, plus the binary (NSP / SOP) cross entropy.

    lm_loss = sum(loss * mask) / sum(mask);  binary_loss = CE(binary_logits, binary_labels) (labels
    -1 ignored); total = lm_loss + binary_loss. Returns ``(total, {"lm_loss", "binary_loss"})`` with
    detached values for logging (``binary_loss`` only when a binary head is used).
    """
    mask = loss_mask.float()
    lm_loss = (lm_loss_per_token.float() * mask).sum() / mask.sum().clamp(min=1.0)
    stats = {"lm_loss": lm_loss.detach()}
    total = lm_loss
    if binary_logits is not None:
        if binary_labels is None:
            raise ValueError("bert_loss: binary_logits given without binary_labels")
        binary_loss = F.cross_entropy(binary_logits.float(), binary_labels.view(-1), ignore_index=-1)
        stats["binary_loss"] = binary_loss.detach()
        total = total + binary_loss
    return total, stats


def count_parameters(config: TransformerConfig, vocab_size: int, max_sequence_length: int, *,
                     spec: ModuleSpec | str = "bert_layer_local_spec", num_tokentypes: int = 2,
                     add_binary_head: bool = True, share_embeddings_and_output_weights: bool = True,
                     make_vocab_size_divisible_by: int = 128) -> int:
    """Closed-form parameter count of the whole model (all TP shards and pipeline stages, each
    parameter once), with V = the padded vocab at ``config.tensor_model_parallel_size``:

        layer      = 3hP + P h + 2 h f  (+ 3P + h + f + h biases)  + 2 norms
        embeddings = V h + S h + T h (+ a norm for post-norm specs)
        heads      = LM head (h^2 + h + norm) + vocab bias V (+ V h if untied)
                     + pooler (h^2 + h) + binary head (2h + 2)
        final norm for pre-norm specs;  P = n d, f = ffn, norm = 2h (LayerNorm) or h (RMSNorm).
    """
    spec = _resolve_spec(spec)
    h, n, d, f = config.hidden_size, config.num_attention_heads, config.kv_channels, config.ffn_hidden_size
    proj = n * d
    v = pad_vocab_size(vocab_size, config.tensor_model_parallel_size, make_vocab_size_divisible_by)
    norm_cls = layer_norm_spec(spec)
    norm_cls = resolve_norm_class(norm_cls.module if isinstance(norm_cls, ModuleSpec) else norm_cls, config)
    norm = {"RMSNorm": h, "LayerNorm": 2 * h, "IdentityOp": 0}[norm_cls.__name__]
    biases = (3 * proj + h + f + h) if config.add_bias_linear else 0
    layer = 3 * h * proj + proj * h + 2 * h * f + biases + 2 * norm
    post_norm = norm_placement(spec) == "post"
    embeddings = v * h + max_sequence_length * h + num_tokentypes * h + (norm if post_norm else 0)
    heads = (h * h + h + norm) + v + (0 if share_embeddings_and_output_weights else v * h)
    if add_binary_head:
        heads += h * h + h + 2 * h + 2
    return config.num_layers * layer + embeddings + heads + (0 if post_norm else norm)
