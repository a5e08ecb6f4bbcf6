"""Model-agnostic transformer building blocks described by ModuleSpecs. No Lightning imports here."""

from __future__ import annotations

from lightning_megatron.transformer.attention import DotProductAttention, SelfAttention, SelfAttentionSubmodules
from lightning_megatron.transformer.block import TransformerBlock
from lightning_megatron.transformer.config import TransformerConfig
from lightning_megatron.transformer.dropout import Dropout, dropout
from lightning_megatron.transformer.inference import InferenceContext
from lightning_megatron.transformer.kernels import DEFAULT_KERNELS, Kernels, set_kernels
from lightning_megatron.transformer.layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_bias_dropout_add,
    layer_norm_spec,
    norm_placement,
)
from lightning_megatron.transformer.mlp import MLP, MLPSubmodules
from lightning_megatron.transformer.norms import LayerNorm, Norm, RMSNorm, get_norm_class, resolve_norm_class
from lightning_megatron.transformer.rotary import RotaryEmbedding, RotaryTable, apply_rotary_pos_emb
from lightning_megatron.transformer.spec import ModuleSpec, build_module, get_spec, list_specs, register_spec
from lightning_megatron.transformer.utils import (
    AttnMaskType,
    IdentityFuncOp,
    IdentityOp,
    get_activation_func,
    mark_sequence_parallel,
    seeded,
    stable_seed,
)

__all__ = [
    "ModuleSpec", "build_module", "register_spec", "get_spec", "list_specs",
    "TransformerConfig", "TransformerLayer", "TransformerLayerSubmodules", "TransformerBlock",
    "SelfAttention", "SelfAttentionSubmodules", "DotProductAttention", "MLP", "MLPSubmodules",
    "LayerNorm", "RMSNorm", "Norm", "get_norm_class", "resolve_norm_class", "get_bias_dropout_add", "norm_placement", "layer_norm_spec",
    "Dropout", "dropout", "AttnMaskType", "IdentityOp", "IdentityFuncOp", "get_activation_func", "mark_sequence_parallel",
    "seeded", "stable_seed", "Kernels", "DEFAULT_KERNELS", "set_kernels", "RotaryEmbedding", "apply_rotary_pos_emb",
    "RotaryTable", "InferenceContext",
]
