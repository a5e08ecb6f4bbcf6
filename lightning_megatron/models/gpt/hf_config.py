"""Hugging Face configs <-> our GPT module arguments: the architecture of ``LlamaForCausalLM`` /
``MistralForCausalLM`` (read only: the Llama shape, written as Llama) / ``Qwen2ForCausalLM`` /
``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` / ``GPT2LMHeadModel``.

:func:`hf_architecture` reads a transformers config into the module arguments our model needs
(:data:`GPT_ARCHITECTURE_KEYS`) and refuses, by name, every setting our model cannot reproduce (rope scaling,
biases in Llama, a head size other than hidden / heads, Qwen2-MoE's dense layers between MoE layers, ...);
:func:`hf_config_from_architecture` writes the transformers config of our architecture, refusing what the
transformers class cannot compute. The weights: :mod:`lightning_megatron.models.gpt.hf`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from lightning_megatron.transformer.rotary import (LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR,
                                                   LLAMA3_ORIGINAL_LENGTH)

__all__ = ["GPT_ARCHITECTURE_KEYS", "LLAMA_SPEC", "GPT2_SPEC", "MOE_SPEC", "HF_MODEL_TYPES", "MODEL_NAMES",
           "llama_architecture", "mistral_architecture", "qwen2_architecture", "mixtral_architecture",
           "qwen2_moe_architecture", "qwen3_architecture", "qwen3_moe_architecture", "gpt2_architecture",
           "hf_architecture", "hf_model_type", "hf_class_name", "hf_config_from_architecture"]

LLAMA_SPEC = "llama_layer_spec"
"""The registered layer spec of the Llama shape (RMSNorm, rotary, SwiGLU, GQA, no biases; Qwen2 adds a qkv bias)."""
GPT2_SPEC = "gpt_layer_spec"
"""The registered layer spec of the GPT-2 shape (LayerNorm, learned positions, GELU, biases, tied)."""
MOE_SPEC = "llama_moe_layer_spec"
"""The registered layer spec of the Mixtral / Qwen2-MoE shape (the Llama layer, a mixture of experts as its MLP)."""

GPT_ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                         "kv_channels", "spec", "activation", "layernorm_epsilon", "max_sequence_length", "vocab_size",
                         "position_embedding_type", "add_bias_linear", "gated_linear_unit", "rotary_base",
                         "rotary_percent", "rope_scaling", "rope_scaling_factor", "untie_embeddings_and_output_weights",
                         "add_qkv_bias", "num_moe_experts", "moe_router_topk", "moe_router_score_function",
                         "moe_router_pre_softmax", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                         "moe_shared_expert_gate", "qk_layernorm", "moe_router_dtype")
"""``GPTLightningModule`` arguments a source fixes (the architecture dicts below use these; they also carry the
training settings a source suggests but does not fix: ``hidden_dropout`` and ``attention_dropout``, and a mixture of
experts' ``moe_aux_loss_coeff``)."""

HF_MODEL_TYPES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "qwen2": "Qwen2ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
"""transformers ``model_type`` -> the causal-LM class the decoder family reads and (but Mistral's, the Llama shape
under Llama's names, written as ``LlamaForCausalLM``) writes."""

_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_GPT2_ACT_OUT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
MODEL_NAMES = {"llama": "Llama", "gpt2": "GPT-2", "qwen2": "Qwen2", "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE",
               "mistral": "Mistral", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE"}
"""transformers ``model_type`` -> the name our messages give the family."""


def _refuse(model: str, bad: list[str]) -> None:
    if bad:
        raise ValueError(f"the {model} config has {', '.join(bad)}: our GPT model has no equivalent, so its logits "
                         f"would differ; convert a model without these settings (or as a setting above says)")


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
    factor = _llama3_factor(rope_type, scaling or {}, bad)
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        bad.append(f"hidden_act={cfg.get('hidden_act')!r} (the Llama spec's SwiGLU uses silu)")
    # (pretraining_tp, Meta's matmuls computed in slices summed again, is the same model: read as one matmul)
    head_dim = cfg.get("head_dim")
    kv_channels = head_dim if head_dim is not None and head_dim * heads != hidden else None
    if heads % groups:
        bad.append(f"num_key_value_heads={groups} not dividing num_attention_heads={heads}")
    # Llama and Mixtral slide whenever sliding_window is set; Qwen2 / Qwen2-MoE keep a sliding_window they use
    # only in the layer_types "sliding_attention" layers (use_sliding_window, when they have no layer_types).
    if cfg.get("model_type") in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        window_keys: tuple[str, ...] = () if "layer_types" in cfg else ("use_sliding_window",)
    else:
        window_keys = ("sliding_window", "use_sliding_window")
    for key in (*window_keys, "partial_rotary_factor", "qk_norm"):
        if key == "sliding_window" and cfg.get(key) is not None:
            window = cfg[key]
            bad.append(f"sliding_window={window!r} (each token attends to the last {window} only; ours attends to "
                       f"every earlier token: the same up to {window} tokens; if no sequence is ever longer, set "
                       f"\"sliding_window\": null in config.json)")
        elif cfg.get(key) not in (None, False, 1.0):
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
                add_qkv_bias=False, rope_scaling=factor is not None, rope_scaling_factor=factor or 8.0,
                qk_layernorm=False, hidden_dropout=0.0,  # no hidden dropout in these decoders
                attention_dropout=float(cfg.get("attention_dropout") or 0.0))


def _llama3_factor(rope_type: str, scaling: dict[str, Any], bad: list[str]) -> float | None:
    """The factor of Llama 3.1's frequency scaling (``rope_type: llama3``) with Meta's other constants, which our
    rope (as megatron-core's) fixes; None without scaling. Any other scaling appended to ``bad``."""
    if rope_type == "default" and not scaling:
        return None
    if rope_type != "llama3":
        bad.append(f"rope scaling (rope_type={rope_type!r}, {scaling!r})")
        return None
    fixed = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
             "original_max_position_embeddings": LLAMA3_ORIGINAL_LENGTH}
    bad += [f"rope scaling {key}={scaling[key]!r} (Llama 3.1's is {want!r})" for key, want in fixed.items()
            if key in scaling and float(scaling[key]) != float(want)]
    return float(scaling.get("factor", 8.0))


