"""GPTConfig: a causal decoder's configuration record (what ``GPTLightningModule`` builds its chunks from).

No Lightning imports here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_megatron.language.config import ROPE_FIELDS, LanguageModelConfig
from lightning_megatron.models.gpt.model import POSITION_EMBEDDING_TYPES

__all__ = ["GPTConfig", "SPEC_NORMALIZATION"]

SPEC_NORMALIZATION = {"gpt_layer_spec": "LayerNorm", "llama_layer_spec": "RMSNorm", "llama_moe_layer_spec": "RMSNorm"}
"""The norm each built-in decoder spec is written with (a spec of one's own takes ``normalization``)."""


@dataclass(kw_only=True)
class GPTConfig(LanguageModelConfig):
    """megatron-core's GPT (GPT-2 and Llama shapes): a :class:`~lightning_megatron.language.LanguageModelConfig`
    (the TransformerConfig, vocabulary, positions and spec) with the decoder's own fields. Written in a
    recipe as the ``config:`` section of the model (``--model.config.num_layers 12`` on the command line)."""

    spec: str = "gpt_layer_spec"
    """A registered layer spec name: ``gpt_layer_spec`` (LayerNorm), ``llama_layer_spec`` (RMSNorm) or
    ``llama_moe_layer_spec`` (RMSNorm, a mixture of experts: ``num_moe_experts``)."""
    normalization: Literal["LayerNorm", "RMSNorm"] | None = None
    """The norm of specs that take it from the config (``transformer.Norm``); None: the spec's own
    (LayerNorm for ``gpt_layer_spec``, RMSNorm for ``llama_layer_spec``, which refuse the other)."""
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    """``learned_absolute`` (GPT-2: ``max_sequence_length`` learned rows), ``rope`` (Llama: ``rotary_base``,
    ``rotary_percent``) or ``none``."""
    untie_embeddings_and_output_weights: bool = False
    """The output layer has its own weight (Llama) instead of the word embedding's (GPT-2)."""

    def __post_init__(self) -> None:
        import lightning_megatron.models.gpt.specs  # noqa: F401  (the built-in specs registered)

        if self.spec not in SPEC_NORMALIZATION:
            from lightning_megatron.transformer import get_spec

            get_spec(self.spec)  # ValueError listing the registered names
        elif self.normalization not in (None, SPEC_NORMALIZATION[self.spec]):
            raise ValueError(f"normalization={self.normalization!r} but spec={self.spec!r} uses "
                             f"{SPEC_NORMALIZATION[self.spec]}: drop normalization, or use the other spec")
        if self.normalization is None:
            self.normalization = SPEC_NORMALIZATION.get(self.spec, "LayerNorm")
        self._check_experts("llama_moe_layer_spec")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type={self.position_embedding_type!r} must be one of "
                             f"{POSITION_EMBEDDING_TYPES}")
        if self.position_embedding_type != "rope":
            self._refuse_unused(ROPE_FIELDS, f"position_embedding_type={self.position_embedding_type!r} has no "
                                             f"rotary embedding: set position_embedding_type: rope, or drop them")
        super().__post_init__()
