"""The decoder family's state-dict adapter (:class:`GPTInterop`), declared by ``GPTLightningModule.interop``.

- Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` /
  ``GPT2LMHeadModel`` folders (:data:`GPT_MODEL_TYPES`): the architecture from ``config.json`` (refusing, by
  name, what our model cannot compute), the names mapped by :mod:`.hf` (the mixtures of experts' fused or
  per-expert tensors);
- Megatron-LM (megatron-core) GPT checkpoints: the generic reader merges the rank files (SwiGLU
  ``linear_fc1`` shards, each TP rank ``[gate_r; up_r]``, regrouped: :meth:`GPTInterop.tp_layout`) and this
  adapter reads ``args``: ``normalization RMSNorm`` -> ``llama_layer_spec`` (else ``gpt_layer_spec``),
  ``swiglu`` -> ``gated_linear_unit`` + ``silu``, ``--bias-gelu-fusion`` / ``openai_gelu`` -> ``gelu_tanh``
  (megatron-core's fused bias-GELU is the tanh approximation), ``group_query_attention`` ->
  ``num_query_groups``, ``position_embedding_type``, ``rotary_base``, ``rotary_percent``,
  ``add_bias_linear``, ``add_qkv_bias``, ``untie_embeddings_and_output_weights``, ``kv_channels``,
  ``norm_epsilon``. Settings our model cannot compute are refused by name (:data:`UNSUPPORTED_GPT_ARGS`).
  A mixture of experts (``num_experts``; megatron-core's ``SequentialMLP`` names under the global expert index,
  whatever the format and expert-parallel layout: :mod:`~lightning_megatron.interop.megatron_lm`) becomes
  ``llama_moe_layer_spec`` with the ``moe_*`` fields of :func:`moe_architecture_from_args` (refusing, by name,
  what our MoE layer does not compute: :data:`UNSUPPORTED_MOE_ARGS`), the shared experts' gate
  ``shared_experts.gate_weight`` renamed ``shared_expert_gate``;
- export: ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (a qkv bias) / ``MixtralForCausalLM`` /
  ``Qwen2MoeForCausalLM`` (``llama_moe_layer_spec``; :func:`~.hf.hf_model_type` says which) /
  ``GPT2LMHeadModel`` with the tokenizer the model was trained with.
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.interop.hf_folder import tokenizer_size_problem
from lightning_megatron.interop.tp import TPLayout
from lightning_megatron.models.gpt import hf as ghf
from lightning_megatron.models.gpt import hf_config as ghc
from lightning_megatron.saved_model import SavedModel

__all__ = ["GPTInterop", "GPT_MODEL_TYPES", "UNSUPPORTED_GPT_ARGS", "UNSUPPORTED_MOE_ARGS",
           "gpt_architecture_from_args", "moe_architecture_from_args", "architecture_of_saved"]

_EOD = "<|endoftext|>"

GPT_MODEL_TYPES = tuple(ghc.HF_MODEL_TYPES)  # llama, gpt2, qwen2, mixtral, qwen2_moe, mistral
"""transformers ``model_type`` s the decoder family reads."""

UNSUPPORTED_GPT_ARGS: dict[str, tuple[tuple[Any, ...], str]] = {
    "position_embedding_type": (("learned_absolute", "rope", "none", None), "other position embeddings"),
    "apply_residual_connection_post_layernorm": ((False, None), "residuals taken after the norm"),
    "squared_relu": ((False, None), "a squared-ReLU MLP"),
    "apply_layernorm_1p": ((False, None), "zero-centred norm weights (apply_layernorm_1p)"),
    "layernorm_zero_centered_gamma": ((False, None), "zero-centred norm weights"),
    "multi_latent_attention": ((False, None), "multi-latent attention"),
    "mtp_num_layers": ((None, 0), "multi-token prediction layers"),
    "rotary_interleaved": ((False, None), "interleaved rotary embeddings"),
    "rotary_seq_len_interpolation_factor": ((None, 1, 1.0), "rotary sequence interpolation"),
    "softmax_type": (("vanilla", None), "another attention softmax (off-by-one, learnable offsets)"),
    "qk_l2_norm": ((False, None), "L2-normalised queries and keys"),
    "quick_geglu": ((False, None), "a quick-GeGLU MLP"),
    "glu_linear_offset": ((None, 0, 0.0), "an offset on the GLU's linear half"),
    "activation_func_clamp_value": ((None,), "a clamped activation"),
    "attention_output_gate": ((False, None), "a gated attention output"),
    "no_rope_freq": ((None, 0), "layers without rotary embeddings"),
    "window_size": ((None,), "sliding-window attention"),
    "window_attn_skip_freq": ((None,), "sliding-window attention on some layers"),
}
"""Megatron-LM arguments whose other values change the computation in ways GPTModel does not have."""

UNSUPPORTED_MOE_ARGS: dict[str, tuple[tuple[Any, ...], str]] = {
    "moe_router_topk_scaling_factor": ((None, 1, 1.0), "routing weights scaled by a factor"),
    "moe_router_num_groups": ((None, 0, 1), "group-limited routing (device-limited top-k)"),
    "moe_router_group_topk": ((None, 0), "group-limited routing (device-limited top-k)"),
    "moe_router_topk_limited_devices": ((None, 0), "device-limited routing (megatron-core's older spelling of "
                                                   "group-limited top-k)"),
    "moe_router_enable_expert_bias": ((False, None), "expert-bias routing (aux-loss-free load balancing)"),
    "moe_router_force_load_balancing": ((False, None), "random routing (a benchmark setting)"),
    "moe_apply_probs_on_input": ((False, None), "routing weights applied to the experts' input"),
    "moe_latent_size": ((None, 0), "latent projections around the experts"),
}
"""Megatron-LM mixture-of-experts arguments whose other values change the routing or the experts' output in ways
our MoE layer does not have (``moe_layer_freq``, the load-balancing type and the capacity's drop policy are
checked in :func:`moe_architecture_from_args`)."""

_DISPATCHERS = {"alltoall": "alltoall", "allgather": "allgather", "alltoall_seq": "alltoall", "flex": "alltoall"}
"""megatron-core's token dispatchers -> ours (the same outputs: ``flex`` is the all-to-all with DeepEP kernels,
``alltoall_seq`` an older all-to-all)."""


def gpt_architecture_from_args(args: Any, num_layers: int) -> dict[str, Any]:
    """The ``GPTLightningModule`` arguments a GPT checkpoint's ``args`` fix; refuses what our model lacks."""
    if not isinstance(args, argparse.Namespace):
        return {"num_layers": num_layers}
    get = lambda k, d=None: getattr(args, k, d)  # noqa: E731
    bias = get("add_bias_linear", True)
    unsupported = [f"{k}={get(k)!r} ({what})" for k, (ok, what) in UNSUPPORTED_GPT_ARGS.items() if get(k) not in ok]
    normalization = get("normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        unsupported.append(f"normalization={normalization!r}")
    moe = moe_architecture_from_args(args, unsupported) if get("num_experts") else {}
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
        "add_qkv_bias": bool(get("add_qkv_bias", False)),  # megatron-core: a linear_qkv bias when either is set
        "qk_layernorm": bool(get("qk_layernorm", False)),  # each head's queries and keys normed (the layers' norm)
        "layernorm_epsilon": get("norm_epsilon", get("layernorm_epsilon", 1e-5)),
        "max_sequence_length": get("max_position_embeddings"), "position_embedding_type": position,
        "untie_embeddings_and_output_weights": bool(get("untie_embeddings_and_output_weights", False)),
        "hidden_dropout": get("hidden_dropout"), "attention_dropout": get("attention_dropout"),  # suggested
    }
    if position == "rope":
        hp.update(rotary_base=float(get("rotary_base", 10000)), rotary_percent=float(get("rotary_percent", 1.0)),
                  rope_scaling=bool(get("use_rope_scaling", False)),  # Llama 3.1's, as our rope_scaling
                  rope_scaling_factor=float(get("rope_scaling_factor", 8.0)))
    if moe:
        hp.update(moe, spec=ghc.MOE_SPEC)
        hp["moe_ffn_hidden_size"] = hp["moe_ffn_hidden_size"] or hp["ffn_hidden_size"]
    return {k: v for k, v in hp.items() if v is not None or k in ("num_query_groups", "kv_channels")}


