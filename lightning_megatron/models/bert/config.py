"""BertConfig: BERT's configuration record (what ``BertLightningModule`` builds its chunks from).

No Lightning imports here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_megatron.language.config import ROPE_FIELDS, LanguageModelConfig
from lightning_megatron.transformer.config import ACTIVATIONS

__all__ = ["BertConfig"]


@dataclass(kw_only=True)
class BertConfig(LanguageModelConfig):
    """Megatron's BERT: a :class:`~lightning_megatron.language.LanguageModelConfig` (the TransformerConfig,
    vocabulary, positions and spec) with BERT's defaults and heads. Written in a recipe as the
    ``config:`` section of the model (``--model.config.num_layers 12`` on the command line)."""

    spec: str = "bert_layer_local_spec"
    """A registered layer spec name: ``bert_layer_local_spec`` (pre-norm, as Megatron),
    ``bert_layer_post_norm_spec`` (post-norm, as Hugging Face), ``bert_layer_rmsnorm_spec``."""
    layernorm_epsilon: float = 1e-12
    """Epsilon added to the variance (LayerNorm) or mean square (RMSNorm); BERT's 1e-12."""
    add_binary_head: bool = True
    """The pooler and the binary (next-sentence / sentence-order) head on the last stage."""
    num_tokentypes: int = 2
    """Token-type (segment) embeddings: 2 (the first and the second text), or 0 (none: the batch's token types are
    left out, as Megatron-LM's ``--bert-no-binary-head`` builds and runs BERT)."""
    lm_head_activation: Literal["gelu", "gelu_tanh", "relu", "silu"] | None = None
    """The LM head's activation; None: ``activation``. Megatron-LM models trained with
    ``--bias-gelu-fusion`` need ``activation=gelu_tanh`` and ``lm_head_activation=gelu``."""

    def __post_init__(self) -> None:
        if self.spec == "bert_layer_post_norm_spec" and self.normalization != "LayerNorm":
            raise ValueError(f"normalization={self.normalization!r} with spec='bert_layer_post_norm_spec': that spec "
                             f"is Hugging Face BERT's, LayerNorm after each residual branch, and would ignore it; use "
                             f"bert_layer_local_spec (pre-norm, its norm the config's normalization) or "
                             f"bert_layer_rmsnorm_spec")
        import lightning_megatron.models.bert.specs  # noqa: F401  (the built-in specs registered)

        self._check_experts(None)
        self._refuse_unused(ROPE_FIELDS, "BERT's positions are learned (max_sequence_length rows), it has no rotary "
                                         "embedding: drop them")
        if self.num_tokentypes < 0:
            raise ValueError(f"num_tokentypes={self.num_tokentypes} must be 0 (no token types) or more")
        if self.lm_head_activation is not None and self.lm_head_activation not in ACTIVATIONS:
            raise ValueError(f"lm_head_activation={self.lm_head_activation!r} is not supported; use one of "
                             f"{ACTIVATIONS} or None (the MLP's activation)")
        super().__post_init__()
