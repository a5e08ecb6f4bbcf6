"""Hugging Face ``transformers`` BERT / MegatronBERT <-> our BertModel, at any TP size.

Two architectures convert: post-norm BERT (``BertForPreTraining``, our ``bert_layer_post_norm_spec``)
and Megatron's pre-norm BERT (``MegatronBertForPreTraining``, our default ``bert_layer_local_spec``
with LayerNorm: a norm before attention and before the MLP, a final norm, none on the embeddings).
The functions below detect MegatronBERT state dicts by their ``attention.ln`` keys and take
``megatron=True`` for export.

Import (:func:`bert_state_dict_from_hf`) takes a ``BertForPreTraining`` or ``BertModel`` state dict
and returns THIS rank's shard of our state dict, for a model built with
``spec="bert_layer_post_norm_spec"`` and the config from :func:`bert_config_from_hf`:

- q, k, v ([n d, h] each) are interleaved head-major into ``linear_qkv`` ([3 n d, h], rows
  [head 0: q k v | head 1: q k v | ...]), so the contiguous 1/t row slice a rank keeps holds whole heads;
- column-parallel weights (qkv, fc1, word embeddings, output layer, vocab bias) keep a row slice,
  row-parallel weights (attention output, fc2) a column slice, everything else is replicated;
- the vocabulary is padded with zero rows to ``pad_vocab_size(V, t)`` (the loss ignores the padding).

Export (:func:`hf_state_dict_from_bert`) takes a FULL state dict (TP=1, or shards merged by
:func:`merge_tp_state_dicts` / gathered by :func:`lightning_megatron.interop.tp.gather_full_state_dict`),
drops the vocab padding, splits qkv back, and names keys so ``transformers`` loads it with no missing or
unexpected keys. Conversion only moves and slices tensors, so export then import is bit-exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from lightning_megatron.interop.tp import TPLayout, merge_tp_shards, shard_tensor
from lightning_megatron.tensor_parallel import pad_vocab_size
from lightning_megatron.transformer import TransformerConfig

__all__ = [
    "bert_config_from_hf",
    "bert_model_kwargs_from_hf",
    "bert_state_dict_from_hf",
    "bert_state_dict_and_unread_from_hf",
    "hf_state_dict_from_bert",
    "merge_tp_state_dicts",
    "BERT_TP_LAYOUT",
    "HF_BERT_SPEC",
    "HF_MEGATRON_BERT_SPEC",
    "is_megatron_bert_state_dict",
]

HF_BERT_SPEC = "bert_layer_post_norm_spec"
"""The registered spec whose layers match Hugging Face BERT (post-norm LayerNorm)."""

HF_MEGATRON_BERT_SPEC = "bert_layer_local_spec"
"""The registered spec whose layers match transformers' MegatronBERT (pre-norm, final norm)."""

_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                   "relu": "relu", "silu": "silu", "swish": "silu"}

# Our per-layer names -> Hugging Face's, inside encoder.layers.<i>. / encoder.layer.<i>.
_LAYER_KEYS = {
    "self_attention.linear_proj.weight": "attention.output.dense.weight",
    "self_attention.linear_proj.bias": "attention.output.dense.bias",
    "post_self_attn_layernorm.weight": "attention.output.LayerNorm.weight",
    "post_self_attn_layernorm.bias": "attention.output.LayerNorm.bias",
    "mlp.linear_fc1.weight": "intermediate.dense.weight",
    "mlp.linear_fc1.bias": "intermediate.dense.bias",
    "mlp.linear_fc2.weight": "output.dense.weight",
    "mlp.linear_fc2.bias": "output.dense.bias",
    "post_mlp_layernorm.weight": "output.LayerNorm.weight",
    "post_mlp_layernorm.bias": "output.LayerNorm.bias",
}
# MegatronBERT (pre-norm): the same attention / MLP linears, norms before each branch.
_MEGATRON_LAYER_KEYS = {
    "input_layernorm.weight": "attention.ln.weight",
    "input_layernorm.bias": "attention.ln.bias",
    "self_attention.linear_proj.weight": "attention.output.dense.weight",
    "self_attention.linear_proj.bias": "attention.output.dense.bias",
    "pre_mlp_layernorm.weight": "ln.weight",
    "pre_mlp_layernorm.bias": "ln.bias",
    "mlp.linear_fc1.weight": "intermediate.dense.weight",
    "mlp.linear_fc1.bias": "intermediate.dense.bias",
    "mlp.linear_fc2.weight": "output.dense.weight",
    "mlp.linear_fc2.bias": "output.dense.bias",
}
_MEGATRON_FINAL_KEYS = {"encoder.final_layernorm.weight": "encoder.ln.weight",
                        "encoder.final_layernorm.bias": "encoder.ln.bias"}
