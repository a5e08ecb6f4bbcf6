"""Hugging Face folders <-> our GPT checkpoints: the decoder side of ``init_from`` and ``export hf``.

- :func:`read_hf_gpt_folder`: a ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` folder (``config.json`` read
  without running code: ``auto_map`` refused, ``trust_remote_code=False``; weights from
  ``model.safetensors``, a sharded ``model.safetensors.index.json``, or ``pytorch_model.bin`` with
  ``torch.load(weights_only=True)``) as a :class:`~lightning_megatron.saved_model.SavedModel`:
  the full state dict under our names and the ``GPTLightningModule`` arguments its config fixes.
- :func:`read_pretrained_source` / :func:`read_source_architecture`: the sources ``GPTLightningModule``
  reads besides our checkpoints (which the base class reads): such a folder, or a Megatron-LM GPT
  checkpoint (:mod:`lightning_megatron.models.bert.megatron_lm` reads the files, legacy or ``torch_dist``,
  :mod:`.megatron_lm` the architecture).
- :func:`hf_model_from_saved`: the transformers model (weights loaded strictly) and its tokenizer
  writer for a checkpoint of ours; ``lightning_megatron.models.bert.convert.export_hf`` (``export hf``)
  calls it for decoder checkpoints (``decoder.layers.*`` tensors) and writes the folder atomically.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.saved_model import SavedModel
from lightning_megatron.models.gpt import hf as ghf

__all__ = ["GPT_MODEL_TYPES", "is_decoder_state_dict", "read_hf_gpt_folder", "read_pretrained_source",
           "read_source_architecture", "architecture_of_saved", "hf_model_from_saved"]

_EOD = "<|endoftext|>"

GPT_MODEL_TYPES = ("llama", "gpt2")
"""transformers ``model_type`` s the decoder family reads."""


def is_decoder_state_dict(state_dict: dict[str, torch.Tensor]) -> bool:
    """True for our GPT family's names (``decoder.layers.*``), False for BERT's (``encoder.layers.*``)."""
    return any(k.startswith("decoder.layers.") for k in state_dict)


def read_hf_gpt_folder(path: str | os.PathLike[str], config: Any = None) -> SavedModel:
    """A Llama / GPT-2 Hugging Face folder as our full state dict plus its architecture."""
    from lightning_megatron.models.bert.hf import read_hf_config, read_hf_weights

    path = Path(path)
    config = read_hf_config(path) if config is None else config
    arch = ghf.hf_architecture(config)  # refuses what our model cannot compute, before reading weights
    hf_sd = read_hf_weights(path)
    for key in ("model.embed_tokens.weight", "transformer.wte.weight"):
        if key in hf_sd and hf_sd[key].size(0) != arch["vocab_size"]:
            raise ValueError(f"{str(path / 'config.json')!r} says vocab_size={arch['vocab_size']} but {key} has "
                             f"{hf_sd[key].size(0)} rows: the config does not belong to these weights (fix vocab_size "
                             f"in config.json)")
    return SavedModel(state_dict=ghf.gpt_state_dict_from_hf(hf_sd, arch), hparams=arch)


def _kind(path: Path) -> str | None:
    from lightning_megatron import checkpoint as ckpt
    from lightning_megatron.models.bert import megatron_lm

    if path.is_dir() and (path / ckpt.MARKER).is_file():
        return None  # ours: the base class reads it
    if path.is_dir() and (path / "config.json").is_file():
        return "hf"
    if path.exists() and megatron_lm.is_megatron_checkpoint(path):
        return "megatron"
    return None


def _decoder(saved: SavedModel, source: Path) -> SavedModel:
    if not is_decoder_state_dict(saved.state_dict):
        raise ValueError(f"init_from={str(source)!r} holds an encoder (BERT) checkpoint, not a GPT one")
    return saved


def read_pretrained_source(source: str | os.PathLike[str]) -> SavedModel | None:
    """A Llama / GPT-2 Hugging Face folder or a Megatron-LM GPT checkpoint as a SavedModel; None for a
    lightning_megatron checkpoint directory or anything else (the base class reads ours, refuses the rest)."""
    from lightning_megatron.models.bert import megatron_lm

    path = Path(source)
    kind = _kind(path)
    if kind == "hf":
        return read_hf_gpt_folder(path)
    if kind == "megatron":
        return _decoder(megatron_lm.read_megatron_checkpoint(path), path)
    return None


def read_source_architecture(source: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The GPT architecture a Hugging Face folder (its ``config.json`` only) or a Megatron-LM checkpoint
    (its ``args``) fixes; None for our checkpoints (the base class reads their saved hyper-parameters)."""
    from lightning_megatron.models.bert import megatron_lm
    from lightning_megatron.models.bert.hf import read_hf_config

    path = Path(source)
    kind = _kind(path)
    if kind == "hf":
        return ghf.hf_architecture(read_hf_config(path))
    if kind == "megatron":
        return megatron_lm.read_megatron_architecture(path)
    return None


def _num_layers(sd: dict[str, torch.Tensor]) -> int:
    layers = {int(k.split(".")[2]) for k in sd if k.startswith("decoder.layers.")}
    return max(layers) + 1 if layers else 0


