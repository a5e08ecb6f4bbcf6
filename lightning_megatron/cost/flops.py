"""FLOPs of a step from a cost record: what ``check --estimate-time`` predicts and a decoder's
``training_flops`` logs (``ThroughputCallback``'s TFLOP/s and MFU), one count for both: the step's executed model
FLOPs (:func:`lightning_megatron.flops.transformer_flops` at the record's shapes; under LoRA without the frozen
weights' weight gradients; recomputation only when asked)."""

from __future__ import annotations

from typing import Any

from lightning_megatron.cost.memory import adapters_only
from lightning_megatron.cost.protocols import StepCost
from lightning_megatron.cost.transformer import TransformerCost
from lightning_megatron.flops import transformer_flops

__all__ = ["layer_flops", "layer_shape", "model_flops"]


def layer_shape(m: StepCost) -> dict[str, Any]:
    """What :func:`transformer_flops` takes beyond the sizes, where the cost record has it (a
    :class:`TransformerCost`): the query and key/value projection widths (grouped-query attention)
    and a gated MLP (SwiGLU: three h x f matrices); a plain layer's otherwise."""
    if not isinstance(m, TransformerCost):
        return {}
    return dict(query_projection_size=m.num_attention_heads * m.head_dim, kv_projection_size=m.groups * m.head_dim,
                gated_linear_unit=m.gated_linear_unit)


def model_flops(m: StepCost, *, recompute: bool = False) -> float:
    """FLOPs of one step of ``m`` (all replicas): :func:`lightning_megatron.flops.transformer_flops`
    with the output layer on the model's ``head_fraction`` of the tokens (a masked LM's: the masked ones);
    under LoRA what its step runs (:func:`layer_flops`: no weight gradients of the frozen weights, the
    output layer's included; the adapters'), so that its MFU is not inflated by work it skips."""
    tokens = m.global_batch_size * m.seq_length
    head = transformer_flops(num_layers=0, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn, seq_length=m.seq_length,
                             tokens=tokens, head_tokens=m.head_fraction * tokens, vocab_size=m.padded_vocab(1),
                             head_dense=m.head_dense)
    if adapters_only(m):
        head *= 2 / 3
    return layer_flops(m, m.num_layers, tokens, recompute=recompute, replay_attention=recompute) + head


def layer_flops(m: StepCost, layers: int, tokens: float, tp: int = 1, *, recompute: bool | None = None,
                replay_attention: bool = True) -> float:
    """FLOPs of ``layers`` layers over ``tokens`` tokens (forward, backward, recomputation), all TP ranks
    together; under LoRA without the frozen weights' weight-gradient GEMMs (2 of each weight's 6 FLOPs per
    token: the weight matmuls alone are the count at seq_length 0) and with all 6 for each adapter weight
    (``tp`` ranks' adapters: a row-parallel adapter's B is on every rank); ``recompute``: the model's when None
    (full recomputation's one more forward of every layer); ``replay_attention``: with selective recomputation,
    the core attention's forward again (the hardware's FLOPs; a model count, the MFU's, leaves it out)."""
    shape = dict(num_layers=layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn, tokens=tokens,
                 head_tokens=0, vocab_size=0, **layer_shape(m))
    flops = transformer_flops(seq_length=m.seq_length, recompute=m.recompute if recompute is None else recompute,
                              **shape)
    if replay_attention and getattr(m, "selective_recompute", False):  # the core attention's forward again:
        p = shape.get("query_projection_size") or m.hidden_size  # its scores and weighted sum, 4 T s P a layer
        flops += 4.0 * tokens * layers * m.seq_length * p
    if adapters_only(m):
        assert isinstance(m, TransformerCost)
        flops -= transformer_flops(seq_length=0, **shape) / 3
        flops += 6 * tokens * layers * m.lora_layer_parameters(tp) * tp
    return flops
