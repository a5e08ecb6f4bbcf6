"""Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` /
``GPT2LMHeadModel`` <-> our GPT state dict (megatron-core names).

Everything here works on FULL state dicts: ours is the TP=1 state dict under megatron-core GPTModel
names with global layer numbers (and global expert numbers) and the real (unpadded) vocabulary, the form
a lightning_megatron checkpoint stores and ``init_from`` slices. Conversion only moves, transposes,
concatenates and stacks tensors, so HF -> ours -> HF is bit-exact.

Our layouts (the decoder-family contract):

- ``self_attention.linear_qkv.weight`` ``[(n + 2 g) d, h]`` (and its bias, Qwen2's ``add_qkv_bias``): rows
  grouped per query group, for each group its ``n / g`` query heads, then its key head, then its value
  head (megatron-core);
- ``mlp.linear_fc1.weight`` (SwiGLU) ``[2 f, h]`` = ``[gate; up]`` at TP=1; on TP rank ``r`` of ``t``
  the local rows are ``[gate_r; up_r]`` (:func:`shard_full_state_dict` / :func:`merge_tp_shards`);
- a mixture of experts (``llama_moe_layer_spec``: Mixtral, Qwen2-MoE): ``mlp.router.weight`` ``[E, h]``,
  ``mlp.experts.local_experts.<e>.linear_fc1.weight`` ``[2 f, h]`` = ``[gate_e; up_e]`` (transformers 5's
  fused ``mlp.experts.gate_up_proj[e]``) and ``...linear_fc2.weight`` ``[h, f]`` (``down_proj[e]``), the
  shared expert (Qwen2-MoE) ``mlp.shared_experts.linear_fc1/2.weight`` and ``mlp.shared_expert_gate`` ``[1, h]``.
  Import also reads the per-expert layout that hub checkpoints, transformers 4 and transformers 5's own
  ``save_pretrained`` (``save_original_format=True``, its default) write: Mixtral's
  ``block_sparse_moe.experts.<e>.w1`` (gate) / ``w3`` (up) / ``w2`` (down) and ``block_sparse_moe.gate``,
  Qwen2-MoE's ``mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``. Export gives transformers the
  fused tensors of its classes (:func:`hf_state_dict_from_gpt`) and its ``save_pretrained`` writes the files;
- GPT-2's ``Conv1D`` weights are ``[in, out]``: transposed to our ``[out, in]``.

:func:`hf_architecture` reads a transformers config into the module arguments our model needs
(:data:`GPT_ARCHITECTURE_KEYS`) and refuses, by name, every setting our model cannot reproduce (rope scaling,
biases in Llama, a head size other than hidden / heads, Qwen2-MoE's dense layers between MoE layers, ...).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from lightning_megatron.interop.tp import TPLayout, shard_state_dict
from lightning_megatron.interop.tp import merge_tp_shards as generic_merge
from lightning_megatron.tensor_parallel import pad_vocab_size

__all__ = ["GPT_ARCHITECTURE_KEYS", "LLAMA_SPEC", "GPT2_SPEC", "MOE_SPEC", "HF_MODEL_TYPES", "llama_architecture",
           "qwen2_architecture", "mixtral_architecture", "qwen2_moe_architecture", "gpt2_architecture",
           "hf_architecture", "hf_model_type", "hf_class_name", "gpt_state_dict_from_hf", "hf_state_dict_from_gpt",
           "hf_config_from_architecture", "qkv_from_separate", "qkv_to_separate", "gpt_tp_layout",
           "shard_full_state_dict", "merge_tp_shards"]

LLAMA_SPEC = "llama_layer_spec"
"""The registered layer spec of the Llama shape (RMSNorm, rotary, SwiGLU, GQA, no biases; Qwen2 adds a qkv bias)."""
GPT2_SPEC = "gpt_layer_spec"
"""The registered layer spec of the GPT-2 shape (LayerNorm, learned positions, GELU, biases, tied)."""
MOE_SPEC = "llama_moe_layer_spec"
"""The registered layer spec of the Mixtral / Qwen2-MoE shape (the Llama layer, a mixture of experts as its MLP)."""

GPT_ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                         "kv_channels", "spec", "activation", "layernorm_epsilon", "max_sequence_length", "vocab_size",
                         "position_embedding_type", "add_bias_linear", "gated_linear_unit", "rotary_base",
                         "rotary_percent", "untie_embeddings_and_output_weights", "add_qkv_bias", "num_moe_experts",
                         "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
                         "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")
"""``GPTLightningModule`` arguments a source fixes (the architecture dicts below use these; a mixture of experts'
also carries ``moe_aux_loss_coeff``, a training setting the source suggests but does not fix)."""

HF_MODEL_TYPES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "qwen2": "Qwen2ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
"""transformers ``model_type`` -> the causal-LM class the decoder family reads and writes."""

_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_GPT2_ACT_OUT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_MODEL_NAMES = {"llama": "Llama", "gpt2": "GPT-2", "qwen2": "Qwen2", "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE"}


def _refuse(model: str, bad: list[str]) -> None:
    if bad:
        raise ValueError(f"the {model} config has {', '.join(bad)}: our GPT model has no equivalent, so its logits "
                         f"would differ; convert a model without these settings")


def _rope(cfg: dict[str, Any]) -> tuple[float, str, Any]:
    """(rope_theta, rope_type, scaling) from a transformers 4.x (``rope_theta``, ``rope_scaling``) or 5.x
    (``rope_parameters``) Llama config dict."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    extra = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type")}
    return float(theta), rope_type, scaling if scaling else (extra or None)


