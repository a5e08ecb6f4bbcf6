"""Hugging Face ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` <-> our GPT state dict (megatron-core names).

Everything here works on FULL state dicts: ours is the TP=1 state dict under megatron-core GPTModel
names with global layer numbers and the real (unpadded) vocabulary, the form a lightning_megatron
checkpoint stores and ``init_from`` slices. Conversion only moves, transposes and concatenates
tensors, so HF -> ours -> HF is bit-exact.

Our layouts (the decoder-family contract):

- ``self_attention.linear_qkv.weight`` ``[(n + 2 g) d, h]``: rows grouped per query group, for each
  group its ``n / g`` query heads, then its key head, then its value head (megatron-core);
- ``mlp.linear_fc1.weight`` (SwiGLU) ``[2 f, h]`` = ``[gate; up]`` at TP=1; on TP rank ``r`` of ``t``
  the local rows are ``[gate_r; up_r]`` (:func:`shard_full_state_dict` / :func:`merge_tp_shards`);
- GPT-2's ``Conv1D`` weights are ``[in, out]``: transposed to our ``[out, in]``.

:func:`llama_architecture` / :func:`gpt2_architecture` read a transformers config into the module
arguments our model needs (:data:`GPT_ARCHITECTURE_KEYS`) and refuse, by name, every setting our model
cannot reproduce (rope scaling, biases in Llama, a head size other than hidden / heads, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_megatron.interop.tp import TPLayout, shard_state_dict
from lightning_megatron.interop.tp import merge_tp_shards as generic_merge
from lightning_megatron.tensor_parallel import pad_vocab_size

__all__ = ["GPT_ARCHITECTURE_KEYS", "LLAMA_SPEC", "GPT2_SPEC", "llama_architecture", "gpt2_architecture",
           "hf_architecture", "gpt_state_dict_from_hf", "hf_state_dict_from_gpt", "hf_config_from_architecture",
           "qkv_from_separate", "qkv_to_separate", "gpt_tp_layout", "shard_full_state_dict", "merge_tp_shards"]

LLAMA_SPEC = "llama_layer_spec"
"""The registered layer spec of the Llama shape (RMSNorm, rotary, SwiGLU, GQA, no biases)."""
GPT2_SPEC = "gpt_layer_spec"
"""The registered layer spec of the GPT-2 shape (LayerNorm, learned positions, GELU, biases, tied)."""

GPT_ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                         "kv_channels", "spec", "activation", "layernorm_epsilon", "max_sequence_length", "vocab_size",
                         "position_embedding_type", "add_bias_linear", "gated_linear_unit", "rotary_base",
                         "rotary_percent", "untie_embeddings_and_output_weights")
"""``GPTLightningModule`` arguments a source fixes (the architecture dicts below use exactly these)."""

_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_GPT2_ACT_OUT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


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


def llama_architecture(hf_config: Any) -> dict[str, Any]:
    """Our module arguments for a ``transformers.LlamaConfig``; refuses what our Llama spec cannot compute."""
    cfg = hf_config.to_dict()
    if cfg.get("model_type") != "llama":
        raise ValueError(f"model_type={cfg.get('model_type')!r} is not 'llama'")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    theta, rope_type, scaling = _rope(cfg)
    bad = []
    if rope_type != "default" or scaling:
        bad.append(f"rope scaling (rope_type={rope_type!r}, {scaling!r})")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            bad.append(f"{key}=True")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        bad.append(f"hidden_act={cfg.get('hidden_act')!r} (the Llama spec's SwiGLU uses silu)")
    head_dim = cfg.get("head_dim")
    kv_channels = head_dim if head_dim is not None and head_dim * heads != hidden else None
    if (cfg.get("pretraining_tp") or 1) != 1:
        bad.append(f"pretraining_tp={cfg['pretraining_tp']}")
    if heads % groups:
        bad.append(f"num_key_value_heads={groups} not dividing num_attention_heads={heads}")
    for key in ("sliding_window", "partial_rotary_factor", "qk_norm", "use_sliding_window"):
        if cfg.get(key) not in (None, False, 1.0):
            bad.append(f"{key}={cfg[key]!r}")
    _refuse("Llama", bad)
    return dict(num_layers=cfg["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
                num_query_groups=groups, ffn_hidden_size=cfg["intermediate_size"], kv_channels=kv_channels,
                spec=LLAMA_SPEC, activation="silu", layernorm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
                max_sequence_length=cfg.get("max_position_embeddings", 2048), vocab_size=cfg["vocab_size"],
                position_embedding_type="rope", add_bias_linear=False, gated_linear_unit=True, rotary_base=theta,
                rotary_percent=1.0, untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False))


def gpt2_architecture(hf_config: Any) -> dict[str, Any]:
    """Our module arguments for a ``transformers.GPT2Config``; refuses what our GPT-2 spec cannot compute."""
    cfg = hf_config.to_dict()
    if cfg.get("model_type") != "gpt2":
        raise ValueError(f"model_type={cfg.get('model_type')!r} is not 'gpt2'")
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
                untie_embeddings_and_output_weights=False)


def hf_architecture(hf_config: Any) -> dict[str, Any]:
    """:func:`llama_architecture` or :func:`gpt2_architecture`, by ``model_type``."""
    model_type = hf_config.model_type
    if model_type == "llama":
        return llama_architecture(hf_config)
    if model_type == "gpt2":
        return gpt2_architecture(hf_config)
    raise ValueError(f"model_type={model_type!r}: the GPT family converts 'llama' (LlamaForCausalLM) and 'gpt2' "
                     f"(GPT2LMHeadModel)")


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


_LLAMA_LAYER = {  # ours -> theirs, inside decoder.layers.<i>. / model.layers.<i>.
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
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


def _take(hf: dict[str, torch.Tensor], key: str, model: str) -> torch.Tensor:
    if key not in hf:
        raise KeyError(f"the {model} state dict has no {key!r}")
    return hf.pop(key)


def gpt_state_dict_from_hf(hf_state_dict: Mapping[str, torch.Tensor],
                           arch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Our full TP=1 state dict (unpadded vocabulary) from a Llama / GPT-2 state dict and the
    architecture :func:`hf_architecture` read from its config. A tensor the conversion does not use
    (a bias, a layer beyond ``num_layers``) is refused by name: it would change the logits."""
    llama = arch["spec"] == LLAMA_SPEC
    model = "Llama" if llama else "GPT-2"
    prefix = "model." if llama else "transformer."
    hf = {k.removeprefix(prefix): v for k, v in hf_state_dict.items() if not k.endswith(_IGNORED)}
    n = arch["num_attention_heads"]
    g = arch["num_query_groups"] or n
    out: dict[str, torch.Tensor] = {}
    if llama:
        out["embedding.word_embeddings.weight"] = _take(hf, "embed_tokens.weight", model)
        for i in range(arch["num_layers"]):
            src, dst = f"layers.{i}.", f"decoder.layers.{i}."
            q, k, v = (_take(hf, f"{src}self_attn.{x}_proj.weight", model) for x in "qkv")
            out[dst + "self_attention.linear_qkv.weight"] = qkv_from_separate(q, k, v, n, g)
            gate, up = (_take(hf, f"{src}mlp.{x}_proj.weight", model) for x in ("gate", "up"))
            out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
            for ours, theirs in _LLAMA_LAYER.items():
                out[dst + ours] = _take(hf, src + theirs, model)
        out["decoder.final_layernorm.weight"] = _take(hf, "norm.weight", model)
        head = hf.pop("lm_head.weight", None)
        if arch["untie_embeddings_and_output_weights"]:
            if head is None:
                raise KeyError("the Llama state dict has no 'lm_head.weight' but tie_word_embeddings=False")
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
    """A ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` state dict from our FULL state dict; vocabulary rows
    beyond ``arch["vocab_size"]`` (padding) are dropped."""
    vocab = arch["vocab_size"]
    sd = {k: (v[:vocab] if k in ("embedding.word_embeddings.weight", "output_layer.weight") else v)
          for k, v in state_dict.items()}
    n = arch["num_attention_heads"]
    g = arch["num_query_groups"] or n
    out: dict[str, torch.Tensor] = {}
    if arch["spec"] == LLAMA_SPEC:
        out["model.embed_tokens.weight"] = sd["embedding.word_embeddings.weight"]
        for i in range(arch["num_layers"]):
            src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
            q, k, v = qkv_to_separate(sd[src + "self_attention.linear_qkv.weight"], n, g)
            out.update({f"{dst}self_attn.q_proj.weight": q, f"{dst}self_attn.k_proj.weight": k,
                        f"{dst}self_attn.v_proj.weight": v})
            gate, up = sd[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
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


def hf_config_from_architecture(arch: Mapping[str, Any]) -> Any:
    """The transformers ``LlamaConfig`` / ``GPT2Config`` (``architectures`` set) of our architecture
    (``GPTLightningModule`` arguments); refuses, naming each, what the transformers class cannot compute.

    The dropouts the model trained with, when ``arch`` has them (``hidden_dropout``, ``attention_dropout``;
    0.0 otherwise), go where transformers applies them: GPT-2's ``resid_pdrop`` and ``embd_pdrop`` (Megatron
    drops the embeddings' output and each residual branch with ``hidden_dropout``) and ``attn_pdrop``; Llama's
    ``attention_dropout`` (``LlamaConfig`` has no hidden dropout). They do not change the logits in eval mode."""
    import transformers

    spec, n, h = arch["spec"], arch["num_attention_heads"], arch["hidden_size"]
    g = arch.get("num_query_groups") or n
    ffn = arch.get("ffn_hidden_size") or 4 * h
    kv = arch.get("kv_channels")
    llama = spec == LLAMA_SPEC
    if not llama and spec != GPT2_SPEC:
        raise ValueError(f"spec={spec!r} has no transformers equivalent: export supports {LLAMA_SPEC!r} "
                         f"(LlamaForCausalLM) and {GPT2_SPEC!r} (GPT2LMHeadModel)")
    want = (dict(position_embedding_type="rope", activation="silu", add_bias_linear=False, gated_linear_unit=True,
                 rotary_percent=1.0) if llama else
            dict(position_embedding_type="learned_absolute", add_bias_linear=True, gated_linear_unit=False,
                 untie_embeddings_and_output_weights=False))
    bad = [f"{k}={arch.get(k)!r} (needs {v!r})" for k, v in want.items() if k in arch and arch[k] != v]
    if not llama:
        if arch.get("activation", "gelu") not in _GPT2_ACT_OUT:
            bad.append(f"activation={arch['activation']!r} (GPT-2 knows {sorted(_GPT2_ACT_OUT)})")
        if g != n:
            bad.append(f"num_query_groups={g} (GPT-2 has one key/value head per query head)")
        if kv not in (None, h // n) or h % n:
            bad.append(f"kv_channels={kv} (GPT-2's heads are hidden_size / num_attention_heads wide)")
    if bad:
        cls = "LlamaForCausalLM" if llama else "GPT2LMHeadModel"
        raise ValueError(f"export to {cls}: {', '.join(bad)}; transformers' {cls} would compute other logits")
    hidden_dropout = float(arch.get("hidden_dropout", 0.0))
    attention_dropout = float(arch.get("attention_dropout", 0.0))
    if llama:
        theta = float(arch.get("rotary_base", 10000.0))
        config = transformers.LlamaConfig(
            vocab_size=arch["vocab_size"], hidden_size=h, intermediate_size=ffn, num_hidden_layers=arch["num_layers"],
            num_attention_heads=n, num_key_value_heads=g, head_dim=kv or h // n,
            max_position_embeddings=arch["max_sequence_length"], rms_norm_eps=arch["layernorm_epsilon"],
            tie_word_embeddings=not arch.get("untie_embeddings_and_output_weights", True), hidden_act="silu",
            rope_theta=theta, attention_bias=False, mlp_bias=False, attention_dropout=attention_dropout)
        if "rope_parameters" in config.to_dict():  # transformers >= 5 keeps rope_theta there
            config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
        config.architectures = ["LlamaForCausalLM"]
        return config
    config = transformers.GPT2Config(
        vocab_size=arch["vocab_size"], n_positions=arch["max_sequence_length"], n_embd=h, n_layer=arch["num_layers"],
        n_head=n, n_inner=ffn, activation_function=_GPT2_ACT_OUT[arch.get("activation", "gelu")],
        layer_norm_epsilon=arch["layernorm_epsilon"], resid_pdrop=hidden_dropout, embd_pdrop=hidden_dropout,
        attn_pdrop=attention_dropout,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    config.architectures = ["GPT2LMHeadModel"]
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
