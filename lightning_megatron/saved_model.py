"""A model's weights without a layout, for any model family: read from our checkpoints, sliced into a rank.

A lightning_megatron checkpoint stores every model tensor as a DCP *global* tensor under
``model.<name>`` (global layer numbers, vocabulary unpadded, the tied word embedding once), whatever
the TP/PP/VP/DP layout it was written at. :func:`read_model_checkpoint` reads those tensors on ONE
process (no process group) into a :class:`SavedModel` (a plain TP=1 state dict with the module's and
the datamodule's hyper-parameters from ``extra.pt``, ``torch.load(weights_only=True)``; the module's
also flat, its config record's fields at the top level as every architecture dict has them), and
:func:`load_full_state_dict` copies this rank's slice of each tensor into a built model at any layout
(from the parameters' typed facts: partition dim, real vocabulary rows, tied embedding).

:class:`~lightning_megatron.module.MegatronLightningModule` builds ``load_from_checkpoint``,
``from_pretrained`` and ``init_from`` on these for every family; a family adds the sources it reads
besides our checkpoints through its state-dict adapter (:mod:`lightning_megatron.interop`).

Every checkpoint records the class path of the module that wrote it (:data:`MODULE_CLASS` in
``extra.pt``, a plain string: :attr:`SavedModel.module_class`); ``export hf`` takes that class's adapter.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_megatron import checkpoint as ckpt
from lightning_megatron import dcp_io
from lightning_megatron.checkpoint_data import LABEL_NAMES, VOCABULARY
from lightning_megatron.tensor_parallel.param_facts import param_facts

__all__ = ["SavedModel", "MODULE_CLASS", "class_path", "flat_hparams", "load_full_state_dict", "read_model_checkpoint",
           "read_saved_hparams", "refuse_architecture", "state_digest"]

MODULE_CLASS = "module_class"
"""The ``extra.pt`` entry naming the class of the module that wrote the checkpoint (``package.module.Class``)."""

_LAYER = re.compile(r"^\w+\.layers\.(\d+)\.")
"""A transformer layer's parameter under its global number (``encoder.layers.3.*``, ``decoder.layers.3.*``)."""


@dataclass(kw_only=True)
class SavedModel:
    """A checkpoint's model, layout-free."""

    state_dict: dict[str, torch.Tensor]
    """Full tensors under our global names (``encoder.layers.<global i>.*``), vocabulary unpadded."""
    hparams: dict[str, Any] = field(default_factory=dict)
    """The architecture and the other hyper-parameters, flat: keyed by the config record's field names
    (``num_layers``, ``spec``, ...), as every architecture dict (:func:`flat_hparams` of the saved ones)."""
    module_hparams: dict[str, Any] = field(default_factory=dict)
    """The LightningModule's ``hyper_parameters`` as saved (its init arguments; a checkpoint written before
    a module's arguments moved holds the old spelling: ``upgrade_hparams`` maps it)."""
    datamodule_hparams: dict[str, Any] = field(default_factory=dict)
    """The datamodule's hyper-parameters (``vocab_file``, ...), when it saved them."""
    layout: dict[str, Any] = field(default_factory=dict)
    """The layout it was saved at (``tp``, ``pp``, ``vp``, ``dp``, ``world_size``)."""
    fresh: tuple[str, ...] = ()
    """Names of the model's tensors the source does not have and ``init_from`` initialises fresh (the
    MLM / binary heads of an encoder-only Hugging Face model)."""
    module_class: str | None = None
    """The class path of the module that wrote our checkpoint (:data:`MODULE_CLASS`); None for
    checkpoints written before it was recorded, and for other sources."""
    vocabulary: dict[str, Any] | None = None
    """What our checkpoint records of the vocabulary its data was tokenized with
    (:func:`~lightning_megatron.data.dataset_vocab.vocabulary_record`); None where it records none."""
    label_names: list[str] | None = None
    """A classifier checkpoint's class names in class-id order
    (:data:`~lightning_megatron.checkpoint_data.LABEL_NAMES`); None where it records none."""


