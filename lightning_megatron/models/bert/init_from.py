"""``init_from``: start a BertLightningModule from pretrained weights, at any TP/PP/VP layout.

One mechanism for every source: the source becomes a :class:`~lightning_megatron.saved_model.SavedModel`
(a full TP=1 state dict under our global names, unpadded vocabulary, plus the architecture it needs),
which :func:`~lightning_megatron.saved_model.load_full_state_dict` slices into each rank's chunks (the
generic base, ``MegatronLightningModule.load_pretrained``, does it; this module is BERT's sources).
Sources (:func:`read_pretrained`):

- a lightning_megatron checkpoint directory (``lightning_megatron.json``);
- a Hugging Face folder (``config.json`` + ``model.safetensors`` / ``pytorch_model.bin``) of BERT
  (post-norm: ``spec=bert_layer_post_norm_spec``) or MegatronBERT (pre-norm: ``bert_layer_local_spec``);
- a Megatron-LM checkpoint, legacy per-rank ``model_optim_rng.pt`` files or megatron-core's
  ``torch_dist`` format (:mod:`.megatron_lm`).

Nothing is unpickled outside ``torch.load(weights_only=True)``. :func:`read_architecture` reads the
architecture a source fixes from its configuration (``config.json``, saved hyper-parameters,
Megatron-LM ``args``): ``BertLightningModule.from_pretrained`` and ``--model.init_from`` on the command
line build the module with it. A module built with other architecture arguments raises an error
listing the flags to set. Heads an encoder-only source lacks (``SavedModel.fresh``) start fresh, with
one warning.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_megatron.saved_model import SavedModel, read_model_checkpoint, read_saved_hparams, refuse_architecture

__all__ = ["read_pretrained", "read_hf_folder", "check_architecture", "MISSING_TENSORS_HINT",
           "ARCHITECTURE_KEYS", "read_architecture", "architecture_conflicts"]

ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "spec", "activation",
                     "lm_head_activation", "layernorm_epsilon", "max_sequence_length", "vocab_size")
"""Module arguments a source fixes (checked by :func:`check_architecture`)."""

MISSING_TENSORS_HINT = ("is the spec right (post-norm Hugging Face BERT needs --model.config.spec "
                        "bert_layer_post_norm_spec)?")

_HF_TO_OURS_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
                   "silu": "silu", "swish": "silu"}


def read_hf_folder(path: str | os.PathLike[str]) -> SavedModel:
    """A Hugging Face BERT / MegatronBERT folder as a full state dict under our names."""
    from lightning_megatron.models.bert.hf import bert_config_from_hf, bert_state_dict_from_hf, read_hf_weights

    path = Path(path)
    config = _hf_config(path)
    hf_sd = read_hf_weights(path)  # safetensors (a sharded index too) or weights_only .bin
    keys = {k.removeprefix("bert.") for k in hf_sd}
    heads = "cls.predictions.bias" in keys
    binary = "cls.seq_relationship.weight" in keys
    word = hf_sd.get("bert.embeddings.word_embeddings.weight", hf_sd.get("embeddings.word_embeddings.weight"))
    if word is not None and word.size(0) != config.vocab_size:
        raise ValueError(f"{str(path / 'config.json')!r} says vocab_size={config.vocab_size} but the word embeddings "
                         f"have {word.size(0)} rows: the config does not belong to these weights (fix vocab_size in "
                         f"config.json)")
    ours = bert_config_from_hf(config)
    sd = bert_state_dict_from_hf(hf_sd, ours, 0, 1, post_process=heads, add_binary_head=binary,
                                 make_vocab_size_divisible_by=1)
    if not heads:  # a transformers BertModel: its pooler, if saved
        for key in ("pooler.dense.weight", "pooler.dense.bias"):
            src = hf_sd.get(key, hf_sd.get("bert." + key))
            if src is not None:
                sd[key] = src.clone()
    if config.model_type == "megatron-bert" and not heads:
        for ours_key, theirs in (("encoder.final_layernorm.weight", "encoder.ln.weight"),
                                 ("encoder.final_layernorm.bias", "encoder.ln.bias")):
            src = hf_sd.get(theirs, hf_sd.get("bert." + theirs))
            if src is not None:
                sd[ours_key] = src.clone()
    # An encoder-only model (transformers' BertModel, e.g. MiniLM) or one without the binary head: the
    # heads it lacks start fresh.
    fresh = [k for k in _HF_HEADS if k not in sd and (not heads or k.startswith(("binary_head.", "pooler.")))]
    return SavedModel(state_dict=sd, hparams=_hf_architecture(config), fresh=tuple(fresh))


_HF_HEADS = ("lm_head.dense.weight", "lm_head.dense.bias", "lm_head.layer_norm.weight", "lm_head.layer_norm.bias",
             "output_layer.bias", "pooler.dense.weight", "pooler.dense.bias", "binary_head.weight", "binary_head.bias")


def _hf_architecture(config: Any) -> dict[str, Any]:
    """The module arguments a transformers BERT / MegatronBERT config fixes."""
    from lightning_megatron.models.bert.hf import bert_config_from_hf, bert_model_kwargs_from_hf

    ours, kwargs = bert_config_from_hf(config), bert_model_kwargs_from_hf(config)
    return dict(num_layers=ours.num_layers, hidden_size=ours.hidden_size,
                num_attention_heads=ours.num_attention_heads, ffn_hidden_size=ours.ffn_hidden_size,
                spec=kwargs["spec"], activation=_HF_TO_OURS_ACT[config.hidden_act], lm_head_activation=None,
                layernorm_epsilon=ours.layernorm_epsilon, max_sequence_length=kwargs["max_sequence_length"],
                vocab_size=kwargs["vocab_size"])


def _hf_config(path: Path) -> Any:
    from lightning_megatron.models.bert.hf import read_hf_config

    config = read_hf_config(path)  # config.json only; auto_map (the folder's own code) is refused
    if config.model_type not in ("bert", "megatron-bert"):
        raise ValueError(f"{str(path)!r} holds a {config.model_type!r} model; init_from reads 'bert' and "
                         f"'megatron-bert' folders")
    return config


def read_architecture(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The module arguments (:data:`ARCHITECTURE_KEYS`) a source fixes, from its configuration where it
    has one: a Hugging Face ``config.json``, our checkpoint's saved hyper-parameters, Megatron-LM's
    ``args`` (read from the checkpoint)."""
    from lightning_megatron import checkpoint as ckpt

    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file() and not (path / ckpt.MARKER).is_file():
        return _hf_architecture(_hf_config(path))
    if path.is_dir() and (path / ckpt.MARKER).is_file():
        hparams = read_saved_hparams(path)
        return {k: hparams[k] for k in ARCHITECTURE_KEYS if k in hparams}
    from lightning_megatron.models.bert import megatron_lm

    if megatron_lm.is_megatron_checkpoint(path):
        return megatron_lm.read_megatron_architecture(path)
    return dict(read_pretrained(path).hparams)  # refuses what it cannot read, naming the kinds it reads


