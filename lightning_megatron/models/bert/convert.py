"""Our checkpoints as one full state dict, and their export to a Hugging Face folder.

A lightning_megatron checkpoint stores every model tensor as a DCP *global* tensor under
``model.<name>`` (global layer numbers, vocabulary unpadded, the tied word embedding once), whatever
the TP/PP/VP/DP layout it was written at. :func:`read_model_checkpoint` reads those tensors on ONE
process (no process group) into a plain TP=1 state dict, with the module's and the datamodule's
hyper-parameters from ``extra.pt`` (``torch.load(weights_only=True)``).

:func:`export_hf` turns that into a folder ``transformers`` loads with ``from_pretrained``:

- ``bert_layer_post_norm_spec`` -> ``BertForPreTraining`` (``BertForMaskedLM`` without a binary head);
- ``bert_layer_local_spec`` (pre-norm LayerNorm, the default recipe) -> ``MegatronBertForPreTraining``
  (``MegatronBertForMaskedLM``);
- weights as ``model.safetensors``, ``config.json``, and the WordPiece tokenizer files.

Command line: ``lightning-megatron export hf --ckpt_path CKPT --output DIR [--vocab_file vocab.txt]``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.saved_model import SavedModel, read_model_checkpoint

__all__ = ["SavedModel", "read_model_checkpoint", "export_hf", "hf_config_for", "HF_ACTIVATION_NAMES"]

HF_ACTIVATION_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu"}
"""Our ``activation`` -> transformers' ``hidden_act``."""


def _num_layers(sd: dict[str, torch.Tensor]) -> int:
    layers = {int(k.split(".")[2]) for k in sd if k.startswith("encoder.layers.")}
    return max(layers) + 1 if layers else 0


def hf_config_for(saved: SavedModel) -> tuple[Any, bool, bool]:
    """``(transformers config, megatron, pretraining)`` for a saved model: ``megatron`` picks the
    MegatronBERT classes (pre-norm), ``pretraining`` the ``*ForPreTraining`` head (binary head saved)."""
    import transformers

    hp, sd = saved.hparams, saved.state_dict
    spec = hp.get("spec", "bert_layer_local_spec")
    if spec == "bert_layer_post_norm_spec":
        megatron = False
    elif spec == "bert_layer_local_spec" and hp.get("normalization", "LayerNorm") == "LayerNorm":
        megatron = True
    else:
        raise ValueError(f"spec={spec!r} has no transformers equivalent: export supports "
                         f"'bert_layer_post_norm_spec' (BertForPreTraining) and 'bert_layer_local_spec' with "
                         f"LayerNorm (MegatronBertForPreTraining)")
    activation = hp.get("activation", "gelu")
    head_activation = hp.get("lm_head_activation") or activation
    if head_activation != activation:
        raise ValueError(f"activation={activation!r} but lm_head_activation={head_activation!r}: transformers' BERT "
                         f"uses one hidden_act for the MLP and the LM head, so the export would not compute the same "
                         f"logits")
    if "embedding.tokentype_embeddings.weight" not in sd:
        raise ValueError("the checkpoint has no token-type embeddings; transformers' BERT needs them")
    word = sd["embedding.word_embeddings.weight"]
    kwargs = dict(
        vocab_size=word.size(0), hidden_size=word.size(1), num_hidden_layers=_num_layers(sd),
        num_attention_heads=int(hp.get("num_attention_heads", 4)),
        intermediate_size=sd["encoder.layers.0.mlp.linear_fc1.weight"].size(0),
        hidden_act=HF_ACTIVATION_NAMES[activation],
        hidden_dropout_prob=float(hp.get("hidden_dropout", 0.1)),
        attention_probs_dropout_prob=float(hp.get("attention_dropout", 0.1)),
        max_position_embeddings=sd["embedding.position_embeddings.weight"].size(0),
        type_vocab_size=sd["embedding.tokentype_embeddings.weight"].size(0),
        initializer_range=float(hp.get("init_method_std", 0.02)),
        layer_norm_eps=float(hp.get("layernorm_epsilon", 1e-12)),
        pad_token_id=0,
    )
    pretraining = "binary_head.weight" in sd
    cls = transformers.MegatronBertConfig if megatron else transformers.BertConfig
    config = cls(**kwargs)
    prefix = "MegatronBert" if megatron else "Bert"
    config.architectures = [prefix + ("ForPreTraining" if pretraining else "ForMaskedLM")]
    return config, megatron, pretraining


def _vocab_file(saved: SavedModel, vocab_file: str | os.PathLike[str] | None) -> Path:
    if vocab_file is None:
        vocab_file = saved.datamodule_hparams.get("vocab_file")
    if vocab_file is None:
        from lightning_megatron.data.tokenizer import default_vocab_file

        vocab_file = default_vocab_file()
    vocab_file = Path(vocab_file)
    if not vocab_file.is_file():
        raise FileNotFoundError(f"vocab file {str(vocab_file)!r} not found: pass --vocab_file with the vocabulary "
                                f"the model was trained with")
    return vocab_file


