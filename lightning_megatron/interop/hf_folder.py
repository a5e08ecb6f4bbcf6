"""Hugging Face folders in and out, for any family (its :class:`~.adapter.StateDictAdapter` maps the names).

Reading never runs code from the folder: ``config.json`` is parsed as JSON first and refused when it has
``auto_map`` (the folder's own model classes, which transformers would offer to run), then read with
``trust_remote_code=False``; weights come from ``model.safetensors``, the shards a
``model.safetensors.index.json`` names (inside the folder), or ``pytorch_model.bin`` through
``torch.load(weights_only=True)``.

transformers is the ``hf`` extra's, not the library's install (:func:`import_transformers`): torchmetrics, which
Lightning imports, imports it whenever it is installed, ~0.9 s of every process's start-up on 2 cores
(docs/benchmarks.md, "Start-up without transformers").

Writing (:func:`write_hf_folder`) puts the model (safetensors) and its tokenizer in a temporary folder
next to the target and swaps it in whole, so a failed export never leaves a half-written model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.atomic_files import finalize_directory, fsync_tree
from lightning_megatron.interop.adapter import StateDictAdapter
from lightning_megatron.saved_model import SavedModel

__all__ = ["HF_EXTRA", "import_transformers", "read_hf_config", "read_hf_weights", "read_hf_folder",
           "read_hf_architecture", "hf_model", "hf_model_from_saved", "check_output_folder", "write_hf_folder",
           "swap_in_folder", "tokenizer_size_problem"]


HF_EXTRA = "pip install 'lightning-megatron[hf]'"
"""The install that brings transformers (and Hugging Face datasets)."""


def import_transformers(purpose: str) -> Any:
    """The ``transformers`` module; without it an ``ImportError`` saying that ``purpose`` needs it and which install
    brings it (:data:`HF_EXTRA`)."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"{purpose} needs the `transformers` package: {HF_EXTRA}") from None
    return transformers


def read_hf_config(path: str | os.PathLike[str]) -> Any:
    """The ``config.json`` of a Hugging Face folder as a transformers config, never running code from the
    folder: a config with ``auto_map`` is refused, and transformers is called with ``trust_remote_code=False``."""
    transformers = import_transformers(f"reading the Hugging Face folder {str(path)!r}")

    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{str(file)!r} cannot be read as JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{str(file)!r} is not a JSON object")
    if "auto_map" in raw:
        raise ValueError(
            f"{str(file)!r} has auto_map {raw['auto_map']!r}: the folder ships its own model code, and "
            f"lightning_megatron never runs code from a model folder (trust_remote_code=False). Use a folder of "
            f"transformers' own model classes (if the weights are a plain BERT, Llama, ..., remove auto_map)")
    return transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False)


def read_hf_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face folder, never unpickling code: ``model.safetensors``, the shards a
    ``model.safetensors.index.json`` names (inside the folder), ``pytorch_model.bin`` or the shards a
    ``pytorch_model.bin.index.json`` names, through ``torch.load(weights_only=True)``."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return _load_safetensors(path / "model.safetensors")
    if (path / "model.safetensors.index.json").is_file():
        return _load_shards(path, "model.safetensors.index.json", ".safetensors", _load_safetensors)
    if (path / "pytorch_model.bin").is_file():
        return _load_bin(path / "pytorch_model.bin")
    if (path / "pytorch_model.bin.index.json").is_file():
        return _load_shards(path, "pytorch_model.bin.index.json", ".bin", _load_bin)
    raise FileNotFoundError(f"{str(path)!r} has neither model.safetensors nor pytorch_model.bin (nor an index of "
                            f"either's shards)")


