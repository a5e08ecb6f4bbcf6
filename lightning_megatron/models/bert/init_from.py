"""``init_from``: start a BertLightningModule from pretrained weights, at any TP/PP/VP layout.

One mechanism for every source: the source becomes a :class:`~.convert.SavedModel` (a full TP=1
state dict under our global names, unpadded vocabulary, plus the architecture it needs), which
:func:`load_full_state_dict` slices into each rank's chunks. Sources (:func:`read_pretrained`):

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

import torch
from torch import nn
from typing_extensions import Self

from lightning_megatron.models.bert.convert import SavedModel, read_model_checkpoint
from lightning_megatron.tensor_parallel.param_facts import param_facts

__all__ = ["PretrainedWeights", "read_pretrained", "read_hf_folder", "load_full_state_dict", "check_architecture",
           "ARCHITECTURE_KEYS", "read_architecture", "architecture_conflicts"]

ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "spec", "activation",
                     "lm_head_activation", "layernorm_epsilon", "max_sequence_length", "vocab_size",
                     # the decoder family's (GPTLightningModule), absent from BERT sources
                     "num_query_groups", "kv_channels", "position_embedding_type", "add_bias_linear",
                     "gated_linear_unit", "rotary_base", "rotary_percent", "untie_embeddings_and_output_weights")
"""Module arguments a source fixes (checked by :func:`check_architecture`)."""

_GPT_MODEL_TYPES = ("llama", "gpt2")  # Hugging Face folders read by lightning_megatron.models.gpt.convert

_HF_TO_OURS_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
                   "silu": "silu", "swish": "silu"}


def read_hf_folder(path: str | os.PathLike[str]) -> SavedModel:
    """A Hugging Face BERT / MegatronBERT (or Llama / GPT-2: :mod:`lightning_megatron.models.gpt.convert`)
    folder as a full state dict under our names."""
    from lightning_megatron.models.bert.hf import bert_config_from_hf, bert_state_dict_from_hf

    from lightning_megatron.models.bert.hf import read_hf_weights

    path = Path(path)
    config = _hf_config(path)
    if config.model_type in _GPT_MODEL_TYPES:
        from lightning_megatron.models.gpt.convert import read_hf_gpt_folder

        return read_hf_gpt_folder(path, config)
    hf_sd = read_hf_weights(path)
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
    """The module arguments a transformers BERT / MegatronBERT (or Llama / GPT-2) config fixes."""
    if config.model_type in _GPT_MODEL_TYPES:
        from lightning_megatron.models.gpt.hf import hf_architecture

        return hf_architecture(config)
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
    if config.model_type not in ("bert", "megatron-bert", *_GPT_MODEL_TYPES):
        raise ValueError(f"{str(path)!r} holds a {config.model_type!r} model; init_from reads 'bert', "
                         f"'megatron-bert', 'llama' and 'gpt2' folders")
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
        ckpt.validate_checkpoint_dir(path)
        try:
            extra = torch.load(path / "extra.pt", weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - name the file and the cause
            raise ckpt.CheckpointError(f"checkpoint {str(path)!r}: extra.pt cannot be read safely "
                                       f"(weights_only=True): {e}") from e
        hparams = dict(extra.get("hyper_parameters") or {})
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
    wrong = architecture_conflicts(hparams, source)
    if wrong:
        flags = " ".join(f"--model.{k} {v}" for k, _, v in wrong)
        details = ", ".join(f"{k}={h!r} (needs {w!r})" for k, h, w in wrong)
        raise ValueError(f"init_from={source_name!r}: the model's {details}. Set: {flags}")


def load_full_state_dict(chunks: list[nn.Module], named_parameters: list[tuple[str, nn.Parameter]],
                         full: dict[str, torch.Tensor], *, tp_rank: int, tp_size: int, num_layers: int,
                         source_name: str, optional: tuple[str, ...] = (), fresh: tuple[str, ...] = ()) -> None:
    """Copy this rank's slice of every tensor of ``full`` (TP=1, unpadded vocab, global layer names)
    into the parameters ``named_parameters`` (global names, as ``sharded_named_parameters``).
    Parameters whose names start with one of ``optional`` keep their initialization when the source
    lacks them (a warning names them); those named in ``fresh`` keep it silently (the caller warns once)."""
    layers = {int(k.split(".")[2]) for k in full if k.startswith(("encoder.layers.", "decoder.layers."))}
    if layers and max(layers) + 1 != num_layers:
        raise ValueError(f"init_from={source_name!r} has {max(layers) + 1} layers but the model has "
                         f"num_layers={num_layers}: set --model.num_layers {max(layers) + 1}")
    missing, skipped = [], []
    with torch.no_grad():
        for name, p in named_parameters:
            key = name
            facts = param_facts(p)
            if name == "output_layer.weight" and facts.shared_embedding:
                key = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
            t = full.get(key)
            if t is None:
                if key in fresh:
                    continue
                if key.startswith(optional) and optional:
                    skipped.append(key)
                else:
                    missing.append(key)
                continue
            sharded = facts.tensor_model_parallel and tp_size > 1
            dim = facts.partition_dim % p.dim() if sharded else 0
            real = facts.real_vocab_size
            if real is not None:
                padded = p.size(0) * (tp_size if sharded else 1)
                if t.size(0) < real:
                    raise ValueError(f"init_from={source_name!r}: {key} has a vocabulary of {t.size(0)} rows, "
                                     f"the model's vocab_size is {real}: set --model.vocab_size {t.size(0)}")
                t = t[:real]  # Megatron-LM pads its vocabulary; the padding never is a prediction
                t = torch.cat([t, t.new_zeros((padded - real, *t.shape[1:]))]) if padded > real else t
            if sharded and facts.partition_stride > 1:
                # Megatron's strided partition (a SwiGLU fc1: full [gate; up], each rank [gate_r; up_r]):
                # this rank's slice of every one of the stride blocks, in order.
                t = torch.cat([b.chunk(tp_size, dim=dim)[tp_rank] for b in t.chunk(facts.partition_stride, dim=dim)],
                              dim=dim)
            elif sharded:
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


class PretrainedWeights:
    """``init_from`` for a :class:`~lightning_megatron.module.MegatronLightningModule` whose
    ``sharded_named_parameters`` give our global names (BERT's and the GPT family's modules): the
    module calls :meth:`load_pretrained` from ``on_chunks_built`` when its ``init_from`` argument is set."""

    def load_pretrained(self, source: str | SavedModel, *, everything: bool = False) -> None:
        """Copy pretrained weights (see ``init_from``) into this rank's chunks, any layout
        (``everything``: fine-tuning heads too, as ``load_from_checkpoint`` does)."""
        if self._trainer is not None and self.trainer.optimizers:
            raise RuntimeError("load_pretrained after the optimizers exist would leave their fp32 main params and "
                               "state behind the new weights; load in configure_model (init_from=...)")
        name = source if isinstance(source, str) else "<state dict>"
        saved = read_pretrained(source) if isinstance(source, str) else source
        check_architecture(dict(self.hparams), saved.hparams, name)
        ps = self.parallel_state
        params = list(self.sharded_named_parameters()) if everything else self.pretrained_parameters()
        load_full_state_dict(list(self.model_chunks), params, saved.state_dict,
                             tp_rank=ps.tp_rank, tp_size=ps.tp_size, num_layers=self.config.num_layers,
                             source_name=name, optional=() if everything else self.optional_pretrained,
                             fresh=saved.fresh)
        fresh = [n for n, _ in params if n in saved.fresh]
        if fresh and ps.tp_rank == 0 and ps.dp_rank == 0:  # once: the heads live on the last stage
            import warnings

            warnings.warn(f"init_from={name!r} has no {fresh} (its model has no such heads): they are initialised "
                          f"fresh, from init_seed", UserWarning, stacklevel=2)

    @classmethod
    def from_pretrained(cls, source: str, **kwargs: Any) -> Self:
        """A module with the architecture of ``source`` (any ``init_from`` source: its ``config.json``,
        saved hyper-parameters or Megatron-LM ``args``), started from its weights in ``configure_model``.
        ``kwargs`` set the other arguments; architecture arguments among them must agree with the source."""
        architecture = read_architecture(source)
        wrong = architecture_conflicts(kwargs, architecture)
        if wrong:
            raise ValueError(f"from_pretrained({source!r}): " + ", ".join(
                f"{k}={h!r} but the source has {w!r}" for k, h, w in wrong) + ": drop these arguments")
        return cls(**{**architecture, **kwargs, "init_from": source})

    optional_pretrained: tuple[str, ...] = ()
    """Name prefixes ``init_from`` may leave at their initialization when the source lacks them."""

    def pretrained_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The (global name, parameter) pairs ``init_from`` fills (fine-tuning heads excluded)."""
        return list(self.sharded_named_parameters())