_EMBEDDING_KEYS = {
    "embedding.word_embeddings.weight": "embeddings.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embeddings.position_embeddings.weight",
    "embedding.tokentype_embeddings.weight": "embeddings.token_type_embeddings.weight",
    "embedding.layernorm.weight": "embeddings.LayerNorm.weight",
    "embedding.layernorm.bias": "embeddings.LayerNorm.bias",
}
_HEAD_KEYS = {  # Hugging Face names relative to the BertForPreTraining root
    "lm_head.dense.weight": "cls.predictions.transform.dense.weight",
    "lm_head.dense.bias": "cls.predictions.transform.dense.bias",
    "lm_head.layer_norm.weight": "cls.predictions.transform.LayerNorm.weight",
    "lm_head.layer_norm.bias": "cls.predictions.transform.LayerNorm.bias",
    "output_layer.bias": "cls.predictions.bias",
    "output_layer.weight": "cls.predictions.decoder.weight",
}
_POOLER_KEYS = {
    "pooler.dense.weight": "pooler.dense.weight",
    "pooler.dense.bias": "pooler.dense.bias",
}
_BINARY_KEYS = {
    "binary_head.weight": "cls.seq_relationship.weight",
    "binary_head.bias": "cls.seq_relationship.bias",
}
# How our full tensors are split across TP: key suffix -> dim (absent: replicated).
_PARTITION_DIM = {
    "linear_qkv.weight": 0, "linear_qkv.bias": 0, "linear_fc1.weight": 0, "linear_fc1.bias": 0,
    "linear_proj.weight": 1, "linear_fc2.weight": 1,
    "word_embeddings.weight": 0, "output_layer.weight": 0, "output_layer.bias": 0,
}
_VOCAB_PADDED = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")
BERT_TP_LAYOUT = TPLayout(partition_dims=_PARTITION_DIM, vocab_keys=_VOCAB_PADDED)
"""How our BERT's tensors are split over TP ranks (the Megatron-LM reader merges rank files by it)."""


def bert_config_from_hf(hf_config: Any, **overrides: Any) -> TransformerConfig:
    """A TransformerConfig matching a ``transformers.BertConfig`` (sizes, dropouts, eps, activation).

    ``overrides`` set any other field (``tensor_model_parallel_size``, ``sequence_parallel``, ...).
    """
    if getattr(hf_config, "is_decoder", False):
        raise ValueError("is_decoder=True: the folder's BERT attends causally (each token to the ones before it); "
                         "BertLightningModule attends both ways, so its logits would differ; import an encoder "
                         "(is_decoder false)")
    if getattr(hf_config, "add_cross_attention", False):
        raise ValueError("add_cross_attention=True: the folder's BERT attends to an encoder's states too; "
                         "BertLightningModule has no cross-attention")
    if getattr(hf_config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type={hf_config.position_embedding_type!r} is not supported; "
                         f"only 'absolute' (learned positions) converts")
    act = hf_config.hidden_act
    if not isinstance(act, str) or act not in _HF_ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r} is not supported; use one of {sorted(_HF_ACTIVATIONS)}")
    fields = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads, ffn_hidden_size=hf_config.intermediate_size,
        hidden_dropout=hf_config.hidden_dropout_prob, attention_dropout=hf_config.attention_probs_dropout_prob,
        layernorm_epsilon=hf_config.layer_norm_eps, activation=_HF_ACTIVATIONS[act],
        init_method_std=hf_config.initializer_range, normalization="LayerNorm",
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def is_megatron_bert_state_dict(hf_state_dict: Mapping[str, torch.Tensor]) -> bool:
    """True for a MegatronBERT (pre-norm) state dict, False for a BERT (post-norm) one."""
    return any(k.endswith("attention.ln.weight") for k in hf_state_dict)