def _config_dict(hf_config: Any, model_type: str) -> dict[str, Any]:
    cfg = hf_config.to_dict()
    if cfg.get("model_type") != model_type:
        raise ValueError(f"model_type={cfg.get('model_type')!r} is not {model_type!r}")
    return cfg


def _rotary_decoder(cfg: dict[str, Any], bad: list[str]) -> dict[str, Any]:
    """The module arguments of the Llama-shaped decoder Llama, Qwen2, Mixtral and Qwen2-MoE share (RMSNorm, rope,
    SwiGLU, grouped-query attention, no linear biases); what it cannot compute appended to ``bad``."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    theta, rope_type, scaling = _rope(cfg)
    if rope_type != "default" or scaling:
        bad.append(f"rope scaling (rope_type={rope_type!r}, {scaling!r})")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        bad.append(f"hidden_act={cfg.get('hidden_act')!r} (the Llama spec's SwiGLU uses silu)")
    head_dim = cfg.get("head_dim")
    kv_channels = head_dim if head_dim is not None and head_dim * heads != hidden else None
    if (cfg.get("pretraining_tp") or 1) != 1:
        bad.append(f"pretraining_tp={cfg['pretraining_tp']}")
    if heads % groups:
        bad.append(f"num_key_value_heads={groups} not dividing num_attention_heads={heads}")
    # Llama and Mixtral slide whenever sliding_window is set; Qwen2 / Qwen2-MoE keep a sliding_window they use
    # only in the layer_types "sliding_attention" layers (use_sliding_window, when they have no layer_types).
    if cfg.get("model_type") in ("qwen2", "qwen2_moe"):
        window_keys: tuple[str, ...] = () if "layer_types" in cfg else ("use_sliding_window",)
    else:
        window_keys = ("sliding_window", "use_sliding_window")
    for key in (*window_keys, "partial_rotary_factor", "qk_norm"):
        if cfg.get(key) not in (None, False, 1.0):
            bad.append(f"{key}={cfg[key]!r}")
    other = sorted(set(cfg.get("layer_types") or ()) - {"full_attention"})
    if other:
        bad.append(f"layer_types with {other} (sliding-window attention in some layers)")
    return dict(num_layers=cfg["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
                num_query_groups=groups, ffn_hidden_size=cfg["intermediate_size"], kv_channels=kv_channels,
                spec=LLAMA_SPEC, activation="silu", layernorm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
                max_sequence_length=cfg.get("max_position_embeddings", 2048), vocab_size=cfg["vocab_size"],
                position_embedding_type="rope", add_bias_linear=False, gated_linear_unit=True, rotary_base=theta,
                rotary_percent=1.0, untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
                add_qkv_bias=False)


def llama_architecture(hf_config: Any) -> dict[str, Any]:
    """Our module arguments for a ``transformers.LlamaConfig``; refuses what our Llama spec cannot compute."""
    cfg = _config_dict(hf_config, "llama")
    bad = [f"{key}=True" for key in ("attention_bias", "mlp_bias") if cfg.get(key)]
    arch = _rotary_decoder(cfg, bad)
    _refuse("Llama", bad)
    return arch


def qwen2_architecture(hf_config: Any) -> dict[str, Any]:
    """Our module arguments for a ``transformers.Qwen2Config``: the Llama shape with a bias on q, k and v only
    (``add_qkv_bias``); refuses sliding-window attention."""
    cfg = _config_dict(hf_config, "qwen2")
    bad: list[str] = []
    arch = _rotary_decoder(cfg, bad)
    _refuse("Qwen2", bad)
    return {**arch, "add_qkv_bias": True}


def _moe(experts: int, topk: int, ffn: int, *, pre_softmax: bool, shared: int | None, aux: float) -> dict[str, Any]:
    return dict(spec=MOE_SPEC, num_moe_experts=experts, moe_router_topk=topk, moe_router_score_function="softmax",
                moe_router_pre_softmax=pre_softmax, moe_ffn_hidden_size=ffn, moe_shared_expert_intermediate_size=shared,
                moe_shared_expert_gate=shared is not None, moe_aux_loss_coeff=aux)


def mixtral_architecture(hf_config: Any) -> dict[str, Any]:
    """Our module arguments for a ``transformers.MixtralConfig``: ``llama_moe_layer_spec``, ``num_local_experts``
    experts of width ``intermediate_size``, the top ``num_experts_per_tok`` of the router's logits softmaxed
    (``moe_router_pre_softmax=False``: softmax, top-k, renormalise), ``router_aux_loss_coef`` ->
    ``moe_aux_loss_coeff``. ``router_jitter_noise`` (training-time noise on the router's input; the logits are
    unchanged) is dropped with a warning."""
    cfg = _config_dict(hf_config, "mixtral")
    bad: list[str] = []
    arch = _rotary_decoder(cfg, bad)
    experts, topk = cfg.get("num_local_experts") or 0, cfg.get("num_experts_per_tok") or 0
    if not 1 <= topk <= experts:
        bad.append(f"num_experts_per_tok={topk} with num_local_experts={experts}")
    _refuse("Mixtral", bad)
    if cfg.get("router_jitter_noise"):
        warnings.warn(f"the Mixtral config has router_jitter_noise={cfg['router_jitter_noise']}: our router adds no "
                      f"jitter noise when training (the logits are the same), so fine-tuning runs without it",
                      UserWarning, stacklevel=3)
    return {**arch, **_moe(experts, topk, cfg["intermediate_size"], pre_softmax=False, shared=None,
                           aux=float(cfg.get("router_aux_loss_coef") or 0.0))}


def qwen2_moe_architecture(hf_config: Any) -> dict[str, Any]:
    """Our module arguments for a ``transformers.Qwen2MoeConfig``: ``llama_moe_layer_spec`` with a qkv bias
    (``qkv_bias`` -> ``add_qkv_bias``), ``num_experts`` experts of width ``moe_intermediate_size``, a shared
    expert of width ``shared_expert_intermediate_size`` scaled by its sigmoid gate (0: none),
    ``norm_topk_prob`` -> ``moe_router_pre_softmax = not norm_topk_prob`` (False: the top-k of the softmax kept
    as they are; True: renormalised, equal to a softmax over the top-k logits); ``intermediate_size`` (the
    width of Qwen2-MoE's dense layers, which a checkpoint we read does not have) -> ``ffn_hidden_size``.
    Refused: dense layers among the MoE ones (``decoder_sparse_step`` != 1, ``mlp_only_layers``), no experts,
    sliding-window attention."""
    cfg = _config_dict(hf_config, "qwen2_moe")
    bad: list[str] = []
    arch = _rotary_decoder(cfg, bad)
    experts, topk = cfg.get("num_experts") or 0, cfg.get("num_experts_per_tok") or 0
    if experts < 1:
        bad.append(f"num_experts={experts} (every layer dense)")
    elif not 1 <= topk <= experts:
        bad.append(f"num_experts_per_tok={topk} with num_experts={experts}")
    if (cfg.get("decoder_sparse_step") or 1) != 1:
        bad.append(f"decoder_sparse_step={cfg['decoder_sparse_step']} (dense MLP layers between the MoE layers; "
                   f"every layer of llama_moe_layer_spec is a mixture of experts)")
    if cfg.get("mlp_only_layers"):
        bad.append(f"mlp_only_layers={cfg['mlp_only_layers']} (dense MLP layers among the MoE layers)")
    _refuse("Qwen2-MoE", bad)
    shared = cfg.get("shared_expert_intermediate_size") or None  # 0: an empty shared expert, adding nothing
    return {**arch, "add_qkv_bias": bool(cfg.get("qkv_bias", True)),
            **_moe(experts, topk, cfg["moe_intermediate_size"], pre_softmax=not cfg.get("norm_topk_prob", False),
                   shared=shared, aux=float(cfg.get("router_aux_loss_coef") or 0.0))}


def gpt2_architecture(hf_config: Any) -> dict[str, Any]:
    """Our module arguments for a ``transformers.GPT2Config``; refuses what our GPT-2 spec cannot compute."""
    cfg = _config_dict(hf_config, "gpt2")
    act = cfg.get("activation_function", "gelu_new")
    bad = []
    if act not in _GPT2_ACT:
        bad.append(f"activation_function={act!r} (known: {sorted(_GPT2_ACT)})")
    if not cfg.get("scale_attn_weights", True):
        bad.append("scale_attn_weights=False")
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if cfg.get(key):
            bad.append(f"{key}=True")
    if not cfg.get("tie_word_embeddings", True):
        bad.append("tie_word_embeddings=False (the GPT-2 spec ties the output layer to the embedding)")
    _refuse("GPT-2", bad)
    hidden = cfg["n_embd"]
    return dict(num_layers=cfg["n_layer"], hidden_size=hidden, num_attention_heads=cfg["n_head"],
                num_query_groups=None, ffn_hidden_size=cfg.get("n_inner") or 4 * hidden, kv_channels=None,
                spec=GPT2_SPEC, activation=_GPT2_ACT.get(act, act),
                layernorm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)), max_sequence_length=cfg["n_positions"],
                vocab_size=cfg["vocab_size"], position_embedding_type="learned_absolute", add_bias_linear=True,
                gated_linear_unit=False, rotary_base=10000.0, rotary_percent=1.0,
                untie_embeddings_and_output_weights=False, add_qkv_bias=False)


_ARCHITECTURES = {"llama": llama_architecture, "qwen2": qwen2_architecture, "mixtral": mixtral_architecture,
                  "qwen2_moe": qwen2_moe_architecture, "gpt2": gpt2_architecture}


def hf_architecture(hf_config: Any) -> dict[str, Any]:
    """Our module arguments for a transformers config of one of :data:`HF_MODEL_TYPES`, by ``model_type``."""
    model_type = hf_config.model_type
    if model_type not in _ARCHITECTURES:
        known = ", ".join(f"{t!r} ({c})" for t, c in HF_MODEL_TYPES.items())
        raise ValueError(f"model_type={model_type!r}: the GPT family converts {known}")
    return _ARCHITECTURES[model_type](hf_config)


# ---------------------------------------------------------------------- layouts


def qkv_from_separate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """``q [n d, ...]``, ``k, v [g d, ...]`` -> ``[(n + 2 g) d, ...]``: per group ``[n/g q heads, k, v]``."""
    d = q.size(0) // heads
    rest = q.shape[1:]
    parts = [q.reshape(groups, heads // groups, d, *rest), k.reshape(groups, 1, d, *rest),
             v.reshape(groups, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape((heads + 2 * groups) * d, *rest)


def qkv_to_separate(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`qkv_from_separate`."""
    d = qkv.size(0) // (heads + 2 * groups)
    rest = qkv.shape[1:]
    per = heads // groups
    x = qkv.reshape(groups, per + 2, d, *rest)
    q, k, v = x[:, :per], x[:, per:per + 1], x[:, per + 1:]
    return (q.reshape(heads * d, *rest).clone(), k.reshape(groups * d, *rest).clone(),
            v.reshape(groups * d, *rest).clone())


_LLAMA_LAYER = {  # ours -> theirs, inside decoder.layers.<i>. / model.layers.<i>. (the MLP apart)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
_GPT2_LAYER = {  # ours -> theirs (transposed: Conv1D), inside decoder.layers.<i>. / h.<i>.
    "input_layernorm.weight": ("ln_1.weight", False), "input_layernorm.bias": ("ln_1.bias", False),
    "self_attention.linear_proj.weight": ("attn.c_proj.weight", True),
    "self_attention.linear_proj.bias": ("attn.c_proj.bias", False),
    "pre_mlp_layernorm.weight": ("ln_2.weight", False), "pre_mlp_layernorm.bias": ("ln_2.bias", False),
    "mlp.linear_fc1.weight": ("mlp.c_fc.weight", True), "mlp.linear_fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.linear_fc2.weight": ("mlp.c_proj.weight", True), "mlp.linear_fc2.bias": ("mlp.c_proj.bias", False),
}
_IGNORED = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")  # buffers old transformers saved
_PER_EXPERT = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))  # (gate, up, down): Mixtral's, Qwen's
_SHARED = ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight")