def moe_architecture_from_args(args: argparse.Namespace, unsupported: list[str]) -> dict[str, Any]:
    """The ``moe_*`` fields of a Megatron-LM mixture of experts (``num_experts`` set): ``num_experts`` ->
    ``num_moe_experts`` and, under the same names, ``moe_router_topk``, ``moe_router_score_function``,
    ``moe_router_pre_softmax``, ``moe_ffn_hidden_size``, ``moe_shared_expert_intermediate_size`` (0: None),
    ``moe_shared_expert_gate``, ``moe_router_load_balancing_type``, ``moe_aux_loss_coeff``, ``moe_z_loss_coeff``,
    ``moe_expert_capacity_factor``, ``moe_pad_expert_input_to_capacity``, ``moe_token_dispatcher_type``.
    What our MoE layer cannot compute is appended to ``unsupported`` (its name and value): the arguments of
    :data:`UNSUPPORTED_MOE_ARGS`, dense layers among the MoE ones (``moe_layer_freq``), sinkhorn routing, the
    capacity's ``position`` drop policy, a norm other than RMSNorm (``llama_moe_layer_spec``), experts that are
    not bias-free SwiGLU MLPs. Load-balancing losses that only training sees and our layer lacks
    (``global_aux_loss``, several types at once) and the router's input jitter are dropped with a warning."""
    get = lambda k, d=None: getattr(args, k, d)  # noqa: E731
    one_group = get("moe_router_num_groups") in (None, 0, 1) and get("moe_router_group_topk") == 1  # plain top-k
    unsupported += [f"{k}={get(k)!r} ({what})" for k, (ok, what) in UNSUPPORTED_MOE_ARGS.items()
                    if get(k) not in ok and not (one_group and k == "moe_router_group_topk")]
    freq = get("moe_layer_freq", 1)  # Megatron-LM parses it into an int (every n-th layer) or a per-layer list
    if not (freq in (None, 1, "1") or isinstance(freq, (list, tuple)) and all(f == 1 for f in freq)):
        unsupported.append(f"moe_layer_freq={freq!r} (dense layers among the mixture-of-experts layers: every layer "
                           f"of llama_moe_layer_spec is one)")
    if get("normalization", "LayerNorm") != "RMSNorm":
        unsupported.append(f"num_experts={get('num_experts')} with normalization={get('normalization', 'LayerNorm')!r} "
                           f"(llama_moe_layer_spec is the RMSNorm layer)")
    if not get("swiglu") or get("add_bias_linear", True):
        unsupported.append(f"num_experts={get('num_experts')} with swiglu={bool(get('swiglu'))}, add_bias_linear="
                           f"{bool(get('add_bias_linear', True))} (our experts are bias-free SwiGLU MLPs)")
    balance, coeff = get("moe_router_load_balancing_type", "aux_loss"), get("moe_aux_loss_coeff", 0.0)
    if isinstance(balance, (list, tuple)) and len(balance) == 1:  # megatron-core's per-type lists, one type
        balance, coeff = balance[0], coeff[0] if isinstance(coeff, (list, tuple)) and len(coeff) == 1 else coeff
    if balance == "sinkhorn":
        unsupported.append("moe_router_load_balancing_type='sinkhorn' (Sinkhorn routing)")
    dropped = []
    if isinstance(balance, (list, tuple)) or isinstance(coeff, (list, tuple)) or balance not in (
            "aux_loss", "seq_aux_loss", "none", "sinkhorn", None):
        dropped.append(f"moe_router_load_balancing_type={balance!r} with moe_aux_loss_coeff={coeff!r} (our layer has "
                       f"one of aux_loss / seq_aux_loss: set --model.config.moe_router_load_balancing_type and "
                       f"moe_aux_loss_coeff; imported as none)")
        balance, coeff = "none", 0.0
    if get("moe_input_jitter_eps"):
        dropped.append(f"moe_input_jitter_eps={get('moe_input_jitter_eps')} (training-time noise on the router's "
                       f"input)")
    capacity = get("moe_expert_capacity_factor")
    if capacity is not None and get("moe_token_drop_policy", "probs") not in ("probs", None):
        unsupported.append(f"moe_token_drop_policy={get('moe_token_drop_policy')!r} (tokens over an expert's capacity "
                           f"dropped by position; ours drops the least probable)")
    dispatcher = get("moe_token_dispatcher_type") or "alltoall"
    if dispatcher not in _DISPATCHERS:
        unsupported.append(f"moe_token_dispatcher_type={dispatcher!r}")
    if dropped:
        warnings.warn(f"the Megatron-LM checkpoint was trained with {', '.join(dropped)}: these change training, not "
                      f"the logits, and GPTLightningModule has no equivalent", UserWarning, stacklevel=3)
    score = get("moe_router_score_function") or "softmax"
    return {
        "num_moe_experts": int(get("num_experts")), "moe_router_topk": int(get("moe_router_topk") or 2),
        # pre-softmax has no effect under sigmoid scores in megatron-core (and is refused with them here)
        "moe_router_score_function": score,
        "moe_router_pre_softmax": bool(get("moe_router_pre_softmax", False)) and score == "softmax",
        "moe_router_dtype": get("moe_router_dtype") or None,
        "moe_ffn_hidden_size": get("moe_ffn_hidden_size"),
        "moe_shared_expert_intermediate_size": get("moe_shared_expert_intermediate_size") or None,
        "moe_shared_expert_gate": bool(get("moe_shared_expert_gate", False)),
        "moe_router_load_balancing_type": balance or "none", "moe_aux_loss_coeff": float(coeff or 0.0),
        "moe_z_loss_coeff": get("moe_z_loss_coeff"), "moe_expert_capacity_factor": capacity,
        "moe_pad_expert_input_to_capacity": bool(get("moe_pad_expert_input_to_capacity", False)),
        "moe_token_dispatcher_type": _DISPATCHERS.get(dispatcher, "alltoall"),
    }


