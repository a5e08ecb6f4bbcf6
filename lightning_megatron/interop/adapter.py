"""The contract between the generic readers / writers of :mod:`lightning_megatron.interop` and a model family.

A family writes one adapter (``models/<family>/interop.py``) and its LightningModule class declares it::

    class GPTLightningModule(MegatronLightningModule):
        interop = GPTInterop()

Every way in and out goes through the adapter of the class that reads or wrote the weights
(``from_pretrained``, ``--model.init_from``, ``export hf``): which family a source belongs to is never
guessed from its tensor names. The generic side owns the files (``config.json`` without running code,
safetensors / ``weights_only`` loads, Megatron-LM's rank files through the restricted unpickler, DCP,
TP merges, the atomic export folder); the adapter owns the names, the architecture and the refusals.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_megatron.interop.tp import TPLayout
from lightning_megatron.saved_model import SavedModel

__all__ = ["StateDictAdapter", "check_adapter"]


@runtime_checkable
class StateDictAdapter(Protocol):
    """What a model family gives the generic readers and writers. Architecture dicts are flat, keyed by the
    module's constructor arguments (``num_layers``, ``hidden_size``, ...); state dicts are full (TP=1),
    under our names with global layer numbers."""

    hf_model_types: tuple[str, ...]
    """transformers ``model_type`` s (``config.json``) the family reads, e.g. ``("llama", "gpt2")``."""
    megatron_prefixes: tuple[str, ...]
    """Top-level names of the family's tensors in a megatron-core checkpoint (``"embedding."``, ...)."""

    def architecture_from_hf(self, config: Any) -> dict[str, Any]:
        """The module arguments a transformers config fixes; refuses, by name, what the family cannot compute."""
        ...

    def state_dict_from_hf(self, hf_state_dict: dict[str, torch.Tensor], config: Any, architecture: dict[str, Any],
                           *, source: str) -> SavedModel:
        """Our state dict (unpadded vocabulary; ``hparams`` = ``architecture``, ``fresh`` = heads the source
        lacks) from a transformers one. ``source`` names the folder's ``config.json`` in errors."""
        ...

    def architecture_from_megatron(self, args: argparse.Namespace | None, num_layers: int) -> dict[str, Any]:
        """The module arguments a Megatron-LM checkpoint's ``args`` fix (``num_layers`` counted from its
        tensors); refuses, by name, what the family lacks."""
        ...

    def state_dict_from_megatron(self, state_dict: dict[str, torch.Tensor],
                                 architecture: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Our state dict from megatron-core's (TP-merged, global layers, fused norms renamed, vocabulary as
        padded): the tied output layer's copy checked and dropped, buffers dropped."""
        ...

    def tp_layout(self, state_dict: Mapping[str, torch.Tensor]) -> TPLayout:
        """How the family's tensors are split over TP ranks (``state_dict`` may be one rank's shard: a
        family whose layout depends on the model, e.g. a gated MLP, reads it from the shapes)."""
        ...

    def hf_config(self, saved: SavedModel) -> Any:
        """The transformers config of a saved model of ours, ``architectures[0]`` naming the transformers
        model class; refuses, by name, what that class would compute otherwise."""
        ...

    def state_dict_to_hf(self, saved: SavedModel, config: Any) -> dict[str, torch.Tensor]:
        """The transformers state dict (keys of ``config.architectures[0]``) of a saved model of ours."""
        ...

    def hf_tokenizer(self, saved: SavedModel, config: Any,
                     tokenizer: str | os.PathLike[str] | None) -> Callable[[Path], None]:
        """Writes the tokenizer files into an export folder. ``tokenizer``: the file the user names, None:
        the one the checkpoint's datamodule recorded. Refuses one whose size is not the model's vocabulary;
        may set the config's special token ids."""
        ...


_MEMBERS = ("hf_model_types", "megatron_prefixes", "architecture_from_hf", "state_dict_from_hf",
            "architecture_from_megatron", "state_dict_from_megatron", "tp_layout", "hf_config", "state_dict_to_hf",
            "hf_tokenizer")


def check_adapter(adapter: object, owner: str) -> StateDictAdapter:
    """``adapter`` when it has every member of :class:`StateDictAdapter`; else an error naming the missing ones."""
    missing = [m for m in _MEMBERS if not hasattr(adapter, m)]
    if missing:
        raise TypeError(f"{owner}.interop = {type(adapter).__name__}(...) is not a StateDictAdapter "
                        f"(lightning_megatron.interop): it lacks {', '.join(missing)}")
    return adapter  # type: ignore[return-value]
