"""BERT built from ModuleSpecs: the model, its config record, its registered layer specs, and Hugging Face
conversion (the LightningModule: ``lightning_megatron.models.bert.module.BertLightningModule``)."""

from __future__ import annotations

from lightning_megatron.models.bert.config import BertConfig
from lightning_megatron.models.bert.model import (
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
    "BertConfig", "BertModel", "BertLMHead", "Pooler", "bert_attention_mask", "bert_loss", "count_parameters",
    "bert_layer_local_spec", "bert_layer_post_norm_spec", "bert_layer_rmsnorm_spec", "bert_layer_spec",
]
