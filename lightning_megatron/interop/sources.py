"""``init_from`` / ``from_pretrained`` sources: which kind of source a path is (by its files), read through the
adapter of the class that reads it.

- a lightning_megatron checkpoint directory (``lightning_megatron.json``): every class reads it;
- a Hugging Face folder (``config.json``) and a Megatron-LM checkpoint (legacy ``model_optim_rng.pt`` or
  ``torch_dist``): a class whose family declares a :class:`~.adapter.StateDictAdapter`.

The kind of a source is told by its files; the family is the reading class's, never read from tensor names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from lightning_megatron.interop.adapter import StateDictAdapter, check_adapter
from lightning_megatron.saved_model import SavedModel

__all__ = ["source_kind", "read_pretrained", "read_architecture"]


def source_kind(path: str | os.PathLike[str]) -> Literal["ours", "hf", "megatron"] | None:
    """``"ours"``, ``"hf"`` or ``"megatron"`` by the files ``path`` holds; None for anything else."""
    from lightning_megatron import checkpoint as ckpt
    from lightning_megatron.interop.megatron_lm import is_megatron_checkpoint

    path = Path(path)
    if path.is_dir() and (path / ckpt.MARKER).is_file():
        return "ours"
    if path.is_dir() and (path / "config.json").is_file():
        return "hf"
    if path.exists() and is_megatron_checkpoint(path):
        return "megatron"
    return None


def read_pretrained(source: str | os.PathLike[str], adapter: StateDictAdapter | None, *,
                    architecture_keys: tuple[str, ...], owner: str) -> SavedModel:
    """The weights of ``source`` for the class ``owner`` (whose family's adapter is ``adapter``, None: our
    checkpoints only); our checkpoints' hyper-parameters restricted to ``architecture_keys``."""
    from lightning_megatron import checkpoint as ckpt
    from lightning_megatron.saved_model import read_model_checkpoint

    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"init_from={str(source)!r} does not exist")
    kind = source_kind(path)
    if kind == "ours":
        saved = read_model_checkpoint(path)
        saved.hparams = {k: saved.hparams[k] for k in architecture_keys if k in saved.hparams}
        return saved
    if adapter is None:
        raise ValueError(f"init_from={str(source)!r} is not a lightning_megatron checkpoint directory "
                         f"({ckpt.MARKER} missing), the only source {owner} reads")
    adapter = check_adapter(adapter, owner)
    if kind == "hf":
        from lightning_megatron.interop.hf_folder import read_hf_folder

        return read_hf_folder(path, adapter, owner)
    if kind == "megatron":
        from lightning_megatron.interop.megatron_lm import read_megatron_checkpoint

        return read_megatron_checkpoint(path, adapter)
    raise ValueError(f"init_from={str(source)!r} is not a lightning_megatron checkpoint directory, a Hugging Face "
                     f"folder (config.json) or a Megatron-LM checkpoint (model_optim_rng.pt / torch_dist)")


def read_architecture(source: str | os.PathLike[str], adapter: StateDictAdapter | None, *,
                      architecture_keys: tuple[str, ...], owner: str) -> dict[str, Any]:
    """The ``architecture_keys`` arguments ``source`` fixes, from its configuration where it has one (our
    saved hyper-parameters, a ``config.json``, Megatron-LM's ``args``), without reading its tensors."""
    from lightning_megatron.saved_model import read_saved_hparams

    kind = source_kind(source)
    if adapter is None or kind == "ours":
        hparams = read_saved_hparams(source)  # refuses what is not our checkpoint
        return {k: hparams[k] for k in architecture_keys if k in hparams}
    adapter = check_adapter(adapter, owner)
    if kind == "hf":
        from lightning_megatron.interop.hf_folder import read_hf_architecture

        return read_hf_architecture(source, adapter, owner)
    if kind == "megatron":
        from lightning_megatron.interop.megatron_lm import read_megatron_architecture

        return read_megatron_architecture(source, adapter)
    return dict(read_pretrained(source, adapter, architecture_keys=architecture_keys, owner=owner).hparams)