def _take(hf: dict[str, torch.Tensor], key: str, model: str) -> torch.Tensor:
    if key not in hf:
        raise KeyError(f"the {model} state dict has no {key!r}")
    return hf.pop(key)


def hf_model_type(arch: Mapping[str, Any]) -> str:
    """The transformers ``model_type`` whose names and class fit our architecture (no refusal here: see
    :func:`hf_config_from_architecture`): GPT-2 for ``gpt_layer_spec``; Qwen2 for the Llama spec with a qkv
    bias, else Llama; for ``llama_moe_layer_spec`` Qwen2-MoE when the model has what only Qwen2-MoE has (shared
    experts, a qkv bias, the top-k probabilities not renormalised), else Mixtral."""
    spec = arch["spec"]
    if spec == GPT2_SPEC:
        return "gpt2"
    if spec == MOE_SPEC:
        qwen = (arch.get("moe_shared_expert_intermediate_size") or arch.get("add_qkv_bias")
                or arch.get("moe_router_pre_softmax"))
        return "qwen2_moe" if qwen else "mixtral"
    return "qwen2" if arch.get("add_qkv_bias") else "llama"


def hf_class_name(arch: Mapping[str, Any]) -> str:
    """The transformers class of :func:`hf_model_type`."""
    return HF_MODEL_TYPES[hf_model_type(arch)]


