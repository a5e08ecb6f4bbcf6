"""The decoder's costs (:class:`GPTCost`) for ``check --estimate-memory`` / ``--estimate-time`` (no model is built).

A :class:`~lightning_megatron.cost.TransformerCost`, whose ends are a decoder's: the vocab-parallel word
embedding V/t x h (+ learned positions s_max x h) on the first stage; the final norm and the output
layer V/t x h when untied, or, tied, the last stage's copy of the word embedding when it is not also the
first; the output layer on every token, no head dense layer. This family adds which layer it builds
(its registered spec) and a one-layer GPTModel with its loss to time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_megatron.cost.transformer import TransformerCost

if TYPE_CHECKING:
    from typing_extensions import Self

    from lightning_megatron.models.gpt.config import GPTConfig
    from lightning_megatron.transformer.spec import ModuleSpec

__all__ = ["GPTCost"]


@dataclass(frozen=True, kw_only=True)
class GPTCost(TransformerCost):
    """A decoder's sizes (GPTLightningModule's config record plus the batch)."""

    @classmethod
    def from_config(cls, config: GPTConfig, **shape: Any) -> Self:  # type: ignore[override]
        """:meth:`TransformerCost.from_config` with the decoder's ends of a ``GPTConfig``."""
        ends = dict(untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
                    position_embedding_type=config.position_embedding_type,
                    rmsnorm=config.normalization == "RMSNorm")
        return super().from_config(config, **{**ends, **shape})

    def describe(self) -> str:
        return "decoder: " + super().describe()

    def layer_spec(self) -> ModuleSpec:
        from lightning_megatron.models.gpt.specs import decoder_layer_spec, moe_mlp_spec
        from lightning_megatron.transformer.norms import LayerNorm, RMSNorm

        return decoder_layer_spec(RMSNorm if self.rmsnorm else LayerNorm,
                                  moe_mlp_spec() if self.num_moe_experts else None)

    def build_model_step(self, num_layers: int = 1) -> tuple[Any, Callable[[], None]]:
        """A GPTModel of ``num_layers`` layers with its loss on every token, as ``GPTLightningModule`` runs a
        microbatch."""
        import torch

        from lightning_megatron.models.gpt.model import GPTModel, gpt_loss

        s, b, v = self.seq_length, self.micro_batch_size, self.vocab_size
        model = GPTModel(self.layer_config(num_layers), self.layer_spec(), v, max(self.max_sequence_length, s),
                         position_embedding_type=self.position_embedding_type,
                         share_embeddings_and_output_weights=not self.untie_embeddings_and_output_weights,
                         make_vocab_size_divisible_by=self.make_vocab_size_divisible_by)
        model = self.with_adapters(model)
        tokens, labels = torch.randint(0, v, (b, s)), torch.randint(0, v, (b, s))

        def step() -> None:
            loss = gpt_loss(model(tokens, labels=labels), torch.ones(b, s))
            loss.backward()
            model.zero_grad(set_to_none=True)

        return model, step