def architecture_of_saved(saved: SavedModel) -> dict[str, Any]:
    """The architecture (:data:`~.hf.GPT_ARCHITECTURE_KEYS`) of a saved GPT model: its module arguments,
    completed from the tensors' shapes (layers, vocabulary, query groups, gating) and checked against them."""
    hp, sd = saved.hparams, saved.state_dict
    word = sd["embedding.word_embeddings.weight"]
    n, h = int(hp.get("num_attention_heads", 4)), word.size(1)
    d = hp.get("kv_channels") or h // n
    qkv = sd["decoder.layers.0.self_attention.linear_qkv.weight"]
    fc1, fc2 = sd["decoder.layers.0.mlp.linear_fc1.weight"], sd["decoder.layers.0.mlp.linear_fc2.weight"]
    groups = (qkv.size(0) // d - n) // 2
    arch = {k: hp[k] for k in ghf.GPT_ARCHITECTURE_KEYS if k in hp}
    arch.update(num_layers=_num_layers(sd), hidden_size=h, num_attention_heads=n, num_query_groups=groups,
                ffn_hidden_size=fc2.size(1), kv_channels=hp.get("kv_channels"), vocab_size=word.size(0),
                gated_linear_unit=fc1.size(0) == 2 * fc2.size(1),
                untie_embeddings_and_output_weights="output_layer.weight" in sd)
    arch.setdefault("spec", "gpt_layer_spec")
    arch.setdefault("position_embedding_type", "learned_absolute")
    arch.setdefault("activation", "gelu")
    arch.setdefault("add_bias_linear", "decoder.layers.0.mlp.linear_fc1.bias" in sd)
    arch.setdefault("layernorm_epsilon", 1e-5)
    if "embedding.position_embeddings.weight" in sd:
        arch["max_sequence_length"] = sd["embedding.position_embeddings.weight"].size(0)
    arch.setdefault("max_sequence_length", 128)
    if hp.get("num_query_groups") not in (None, groups):
        raise ValueError(f"the checkpoint says num_query_groups={hp['num_query_groups']} but linear_qkv has "
                         f"{qkv.size(0)} rows ({groups} groups of {d} channels)")
    return arch


def _tokenizer_source(saved: SavedModel, tokenizer: str | os.PathLike[str] | None) -> Path | None:
    if tokenizer is not None:
        return Path(tokenizer)
    dm = saved.datamodule_hparams
    for key in ("tokenizer_file", "tokenizer", "vocab_file"):
        if isinstance(dm.get(key), str) and Path(dm[key]).exists():
            return Path(dm[key])
    if "vocab_file" in dm and dm["vocab_file"] is None and not dm.get("data_prefix"):
        # GPTDataModule's default: the packaged byte-level BPE (the size check below still applies)
        from lightning_megatron.data.bpe_tokenizer import packaged_bpe_tokenizer_file

        return packaged_bpe_tokenizer_file()
    return None


def _hf_tokenizer(source: Path) -> Any:
    """A transformers fast tokenizer from a ``tokenizer.json``, GPT-2's ``vocab.json`` + ``merges.txt``, or a
    folder holding either."""
    import json

    import transformers

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
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(source))


def hf_model_from_saved(saved: SavedModel, *, tokenizer: str | os.PathLike[str] | None = None
                        ) -> tuple[Any, Callable[[Path], None]]:
    """``(transformers model, write_tokenizer(folder))`` for a saved GPT model. ``tokenizer``: the
    ``tokenizer.json`` / GPT-2 ``vocab.json`` (or a folder) the model was trained with; None takes the one the
    checkpoint's datamodule names (``GPTDataModule``'s default: the packaged BPE), else the folder gets no
    tokenizer (a warning says so). A tokenizer whose
    size differs from the model's vocabulary is refused."""
    import transformers

    arch = architecture_of_saved(saved)
    config = ghf.hf_config_from_architecture(arch)
    source = _tokenizer_source(saved, tokenizer)
    hf_tok = _hf_tokenizer(source) if source is not None else None
    if hf_tok is not None and len(hf_tok) != arch["vocab_size"]:
        raise ValueError(f"tokenizer {str(source)!r} has {len(hf_tok)} tokens but the model's vocabulary is "
                         f"{arch['vocab_size']}: pass --tokenizer with the tokenizer it was trained with")
    eod = hf_tok.get_vocab().get(_EOD) if hf_tok is not None else None
    if eod is not None:  # Megatron's end-of-document token is the model's end of text
        config.bos_token_id = config.eos_token_id = eod
    hf_sd = ghf.hf_state_dict_from_gpt(saved.state_dict, arch)
    cls = getattr(transformers, config.architectures[0])
    model = cls(config)
    result = model.load_state_dict(hf_sd, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise ValueError(f"export to {cls.__name__} does not match transformers' keys: missing {missing}, "
                         f"unexpected {list(result.unexpected_keys)}")
    if config.tie_word_embeddings:
        model.tie_weights()

    def write_tokenizer(folder: Path) -> None:
        if hf_tok is None:
            warnings.warn("export hf: the checkpoint names no tokenizer, so the folder has none; pass --tokenizer "
                          "with the tokenizer.json the model was trained with", UserWarning, stacklevel=3)
            return
        if eod is not None and hf_tok.eos_token is None:
            hf_tok.eos_token = hf_tok.bos_token = _EOD
        hf_tok.model_max_length = arch["max_sequence_length"]
        hf_tok.save_pretrained(folder)

    return model, write_tokenizer