def bert_model_kwargs_from_hf(hf_config: Any) -> dict[str, Any]:
    """``BertModel`` keyword arguments (spec, vocab_size, max_sequence_length, num_tokentypes)."""
    megatron = getattr(hf_config, "model_type", "bert") == "megatron-bert"
    return dict(spec=HF_MEGATRON_BERT_SPEC if megatron else HF_BERT_SPEC, vocab_size=hf_config.vocab_size,
                max_sequence_length=hf_config.max_position_embeddings, num_tokentypes=hf_config.type_vocab_size)


def _normalize_hf_keys(hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the ``bert.`` prefix and rename old-style LayerNorm ``gamma``/``beta``."""
    out = {}
    for key, value in hf_state_dict.items():
        key = key.removeprefix("bert.")
        if key.endswith("LayerNorm.gamma"):
            key = key[: -len("gamma")] + "weight"
        elif key.endswith("LayerNorm.beta"):
            key = key[: -len("beta")] + "bias"
        out[key] = value
    return out


def _qkv_from_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """[n d, ...] x 3 -> [3 n d, ...] head-major: rows [head i: q_i, k_i, v_i]."""
    d = q.size(0) // heads
    return torch.stack([x.reshape(heads, d, *x.shape[1:]) for x in (q, k, v)], dim=1).reshape(3 * heads * d,
                                                                                             *q.shape[1:])


def _qkv_to_hf(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = qkv.size(0) // (3 * heads)
    q, k, v = qkv.reshape(heads, 3, d, *qkv.shape[1:]).unbind(1)
    return tuple(x.reshape(heads * d, *qkv.shape[1:]).clone() for x in (q, k, v))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.size(0) > rows:
        raise ValueError(f"cannot pad a vocabulary of {t.size(0)} rows to {rows}")
    pad = t.new_zeros((rows - t.size(0), *t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def _shard(key: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    dim = BERT_TP_LAYOUT.dim(key)
    if dim is None or tp_size == 1:
        return full.clone()
    return shard_tensor(full, tp_rank, tp_size, dim)


def bert_state_dict_from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig, tp_rank: int = 0,
                            tp_size: int = 1, *, layer_range: range | None = None, pre_process: bool = True,
                            post_process: bool = True, add_binary_head: bool = True,
                            share_embeddings_and_output_weights: bool = True,
                            make_vocab_size_divisible_by: int = 128) -> dict[str, torch.Tensor]:
    """This TP rank's shard of our state dict, for ``BertModel(config, HF_BERT_SPEC, ...)`` (or
    ``HF_MEGATRON_BERT_SPEC`` for a MegatronBERT state dict) built with
    the same ``layer_range`` / ``pre_process`` / ``post_process`` / head options. Load it with
    ``model.load_state_dict(sd, strict=True)``.

    ``post_process=True`` needs the ``cls.*`` heads of a ``BertForPreTraining`` state dict; a
    ``transformers.BertModel`` (no heads) imports with ``post_process=False`` (the encoder output).
    """
    return bert_state_dict_and_unread_from_hf(
        hf_state_dict, config, tp_rank, tp_size, layer_range=layer_range, pre_process=pre_process,
        post_process=post_process, add_binary_head=add_binary_head,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by)[0]


def bert_state_dict_and_unread_from_hf(hf_state_dict: Mapping[str, torch.Tensor], config: TransformerConfig,
                                       tp_rank: int = 0, tp_size: int = 1, *, layer_range: range | None = None,
                                       pre_process: bool = True, post_process: bool = True,
                                       add_binary_head: bool = True, share_embeddings_and_output_weights: bool = True,
                                       make_vocab_size_divisible_by: int = 128) -> tuple[dict[str, torch.Tensor],
                                                                                         list[str]]:
    """:func:`bert_state_dict_from_hf` and the names of ``hf_state_dict`` it did not read (``bert.`` prefix and
    old ``gamma`` / ``beta`` names normalized)."""
    if config.tensor_model_parallel_size != tp_size:
        raise ValueError(f"tensor_model_parallel_size={config.tensor_model_parallel_size} in the config but "
                         f"tp_size={tp_size}; build the config with tensor_model_parallel_size={tp_size}")
    hf = _normalize_hf_keys(hf_state_dict)
    megatron = is_megatron_bert_state_dict(hf)
    layer_keys = _MEGATRON_LAYER_KEYS if megatron else _LAYER_KEYS
    vocab = hf["embeddings.word_embeddings.weight"].size(0) if "embeddings.word_embeddings.weight" in hf else \
        hf["cls.predictions.bias"].size(0)
    padded = pad_vocab_size(vocab, tp_size, make_vocab_size_divisible_by)
    full: dict[str, torch.Tensor] = {}
    read: set[str] = set()

    def take(hf_key: str) -> torch.Tensor:
        if hf_key not in hf:
            hint = (" (a transformers BertModel has no cls.* heads: build with post_process=False)"
                    if hf_key.startswith("cls.") else "")
            raise KeyError(f"Hugging Face state dict has no {hf_key!r}{hint}")
        read.add(hf_key)
        return hf[hf_key]

    if pre_process:
        for ours, theirs in _EMBEDDING_KEYS.items():
            if theirs in hf:
                full[ours] = take(theirs)
    layer_range = range(config.num_layers) if layer_range is None else layer_range
    for local, i in enumerate(layer_range):
        src, dst = f"encoder.layer.{i}.", f"encoder.layers.{local}."
        for part in ("weight", "bias"):
            q, k, v = (take(f"{src}attention.self.{name}.{part}") for name in ("query", "key", "value"))
            full[f"{dst}self_attention.linear_qkv.{part}"] = _qkv_from_hf(q, k, v, config.num_attention_heads)
        for ours, theirs in layer_keys.items():
            full[dst + ours] = take(src + theirs)
    if post_process and megatron:
        for ours, theirs in _MEGATRON_FINAL_KEYS.items():
            full[ours] = take(theirs)
    if post_process:
        heads = dict(_HEAD_KEYS)
        if pre_process and share_embeddings_and_output_weights:
            del heads["output_layer.weight"]  # the embedding weight is used, no separate parameter
        elif "cls.predictions.decoder.weight" not in hf:  # tied in transformers: same as the embedding
            heads["output_layer.weight"] = "embeddings.word_embeddings.weight"
        if add_binary_head:
            heads.update(_POOLER_KEYS)
            heads.update(_BINARY_KEYS)
        for ours, theirs in heads.items():
            full[ours] = take(theirs)
    out = {}
    for key, value in full.items():
        if key in _VOCAB_PADDED:
            value = _pad_rows(value, padded)
        out[key] = _shard(key, value.to(config.params_dtype), tp_rank, tp_size)
    return out, sorted(k for k in hf if k not in read)


def merge_tp_state_dicts(shards: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate the TP shards (rank order) of our state dict into the TP=1 state dict."""
    return merge_tp_shards(shards, BERT_TP_LAYOUT)