def _load_shards(path: Path, index_name: str, suffix: str,
                 load: Callable[[Path], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors of the shards an index names: files of the folder, each read by ``load``."""
    index = path / index_name
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, KeyError, TypeError) as e:
        raise ValueError(f"{str(index)!r} is not a shard index (no weight_map): {e}") from e
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(weight_map.values())):
        # a file name of the folder: no path in it (the hub cache's shards are links into its blobs/: followed)
        plain = isinstance(name, str) and name == Path(name).name and name not in (".", "..")
        if not plain or not name.endswith(suffix) or not (path / name).is_file():
            raise ValueError(f"{str(index)!r} names {name!r}: shards must be {suffix} files inside the folder")
        out.update(load(path / name))
    return out


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``pytorch_model*.bin`` (``weights_only``: a global outside torch's allow-list is refused,
    never imported)."""
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        said = next((line.strip() for line in str(e).splitlines() if "global" in line.lower()), str(e)[:200])
        raise ValueError(f"{str(file)!r} holds more than tensors ({said}): refused, nothing in it was run; use the "
                         f"folder's safetensors weights") from None


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; a damaged one refused by its name."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except SafetensorError as e:
        raise ValueError(f"{str(file)!r} cannot be read ({e}): the file is damaged or incomplete; download it "
                         f"again") from None


def _family_config(path: Path, adapter: StateDictAdapter, owner: str) -> Any:
    config = read_hf_config(path)
    if config.model_type not in adapter.hf_model_types:
        raise ValueError(f"{str(path)!r} holds a {config.model_type!r} model; {owner} reads "
                         f"{' and '.join(map(repr, adapter.hf_model_types))} folders")
    return config


def read_hf_architecture(path: str | os.PathLike[str], adapter: StateDictAdapter, owner: str) -> dict[str, Any]:
    """The module arguments a Hugging Face folder's ``config.json`` fixes (no tensor read)."""
    return adapter.architecture_from_hf(_family_config(Path(path), adapter, owner))


def read_hf_folder(path: str | os.PathLike[str], adapter: StateDictAdapter, owner: str) -> SavedModel:
    """A Hugging Face folder of one of ``adapter.hf_model_types`` as our full state dict plus its architecture
    (settings the family cannot compute are refused before any tensor is read)."""
    path = Path(path)
    config = _family_config(path, adapter, owner)
    architecture = adapter.architecture_from_hf(config)
    return adapter.state_dict_from_hf(read_hf_weights(path), config, architecture, source=str(path / "config.json"))


def hf_model(config: Any, hf_state_dict: dict[str, torch.Tensor]) -> Any:
    """The transformers model ``config.architectures[0]`` with ``hf_state_dict`` loaded: every parameter must
    be given (buffers, and a tied head that shares its tensor, are not parameters of their own), nothing
    else may be."""
    transformers = import_transformers("building a transformers model")
    cls = getattr(transformers, config.architectures[0])
    model = cls(config)
    parameters = {name for name, _ in model.named_parameters()}  # a tied weight appears once
    result = model.load_state_dict(hf_state_dict, strict=False)
    missing = [k for k in result.missing_keys if k in parameters]
    if missing or result.unexpected_keys:
        raise ValueError(f"export to {cls.__name__} does not match transformers' keys: missing {missing}, "
                         f"unexpected {list(result.unexpected_keys)}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def hf_model_from_saved(saved: SavedModel, adapter: StateDictAdapter, *,
                        tokenizer: str | os.PathLike[str] | None = None) -> tuple[Any, Callable[[Path], None]]:
    """``(transformers model, write_tokenizer(folder))`` of a saved model of ours, through the family's
    adapter: its config (refusals first), its tokenizer (size checked), its state dict, loaded strictly, in the
    saved weights' dtype when they all have one (a bf16 model's tensors go out bf16, bit for bit)."""
    config = adapter.hf_config(saved)
    write_tokenizer = adapter.hf_tokenizer(saved, config, tokenizer)
    read = _ReadKeys(saved.state_dict)
    hf_state_dict = adapter.state_dict_to_hf(dataclasses.replace(saved, state_dict=read), config)
    left_out = _left_out(saved, adapter, config, hf_state_dict, read.read)
    if left_out:
        raise ValueError(f"export hf: the checkpoint holds {len(left_out)} tensor(s) that {config.architectures[0]} "
                         f"has no place for: {', '.join(left_out[:4])}{' ...' if len(left_out) > 4 else ''} (a "
                         f"parameter of a module of your own?); the export would leave them out, and the model "
                         f"would compute without them. Export a model of the family's own architecture")
    model = hf_model(config, hf_state_dict)
    dtypes = {t.dtype for t in hf_state_dict.values() if t.is_floating_point()}
    if len(dtypes) == 1 and dtypes != {model.dtype}:  # a 16-bit model's weights as they are (the config says so)
        model = model.to(dtypes.pop())
    return model, write_tokenizer


class _ReadKeys(dict):
    """A state dict that records the names read from it by name (``[name]``, ``get``, ``pop``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def pop(self, key: str, *default: Any) -> Any:
        self.read.add(key)
        return super().pop(key, *default)


def _left_out(saved: SavedModel, adapter: StateDictAdapter, config: Any, hf_state_dict: dict[str, torch.Tensor],
              read: set[str]) -> list[str]:
    """Names of the saved tensors the transformers state dict does not carry: neither read by name by the
    adapter's mapping nor in that mapping read back (:meth:`~StateDictAdapter.state_dict_from_hf` of it: a
    mapping may rename by pattern). An adapter maps the names it knows, so a tensor of a user's own module
    would otherwise be dropped, unsaid."""
    import warnings

    with warnings.catch_warnings():  # reading it back says what an import would (a head it starts fresh)
        warnings.simplefilter("ignore")
        back = adapter.state_dict_from_hf(dict(hf_state_dict), config, adapter.architecture_from_hf(config),
                                          source="the exported config.json")
    return sorted(set(saved.state_dict) - set(back.state_dict) - read)


def tokenizer_size_problem(saved: SavedModel, size: int, model_vocab: int, source: Any, option: str) -> str | None:
    """Why a tokenizer of ``size`` pieces (from ``source``) cannot go out with a model of ``model_vocab`` rows; None
    when they are equal, or when the tokenizer is smaller and the checkpoint records its data's vocabulary with just
    that many pieces (a model set larger than its tokenizer, as Hugging Face configs often are: Qwen2's 151,936 rows
    over 151,665 tokens; the pieces themselves are compared once written). ``option``: the CLI's flag naming it."""
    recorded = saved.vocabulary.get("vocab_size") if isinstance(saved.vocabulary, dict) else None
    if size == model_vocab or (size < model_vocab and recorded == size):
        return None
    noun = "tokens" if option == "--tokenizer" else "pieces"
    return (f"{option.removeprefix('--').replace('_', ' ')} {str(source)!r} has {size} {noun} but the model's "
            f"vocabulary is {model_vocab}: pass {option} with the vocabulary it was trained with")


def check_output_folder(output: str | os.PathLike[str], overwrite: bool) -> Path:
    """``output`` as a Path; a file, or a non-empty folder without ``overwrite``, is refused."""
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--output {str(out)!r} is a file: give a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"--output {str(out)!r} is not empty: choose another folder, or pass --overwrite to "
                              f"replace it")
    if out.is_dir() and any(out.iterdir()) and not any((out / n).is_file() for n in _EXPORT_FILES):
        # --overwrite replaces an earlier export, deleting the folder: never a folder of something else (a typo'd
        # --output of a home or data folder was deleted whole)
        raise FileExistsError(f"--output {str(out)!r} is not an earlier export (it holds none of "
                              f"{', '.join(_EXPORT_FILES)}): --overwrite would delete what it holds; choose a new "
                              f"or empty folder")
    return out


_EXPORT_FILES = ("config.json", "adapter_config.json")
"""What an export folder (a Hugging Face model's, a PEFT adapter's) holds: ``--overwrite`` replaces only those."""


def write_hf_folder(model: Any, write_tokenizer: Callable[[Path], None], out: Path) -> None:
    """The model (safetensors) and its tokenizer written next to ``out`` under a temporary name, then swapped in."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        write_tokenizer(tmp)
        swap_in_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def swap_in_folder(new: Path, target: Path) -> None:
    """Put the finished folder ``new`` at ``target`` as a checkpoint save does (:mod:`lightning_megatron.atomic_files`:
    its files synced, then exchanged with the old folder in one step, which is removed after: a crash leaves the old
    export or the new one whole, never no model or a half-written one). Its folders and files get the modes the
    process's umask gives a new folder and file (``mkdtemp`` made it 0700, and some writers' files are 0600: others
    on a shared cluster could not read an export)."""
    mask = _umask()
    for path in [new, *new.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
    fsync_tree(new)
    finalize_directory(new, target)
