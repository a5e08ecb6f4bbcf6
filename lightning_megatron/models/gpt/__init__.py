"""Causal decoder LMs (GPT-2 and Llama shapes) built from ModuleSpecs: the model, its config record, its
registered layer specs and the LightningModule (``lightning_megatron.models.gpt.module.GPTLightningModule``)."""

from __future__ import annotations

from lightning_megatron.models.gpt.config import GPTConfig
from lightning_megatron.models.gpt.model import POSITION_EMBEDDING_TYPES, GPTModel, gpt_loss
from lightning_megatron.models.gpt.specs import decoder_layer_spec, gpt_layer_spec, llama_layer_spec

__all__ = ["GPTConfig", "GPTModel", "gpt_loss", "POSITION_EMBEDDING_TYPES", "decoder_layer_spec",
           "gpt_layer_spec", "llama_layer_spec"]