def architecture_conflicts(hparams: dict[str, Any], source: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, the module's value, the source's)`` for every argument of ``hparams`` the source fixes
    otherwise (a missing ``ffn_hidden_size`` is ``4 * hidden_size``, a missing ``lm_head_activation`` the
    ``activation``; a ``None`` vocabulary on either side is read from the data and checked on the tensors)."""
    wrong = []
    for key in ARCHITECTURE_KEYS:
        if key not in source or key not in hparams:
            continue
        want, have = source[key], hparams.get(key)
        if want is None and key != "lm_head_activation":
            continue  # the source does not fix it (a checkpoint saved with vocab_size=None read the datamodule's)
        if key == "ffn_hidden_size" and have is None:
            have = 4 * hparams["hidden_size"]
        if key == "lm_head_activation":
            want, have = want or source.get("activation"), have or hparams.get("activation")
        if key == "vocab_size" and have is None:
            continue  # read from the datamodule: checked against the tensors' shapes
        if isinstance(want, float) and isinstance(have, (int, float)):
            if abs(want - have) <= 1e-12 * max(abs(want), 1e-30):
                continue
        elif want == have:
            continue
        wrong.append((key, have, want))
    return wrong


def read_pretrained(path: str | os.PathLike[str]) -> SavedModel:
    """Read any supported source (see the module docstring), detected by the files it holds."""
    from lightning_megatron import checkpoint as ckpt
    from lightning_megatron.models.bert import megatron_lm

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"init_from={str(path)!r} does not exist")
    if path.is_dir() and (path / ckpt.MARKER).is_file():
        saved = read_model_checkpoint(path)
        saved.hparams = {k: saved.hparams[k] for k in ARCHITECTURE_KEYS if k in saved.hparams}
        return saved
    if path.is_dir() and (path / "config.json").is_file():
        return read_hf_folder(path)
    if megatron_lm.is_megatron_checkpoint(path):
        return megatron_lm.read_megatron_checkpoint(path)
    raise ValueError(f"init_from={str(path)!r} is not a lightning_megatron checkpoint directory, a Hugging Face "
                     f"folder (config.json) or a Megatron-LM checkpoint (model_optim_rng.pt / torch_dist)")


def check_architecture(hparams: dict[str, Any], source: dict[str, Any], source_name: str) -> None:
    """Raise listing every module argument that differs from what the source needs."""
    refuse_architecture(architecture_conflicts(hparams, source), source_name, flag_prefix="--model.config.")
