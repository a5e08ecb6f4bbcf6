"""The model's own pieces a step-time estimate times: one layer (or a one-layer model) of a cost record's sizes,
built and stepped (:class:`ModelPieces`, mixed into :class:`~lightning_megatron.cost.transformer.TransformerCost`;
the fields it reads are the record's). torch and the model are imported when a piece is built, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_megatron.transformer.config import TransformerConfig
    from lightning_megatron.transformer.spec import ModuleSpec

__all__ = ["ModelPieces"]


class ModelPieces:
    """StepCost's model pieces of a transformer cost record (its sizes: ``hidden_size``, ``seq_length``, ...)."""

    def layer_spec(self) -> ModuleSpec:
        """The spec of one of the model's layers (its family's). The base has none: a family declares it."""
        raise NotImplementedError(f"{type(self).__name__} declares no layer_spec(): the layer to time is the family's")

    def layer_config(self, num_layers: int = 1) -> TransformerConfig:
        """A ``TransformerConfig`` of these sizes (one TP rank, ``num_layers`` layers; a mixture of experts'
        on one EP rank: every expert)."""
        import torch

        from lightning_megatron.transformer.config import TransformerConfig

        moe = {}
        if self.num_moe_experts:  # the MoE layer itself: router, dispatcher, this many experts of their width
            moe = dict(num_moe_experts=self.num_moe_experts, moe_router_topk=self.moe_router_topk,
                       moe_ffn_hidden_size=self.expert_ffn,
                       moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
                       moe_expert_capacity_factor=self.moe_expert_capacity_factor,
                       moe_pad_expert_input_to_capacity=self.moe_pad_expert_input_to_capacity)
        return TransformerConfig(num_layers=num_layers, hidden_size=self.hidden_size,
                                 num_attention_heads=self.num_attention_heads,
                                 ffn_hidden_size=self.expert_ffn if moe else self.ffn, **moe,
                                 num_query_groups=self.num_query_groups, kv_channels=self.kv_channels,
                                 gated_linear_unit=self.gated_linear_unit, add_bias_linear=self.add_bias_linear,
                                 hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout,
                                 params_dtype=torch.float32 if self.param_bytes == 4 else torch.bfloat16,
                                 attention_backend=self.attention_backend)

    def build_layer_step(self) -> tuple[Any, Callable[[], None]]:
        """One layer of :meth:`layer_spec` on its micro batch ``[s, b, h]``, with the rotary embeddings of the
        sequence when the model has them (``position_embedding_type: rope``; one
        :class:`~lightning_megatron.transformer.rotary.RotaryTable` from step to step, its cos and sin made on the
        first, as the model keeps them): forward, backward with ones, and fresh gradients each time (the
        GradBuffer's hook takes them away after every microbatch)."""
        import torch

        from lightning_megatron.transformer.rotary import RotaryEmbedding, RotaryTable
        from lightning_megatron.transformer.spec import build_module

        config = self.layer_config()
        layer = self.with_adapters(build_module(self.layer_spec(), config=config, layer_number=1))
        x = torch.randn(self.seq_length, self.micro_batch_size, self.hidden_size, dtype=config.params_dtype,
                        requires_grad=True)
        rope = {"rotary_pos_emb": RotaryTable(RotaryEmbedding(self.head_dim)(self.seq_length))} if self.rotary else {}

        def step() -> None:
            y = layer(x, None, **rope)
            y.backward(torch.ones_like(y))
            layer.zero_grad(set_to_none=True)
            x.grad = None

        return layer, step

    def with_adapters(self, module: Any) -> Any:
        """``module`` as a LoRA run trains it: adapters of ``lora_rank`` on the ``lora_targets``, every other
        parameter frozen (unchanged without LoRA). What :meth:`build_layer_step` and a family's
        :meth:`build_model_step` time."""
        if self.lora_rank:
            from lightning_megatron.transformer.lora import LoRAConfig, add_lora

            add_lora(module, LoRAConfig(rank=self.lora_rank, alpha=2.0 * self.lora_rank, dropout=self.lora_dropout,
                                        target_modules=list(self.lora_targets)),
                     global_names={id(p): n for n, p in module.named_parameters()})
        return module

    def build_model_step(self, num_layers: int = 1) -> tuple[Any, Callable[[], None]]:
        raise NotImplementedError(f"{type(self).__name__} builds no one-layer model to time")
