"""BERT built from ModuleSpecs: the model, its registered layer specs, and Hugging Face conversion."""

from __future__ import annotations

from lightning_megatron.models.bert.model import (
    BertEmbedding,
    BertLMHead,
    BertModel,
    Pooler,
    bert_attention_mask,
    bert_loss,
    count_parameters,
)
from lightning_megatron.models.bert.specs import (
    bert_layer_local_spec,
    bert_layer_post_norm_spec,
    bert_layer_rmsnorm_spec,
    bert_layer_spec,
)

__all__ = [
    "BertModel", "BertEmbedding", "BertLMHead", "Pooler", "bert_attention_mask", "bert_loss", "count_parameters",
    "bert_layer_local_spec", "bert_layer_post_norm_spec", "bert_layer_rmsnorm_spec", "bert_layer_spec",
]