def _experts_from_hf(hf: dict[str, torch.Tensor], src: str, dst: str, arch: Mapping[str, Any],
                     model: str) -> dict[str, torch.Tensor]:
    """Our ``mlp.*`` tensors of one MoE layer from transformers' fused ``mlp.experts.gate_up_proj`` /
    ``down_proj`` or the per-expert tensors of older checkpoints (Mixtral ``block_sparse_moe.experts.<e>.w1/w3/w2``,
    Qwen2-MoE ``mlp.experts.<e>.gate_proj/up_proj/down_proj``)."""
    experts, h = arch["num_moe_experts"], arch["hidden_size"]
    ffn = arch.get("moe_ffn_hidden_size") or arch["ffn_hidden_size"]
    block = src + ("block_sparse_moe." if src + "block_sparse_moe.gate.weight" in hf else "mlp.")
    out = {dst + "mlp.router.weight": _take(hf, block + "gate.weight", model)}
    if block + "experts.gate_up_proj" in hf or block + "experts.down_proj" in hf:  # transformers >= 5: fused
        gate_up, down = _take(hf, block + "experts.gate_up_proj", model), _take(hf, block + "experts.down_proj", model)
        if gate_up.shape != (experts, 2 * ffn, h) or down.shape != (experts, h, ffn):
            raise ValueError(f"the {model} state dict's {block}experts.gate_up_proj is {tuple(gate_up.shape)} and "
                             f"down_proj {tuple(down.shape)}; the config says [{experts}, {2 * ffn}, {h}] and "
                             f"[{experts}, {h}, {ffn}] (experts, out, in)")
        pairs = list(zip(gate_up.unbind(0), down.unbind(0)))
    else:  # one tensor per expert and projection
        gate, up, down_name = next((names for names in _PER_EXPERT if f"{block}experts.0.{names[0]}.weight" in hf),
                                   _PER_EXPERT[-1])
        pairs = []
        for e in range(experts):
            part = f"{block}experts.{e}."
            fc1 = torch.cat([_take(hf, f"{part}{gate}.weight", model), _take(hf, f"{part}{up}.weight", model)])
            pairs.append((fc1, _take(hf, f"{part}{down_name}.weight", model)))
    for e, (fc1, fc2) in enumerate(pairs):
        out[f"{dst}mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1
        out[f"{dst}mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2
    mlp = src + "mlp."
    if arch.get("moe_shared_expert_intermediate_size"):
        gate, up, down = (_take(hf, mlp + name, model) for name in _SHARED)
        out[dst + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([gate, up])
        out[dst + "mlp.shared_experts.linear_fc2.weight"] = down
        if arch.get("moe_shared_expert_gate"):
            out[dst + "mlp.shared_expert_gate"] = _take(hf, mlp + "shared_expert_gate.weight", model)
    elif all(mlp + name in hf and hf[mlp + name].numel() == 0 for name in _SHARED):
        for name in (*_SHARED, "shared_expert_gate.weight"):  # Qwen2-MoE's empty shared expert adds nothing
            hf.pop(mlp + name, None)
    return out


def gpt_state_dict_from_hf(hf_state_dict: Mapping[str, torch.Tensor],
                           arch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Our full TP=1 state dict (unpadded vocabulary) from a Llama / Qwen2 / Mixtral / Qwen2-MoE / GPT-2 state
    dict and the architecture :func:`hf_architecture` read from its config. A tensor the conversion does not use
    (a bias, a layer beyond ``num_layers``) is refused by name: it would change the logits."""
    model = _MODEL_NAMES[hf_model_type(arch)]
    gpt2 = arch["spec"] == GPT2_SPEC
    prefix = "transformer." if gpt2 else "model."
    hf = {k.removeprefix(prefix): v for k, v in hf_state_dict.items() if not k.endswith(_IGNORED)}
    n = arch["num_attention_heads"]
    g = arch["num_query_groups"] or n
    out: dict[str, torch.Tensor] = {}
    if not gpt2:
        out["embedding.word_embeddings.weight"] = _take(hf, "embed_tokens.weight", model)
        for i in range(arch["num_layers"]):
            src, dst = f"layers.{i}.", f"decoder.layers.{i}."
            parts = ("weight", "bias") if arch.get("add_qkv_bias") else ("weight",)
            for part in parts:
                q, k, v = (_take(hf, f"{src}self_attn.{x}_proj.{part}", model) for x in "qkv")
                out[f"{dst}self_attention.linear_qkv.{part}"] = qkv_from_separate(q, k, v, n, g)
            if arch["spec"] == MOE_SPEC:
                out.update(_experts_from_hf(hf, src, dst, arch, model))
            else:
                gate, up = (_take(hf, f"{src}mlp.{x}_proj.weight", model) for x in ("gate", "up"))
                out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
                out[dst + "mlp.linear_fc2.weight"] = _take(hf, src + "mlp.down_proj.weight", model)
            for ours, theirs in _LLAMA_LAYER.items():
                out[dst + ours] = _take(hf, src + theirs, model)
        out["decoder.final_layernorm.weight"] = _take(hf, "norm.weight", model)
        head = hf.pop("lm_head.weight", None)
        if arch["untie_embeddings_and_output_weights"]:
            if head is None:
                raise KeyError(f"the {model} state dict has no 'lm_head.weight' but tie_word_embeddings=False")
            out["output_layer.weight"] = head
    else:
        out["embedding.word_embeddings.weight"] = _take(hf, "wte.weight", model)
        out["embedding.position_embeddings.weight"] = _take(hf, "wpe.weight", model)
        for i in range(arch["num_layers"]):
            src, dst = f"h.{i}.", f"decoder.layers.{i}."
            for part in ("weight", "bias"):
                fused = _take(hf, f"{src}attn.c_attn.{part}", model)
                fused = fused.t() if part == "weight" else fused
                q, k, v = fused.chunk(3, dim=0)
                out[f"{dst}self_attention.linear_qkv.{part}"] = qkv_from_separate(q, k, v, n, g)
            for ours, (theirs, transpose) in _GPT2_LAYER.items():
                t = _take(hf, src + theirs, model)
                out[dst + ours] = t.t() if transpose else t
        out["decoder.final_layernorm.weight"] = _take(hf, "ln_f.weight", model)
        out["decoder.final_layernorm.bias"] = _take(hf, "ln_f.bias", model)
        head = hf.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, out["embedding.word_embeddings.weight"]):
            raise ValueError("the GPT-2 state dict's lm_head.weight differs from wte.weight (untied); the GPT-2 "
                             "spec ties them")
    if hf:
        raise ValueError(f"the {model} state dict has {len(hf)} tensors the conversion does not use, e.g. "
                         f"{sorted(hf)[:4]}: they would change the logits (biases? more layers than num_layers?)")
    return {k: v.contiguous().clone() for k, v in out.items()}


def hf_state_dict_from_gpt(state_dict: Mapping[str, torch.Tensor], arch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict of :func:`hf_class_name`'s class (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
    ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` with transformers 5's fused experts, ``GPT2LMHeadModel``)
    from our FULL state dict; vocabulary rows beyond ``arch["vocab_size"]`` (padding) are dropped."""
    vocab = arch["vocab_size"]
    sd = {k: (v[:vocab] if k in ("embedding.word_embeddings.weight", "output_layer.weight") else v)
          for k, v in state_dict.items()}
    n = arch["num_attention_heads"]
    g = arch["num_query_groups"] or n
    out: dict[str, torch.Tensor] = {}
    if arch["spec"] != GPT2_SPEC:
        out["model.embed_tokens.weight"] = sd["embedding.word_embeddings.weight"]
        for i in range(arch["num_layers"]):
            src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
            parts = ("weight", "bias") if arch.get("add_qkv_bias") else ("weight",)
            for part in parts:
                q, k, v = qkv_to_separate(sd[f"{src}self_attention.linear_qkv.{part}"], n, g)
                out.update({f"{dst}self_attn.q_proj.{part}": q, f"{dst}self_attn.k_proj.{part}": k,
                            f"{dst}self_attn.v_proj.{part}": v})
            if arch["spec"] == MOE_SPEC:
                experts = range(arch["num_moe_experts"])
                out[dst + "mlp.gate.weight"] = sd[src + "mlp.router.weight"]
                out[dst + "mlp.experts.gate_up_proj"] = torch.stack(
                    [sd[f"{src}mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in experts])
                out[dst + "mlp.experts.down_proj"] = torch.stack(
                    [sd[f"{src}mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in experts])
                if arch.get("moe_shared_expert_intermediate_size"):
                    gate, up = sd[src + "mlp.shared_experts.linear_fc1.weight"].chunk(2, dim=0)
                    out.update({dst + "mlp." + _SHARED[0]: gate, dst + "mlp." + _SHARED[1]: up,
                                dst + "mlp." + _SHARED[2]: sd[src + "mlp.shared_experts.linear_fc2.weight"],
                                dst + "mlp.shared_expert_gate.weight": sd[src + "mlp.shared_expert_gate"]})
            else:
                gate, up = sd[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
                out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
                out[dst + "mlp.down_proj.weight"] = sd[src + "mlp.linear_fc2.weight"]
            for ours, theirs in _LLAMA_LAYER.items():
                out[dst + theirs] = sd[src + ours]
        out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
        out["lm_head.weight"] = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
    else:
        out["transformer.wte.weight"] = sd["embedding.word_embeddings.weight"]
        out["transformer.wpe.weight"] = sd["embedding.position_embeddings.weight"]
        for i in range(arch["num_layers"]):
            src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
            for part in ("weight", "bias"):
                q, k, v = qkv_to_separate(sd[f"{src}self_attention.linear_qkv.{part}"], n, g)
                fused = torch.cat([q, k, v], dim=0)
                out[f"{dst}attn.c_attn.{part}"] = fused.t() if part == "weight" else fused
            for ours, (theirs, transpose) in _GPT2_LAYER.items():
                out[dst + theirs] = sd[src + ours].t() if transpose else sd[src + ours]
        out["transformer.ln_f.weight"] = sd["decoder.final_layernorm.weight"]
        out["transformer.ln_f.bias"] = sd["decoder.final_layernorm.bias"]
        out["lm_head.weight"] = sd["embedding.word_embeddings.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def _moe_export_problems(arch: Mapping[str, Any], model_type: str) -> list[str]:
    """What Mixtral / Qwen2-MoE cannot compute of our mixture of experts."""
    bad = []
    if arch.get("moe_router_score_function", "softmax") != "softmax":
        bad.append(f"moe_router_score_function={arch['moe_router_score_function']!r} (Mixtral and Qwen2-MoE route "
                   f"by softmax)")
    if model_type == "qwen2_moe":
        if arch.get("moe_shared_expert_intermediate_size") and not arch.get("moe_shared_expert_gate"):
            bad.append("moe_shared_expert_gate=False (Qwen2-MoE scales its shared expert by a sigmoid gate)")
        if not arch.get("moe_shared_expert_intermediate_size"):
            bad.append(f"add_qkv_bias={bool(arch.get('add_qkv_bias'))}, moe_router_pre_softmax="
                       f"{bool(arch.get('moe_router_pre_softmax'))} without shared experts (Mixtral has neither a qkv "
                       f"bias nor unrenormalised top-k probabilities; Qwen2-MoE always has a shared expert)")
    return bad


def hf_config_from_architecture(arch: Mapping[str, Any]) -> Any:
    """The transformers config (``architectures`` set) of our architecture (``GPTLightningModule``
    arguments): ``LlamaConfig``, ``Qwen2Config`` (a qkv bias), ``MixtralConfig`` / ``Qwen2MoeConfig``
    (``llama_moe_layer_spec``, :func:`hf_model_type`) or ``GPT2Config``; refuses, naming each, what the
    transformers class cannot compute.

    The dropouts the model trained with, when ``arch`` has them (``hidden_dropout``, ``attention_dropout``;
    0.0 otherwise), go where transformers applies them: GPT-2's ``resid_pdrop`` and ``embd_pdrop`` (Megatron
    drops the embeddings' output and each residual branch with ``hidden_dropout``) and ``attn_pdrop``; the
    rotary decoders' ``attention_dropout`` (they have no hidden dropout). They do not change the logits in eval
    mode; nor does ``moe_aux_loss_coeff`` (-> ``router_aux_loss_coef``) when ``arch`` has it."""
    import transformers

    spec, n, h = arch["spec"], arch["num_attention_heads"], arch["hidden_size"]
    g = arch.get("num_query_groups") or n
    ffn = arch.get("ffn_hidden_size") or 4 * h
    kv = arch.get("kv_channels")
    if spec not in (LLAMA_SPEC, GPT2_SPEC, MOE_SPEC):
        raise ValueError(f"spec={spec!r} has no transformers equivalent: export supports {LLAMA_SPEC!r} "
                         f"(LlamaForCausalLM, Qwen2ForCausalLM), {MOE_SPEC!r} (MixtralForCausalLM, "
                         f"Qwen2MoeForCausalLM) and {GPT2_SPEC!r} (GPT2LMHeadModel)")
    model_type = hf_model_type(arch)
    rotary = spec != GPT2_SPEC
    want = (dict(position_embedding_type="rope", activation="silu", add_bias_linear=False, gated_linear_unit=True,
                 rotary_percent=1.0) if rotary else
            dict(position_embedding_type="learned_absolute", add_bias_linear=True, gated_linear_unit=False,
                 untie_embeddings_and_output_weights=False))
    bad = [f"{k}={arch.get(k)!r} (needs {v!r})" for k, v in want.items() if k in arch and arch[k] != v]
    if not rotary:
        if arch.get("activation", "gelu") not in _GPT2_ACT_OUT:
            bad.append(f"activation={arch['activation']!r} (GPT-2 knows {sorted(_GPT2_ACT_OUT)})")
        if g != n:
            bad.append(f"num_query_groups={g} (GPT-2 has one key/value head per query head)")
        if kv not in (None, h // n) or h % n:
            bad.append(f"kv_channels={kv} (GPT-2's heads are hidden_size / num_attention_heads wide)")
    if spec == MOE_SPEC:
        bad += _moe_export_problems(arch, model_type)
    cls = HF_MODEL_TYPES[model_type]
    if bad:
        raise ValueError(f"export to {cls}: {', '.join(bad)}; transformers' {cls} would compute other logits")
    hidden_dropout = float(arch.get("hidden_dropout", 0.0))
    attention_dropout = float(arch.get("attention_dropout", 0.0))
    if not rotary:
        config = transformers.GPT2Config(
            vocab_size=arch["vocab_size"], n_positions=arch["max_sequence_length"], n_embd=h,
            n_layer=arch["num_layers"], n_head=n, n_inner=ffn,
            activation_function=_GPT2_ACT_OUT[arch.get("activation", "gelu")],
            layer_norm_epsilon=arch["layernorm_epsilon"], resid_pdrop=hidden_dropout, embd_pdrop=hidden_dropout,
            attn_pdrop=attention_dropout, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
        config.architectures = [cls]
        return config
    theta = float(arch.get("rotary_base", 10000.0))
    common = dict(vocab_size=arch["vocab_size"], hidden_size=h, num_hidden_layers=arch["num_layers"],
                  num_attention_heads=n, num_key_value_heads=g, head_dim=kv or h // n,
                  max_position_embeddings=arch["max_sequence_length"], rms_norm_eps=arch["layernorm_epsilon"],
                  tie_word_embeddings=not arch.get("untie_embeddings_and_output_weights", True), hidden_act="silu",
                  attention_dropout=attention_dropout)
    moe = dict(num_experts_per_tok=arch.get("moe_router_topk"),
               router_aux_loss_coef=float(arch.get("moe_aux_loss_coeff") or 0.0))
    expert_ffn = arch.get("moe_ffn_hidden_size") or ffn
    if model_type == "llama":
        config = transformers.LlamaConfig(**common, intermediate_size=ffn, rope_theta=theta, attention_bias=False,
                                          mlp_bias=False)
    elif model_type == "qwen2":
        config = transformers.Qwen2Config(**common, intermediate_size=ffn, rope_theta=theta, use_sliding_window=False)
    elif model_type == "mixtral":
        config = transformers.MixtralConfig(**common, **moe, intermediate_size=expert_ffn, rope_theta=theta,
                                            sliding_window=None, num_local_experts=arch["num_moe_experts"])
    else:
        config = transformers.Qwen2MoeConfig(
            **common, **moe, intermediate_size=ffn, moe_intermediate_size=expert_ffn, rope_theta=theta,
            num_experts=arch["num_moe_experts"], norm_topk_prob=not arch.get("moe_router_pre_softmax", False),
            shared_expert_intermediate_size=arch.get("moe_shared_expert_intermediate_size") or 0,
            qkv_bias=bool(arch.get("add_qkv_bias")), decoder_sparse_step=1, mlp_only_layers=[],
            use_sliding_window=False)
    if "rope_parameters" in config.to_dict():  # transformers >= 5 keeps rope_theta there
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    config.architectures = [cls]
    return config


# ---------------------------------------------------------------------- tensor parallelism

_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
           "word_embeddings.weight", "output_layer.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def gpt_tp_layout(*, gated_linear_unit: bool) -> TPLayout:
    """How our GPT's tensors are split over TP ranks: with SwiGLU each rank's ``linear_fc1`` is
    ``[gate_r; up_r]`` (stride 2)."""
    strides = {".linear_fc1.weight": 2, ".linear_fc1.bias": 2} if gated_linear_unit else {}
    return TPLayout(partition_dims={**{k: 0 for k in _COLUMN}, **{k: 1 for k in _ROW}}, strides=strides,
                    vocab_keys=_VOCAB)


def shard_full_state_dict(full: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int, *,
                          gated_linear_unit: bool, num_query_groups: int,
                          make_vocab_size_divisible_by: int = 128) -> dict[str, torch.Tensor]:
    """TP rank ``tp_rank``'s shard of a full state dict: the vocabulary padded to
    ``pad_vocab_size(V, tp_size, make_vocab_size_divisible_by)`` zero rows, column-parallel rows and
    row-parallel columns chunked (``linear_qkv`` in contiguous row blocks: whole query groups, or with
    fewer groups than ranks part of one); with SwiGLU each rank's ``linear_fc1`` is ``[gate_r; up_r]``."""
    if num_query_groups % tp_size and tp_size % num_query_groups:
        # g < t (t a multiple of g) keeps contiguous row shards too: the model all-gathers the qkv activations
        raise ValueError(f"num_query_groups={num_query_groups} and tp_size={tp_size}: one must divide the other")
    vocab = next((full[k].size(0) for k in _VOCAB if k in full), None)
    padded = None if vocab is None else pad_vocab_size(vocab, tp_size, make_vocab_size_divisible_by)
    return shard_state_dict(full, tp_rank, tp_size, gpt_tp_layout(gated_linear_unit=gated_linear_unit),
                            padded_vocab_size=padded)


def merge_tp_shards(shards: list[Mapping[str, torch.Tensor]], *, gated_linear_unit: bool,
                    vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Inverse of :func:`shard_full_state_dict` (rank order); ``vocab_size`` drops the padding rows."""
    return generic_merge(shards, gpt_tp_layout(gated_linear_unit=gated_linear_unit), vocab_size=vocab_size)