def hf_state_dict_from_bert(state_dict: Mapping[str, torch.Tensor], config: TransformerConfig, vocab_size: int, *,
                            model_type: Literal["BertForPreTraining", "BertForMaskedLM", "BertModel",
                                                "BertForSequenceClassification"] = "BertForPreTraining",
                            megatron: bool = False) -> dict[str, torch.Tensor]:
    """A ``transformers`` state dict from our FULL (TP=1 or merged) state dict.

    ``megatron=False``: a post-norm model, keys of ``BertForPreTraining`` / ``BertForMaskedLM`` /
    ``BertModel`` / ``BertForSequenceClassification``; ``megatron=True``: a pre-norm LayerNorm model, keys of the
    ``MegatronBert*`` twins. ``BertForPreTraining`` needs the heads (``lm_head``, ``output_layer``, ``pooler``,
    ``binary_head``); ``BertForMaskedLM`` the LM head only; ``BertModel`` takes the embeddings, layers and pooler
    (if present) and ignores the LM heads; ``BertForSequenceClassification`` takes those and the ``classifier``.
    """
    kinds = ("BertForPreTraining", "BertForMaskedLM", "BertModel", "BertForSequenceClassification")
    if model_type not in kinds:
        raise ValueError(f"model_type={model_type!r} must be one of {kinds}")
    layer_keys = _MEGATRON_LAYER_KEYS if megatron else _LAYER_KEYS
    lm_heads = model_type in ("BertForPreTraining", "BertForMaskedLM")
    prefix = "" if model_type == "BertModel" else "bert."
    # read by name from the caller's mapping (export checks that every tensor was read), the padded vocabulary's
    # rows cut off as read
    sd = _VocabCut(state_dict, vocab_size)
    out: dict[str, torch.Tensor] = {}
    pooler = _POOLER_KEYS if model_type != "BertForMaskedLM" else {}
    finals = _MEGATRON_FINAL_KEYS if megatron else {}
    for ours, theirs in {**_EMBEDDING_KEYS, **pooler, **finals}.items():
        if ours in sd:
            out[prefix + theirs] = sd[ours].clone()
    for i in range(config.num_layers):
        src, dst = f"encoder.layers.{i}.", f"{prefix}encoder.layer.{i}."
        for part in ("weight", "bias"):
            qkv = _qkv_to_hf(sd[f"{src}self_attention.linear_qkv.{part}"], config.num_attention_heads)
            for name, tensor in zip(("query", "key", "value"), qkv):
                out[f"{dst}attention.self.{name}.{part}"] = tensor
        for ours, theirs in layer_keys.items():
            out[dst + theirs] = sd[src + ours].clone()
    if lm_heads:
        binary = _BINARY_KEYS if model_type == "BertForPreTraining" else {}
        for ours, theirs in {**_HEAD_KEYS, **binary}.items():
            if ours in sd:
                out[theirs] = sd[ours].clone()
        if "output_layer.weight" not in sd:  # tied: the decoder is the word embedding
            out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"].clone()
        out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"].clone()
    if model_type == "BertForSequenceClassification":
        for part in ("weight", "bias"):
            out[f"classifier.{part}"] = sd[f"classifier.{part}"].clone()
    if not lm_heads:  # the pretraining heads a classifier's (or an encoder's) checkpoint keeps: they compute none
        for key in (*_HEAD_KEYS, *_BINARY_KEYS, "output_layer.weight", "output_layer.bias"):  # of its outputs
            sd.get(key)
    elif model_type == "BertForMaskedLM":  # transformers' MLM model computes no pooler or binary head
        for key in (*_BINARY_KEYS, *_POOLER_KEYS):
            sd.get(key)
    return out


class _VocabCut(Mapping):
    """``state_dict`` read by name, its padded-vocabulary tensors (:data:`_VOCAB_PADDED`) cut to ``vocab_size`` rows."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], vocab_size: int) -> None:
        self._sd, self._vocab_size = state_dict, vocab_size

    def __getitem__(self, key: str) -> torch.Tensor:
        tensor = self._sd[key]
        return tensor[:self._vocab_size] if key in _VOCAB_PADDED else tensor

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self._sd else self._sd.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._sd

    def __iter__(self):
        return iter(self._sd)

    def __len__(self) -> int:
        return len(self._sd)
