"""Named BERT layer specs, registered so recipes can say ``spec: bert_layer_local_spec``.

- ``bert_layer_local_spec``: Megatron's BERT layer, pre-norm with the norm named by
  ``config.normalization`` (LayerNorm by default); the model adds a final norm.
- ``bert_layer_post_norm_spec``: original / Hugging Face BERT, post-norm LayerNorm (the model adds a
  LayerNorm on the embeddings and no final norm). Hugging Face checkpoints import into this one.
- ``bert_layer_rmsnorm_spec``: pre-norm with RMSNorm.

Add your own with :func:`lightning_megatron.transformer.register_spec` (see docs/model.md).
"""

from __future__ import annotations

from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from lightning_megatron.transformer import (
    MLP,
    AttnMaskType,
    DotProductAttention,
    IdentityOp,
    LayerNorm,
    MLPSubmodules,
    Norm,
    ModuleSpec,
    RMSNorm,
    SelfAttention,
    SelfAttentionSubmodules,
    TransformerLayer,
    TransformerLayerSubmodules,
    get_bias_dropout_add,
)
from lightning_megatron.transformer.spec import register_built_in_spec

__all__ = [
    "bert_layer_local_spec",
    "bert_layer_post_norm_spec",
    "bert_layer_rmsnorm_spec",
    "bert_layer_spec",
]


def _self_attention() -> ModuleSpec:
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.padding},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )


def _mlp() -> ModuleSpec:
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                           linear_fc2=RowParallelLinear))


def bert_layer_spec(norm: type = LayerNorm, placement: str = "pre") -> ModuleSpec:
    """A BERT layer spec with ``norm`` before ("pre") or after ("post") each residual branch."""
    if placement not in ("pre", "post"):
        raise ValueError(f"placement={placement!r} must be 'pre' or 'post'")
    pre, post = (norm, IdentityOp) if placement == "pre" else (IdentityOp, norm)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=pre,
            self_attention=_self_attention(),
            self_attn_bda=get_bias_dropout_add,
            post_self_attn_layernorm=post,
            pre_mlp_layernorm=pre,
            mlp=_mlp(),
            mlp_bda=get_bias_dropout_add,
            post_mlp_layernorm=post,
        ),
    )


bert_layer_local_spec = register_built_in_spec("bert_layer_local_spec", bert_layer_spec(Norm, "pre"))
bert_layer_post_norm_spec = register_built_in_spec("bert_layer_post_norm_spec", bert_layer_spec(LayerNorm, "post"))
bert_layer_rmsnorm_spec = register_built_in_spec("bert_layer_rmsnorm_spec", bert_layer_spec(RMSNorm, "pre"))
