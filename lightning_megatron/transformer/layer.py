"""TransformerLayer: attention and MLP, each wrapped in a norm and a residual bias-dropout-add.

Pre-norm (Megatron's BERT, modern LLMs), with the post-norm slots left as identity::

    x = x + dropout(attn(norm_1(x)) + b_attn)
    x = x + dropout(mlp(norm_2(x)) + b_mlp)

Post-norm (original and Hugging Face BERT), with the pre-norm slots left as identity::

    x = norm_1(x + dropout(attn(x) + b_attn))
    x = norm_2(x + dropout(mlp(x) + b_mlp))

In pre-norm the residual path is a clean sum from the input to the output, in both directions:
the gradient reaches every layer through the identity, untouched by any norm. In post-norm every
layer's output, and so the gradient flowing back along the residual, passes through a norm,
which is why deep post-norm stacks need warm-up and careful init, and why LLMs use pre-norm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.transformer.config import TransformerConfig
from lightning_megatron.transformer.dropout import dropout
from lightning_megatron.transformer.inference import InferenceContext
from lightning_megatron.transformer.kernels import DEFAULT_KERNELS, Kernels
from lightning_megatron.transformer.spec import ModuleSpec, build_module
from lightning_megatron.transformer.utils import IdentityFuncOp, IdentityOp

if TYPE_CHECKING:
    from lightning_megatron.transformer.context_parallel import ContextParallel
    from lightning_megatron.transformer.rotary import RotaryTable

__all__ = [
    "TransformerLayerSubmodules",
    "TransformerLayer",
    "get_bias_dropout_add",
    "norm_placement",
    "layer_norm_spec",
]

Spec = ModuleSpec | type | Callable[..., object]
BiasDropoutAdd = Callable[[tuple[torch.Tensor, torch.Tensor | None], torch.Tensor, float], torch.Tensor]


def get_bias_dropout_add(training: bool, *, kernels: Kernels = DEFAULT_KERNELS) -> BiasDropoutAdd:
    """Megatron's bias-dropout-add: ``((x, bias), residual, p) -> residual + dropout(x + bias, p)``,
    its dropout through ``kernels``."""

    def bias_dropout_add(x_with_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor,
                         prob: float) -> torch.Tensor:
        x, bias = x_with_bias
        if bias is not None:
            x = x + bias
        return residual + dropout(x, prob, training, kernels)

    return bias_dropout_add


@dataclass(kw_only=True)
class TransformerLayerSubmodules:
    """Submodule slots of :class:`TransformerLayer` (Megatron's names, plus two post-norm slots)."""

    input_layernorm: Spec = IdentityOp
    """Pre-norm before attention (identity in post-norm specs)."""
    self_attention: Spec = IdentityOp
    """The attention module spec (SelfAttention)."""
    self_attn_bda: Spec = IdentityFuncOp
    """Bias-dropout-add after attention (get_bias_dropout_add)."""
    post_self_attn_layernorm: Spec = IdentityOp
    """Post-norm after the attention residual add (identity in pre-norm specs)."""
    pre_mlp_layernorm: Spec = IdentityOp
    """Pre-norm before the MLP (identity in post-norm specs)."""
    mlp: Spec = IdentityOp
    """The MLP module spec."""
    mlp_bda: Spec = IdentityFuncOp
    """Bias-dropout-add after the MLP."""
    post_mlp_layernorm: Spec = IdentityOp
    """Post-norm after the MLP residual add (identity in pre-norm specs)."""


def norm_placement(spec: ModuleSpec) -> Literal["pre", "post"]:
    """"post" when the layer spec normalizes after the residual adds, else "pre".

    A model reads this to know what surrounds the layers: post-norm layers expect a normalized
    input (a norm on the embeddings) and emit a normalized output; pre-norm layers leave the
    residual stream raw, so the stack ends with a final norm.
    """
    subs = spec.submodules
    return "post" if subs is not None and subs.post_mlp_layernorm is not IdentityOp else "pre"


def layer_norm_spec(spec: ModuleSpec) -> Spec:
    """The norm a layer spec uses (its input norm if pre-norm, its last norm if post-norm)."""
    subs = spec.submodules
    return subs.post_mlp_layernorm if norm_placement(spec) == "post" else subs.input_layernorm


class TransformerLayer(nn.Module):
    """One transformer layer: [s, b, h] -> [s, b, h] ([s/t, b, h] under sequence parallelism).

    ``layer_number`` is the 1-based global index (Megatron's convention), whatever pipeline chunk
    builds the layer.
    """

    def __init__(self, config: TransformerConfig, submodules: TransformerLayerSubmodules, layer_number: int = 1,
                 *, tp_group: dist.ProcessGroup | None = None, expert_groups: object | None = None) -> None:
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.hidden_dropout = config.hidden_dropout
        self.kernels: Kernels = DEFAULT_KERNELS  # for the bias-dropout-adds (see transformer.kernels)

        def norm(slot: Spec) -> nn.Module:
            return build_module(slot, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)

        self.input_layernorm = norm(submodules.input_layernorm)
        self.self_attention = build_module(submodules.self_attention, config=config, layer_number=layer_number,
                                           tp_group=tp_group)
        self.self_attn_bda = build_module(submodules.self_attn_bda)
        self.post_self_attn_layernorm = norm(submodules.post_self_attn_layernorm)
        self.pre_mlp_layernorm = norm(submodules.pre_mlp_layernorm)
        # The process groups of a mixture-of-experts MLP (transformer.moe.ExpertGroups), given to the MLP
        # slot only when the model has experts: a dense MLP keeps its signature.
        extra = {} if expert_groups is None else {"expert_groups": expert_groups, "layer_number": layer_number}
        self.mlp = build_module(submodules.mlp, config=config, tp_group=tp_group, **extra)
        self.mlp_bda = build_module(submodules.mlp_bda)
        self.post_mlp_layernorm = norm(submodules.post_mlp_layernorm)

    def _bda(self, slot: Callable) -> BiasDropoutAdd:
        # Installed kernels reach get_bias_dropout_add; a custom bda keeps Megatron's signature.
        if self.kernels is DEFAULT_KERNELS:
            return slot(self.training)
        return slot(self.training, kernels=self.kernels)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, *,
                rotary_pos_emb: torch.Tensor | RotaryTable | None = None,
                inference_context: InferenceContext | None = None,
                context_parallel: ContextParallel | None = None) -> torch.Tensor:
        """``rotary_pos_emb`` (the RoPE table or its :class:`~lightning_megatron.transformer.rotary.RotaryTable`,
        :mod:`~lightning_megatron.transformer.rotary`) and
        ``inference_context`` (the KV cache, :mod:`~lightning_megatron.transformer.inference`) go to the
        attention, and ``context_parallel`` (:mod:`~lightning_megatron.transformer.context_parallel`); each is
        passed only when given, so attention modules without them keep working."""
        extra = {k: v for k, v in (("rotary_pos_emb", rotary_pos_emb), ("inference_context", inference_context),
                                   ("context_parallel", context_parallel)) if v is not None}
        residual = hidden_states
        attention_output_with_bias = self.self_attention(self.input_layernorm(hidden_states), attention_mask, **extra)
        hidden_states = self._bda(self.self_attn_bda)(attention_output_with_bias, residual, self.hidden_dropout)
        hidden_states = self.post_self_attn_layernorm(hidden_states)

        residual = hidden_states
        # a mixture of experts chooses its capacity over the sequence's tokens: it needs to know whether CP split it
        mlp_extra = {"context_parallel": context_parallel} if getattr(self.mlp, "takes_context_parallel", False) else {}
        mlp_output_with_bias = self.mlp(self.pre_mlp_layernorm(hidden_states), **mlp_extra)
        hidden_states = self._bda(self.mlp_bda)(mlp_output_with_bias, residual, self.hidden_dropout)
        return self.post_mlp_layernorm(hidden_states)