def export_hf(ckpt_path: str | os.PathLike[str], output: str | os.PathLike[str], *,
              vocab_file: str | os.PathLike[str] | None = None, lowercase: bool = True,
              overwrite: bool = False, tokenizer: str | os.PathLike[str] | None = None) -> Path:
    """Write ``output/`` (config, ``model.safetensors``, tokenizer) from a checkpoint at any layout.

    ``vocab_file``: the WordPiece vocabulary the model was trained with; None takes the datamodule's
    ``vocab_file`` saved in the checkpoint, else the default vocabulary. Its size must equal the
    model's vocabulary. A decoder checkpoint (GPT family: ``LlamaForCausalLM`` / ``GPT2LMHeadModel``,
    :mod:`lightning_megatron.models.gpt.convert`) takes ``tokenizer`` (a ``tokenizer.json``) instead.
    A non-empty ``output`` is refused unless ``overwrite``; the folder is written
    next to it under a temporary name and swapped in whole, so a failed export leaves no half-written
    model. Returns the output directory.
    """
    import transformers

    from lightning_megatron.models.bert.hf import hf_state_dict_from_bert
    from lightning_megatron.transformer import TransformerConfig

    out = Path(output)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--output {str(out)!r} is a file: give a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"--output {str(out)!r} is not empty: choose another folder, or pass --overwrite to "
                              f"replace it")
    saved = read_model_checkpoint(ckpt_path)
    from lightning_megatron.models.gpt.convert import hf_model_from_saved, is_decoder_state_dict

    if is_decoder_state_dict(saved.state_dict):
        model, write_tokenizer = hf_model_from_saved(saved, tokenizer=tokenizer)
        _write_folder(model, write_tokenizer, out)
        return out
    config, megatron, pretraining = hf_config_for(saved)
    vocab = _vocab_file(saved, vocab_file)
    pieces = sum(1 for line in vocab.read_text(encoding="utf-8").splitlines() if line)
    if pieces != config.vocab_size:
        raise ValueError(f"vocab file {str(vocab)!r} has {pieces} pieces but the model's vocabulary is "
                         f"{config.vocab_size}: pass --vocab_file with the vocabulary it was trained with")
    ours = TransformerConfig(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                             num_attention_heads=config.num_attention_heads,
                             ffn_hidden_size=config.intermediate_size)
    model_type = "BertForPreTraining" if pretraining else "BertForMaskedLM"
    hf_sd = hf_state_dict_from_bert(saved.state_dict, ours, config.vocab_size, model_type=model_type,
                                    megatron=megatron)
    cls = getattr(transformers, config.architectures[0])
    model = cls(config)
    result = model.load_state_dict(hf_sd, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
    if missing or result.unexpected_keys:
        raise ValueError(f"export to {cls.__name__} does not match transformers' keys: missing {missing}, "
                         f"unexpected {list(result.unexpected_keys)}")
    _write_folder(model, lambda tmp: _save_tokenizer(vocab, tmp, lowercase=lowercase,
                                                     max_length=config.max_position_embeddings), out)
    return out


def _write_folder(model: Any, write_tokenizer: Any, out: Path) -> None:
    """The model (safetensors) and its tokenizer written next to ``out`` under a temporary name, then swapped in."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        write_tokenizer(tmp)
        _swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_in(new: Path, target: Path) -> None:
    """Put the finished folder ``new`` at ``target`` (a rename on one filesystem), the old one removed after."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
    try:
        new.rename(target)
    except OSError:
        if old is not None:
            old.rename(target)  # put it back: never leave the user without a model
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _save_tokenizer(vocab: Path, out: Path, *, lowercase: bool, max_length: int) -> None:
    """WordPiece tokenizer files transformers 4.x and 5.x load with ``AutoTokenizer``, plus ``vocab.txt``."""
    import inspect

    import transformers

    kwargs = dict(do_lower_case=lowercase, model_max_length=max_length)
    if "vocab" in inspect.signature(transformers.BertTokenizer.__init__).parameters:  # transformers >= 5
        pieces = [line for line in vocab.read_text(encoding="utf-8").splitlines() if line]
        tokenizer = transformers.BertTokenizer(vocab={p: i for i, p in enumerate(pieces)}, **kwargs)
    else:
        tokenizer = transformers.BertTokenizerFast(vocab_file=str(vocab), **kwargs)
    tokenizer.save_pretrained(out)
    if not (out / "vocab.txt").is_file():
        (out / "vocab.txt").write_bytes(vocab.read_bytes())