def _rope_out(theta: float, arch: dict[str, Any]) -> dict[str, Any]:
    """transformers' rope parameters of our arguments: the base, and Llama 3.1's scaling when ``rope_scaling``."""
    if not arch.get("rope_scaling"):
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "llama3", "rope_theta": theta, "factor": float(arch.get("rope_scaling_factor", 8.0)),
            "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": LLAMA3_ORIGINAL_LENGTH}


def llama_architecture(hf_config: Any) -> dict[str, Any]:
    """Our module arguments for a ``transformers.LlamaConfig``; refuses what our Llama spec cannot compute."""
    cfg = _config_dict(hf_config, "llama")
    bad = [f"{key}=True" for key in ("attention_bias", "mlp_bias") if cfg.get(key)]
    arch = _rotary_decoder(cfg, bad)
    _refuse("Llama", bad)
    return arch


def mistral_architecture(hf_config: Any) -> dict[str, Any]:
    """Our module arguments for a ``transformers.MistralConfig``: the Llama shape (Mistral 7B v0.2 / v0.3,
    Mistral-Nemo's ``head_dim``) under Llama's tensor names; refuses a sliding window (Mistral 7B v0.1's)."""
    cfg = _config_dict(hf_config, "mistral")
    bad: list[str] = []
    arch = _rotary_decoder(cfg, bad)
    _refuse("Mistral", bad)
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
    arch, experts, topk = _qwen_moe(cfg, bad)
    _refuse("Qwen2-MoE", bad)
    shared = cfg.get("shared_expert_intermediate_size") or None  # 0: an empty shared expert, adding nothing
    return {**arch, "add_qkv_bias": bool(cfg.get("qkv_bias", True)),
            **_moe(experts, topk, cfg["moe_intermediate_size"], pre_softmax=not cfg.get("norm_topk_prob", False),
                   shared=shared, aux=float(cfg.get("router_aux_loss_coef") or 0.0))}