def class_path(cls: type) -> str:
    """``package.module.Class``: how a checkpoint names the class that wrote it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _module_class(extra: dict[str, Any], path: Path) -> str | None:
    """The checkpoint's :data:`MODULE_CLASS` record (a string; whether it names an importable class is
    the business of whoever imports it), or None when it has none."""
    value = extra.get(MODULE_CLASS)
    if value is not None and not isinstance(value, str):
        raise ckpt.CheckpointError(f"checkpoint {str(path)!r}: extra.pt's {MODULE_CLASS!r} is {value!r}, not a class "
                                   f"path (package.module.Class)")
    return value


def read_model_checkpoint(path: str | os.PathLike[str]) -> SavedModel:
    """Read the model of a lightning_megatron checkpoint directory (any layout) on this process only."""
    path = Path(path)
    info = ckpt.verify_checkpoint(path)  # the one verification of every load path
    read = dcp_io.read_metadata(path)
    metadata = read.state_dict_metadata
    problem = dcp_io.model_metadata_problem(read)  # before a byte is allocated for what it claims
    if problem is not None:
        raise ckpt.CheckpointError(f"checkpoint {str(path)!r}: {problem}")
    state = {key: torch.zeros(tuple(md.size), dtype=md.properties.dtype)  # never uninitialised memory
             for key, md in metadata.items() if key.startswith("model.") and hasattr(md, "size")}
    if not state:
        raise ckpt.CheckpointError(f"checkpoint {str(path)!r} holds no model tensors (no 'model.*' keys)")
    # no_dist: one process reads the global tensors, whether or not a process group exists.
    dcp_io.load(state, path, single_process=True)
    extra = ckpt.load_plain(path / "extra.pt", path)
    if not isinstance(extra, dict) or not isinstance(extra.get("hyper_parameters") or {}, dict):
        raise ckpt.CheckpointError(f"checkpoint {str(path)!r}: extra.pt is not what this library writes (a "
                                   f"{type(extra).__name__}{'' if isinstance(extra, dict) else ', not a dict'})")
    hparams = dict(extra.get("hyper_parameters") or {})
    return SavedModel(state_dict={k.removeprefix("model."): v for k, v in state.items()},
                      hparams=flat_hparams(hparams), module_hparams=hparams,
                      datamodule_hparams=dict(extra.get("datamodule_hyper_parameters") or {}),
                      layout=dict(info.get("layout") or {}), module_class=_module_class(extra, path),
                      vocabulary=extra.get(VOCABULARY) if isinstance(extra.get(VOCABULARY), dict) else None,
                      label_names=_label_names(extra.get(LABEL_NAMES)))


def _label_names(value: Any) -> list[str] | None:
    """The recorded class names when they are a list of strings (what :func:`~lightning_megatron.checkpoint_data.
    record_data` writes), else None."""
    return list(value) if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value) else None


def state_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 of a state dict's tensors (names, dtypes, shapes and bytes, in name order): the same weights give
    the same digest whatever file format or layout they came from."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def flat_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """Saved hyper-parameters with the config record's fields (``checkpoint.CONFIG_HPARAM``) at the top level:
    ``{"config": {"num_layers": 2}, "lr": 1e-3}`` -> ``{"num_layers": 2, "lr": 1e-3}``; flat ones as they are."""
    config = hparams.get(ckpt.CONFIG_HPARAM)
    if not isinstance(config, dict):
        return dict(hparams)
    return {**{k: v for k, v in hparams.items() if k != ckpt.CONFIG_HPARAM}, **config}


def read_saved_hparams(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The module's saved hyper-parameters of a lightning_megatron checkpoint directory (``extra.pt``,
    ``weights_only=True``), without reading its tensors; flat (:func:`flat_hparams`), as
    :attr:`SavedModel.hparams`."""
    path = Path(path)
    ckpt.validate_checkpoint_dir(path)
    extra = ckpt.load_plain(path / "extra.pt", path)
    if not isinstance(extra, dict) or not isinstance(extra.get("hyper_parameters") or {}, dict):
        raise ckpt.CheckpointError(f"checkpoint {str(path)!r}: extra.pt is not what this library writes")
    return flat_hparams(dict(extra.get("hyper_parameters") or {}))


def saved_shape(path: str | os.PathLike[str], name: str) -> tuple[int, ...] | None:
    """The global shape of the model tensor ``name`` (a module's parameter name) in a lightning_megatron checkpoint
    directory, from its DCP metadata, without reading any tensor; None where it holds no such tensor."""
    md = dcp_io.read_metadata(Path(path)).state_dict_metadata.get(f"model.{name}")
    return tuple(md.size) if md is not None and hasattr(md, "size") else None


def refuse_architecture(wrong: list[tuple[str, Any, Any]], source_name: str, *, flag_prefix: str = "--model.") -> None:
    """Raise listing every ``(argument, the module's value, the source's)`` that differs, with the flags to set
    (``flag_prefix``: ``--model.config.`` for a language model's config record)."""
    if wrong:
        flags = " ".join(f"{flag_prefix}{k} {v}" for k, _, v in wrong)
        details = ", ".join(f"{k}={h!r} (needs {w!r})" for k, h, w in wrong)
        raise ValueError(f"init_from={source_name!r}: the model's {details}. Set: {flags}")