def architecture_of_saved(saved: SavedModel) -> dict[str, Any]:
    """The architecture (:data:`~.hf.GPT_ARCHITECTURE_KEYS`) of a saved GPT model: its module arguments,
    completed from the tensors' shapes (layers, vocabulary, query groups, gating, a qkv-only bias, the experts,
    their width and the shared experts') and checked against them."""
    hp, sd = saved.hparams, saved.state_dict
    word = sd["embedding.word_embeddings.weight"]
    n, h = int(hp.get("num_attention_heads", 4)), word.size(1)
    d = hp.get("kv_channels") or h // n
    layer = "decoder.layers.0."
    qkv = sd[layer + "self_attention.linear_qkv.weight"]
    groups = (qkv.size(0) // d - n) // 2
    layers = {int(k.split(".")[2]) for k in sd if k.startswith("decoder.layers.")}
    arch = {k: hp[k] for k in ghc.GPT_ARCHITECTURE_KEYS if k in hp}
    arch.update(num_layers=max(layers) + 1 if layers else 0, hidden_size=h, num_attention_heads=n,
                num_query_groups=groups, kv_channels=hp.get("kv_channels"), vocab_size=word.size(0),
                untie_embeddings_and_output_weights="output_layer.weight" in sd)
    if layer + "mlp.router.weight" in sd:  # a mixture of experts: its sizes from the router and the experts
        fc1, fc2 = (sd[f"{layer}mlp.experts.local_experts.0.linear_fc{i}.weight"] for i in (1, 2))
        shared = sd.get(layer + "mlp.shared_experts.linear_fc2.weight")
        arch.update(spec=hp.get("spec", ghc.MOE_SPEC), num_moe_experts=sd[layer + "mlp.router.weight"].size(0),
                    moe_ffn_hidden_size=fc2.size(1), gated_linear_unit=fc1.size(0) == 2 * fc2.size(1),
                    moe_shared_expert_intermediate_size=None if shared is None else shared.size(1),
                    moe_shared_expert_gate=layer + "mlp.shared_expert_gate" in sd)
        arch.setdefault("ffn_hidden_size", fc2.size(1))
    else:
        fc1, fc2 = sd[layer + "mlp.linear_fc1.weight"], sd[layer + "mlp.linear_fc2.weight"]
        arch.update(ffn_hidden_size=fc2.size(1), gated_linear_unit=fc1.size(0) == 2 * fc2.size(1))
    arch.setdefault("spec", "gpt_layer_spec")
    arch.setdefault("position_embedding_type", "learned_absolute")
    arch.setdefault("activation", "gelu")
    arch.setdefault("add_bias_linear", layer + "self_attention.linear_proj.bias" in sd)
    arch["add_qkv_bias"] = not arch["add_bias_linear"] and layer + "self_attention.linear_qkv.bias" in sd
    arch.setdefault("layernorm_epsilon", 1e-5)
    if "embedding.position_embeddings.weight" in sd:
        arch["max_sequence_length"] = sd["embedding.position_embeddings.weight"].size(0)
    arch.setdefault("max_sequence_length", 128)
    if hp.get("num_query_groups") not in (None, groups):
        raise ValueError(f"the checkpoint says num_query_groups={hp['num_query_groups']} but linear_qkv has "
                         f"{qkv.size(0)} rows ({groups} groups of {d} channels)")
    return arch


class GPTInterop:
    """:class:`~lightning_megatron.interop.StateDictAdapter` of the decoder family (Llama, Qwen2, Mixtral,
    Qwen2-MoE and GPT-2 shapes)."""

    hf_model_types = GPT_MODEL_TYPES
    megatron_prefixes = ("embedding.", "decoder.", "output_layer.")

    # ------------------------------------------------------------------ Hugging Face -> ours

    def architecture_from_hf(self, config: Any) -> dict[str, Any]:
        return ghc.hf_architecture(config)

    def state_dict_from_hf(self, hf_state_dict: dict[str, torch.Tensor], config: Any, architecture: dict[str, Any],
                           *, source: str) -> SavedModel:
        for key in ("model.embed_tokens.weight", "transformer.wte.weight"):
            if key in hf_state_dict and hf_state_dict[key].size(0) != architecture["vocab_size"]:
                raise ValueError(f"{source!r} says vocab_size={architecture['vocab_size']} but {key} has "
                                 f"{hf_state_dict[key].size(0)} rows: the config does not belong to these weights (fix "
                                 f"vocab_size in config.json)")
        return SavedModel(state_dict=ghf.gpt_state_dict_from_hf(hf_state_dict, architecture), hparams=architecture)

    # ------------------------------------------------------------------ Megatron-LM -> ours

    def architecture_from_megatron(self, args: argparse.Namespace | None, num_layers: int) -> dict[str, Any]:
        return gpt_architecture_from_args(args, num_layers)

    def state_dict_from_megatron(self, state_dict: dict[str, torch.Tensor],
                                 architecture: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The last stage's copy of a tied output layer dropped (checked equal to the embedding), an untied
        one kept (without ``args``: one that differs from the embedding); rotary buffers dropped; a mixture of
        experts' shared-expert gate renamed (:meth:`_moe_from_megatron`)."""
        sd = {k: v for k, v in state_dict.items() if not k.endswith("inv_freq")}
        routers = [k for k in sd if k.endswith(".mlp.router.weight")]
        experts = architecture.get("num_moe_experts")
        if experts and not routers:
            raise ValueError(f"the Megatron-LM checkpoint's args say num_experts={experts} but it holds no "
                             f"mixture-of-experts tensors (no mlp.router.weight): the args do not belong to these "
                             f"weights")
        if routers and architecture.get("spec") not in (None, ghc.MOE_SPEC):
            raise ValueError(f"the Megatron-LM checkpoint holds mixture-of-experts tensors ({routers[0]}) but its args "
                             f"name no num_experts: the args do not belong to these weights")
        if routers:
            sd = self._moe_from_megatron(sd, architecture)
            rows = {sd[k].size(0) for k in routers}
            if rows != {architecture["num_moe_experts"]}:
                raise ValueError(f"the Megatron-LM checkpoint's routers have {sorted(rows)} experts but its args say "
                                 f"num_experts={architecture['num_moe_experts']}")
        out_w, emb = sd.get("output_layer.weight"), sd.get("embedding.word_embeddings.weight")
        untied = architecture.get("untie_embeddings_and_output_weights")
        if untied is None:  # no args: an output layer of its own is untied, a copy of the embedding tied
            untied = out_w is not None and (emb is None or not torch.equal(out_w, emb))
        if out_w is not None and emb is not None and not untied:
            if not torch.equal(out_w, emb):
                raise ValueError("the Megatron-LM checkpoint's output layer differs from the word embedding but its "
                                 "args do not say untie_embeddings_and_output_weights")
            del sd["output_layer.weight"]
        if untied and out_w is None:
            raise ValueError("the Megatron-LM checkpoint says untie_embeddings_and_output_weights but has no "
                             "output_layer.weight")
        return sd

    @staticmethod
    def _moe_from_megatron(sd: dict[str, torch.Tensor], architecture: dict[str, Any]) -> dict[str, torch.Tensor]:
        """megatron-core's ``mlp.shared_experts.gate_weight`` -> our ``mlp.shared_expert_gate``; a router bias or
        expert bias (routing our router does not have) refused unless zero. Without ``args`` (``architecture``
        names no experts) the facts the tensors fix are added to ``architecture`` (``spec``,
        ``num_moe_experts``, ``moe_ffn_hidden_size``, the shared experts' width and gate), so that a module
        built otherwise is refused before loading; with ``args``, a gate they do not name is refused."""
        out = {}
        for key, value in sd.items():
            if key.endswith((".mlp.router.bias", ".mlp.router.expert_bias")):
                if bool(value.any()):
                    raise ValueError(f"the Megatron-LM checkpoint has a non-zero {key} (a router bias, or an expert "
                                     f"bias from aux-loss-free balancing): our router routes by x W^T alone, so its "
                                     f"logits would differ")
                continue
            if key.endswith(".mlp.shared_experts.gate_weight"):
                key = key[: -len("shared_experts.gate_weight")] + "shared_expert_gate"
            out[key] = value
        layer = next(k for k in out if k.endswith(".mlp.router.weight"))[: -len("router.weight")]
        gated = layer + "shared_expert_gate" in out
        shared = out.get(layer + "shared_experts.linear_fc2.weight")
        if "num_moe_experts" not in architecture:  # no args: what the tensors fix
            fc2 = out.get(layer + "experts.local_experts.0.linear_fc2.weight")
            architecture.update(spec=ghc.MOE_SPEC, num_moe_experts=out[layer + "router.weight"].size(0),
                                moe_shared_expert_intermediate_size=None if shared is None else shared.size(1),
                                moe_shared_expert_gate=gated)
            if fc2 is not None:
                architecture["moe_ffn_hidden_size"] = fc2.size(1)
        elif gated and not architecture.get("moe_shared_expert_gate"):
            raise ValueError("the Megatron-LM checkpoint has shared_experts.gate_weight (a sigmoid gate on the shared "
                             "experts) but its args do not say moe_shared_expert_gate")
        return out

    def tp_layout(self, state_dict: Mapping[str, torch.Tensor]) -> TPLayout:
        """A SwiGLU ``linear_fc1`` (twice the rows its ``linear_fc2`` has columns, on every rank) is strided
        (a dense MLP's, an expert's, the shared experts')."""
        fc1 = next((k for k in state_dict if k.endswith("linear_fc1.weight")
                    and k.replace("linear_fc1", "linear_fc2") in state_dict), None)
        gated = fc1 is not None and state_dict[fc1].size(0) == 2 * state_dict[fc1.replace("fc1", "fc2")].size(1)
        return ghf.gpt_tp_layout(gated_linear_unit=gated)

    # ------------------------------------------------------------------ ours -> Hugging Face

    def hf_config(self, saved: SavedModel) -> Any:
        """The transformers config of :func:`~.hf.hf_config_from_architecture`, with the dropouts and the aux-loss
        weight the model trained with. A mixture of experts trained with token dropping
        (``moe_expert_capacity_factor``) exports with a warning: transformers drops no tokens, so its logits
        equal ours only where no expert overflowed."""
        extra = {k: saved.hparams[k] for k in ("hidden_dropout", "attention_dropout", "moe_aux_loss_coeff")
                 if k in saved.hparams}
        architecture = architecture_of_saved(saved)
        config = ghc.hf_config_from_architecture({**architecture, **extra})
        router_dtype, dtype = architecture.get("moe_router_dtype"), str(saved.hparams.get("params_dtype", "float32"))
        if architecture.get("num_moe_experts") and router_dtype is not None and "float32" not in dtype:
            warnings.warn(f"export hf: the model computes its router's logits in {router_dtype} (moe_router_dtype); "
                          f"{config.architectures[0]} in the model's {dtype}: a few tokens may route to other experts",
                          UserWarning, stacklevel=2)
        factor = saved.hparams.get("moe_expert_capacity_factor")
        if architecture.get("num_moe_experts") and factor is not None:
            warnings.warn(f"export hf: the model routes with moe_expert_capacity_factor={factor} (tokens over an "
                          f"expert's capacity dropped); {config.architectures[0]} drops none, so its logits equal ours "
                          f"only where no expert overflows", UserWarning, stacklevel=2)
        return config

    def state_dict_to_hf(self, saved: SavedModel, config: Any) -> dict[str, torch.Tensor]:
        return ghf.hf_state_dict_from_gpt(saved.state_dict, architecture_of_saved(saved))

    def hf_tokenizer(self, saved: SavedModel, config: Any,
                     tokenizer: str | os.PathLike[str] | None) -> Callable[[Path], None]:
        """``tokenizer``: the ``tokenizer.json`` / GPT-2 ``vocab.json`` (or a folder) the model was trained with;
        None takes the one the checkpoint's datamodule names (``GPTDataModule``'s default: the packaged BPE),
        else the folder gets no tokenizer (a warning says so). The config's ``eos`` token is the data's end of
        document (``<|endoftext|>``), or a chat run's end of turn, its ``bos`` the tokenizer's own (else the end of
        document); a chat run's ``generation_config.json`` stops at every id its generations stopped at."""
        source = _tokenizer_source(saved, tokenizer)
        hf_tok = _hf_tokenizer(source) if source is not None else None
        chat = _chat_tokenizer(saved) if tokenizer is None else None
        if hf_tok is not None and chat is not None:
            # an instruction-tuned model: the chat template it was trained with, where its turns end, and the
            # special tokens its template saw (a bos_token the run rendered empty stays unnamed)
            from lightning_megatron.data.chat import SPECIAL_TOKEN_NAMES

            hf_tok.chat_template = chat.chat_template
            vocab = hf_tok.get_vocab()
            seen = {name: token if (token := chat.special_tokens.get(name)) in vocab else None
                    for name in SPECIAL_TOKEN_NAMES}
            hf_tok.bos_token, hf_tok.eos_token = seen["bos_token"], seen["eos_token"]
            hf_tok.unk_token, hf_tok.sep_token = seen["unk_token"], seen["sep_token"]
            hf_tok.pad_token, hf_tok.cls_token = seen["pad_token"], seen["cls_token"]
            hf_tok.mask_token = seen["mask_token"]
        problem = tokenizer_size_problem(saved, len(hf_tok), config.vocab_size, source, "--tokenizer") \
            if hf_tok is not None else None
        if problem is not None:
            raise ValueError(problem)
        # the data's end of document (BPETokenizer's rule: <|endoftext|>, else the folder's eos_token)
        eod_token = _eod_token(source) if source is not None else None
        vocab = hf_tok.get_vocab() if hf_tok is not None else {}
        eod = vocab.get(chat.eos_token if chat is not None else eod_token)
        if eod is not None:  # the model's end of text: the end of turn of chats, else Megatron's end of document;
            # its BOS the tokenizer's own, else the end of document (GPT-2's <|endoftext|>)
            config.eos_token_id = eod
            own_bos = vocab.get(hf_tok.bos_token) if hf_tok.bos_token is not None else None
            config.bos_token_id = own_bos if own_bos is not None else vocab.get(eod_token, eod)
        max_length = architecture_of_saved(saved)["max_sequence_length"]

        def write_tokenizer(folder: Path) -> None:
            if hf_tok is None:
                warnings.warn("export hf: the checkpoint names no tokenizer, so the folder has none; pass --tokenizer "
                              "with the tokenizer.json the model was trained with", UserWarning, stacklevel=3)
                return
            if eod is not None and chat is None:  # the token the model ends a document with
                hf_tok.eos_token = eod_token
                if hf_tok.bos_token is None:
                    hf_tok.bos_token = eod_token
            hf_tok.model_max_length = max_length
            hf_tok.save_pretrained(folder)
            if chat is not None and len(chat.stop_ids) > 1:  # generate stops where predict did (Llama 3.1's three)
                _write_stop_ids(folder, chat.stop_ids)

        return write_tokenizer


def _write_stop_ids(folder: Path, stop_ids: tuple[int, ...]) -> None:
    """``generation_config.json``'s ``eos_token_id``: every id a generation of the run stops at (transformers'
    ``generate`` stops at any of a list), the rest of the file as the model's save wrote it."""
    from lightning_megatron.interop.hf_folder import import_transformers

    transformers = import_transformers("writing a generation config")
    exists = (folder / "generation_config.json").is_file()
    generation = transformers.GenerationConfig.from_pretrained(folder) if exists else transformers.GenerationConfig()
    generation.eos_token_id = list(stop_ids)
    generation.save_pretrained(folder)


def _tokenizer_source(saved: SavedModel, tokenizer: str | os.PathLike[str] | None) -> Path | None:
    if tokenizer is not None:
        return Path(tokenizer)
    from lightning_megatron.data.bpe_tokenizer import packaged_bpe_tokenizer_file
    from lightning_megatron.data.dataset_vocab import trained_vocabulary

    dm = saved.datamodule_hparams
    for key in ("tokenizer_file", "tokenizer"):
        if isinstance(dm.get(key), str) and Path(dm[key]).exists():
            return Path(dm[key])
    if "chat_template" in dm and dm.get("tokenizer") is None:  # SFTDataModule's default: the packaged BPE
        return packaged_bpe_tokenizer_file()
    if "vocab_file" in dm:  # GPTDataModule's rule: its vocab_file, the dataset's record, else the packaged BPE
        vocab_file, _ = trained_vocabulary(dm)  # (the size check still applies)
        return Path(vocab_file) if vocab_file is not None else packaged_bpe_tokenizer_file()
    return None


def _chat_tokenizer(saved: SavedModel) -> Any:
    """The chat tokenizer of a run that trained on chats (an ``SFTDataModule``: its ``tokenizer``, ``chat_template``
    and ``eos_token``), resolved as the run resolved them; None for other runs."""
    dm = saved.datamodule_hparams
    if "chat_template" not in dm or "tokenizer" not in dm:
        return None
    from lightning_megatron.data.bpe_tokenizer import packaged_bpe_tokenizer_file
    from lightning_megatron.data.chat import ChatTokenizer

    path = dm["tokenizer"] if dm["tokenizer"] is not None else packaged_bpe_tokenizer_file()
    return ChatTokenizer(path, eos_token=dm.get("eos_token"), chat_template=dm.get("chat_template"))


def _eod_token(source: Path) -> str:
    """The end-of-document token the data of a tokenizer at ``source`` ends documents with (:class:`BPETokenizer`'s
    rule: ``<|endoftext|>``, else a ``tokenizer_config.json``'s ``eos_token``); ``<|endoftext|>`` for a tokenizer it
    does not read (a word-level one)."""
    from lightning_megatron.data.bpe_tokenizer import BPETokenizer

    try:
        return BPETokenizer(source).eod_token
    except (ValueError, OSError):
        return _EOD


def _config_special_tokens(source: Path) -> dict[str, str]:
    """The special tokens (``bos``, ``eos``, ``pad``, ``unk``) a ``tokenizer_config.json`` beside ``source`` names, as
    strings (a folder's ``<pad>`` was dropped on export, ``pad_token_id`` null)."""
    import json

    config = (source if source.is_dir() else source.parent) / "tokenizer_config.json"
    try:
        spec = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    except (OSError, ValueError):
        return {}
    out = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = spec.get(name) if isinstance(spec, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            out[name] = value
    return out


def _hf_tokenizer(source: Path) -> Any:
    """A transformers fast tokenizer from a ``tokenizer.json``, GPT-2's ``vocab.json`` + ``merges.txt``, or a
    folder holding either, with the special tokens a ``tokenizer_config.json`` beside it names."""
    import json

    from lightning_megatron.interop.hf_folder import import_transformers

    transformers = import_transformers("writing a transformers tokenizer")

    if source.is_dir():
        source = source / "tokenizer.json" if (source / "tokenizer.json").is_file() else source / "vocab.json"
    if not source.is_file():
        raise FileNotFoundError(f"tokenizer {str(source)!r} does not exist: pass --tokenizer with the tokenizer.json "
                                f"(or GPT-2 vocab.json beside its merges.txt) the model was trained with")
    try:
        spec = json.loads(source.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"tokenizer {str(source)!r} is not a tokenizer.json / GPT-2 vocab.json: {e}") from e
    if isinstance(spec, dict) and "model" not in spec:  # GPT-2's flat {piece: id} + merges.txt: as our data reads it
        import tempfile

        from lightning_megatron.data.bpe_tokenizer import BPETokenizer

        with tempfile.TemporaryDirectory() as tmp:
            return transformers.PreTrainedTokenizerFast(tokenizer_file=str(BPETokenizer(source).save(tmp)))
    known = set((spec.get("model") or {}).get("vocab") or {})
    known |= {t.get("content") for t in spec.get("added_tokens") or []}
    special = {k: v for k, v in _config_special_tokens(source).items() if v in known}  # never a token it lacks
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(source), **special)