def qwen3_architecture(hf_config: Any) -> dict[str, Any]:
    """Our module arguments for a ``transformers.Qwen3Config``: the Llama shape with RMSNorms of each head's
    queries and keys (``qk_layernorm``), no biases; refuses ``attention_bias`` (biases on q, k, v and o) and
    sliding-window attention."""
    cfg = _config_dict(hf_config, "qwen3")
    bad = ["attention_bias=True (biases on q, k, v and o)"] if cfg.get("attention_bias") else []
    arch = _rotary_decoder(cfg, bad)
    _refuse("Qwen3", bad)
    return {**arch, "qk_layernorm": True}


def qwen3_moe_architecture(hf_config: Any) -> dict[str, Any]:
    """Our module arguments for a ``transformers.Qwen3MoeConfig``: Qwen3's attention (``qk_layernorm``) and
    Qwen2-MoE's experts without a shared one (``norm_topk_prob`` -> ``moe_router_pre_softmax = not
    norm_topk_prob``); refused as Qwen3's and Qwen2-MoE's are."""
    cfg = _config_dict(hf_config, "qwen3_moe")
    bad = ["attention_bias=True (biases on q, k, v and o)"] if cfg.get("attention_bias") else []
    arch, experts, topk = _qwen_moe(cfg, bad)
    _refuse("Qwen3-MoE", bad)
    return {**arch, "qk_layernorm": True,
            **_moe(experts, topk, cfg["moe_intermediate_size"], pre_softmax=not cfg.get("norm_topk_prob", False),
                   shared=None, aux=float(cfg.get("router_aux_loss_coef") or 0.0))}


def _qwen_moe(cfg: dict[str, Any], bad: list[str]) -> tuple[dict[str, Any], int, int]:
    """The rotary decoder's arguments, the experts and the top-k of a Qwen MoE config (``num_experts``;
    transformers 5's Qwen3-MoE ``num_local_experts``); dense layers among the MoE ones appended to ``bad``."""
    arch = _rotary_decoder(cfg, bad)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    topk = cfg.get("num_experts_per_tok") or 0
    if experts < 1:
        bad.append(f"num_experts={experts} (every layer dense)")
    elif not 1 <= topk <= experts:
        bad.append(f"num_experts_per_tok={topk} with num_experts={experts}")
    if (cfg.get("decoder_sparse_step") or 1) != 1:
        bad.append(f"decoder_sparse_step={cfg['decoder_sparse_step']} (dense MLP layers between the MoE layers; "
                   f"every layer of llama_moe_layer_spec is a mixture of experts)")
    dense = [i for i in cfg.get("mlp_only_layers") or () if i < cfg["num_hidden_layers"]]  # past the last: none
    if dense:
        bad.append(f"mlp_only_layers={dense} (dense MLP layers among the MoE layers)")
    return arch, experts, topk


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
                untie_embeddings_and_output_weights=False, add_qkv_bias=False,
                qk_layernorm=False, hidden_dropout=float(cfg.get("resid_pdrop", 0.1)),  # (embd_pdrop: export's too)
                attention_dropout=float(cfg.get("attn_pdrop", 0.1)))


_ARCHITECTURES = {"llama": llama_architecture, "mistral": mistral_architecture, "qwen2": qwen2_architecture,
                  "mixtral": mixtral_architecture, "qwen2_moe": qwen2_moe_architecture, "gpt2": gpt2_architecture,
                  "qwen3": qwen3_architecture, "qwen3_moe": qwen3_moe_architecture}


def hf_architecture(hf_config: Any) -> dict[str, Any]:
    """Our module arguments for a transformers config of one of :data:`HF_MODEL_TYPES`, by ``model_type``."""
    model_type = hf_config.model_type
    if model_type not in _ARCHITECTURES:
        known = ", ".join(f"{t!r} ({c})" for t, c in HF_MODEL_TYPES.items())
        raise ValueError(f"model_type={model_type!r}: the GPT family converts {known}")
    return _ARCHITECTURES[model_type](hf_config)


