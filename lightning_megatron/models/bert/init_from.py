"""``init_from``: start a BertLightningModule from pretrained weights, at any TP/PP/VP layout.

One mechanism for every source: the source becomes a :class:`~.convert.SavedModel` (a full TP=1
state dict under our global names, unpadded vocabulary, plus the architecture it needs), which
:func:`load_full_state_dict` slices into each rank's chunks. Sources (:func:`read_pretrained`):

- a lightning_megatron checkpoint directory (``lightning_megatron.json``);
- a Hugging Face folder (``config.json`` + ``model.safetensors`` / ``pytorch_model.bin``) of BERT
  (post-norm: ``spec=bert_layer_post_norm_spec``) or MegatronBERT (pre-norm: ``bert_layer_local_spec``);
- a Megatron-LM checkpoint, legacy per-rank ``model_optim_rng.pt`` files or megatron-core's
  ``torch_dist`` format (:mod:`.megatron_lm`).

Nothing is unpickled outside ``torch.load(weights_only=True)``. The module's architecture
arguments must match the source; a mismatch raises an error listing the flags to set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_megatron.models.bert.convert import SavedModel, read_model_checkpoint

__all__ = ["read_pretrained", "read_hf_folder", "load_full_state_dict", "check_architecture",
           "ARCHITECTURE_KEYS"]

ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "spec", "activation",
                     "lm_head_activation", "layernorm_epsilon", "max_sequence_length", "vocab_size")
"""Module arguments a source fixes (checked by :func:`check_architecture`)."""

_HF_TO_OURS_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
                   "silu": "silu", "swish": "silu"}


def read_hf_folder(path: str | os.PathLike[str]) -> SavedModel:
    """A Hugging Face BERT / MegatronBERT folder as a full state dict under our names."""
    from lightning_megatron.models.bert.hf import bert_config_from_hf, bert_model_kwargs_from_hf, \
        bert_state_dict_from_hf, read_hf_config

    path = Path(path)
    config = read_hf_config(path)  # config.json only; auto_map (the folder's own code) is refused
    if config.model_type not in ("bert", "megatron-bert"):
        raise ValueError(f"{str(path)!r} holds a {config.model_type!r} model; init_from reads 'bert' and "
                         f"'megatron-bert' folders")
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        hf_sd = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").is_file():
        hf_sd = torch.load(path / "pytorch_model.bin", weights_only=True, map_location="cpu")
    else:
        raise FileNotFoundError(f"{str(path)!r} has neither model.safetensors nor pytorch_model.bin")
    keys = {k.removeprefix("bert.") for k in hf_sd}
    heads = "cls.predictions.bias" in keys
    binary = "cls.seq_relationship.weight" in keys
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
    kwargs = bert_model_kwargs_from_hf(config)
    hparams = dict(num_layers=ours.num_layers, hidden_size=ours.hidden_size,
                   num_attention_heads=ours.num_attention_heads, ffn_hidden_size=ours.ffn_hidden_size,
                   spec=kwargs["spec"], activation=_HF_TO_OURS_ACT[config.hidden_act], lm_head_activation=None,
                   layernorm_epsilon=ours.layernorm_epsilon, max_sequence_length=kwargs["max_sequence_length"],
                   vocab_size=kwargs["vocab_size"])
    return SavedModel(state_dict=sd, hparams=hparams)


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
    wrong = []
    for key in ARCHITECTURE_KEYS:
        if key not in source:
            continue
        want, have = source[key], hparams.get(key)
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
    if wrong:
        flags = " ".join(f"--model.{k} {v}" for k, _, v in wrong)
        details = ", ".join(f"{k}={h!r} (needs {w!r})" for k, h, w in wrong)
        raise ValueError(f"init_from={source_name!r}: the model's {details}. Set: {flags}")


def load_full_state_dict(chunks: list[nn.Module], named_parameters: list[tuple[str, nn.Parameter]],
                         full: dict[str, torch.Tensor], *, tp_rank: int, tp_size: int, num_layers: int,
                         source_name: str, optional: tuple[str, ...] = ()) -> None:
    """Copy this rank's slice of every tensor of ``full`` (TP=1, unpadded vocab, global layer names)
    into the parameters ``named_parameters`` (global names, as ``sharded_named_parameters``).
    Parameters whose names start with one of ``optional`` keep their initialization when the source
    lacks them (a warning names them)."""
    layers = {int(k.split(".")[2]) for k in full if k.startswith("encoder.layers.")}
    if layers and max(layers) + 1 != num_layers:
        raise ValueError(f"init_from={source_name!r} has {max(layers) + 1} layers but the model has "
                         f"num_layers={num_layers}: set --model.num_layers {max(layers) + 1}")
    missing, skipped = [], []
    with torch.no_grad():
        for name, p in named_parameters:
            key = name
            if name == "output_layer.weight" and getattr(p, "shared_embedding", False):
                key = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
            t = full.get(key)
            if t is None:
                if key.startswith(optional) and optional:
                    skipped.append(key)
                else:
                    missing.append(key)
                continue
            sharded = getattr(p, "tensor_model_parallel", False) and tp_size > 1
            dim = p.partition_dim % p.dim() if sharded else 0
            real = getattr(p, "real_vocab_size", None)
            if real is not None:
                padded = p.size(0) * (tp_size if sharded else 1)
                if t.size(0) < real:
                    raise ValueError(f"init_from={source_name!r}: {key} has a vocabulary of {t.size(0)} rows, "
                                     f"the model's vocab_size is {real}: set --model.vocab_size {t.size(0)}")
                t = t[:real]  # Megatron-LM pads its vocabulary; the padding never is a prediction
                t = torch.cat([t, t.new_zeros((padded - real, *t.shape[1:]))]) if padded > real else t
            if sharded:
                t = t.chunk(tp_size, dim=dim)[tp_rank]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"init_from={source_name!r}: {key} has shape {tuple(t.shape)} for this rank but "
                                 f"the parameter has {tuple(p.shape)}; the model's sizes differ from the source's")
            p.copy_(t.to(p.dtype))  # before the optimizers exist: their main params are copied from p
    if skipped:
        import warnings

        warnings.warn(f"init_from={source_name!r} has no {skipped}: they keep their initialization", UserWarning,
                      stacklevel=2)
    if missing:
        raise ValueError(f"init_from={source_name!r} lacks {len(missing)} tensors the model needs, e.g. "
                         f"{missing[:4]}: is the spec right (post-norm Hugging Face BERT needs "
                         f"--model.spec bert_layer_post_norm_spec)?")