def load_full_state_dict(chunks: list[nn.Module], named_parameters: list[tuple[str, nn.Parameter]],
                         full: dict[str, torch.Tensor], *, coordinates: Mapping[str, int],
                         sizes: Mapping[str, int], num_layers: int | None,
                         source_name: str, optional: tuple[str, ...] = (), fresh: tuple[str, ...] = (),
                         missing_hint: str = "", flag_prefix: str = "--model.", not_taken: tuple[str, ...] = (),
                         agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Copy this rank's slice of every tensor of ``full`` (TP=1, unpadded vocab, global layer names)
    into the parameters ``named_parameters`` (global names, as ``sharded_named_parameters``), this rank being
    at ``coordinates`` among the dimension ``sizes`` (``ParallelState.coordinates``, ``ParallelDims.sizes()``).
    Parameters whose names start with one of ``optional`` keep their initialization when the source
    lacks them (a warning names them); those named in ``fresh`` keep it silently (the caller warns once).
    ``num_layers``: checked against the source's layers (None: not checked); ``missing_hint``: the
    family's advice when tensors are missing; ``flag_prefix``: how a fix's flag is spelled.

    A tensor of ``full`` that no parameter takes is refused (the source computed with it: a bias, a norm, a
    layer the model lacks would change the outputs), unless its name starts with one of ``not_taken`` (heads
    the module does not have, e.g. a classifier's source's masked-LM head). Where the layout splits the names
    over ranks (pipeline stages, expert ranks), ``agree`` takes this rank's flags (int32, 1 = yes) and returns
    their minimum over every rank (an all-reduce): a tensor is refused when no rank takes it, and every rank
    fails when one cannot load (none waits for the others in a later collective)."""
    layers = {int(m.group(1)) for m in map(_LAYER.match, full) if m}
    if num_layers is not None and layers and max(layers) + 1 != num_layers:
        raise ValueError(f"init_from={source_name!r} has {max(layers) + 1} layers but the model has "
                         f"num_layers={num_layers}: set {flag_prefix}num_layers {max(layers) + 1}")
    missing, skipped, errors, taken = [], [], [], set()
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
            taken.add(key)
            rank, count = facts.shard(coordinates, sizes)  # this rank's piece of the sharded dimensions
            sharded = count > 1
            dim = facts.partition_dim % p.dim() if sharded else 0
            real = facts.real_vocab_size
            if real is not None:
                padded = p.size(0) * count
                if t.size(0) < real:
                    errors.append(f"init_from={source_name!r}: {key} has a vocabulary of {t.size(0)} rows, the "
                                  f"model's vocab_size is {real}: the source was trained with another tokenizer than "
                                  f"the data's; tokenize the data with the source's tokenizer and set "
                                  f"{flag_prefix}vocab_size to its size (at most {t.size(0)}: a Megatron-LM checkpoint "
                                  f"pads its vocabulary)")
                    continue
                t = t[:real]  # Megatron-LM pads its vocabulary; the padding never is a prediction
                t = torch.cat([t, t.new_zeros((padded - real, *t.shape[1:]))]) if padded > real else t
            if sharded and facts.partition_stride > 1:
                # Megatron's strided partition (a SwiGLU fc1: full [gate; up], each rank [gate_r; up_r]):
                # this rank's slice of every one of the stride blocks, in order.
                t = torch.cat([b.chunk(count, dim=dim)[rank] for b in t.chunk(facts.partition_stride, dim=dim)],
                              dim=dim)
            elif sharded:
                t = t.chunk(count, dim=dim)[rank]
            if tuple(t.shape) != tuple(p.shape):
                errors.append(f"init_from={source_name!r}: {key} has shape {tuple(t.shape)} for this rank but the "
                              f"parameter has {tuple(p.shape)}; the model's sizes differ from the source's")
                continue
            p.copy_(t.to(p.dtype))  # before the optimizers exist: their main params are copied from p
    if missing:
        errors.append(f"init_from={source_name!r} lacks {len(missing)} tensors the model needs, e.g. "
                      f"{missing[:4]}{': ' + missing_hint if missing_hint else ''}")
    names = sorted(full)
    flags = torch.tensor([int(k not in taken and not (not_taken and k.startswith(not_taken))) for k in names]
                         + [int(not errors)], dtype=torch.int32)
    if agree is not None:
        flags = agree(flags)
    if errors:  # the first (a model of other sizes differs in every tensor), and how many more
        raise ValueError(errors[0] + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
    if not flags[-1]:
        raise ValueError(f"init_from={source_name!r} cannot be loaded on another rank (its error says why)")
    unused = [k for k, f in zip(names, flags[:-1].tolist()) if f]
    if unused:
        raise ValueError(f"init_from={source_name!r} has {len(unused)} tensors no parameter of the model takes, e.g. "
                         f"{unused[:4]}: the source computes with them and the model would not, so its outputs "
                         f"would differ (a bias, a norm or a layer the architecture lacks?)")
    if skipped:
        import warnings

        warnings.warn(f"init_from={source_name!r} has no {skipped}: they keep their initialization", UserWarning,
                      stacklevel=2)
