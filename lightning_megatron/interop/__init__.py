"""Weights in and out of other frameworks, for any model family (docs/interop.md).

The generic half: Hugging Face folders (:mod:`.hf_folder`), Megatron-LM legacy and ``torch_dist``
checkpoints (:mod:`.megatron_lm`), tensor-parallel merges and shards (:mod:`.tp`), which kind a source is
(:mod:`.sources`). The family half: one :class:`StateDictAdapter` per family (``models/<family>/interop.py``),
declared by its LightningModule class (``interop = ...``); every read and every export goes through the
adapter of the class, never a family guessed from tensor names.

No Lightning, CLI, ``check/``, ``callbacks/`` or model family is imported here.
"""

from __future__ import annotations

from lightning_megatron.interop.adapter import StateDictAdapter, check_adapter
from lightning_megatron.interop.sources import read_architecture, read_pretrained, source_kind
from lightning_megatron.interop.tp import TPLayout

__all__ = ["StateDictAdapter", "check_adapter", "TPLayout", "read_pretrained", "read_architecture", "source_kind"]
