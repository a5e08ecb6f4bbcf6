"""BERT's costs (:class:`BertCost`): a transformer encoder's layers (:class:`~lightning_megatron.cost.TransformerCost`)
with BERT's ends, for ``check --estimate-memory`` / ``--estimate-time`` (no model is built).

- first stage: the vocab-parallel word embedding V/t x h, learned positions s_max x h, two token types,
  and with the post-norm (Hugging Face) spec the embedding's LayerNorm;
- last stage: the final norm (pre-norm specs), the LM head (a dense h x h layer, its norm, the output bias
  V/t) tied to the word embedding (the last stage's copy when it is not also the first), the pooler and
  the binary head;
- the LM head runs on the masked tokens only (``masked_lm_prob`` of each sample).

:meth:`BertCost.build_model_step` is a one-layer BertModel with its loss, as a microbatch of
``BertLightningModule`` runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from lightning_megatron.cost.transformer import TransformerCost

if TYPE_CHECKING:
    from lightning_megatron.transformer.spec import ModuleSpec

__all__ = ["BertCost"]


@dataclass(frozen=True, kw_only=True)
class BertCost(TransformerCost):
    """A BERT's sizes (``BertLightningModule``'s config record plus the batch)."""

    masked_lm_prob: float = 0.15
    """Fraction of tokens masked (the LM head runs on them only, :attr:`lm_head_on_masked_only`)."""
    lm_head_on_masked_only: bool = True
    """The module's ``lm_head_on_masked_only``; False: the LM head runs on every token."""
    post_norm: bool = False
    """Hugging Face-style post-norm spec (an embedding LayerNorm instead of the final one)."""

    @property
    def head_fraction(self) -> float:
        return self.masked_lm_prob if self.lm_head_on_masked_only else 1.0

    @property
    def head_dense(self) -> bool:
        return True

    @property
    def replicated_embedding_rows(self) -> bool:
        """Learned positions and token types."""
        return True

    def sequence_parallel_parameters(self, pp: int, stage: int) -> int:
        """The layers' and (pre-norm) the final norm's; the LM head's dense layer and norm (its input the whole
        sequence's gathered masked tokens, its parameters marked so that the TP ranks' partial gradients are
        summed); post-norm the embedding's norm on the first stage."""
        h, norm = self.hidden_size, self.norm_parameters
        n = self.stage_layer_count(pp, stage) * self.sequence_parallel_layer_parameters
        if stage == pp - 1:
            n += (0 if self.post_norm else norm) + h * h + h + norm
        if stage == 0 and self.post_norm:
            n += norm
        return n

    def head_messages(self, tp: int, sequence_parallel: bool, tokens: float) -> list[tuple[Any, ...]]:
        """On the masked tokens only (:attr:`lm_head_on_masked_only`), under SP the whole sequence is gathered
        first (the backward reduce-scatters its gradient) and the output layer gathers nothing itself; without
        SP the output layer all-reduces its input gradient; the cross entropy's three fp32 values a token. The
        pooler gathers its token from SP's chunks (one row a rank, no backward collective). None at one TP
        rank."""
        if tp == 1:
            return []
        if not self.lm_head_on_masked_only:
            head = super().head_messages(tp, sequence_parallel, tokens)
        else:
            n = self.head_fraction * tokens
            loss = [("all_reduce", 4.0 * n)] * 3
            act = self.param_bytes * tokens * self.hidden_size
            head = ([("all_gather", act), ("reduce_scatter", act)] if sequence_parallel
                    else [("all_reduce", self.param_bytes * n * self.hidden_size)]) + loss
        pooler = [("all_gather", self.param_bytes * tp * self.micro_batch_size * self.hidden_size)]
        return head + (pooler if sequence_parallel else [])

    def with_head_tokens(self, tokens: int) -> BertCost:
        """These sizes with ``tokens`` masked tokens a microbatch (what a check run's step had at most)."""
        return replace(self, masked_lm_prob=tokens / (self.seq_length * self.micro_batch_size))

    def stage_parameters(self, tp: int, pp: int, stage: int) -> int:
        h, norm, v = self.hidden_size, self.norm_parameters, self.padded_vocab(tp)
        n = self.stage_layer_count(pp, stage) * self.layer_parameters(tp)
        if stage == 0:
            n += v // tp * h + self.max_sequence_length * h + 2 * h + (norm if self.post_norm else 0)
        if stage == pp - 1:
            n += 0 if self.post_norm else norm  # final norm
            n += h * h + h + norm + v // tp  # LM head dense + norm, output bias (vocab-parallel)
            n += h * h + h + 2 * h + 2  # pooler, binary head
            if pp > 1:
                n += v // tp * h  # the last stage's copy of the tied word embedding
        return n

    def first_stage_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        """The embedding dropout's mask and, post-norm, the embedding norm's input (this rank's chunk under
        sequence parallelism)."""
        norm = self.seq_length * self.micro_batch_size * self.hidden_size * self.param_bytes if self.post_norm else 0
        return super().first_stage_activation_bytes(tp, sequence_parallel) + norm / (tp if sequence_parallel else 1)

    def last_stage_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        """Pre-norm, the final norm's input (this rank's chunk under sequence parallelism); the LM head on the
        masked tokens, the pooler's first token and output, and what the loss keeps of the masked tokens' logits:
        an fp32 softmax (the vocab-parallel cross entropy, whatever the logits' dtype), or the logits themselves
        with the loss compiled at one TP rank (:attr:`compiled_loss`). Measured: ``tests/test_estimate.py``."""
        s, b, h, e = self.seq_length, self.micro_batch_size, self.hidden_size, self.param_bytes
        n = self.head_fraction * s * b
        logit = e if self.compiled_loss and tp == 1 else 4
        norm = 0 if self.post_norm else e * s * b * h / (tp if sequence_parallel else 1)
        return norm + e * (5 * n * h + 2 * b * h) + logit * n * self.padded_vocab(tp) / tp + 8 * s * b

    def describe(self) -> str:
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, {self.num_attention_heads} heads, ffn "
                f"{self.ffn}, vocab {self.vocab_size}, seq {self.seq_length}, micro batch {self.micro_batch_size}, "
                f"global batch {self.global_batch_size}, {self.params_dtype}, {self.optimizer}"
                f"{', full recompute' if self.recompute else ''}, dropout {self.hidden_dropout:g}/"
                f"{self.attention_dropout:g}")

    def layer_spec(self) -> ModuleSpec:
        from lightning_megatron.models.bert.specs import bert_layer_spec
        from lightning_megatron.transformer.norms import LayerNorm, Norm, RMSNorm

        norm = RMSNorm if self.rmsnorm else (LayerNorm if self.post_norm else Norm)
        return bert_layer_spec(norm, "post" if self.post_norm else "pre")

    def build_model_step(self, num_layers: int = 1) -> tuple[Any, Callable[[], None]]:
        """A BertModel of ``num_layers`` layers (one: what :func:`~lightning_megatron.check.devices.probe_times`
        times) and its loss as ``BertLightningModule.forward_step`` runs a microbatch:
        embeddings, the layer, the LM head on the masked tokens with the word embedding tied to the output
        layer, the binary head, the model's cross entropy (:meth:`compute_language_model_loss`), the predictions'
        argmax."""
        import torch

        from lightning_megatron.models.bert.model import BertModel, bert_loss
        from lightning_megatron.models.bert.predict import vocab_parallel_argmax

        s, b, v = self.seq_length, self.micro_batch_size, self.vocab_size
        model = BertModel(self.layer_config(num_layers), self.layer_spec(), v, self.max_sequence_length,
                          make_vocab_size_divisible_by=self.make_vocab_size_divisible_by)
        model = self.with_adapters(model)
        tokens = torch.randint(0, v, (b, s))
        token_types = (torch.arange(s) >= s // 2).long().expand(b, s)
        masked = max(1, int(self.head_fraction * s))
        positions = torch.zeros(b, s, dtype=torch.bool)
        for row in positions:
            row[torch.randperm(s)[:masked]] = True
        labels, binary_labels = torch.randint(0, v, (b, s)), torch.randint(0, 2, (b,))

        def step() -> None:
            logits, binary_logits = model(tokens, None, token_types, lm_positions=positions)
            loss_per_token = model.compute_language_model_loss(labels[positions], logits)
            loss, _ = bert_loss(loss_per_token, torch.ones_like(loss_per_token), binary_logits, binary_labels)
            with torch.no_grad():
                vocab_parallel_argmax(logits, None, v)
            loss.backward()
            model.zero_grad(set_to_none=True)

        return model, step
