"""Megatron-LM (megatron-core) GPT checkpoints: the architecture their ``args`` fix, for ``init_from``.

The files are read by :mod:`lightning_megatron.models.bert.megatron_lm` (legacy per-rank
``model_optim_rng.pt`` through the restricted unpickler, or ``torch_dist`` through DCP with the guarded
metadata), which recognises a GPT checkpoint by its ``decoder.*`` tensors, regroups SwiGLU
``linear_fc1`` shards (each TP rank ``[gate_r; up_r]``) into ``[gate; up]``, and hands the full state
dict here. megatron-core's GPTModel names are ours; the query-group layout of ``linear_qkv`` is ours.

``args`` -> ``GPTLightningModule`` arguments: ``normalization RMSNorm`` -> ``llama_layer_spec`` (else
``gpt_layer_spec``), ``swiglu`` -> ``gated_linear_unit`` + ``silu``, ``--bias-gelu-fusion`` /
``openai_gelu`` -> ``gelu_tanh`` (megatron-core's fused bias-GELU is the tanh approximation),
``group_query_attention`` -> ``num_query_groups``, ``position_embedding_type``, ``rotary_base``,
``rotary_percent``, ``add_bias_linear``, ``untie_embeddings_and_output_weights``, ``kv_channels``,
``norm_epsilon``. Settings our model cannot compute are refused by name (:data:`UNSUPPORTED_GPT_ARGS`).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from lightning_megatron.saved_model import SavedModel

__all__ = ["UNSUPPORTED_GPT_ARGS", "gpt_architecture_from_args", "gpt_saved_model"]

UNSUPPORTED_GPT_ARGS: dict[str, tuple[tuple[Any, ...], str]] = {
    "position_embedding_type": (("learned_absolute", "rope", "none", None), "other position embeddings"),
    "apply_residual_connection_post_layernorm": ((False, None), "residuals taken after the norm"),
    "squared_relu": ((False, None), "a squared-ReLU MLP"),
    "qk_layernorm": ((False, None), "query/key norms"),
    "apply_layernorm_1p": ((False, None), "zero-centred norm weights (apply_layernorm_1p)"),
    "layernorm_zero_centered_gamma": ((False, None), "zero-centred norm weights"),
    "num_experts": ((None, 0, 1), "mixture-of-experts layers"),
    "multi_latent_attention": ((False, None), "multi-latent attention"),
    "mtp_num_layers": ((None, 0), "multi-token prediction layers"),
    "rotary_interleaved": ((False, None), "interleaved rotary embeddings"),
    "use_rope_scaling": ((False, None), "rope frequency scaling (Llama 3.1)"),
    "rotary_seq_len_interpolation_factor": ((None, 1, 1.0), "rotary sequence interpolation"),
    "add_qkv_bias": ((False, None), "a qkv bias without the other linear biases"),
}
"""Megatron-LM arguments whose other values change the computation in ways GPTModel does not have."""


def gpt_architecture_from_args(args: Any, num_layers: int) -> dict[str, Any]:
    """The ``GPTLightningModule`` arguments a GPT checkpoint's ``args`` fix; refuses what our model lacks."""
    if not isinstance(args, argparse.Namespace):
        return {"num_layers": num_layers}
    get = lambda k, d=None: getattr(args, k, d)  # noqa: E731
    bias = get("add_bias_linear", True)
    unsupported = [f"{k}={get(k)!r} ({what})" for k, (ok, what) in UNSUPPORTED_GPT_ARGS.items()
                   if get(k) not in ok and not (k == "add_qkv_bias" and bias)]
    normalization = get("normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        unsupported.append(f"normalization={normalization!r}")
    if unsupported:
        raise ValueError(f"the Megatron-LM checkpoint was trained with {', '.join(unsupported)}: GPTLightningModule "
                         f"has no equivalent, so its logits would differ")
    heads, hidden = get("num_attention_heads"), get("hidden_size")
    kv = get("kv_channels")
    swiglu = bool(get("swiglu"))
    if swiglu:
        activation = "silu"
    elif get("openai_gelu") or get("bias_gelu_fusion") or get("bias_activation_fusion"):
        activation = "gelu_tanh"
    else:
        activation = "gelu"
    position = get("position_embedding_type") or "learned_absolute"
    hp: dict[str, Any] = {
        "num_layers": num_layers, "hidden_size": hidden, "num_attention_heads": heads,
        "num_query_groups": get("num_query_groups") if get("group_query_attention") else None,
        "ffn_hidden_size": get("ffn_hidden_size") or (4 * hidden if hidden else None),
        "kv_channels": kv if kv and heads and hidden and kv * heads != hidden else None,
        "spec": "llama_layer_spec" if normalization == "RMSNorm" else "gpt_layer_spec",
        "activation": activation, "gated_linear_unit": swiglu, "add_bias_linear": bool(bias),
        "layernorm_epsilon": get("norm_epsilon", get("layernorm_epsilon", 1e-5)),
        "max_sequence_length": get("max_position_embeddings"), "position_embedding_type": position,
        "untie_embeddings_and_output_weights": bool(get("untie_embeddings_and_output_weights", False)),
    }
    if position == "rope":
        hp.update(rotary_base=float(get("rotary_base", 10000)), rotary_percent=float(get("rotary_percent", 1.0)))
    return {k: v for k, v in hp.items() if v is not None or k in ("num_query_groups", "kv_channels")}


def gpt_saved_model(full: dict[str, torch.Tensor], args: Any, num_layers: int, layout: dict[str, Any]) -> SavedModel:
    """The SavedModel of a merged megatron-core GPT state dict: the last stage's copy of a tied output
    layer dropped (checked equal to the embedding), an untied one kept (without ``args``: one that
    differs from the embedding); rotary buffers dropped."""
    hp = gpt_architecture_from_args(args, num_layers)
    sd = {k: v for k, v in full.items() if not k.endswith("inv_freq")}
    out_w, emb = sd.get("output_layer.weight"), sd.get("embedding.word_embeddings.weight")
    untied = hp.get("untie_embeddings_and_output_weights")
    if untied is None:  # no args: an output layer of its own is untied, a copy of the embedding tied
        untied = out_w is not None and (emb is None or not torch.equal(out_w, emb))
    if out_w is not None and emb is not None and not untied:
        if not torch.equal(out_w, emb):
            raise ValueError("the Megatron-LM checkpoint's output layer differs from the word embedding but its args "
                             "do not say untie_embeddings_and_output_weights")
        del sd["output_layer.weight"]
    if untied and out_w is None:
        raise ValueError("the Megatron-LM checkpoint says untie_embeddings_and_output_weights but has no "
                         "output_layer.weight")
    return SavedModel(state_dict=sd, hparams=hp, layout=layout)
