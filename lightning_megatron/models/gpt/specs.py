"""Named decoder layer specs, registered so recipes can say ``spec: llama_layer_spec``.

Both are pre-norm layers with causal self-attention (``AttnMaskType.causal``: SDPA's ``is_causal``
path, no materialised mask); they differ in the norm they name. The rest of each shape is a
setting of the config or the model, not of the spec (as megatron-core's ``get_gpt_layer_local_spec``):

- ``gpt_layer_spec`` (GPT-2 shape): LayerNorm; with ``add_bias_linear=True``, a GELU MLP and learned
  absolute positions tied to the output layer (:class:`~lightning_megatron.models.gpt.GPTModel`).
- ``llama_layer_spec`` (Llama shape): RMSNorm; with ``add_bias_linear=False``,
  ``gated_linear_unit=True`` + ``activation="silu"`` (SwiGLU), ``num_query_groups`` (grouped-query
  attention), rotary position embeddings and an untied output layer.

- ``llama_moe_layer_spec`` (Mixtral, Qwen-MoE shape): the Llama layer with a mixture of experts in the MLP slot
  (:class:`~lightning_megatron.transformer.moe.MoELayer`: ``num_moe_experts`` and the ``moe_*`` fields of the
  config; docs/moe.md).

Add your own with :func:`lightning_megatron.transformer.register_spec` (see docs/gpt.md).
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
    ModuleSpec,
    RMSNorm,
    SelfAttention,
    SelfAttentionSubmodules,
    TransformerLayer,
    TransformerLayerSubmodules,
    get_bias_dropout_add,
)
from lightning_megatron.transformer.spec import register_built_in_spec
from lightning_megatron.transformer.moe import MoELayer, MoESubmodules

__all__ = ["decoder_layer_spec", "moe_mlp_spec", "gpt_layer_spec", "llama_layer_spec", "llama_moe_layer_spec"]


def moe_mlp_spec() -> ModuleSpec:
    """A mixture-of-experts MLP slot (its shared experts, when configured, a dense tensor-parallel MLP)."""
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(shared_experts=ModuleSpec(
        module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))))


def decoder_layer_spec(norm: type, mlp: ModuleSpec | None = None) -> ModuleSpec:
    """A pre-norm causal decoder layer with ``norm`` before attention and before the MLP (``mlp``: the MLP
    slot; None: the dense tensor-parallel MLP)."""
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                                           linear_proj=RowParallelLinear, q_layernorm=IdentityOp,
                                           k_layernorm=IdentityOp))
    mlp = mlp or ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                 linear_fc2=RowParallelLinear))
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(input_layernorm=norm, self_attention=attention,
                                              self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=norm,
                                              mlp=mlp, mlp_bda=get_bias_dropout_add))


gpt_layer_spec = register_built_in_spec("gpt_layer_spec", decoder_layer_spec(LayerNorm))
llama_layer_spec = register_built_in_spec("llama_layer_spec", decoder_layer_spec(RMSNorm))
llama_moe_layer_spec = register_built_in_spec("llama_moe_layer_spec", decoder_layer_spec(RMSNorm, moe_mlp_spec()))