def hf_model_type(arch: Mapping[str, Any]) -> str:
    """The transformers ``model_type`` whose names and class fit our architecture (no refusal here: see
    :func:`hf_config_from_architecture`): GPT-2 for ``gpt_layer_spec``; Qwen2 for the Llama spec with a qkv
    bias, else Llama; for ``llama_moe_layer_spec`` Qwen2-MoE when the model has what only Qwen2-MoE has (shared
    experts, a qkv bias, the top-k probabilities not renormalised; without shared experts, an empty one:
    ``shared_expert_intermediate_size`` 0), else Mixtral; with norms of the queries and keys (``qk_layernorm``)
    Qwen3 and Qwen3-MoE."""
    spec = arch["spec"]
    if spec == GPT2_SPEC:
        return "gpt2"
    if arch.get("qk_layernorm"):  # norms of the queries and keys: Qwen3's
        return "qwen3_moe" if spec == MOE_SPEC else "qwen3"
    if spec == MOE_SPEC:
        qwen = (arch.get("moe_shared_expert_intermediate_size") or arch.get("add_qkv_bias")
                or arch.get("moe_router_pre_softmax"))
        return "qwen2_moe" if qwen else "mixtral"
    return "qwen2" if arch.get("add_qkv_bias") else "llama"


def hf_class_name(arch: Mapping[str, Any]) -> str:
    """The transformers class of :func:`hf_model_type`."""
    return HF_MODEL_TYPES[hf_model_type(arch)]


def _moe_export_problems(arch: Mapping[str, Any], model_type: str) -> list[str]:
    """What Mixtral / Qwen2-MoE / Qwen3-MoE cannot compute of our mixture of experts."""
    bad = []
    if arch.get("moe_router_score_function", "softmax") != "softmax":
        bad.append(f"moe_router_score_function={arch['moe_router_score_function']!r} (Mixtral and Qwen2-MoE route "
                   f"by softmax)")
    if model_type == "qwen2_moe":
        if arch.get("moe_shared_expert_intermediate_size") and not arch.get("moe_shared_expert_gate"):
            bad.append("moe_shared_expert_gate=False (Qwen2-MoE scales its shared expert by a sigmoid gate)")
    if model_type == "qwen3_moe" and arch.get("moe_shared_expert_intermediate_size"):
        bad.append("qk_layernorm=True with shared experts (Qwen3-MoE, the class with norms of queries and keys, has "
                   "no shared expert)")
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
    from lightning_megatron.interop.hf_folder import import_transformers

    transformers = import_transformers("a transformers config")

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
        if arch.get("qk_layernorm"):
            bad.append("qk_layernorm=True (GPT-2 has no norms of queries and keys)")
    elif arch.get("qk_layernorm") and arch.get("add_qkv_bias"):
        bad.append("qk_layernorm=True with add_qkv_bias=True (Qwen3's attention_bias puts biases on q, k, v and o)")
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
    elif model_type == "qwen3":
        config = transformers.Qwen3Config(**common, intermediate_size=ffn, rope_theta=theta, attention_bias=False,
                                          use_sliding_window=False)
    elif model_type == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common, **moe, intermediate_size=ffn, moe_intermediate_size=expert_ffn, rope_theta=theta,
            num_experts=arch["num_moe_experts"], norm_topk_prob=not arch.get("moe_router_pre_softmax", False),
            attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    else:
        config = transformers.Qwen2MoeConfig(
            **common, **moe, intermediate_size=ffn, moe_intermediate_size=expert_ffn, rope_theta=theta,
            num_experts=arch["num_moe_experts"], norm_topk_prob=not arch.get("moe_router_pre_softmax", False),
            shared_expert_intermediate_size=arch.get("moe_shared_expert_intermediate_size") or 0,
            qkv_bias=bool(arch.get("add_qkv_bias")), decoder_sparse_step=1, mlp_only_layers=[],
            use_sliding_window=False)
    rope = _rope_out(theta, arch)
    if "rope_parameters" in config.to_dict():  # transformers >= 5 keeps rope_theta there
        config.rope_parameters = rope
    elif rope["rope_type"] != "default":  # transformers 4: rope_scaling beside rope_theta
        config.rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    config.architectures = [cls]
    return config
