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

The architecture these functions take (``arch``: our module arguments, read from a transformers config) and the
transformers config of ours: :mod:`lightning_megatron.models.gpt.hf_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_megatron.interop.tp import TPLayout, shard_state_dict
from lightning_megatron.interop.tp import merge_tp_shards as generic_merge
from lightning_megatron.models.gpt.hf_config import GPT2_SPEC, MODEL_NAMES, MOE_SPEC, hf_model_type
from lightning_megatron.tensor_parallel import pad_vocab_size

__all__ = ["gpt_state_dict_from_hf", "hf_state_dict_from_gpt", "qkv_from_separate", "qkv_to_separate",
           "gpt_tp_layout", "shard_full_state_dict", "merge_tp_shards"]


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
    dict and the architecture :func:`~lightning_megatron.models.gpt.hf_config.hf_architecture` read from its
    config. A tensor the conversion does not use (a bias, a layer beyond ``num_layers``) is refused by name: it
    would change the logits."""
    model = MODEL_NAMES[hf_model_type(arch)]
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
            if arch.get("qk_layernorm"):  # Qwen3's norms of each head's queries and keys
                for x in "qk":
                    norm = _take(hf, f"{src}self_attn.{x}_norm.weight", model)
                    out[f"{dst}self_attention.{x}_layernorm.weight"] = norm
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
    """The state dict of :func:`~lightning_megatron.models.gpt.hf_config.hf_class_name`'s class
    (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` with
    transformers 5's fused experts, ``GPT2LMHeadModel``) from our FULL state dict; vocabulary rows beyond
    ``arch["vocab_size"]`` (padding) are dropped."""
    vocab = arch["vocab_size"]
    sd = {k: (v[:vocab] if k in ("embedding.word_embeddings.weight", "output_layer.weight") else v)
          for k, v in state_dict.items()}
    n = arch["num_attention_heads"]
    g = arch["num_query_groups"] or n
    out: dict[str, torch.Tensor] = {}
    qwen_moe = hf_model_type(arch) == "qwen2_moe"
    if arch["spec"] != GPT2_SPEC:
        out["model.embed_tokens.weight"] = sd["embedding.word_embeddings.weight"]
        for i in range(arch["num_layers"]):
            src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
            parts = ("weight", "bias") if arch.get("add_qkv_bias") else ("weight",)
            for part in parts:
                q, k, v = qkv_to_separate(sd[f"{src}self_attention.linear_qkv.{part}"], n, g)
                out.update({f"{dst}self_attn.q_proj.{part}": q, f"{dst}self_attn.k_proj.{part}": k,
                            f"{dst}self_attn.v_proj.{part}": v})
            if arch.get("qk_layernorm"):
                for x in "qk":
                    out[f"{dst}self_attn.{x}_norm.weight"] = sd[f"{src}self_attention.{x}_layernorm.weight"]
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
                elif qwen_moe:  # Qwen2-MoE without shared experts: its empty one (width 0), the gate of nothing
                    router = sd[src + "mlp.router.weight"]
                    h = router.size(1)
                    out.update({dst + "mlp." + _SHARED[0]: router.new_zeros(0, h),
                                dst + "mlp." + _SHARED[1]: router.new_zeros(0, h),
                                dst + "mlp." + _SHARED[2]: router.new_zeros(h, 0),
                                dst + "mlp.shared_expert_gate.weight": router.new_zeros(1, h)})
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
