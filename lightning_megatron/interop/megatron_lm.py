"""Megatron-LM (megatron-core) checkpoints -> one full state dict under megatron-core's names, any family.

Two formats, any TP/PP (and VP) layout they were saved at:

- legacy per-rank files (``--ckpt-format torch``): ``[iter_XXXXXXX/]mp_rank_TT[_PPP]/model_optim_rng.pt``,
  each rank's ``state_dict()`` of the model (``model``, or ``model0``, ``model1``... per virtual stage)
  with stage-local layer numbers. The TP shards are merged by the family's :class:`~.tp.TPLayout`
  (a SwiGLU ``linear_fc1`` regrouped from ``[gate_r; up_r]``), layer numbers made global,
  ``_extra_state`` entries dropped. Read with ``torch.load(weights_only=True)``, allowing only
  ``argparse.Namespace``, NumPy's RNG-state arrays and the Megatron-LM enums of ``args`` (read as
  inert :class:`MegatronRecord` s, see :data:`MEGATRON_ARGS_CLASSES`) besides tensors;
- megatron-core's ``torch_dist`` (DCP) format: global tensors, the layers stacked along a leading
  dim under ``<stack>.layers.<name>``, read on one process with DCP (guarded metadata).

megatron-core's layer names equal ours, except the Transformer-Engine spec's norms fused into the
next linear (``linear_qkv.layer_norm_weight`` -> ``input_layernorm.weight``,
``linear_fc1.layer_norm_weight`` -> ``pre_mlp_layernorm.weight``). Megatron pads its vocabulary: the
rows travel along (``init_from`` keeps the model's ``vocab_size`` rows). The family's adapter reads the
architecture from ``args`` and finishes the state dict (tied output layer, buffers): which family it is
is the reading class's, never the tensor names'.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.interop.adapter import StateDictAdapter
from lightning_megatron.interop.tp import merge_tp_shards
from lightning_megatron.saved_model import SavedModel

__all__ = ["is_megatron_checkpoint", "read_megatron_checkpoint", "read_megatron_architecture", "MegatronCheckpoint",
           "read_legacy_checkpoint", "read_torch_dist_checkpoint", "normalize_megatron_keys", "read_args",
           "MegatronRecord", "MEGATRON_ARGS_CLASSES"]

_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_RANK_DIR = re.compile(r"mp_rank_(\d+)(?:_(\d+))?$")
_LAYER = re.compile(r"(\w+)\.layers\.(\d+)\.(.*)")
"""A transformer layer's tensor (``encoder.layers.3.*``, ``decoder.layers.3.*``): stack, number, rest."""
_STACKED = re.compile(r"(\w+\.layers\.)(\D.*)")
"""A ``torch_dist`` tensor of all layers stacked (``decoder.layers.mlp.linear_fc1.weight`` [L, ...])."""


@dataclass(kw_only=True)
class MegatronCheckpoint:
    """A Megatron-LM checkpoint's model, merged, before the family finishes it."""

    state_dict: dict[str, torch.Tensor]
    """Full tensors under megatron-core's names, global layer numbers, the vocabulary as padded."""
    args: argparse.Namespace | None
    """The training arguments saved with it (None when the file has none or they cannot be read)."""
    num_layers: int
    """Transformer layers, counted from the tensors."""
    layout: dict[str, Any] = field(default_factory=dict)
    """The layout it was saved at (``tp``, ``pp``, ``vp``), legacy files only."""


def _iteration_dir(path: Path) -> Path:
    """The directory holding ``mp_rank_*`` dirs or a torch_dist checkpoint (root -> latest iteration)."""
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        it = tracker.read_text().strip()
        return path / ("release" if it == "release" else f"iter_{int(it):07d}")
    return path


def _is_torch_dist(d: Path) -> bool:
    return d.is_dir() and (d / ".metadata").is_file()


def is_megatron_checkpoint(path: str | os.PathLike[str]) -> bool:
    path = Path(path)
    if path.is_file():
        return path.name == "model_optim_rng.pt"
    d = _iteration_dir(path)
    return d.is_dir() and (any(_RANK_DIR.match(p.name) for p in d.iterdir())
                           or (d / "metadata.json").is_file() and (d / ".metadata").is_file())


def normalize_megatron_keys(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Drop ``_extra_state`` and non-tensors; rename Transformer-Engine fused norms to ours."""
    out = {}
    for key, value in sd.items():
        if key.endswith("_extra_state") or not torch.is_tensor(value):
            continue
        for fused, ours in _FUSED_NORMS.items():
            if key.endswith(fused):
                key = key[: -len(fused)] + ours
                break
        out[key] = value
    return out


class MegatronRecord:
    """An inert stand-in for a Megatron-LM object in a checkpoint's ``args`` (an enum member such as
    ``AttnBackend.auto``): the class's full name and the arguments it was pickled with. Nothing of
    Megatron-LM is imported and no code of the file runs."""

    __slots__ = ("name", "args")

    def __init__(self, name: str, args: tuple[Any, ...]) -> None:
        self.name, self.args = name, args

    def __repr__(self) -> str:
        return f"{self.name}{self.args!r}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MegatronRecord) and (self.name, self.args) == (other.name, other.args)

    __hash__ = None  # type: ignore[assignment]


class _Record:
    """The callable the unpickler finds under a known Megatron-LM class name: builds a MegatronRecord."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any) -> MegatronRecord:
        return MegatronRecord(self.name, args)


MEGATRON_ARGS_CLASSES = tuple(f"megatron.core.{name}" for name in (
    "enums.ModelType", "enums.Fp8Recipe", "transformer.enums.ModelType", "transformer.enums.AttnBackend",
    "transformer.enums.AttnMaskType", "transformer.enums.AttnType", "transformer.enums.LayerType",
    "transformer.enums.CudaGraphScope", "rerun_state_machine.RerunMode", "rerun_state_machine.RerunState",
    "rerun_state_machine.RerunDiagnostic", "rerun_state_machine.Caller", "optimizer.optimizer_config.ParamKey"))
"""Megatron-LM classes (enums) that current Megatron-LM pickles in ``args`` and that a legacy checkpoint
may hold: read as :class:`MegatronRecord` s. Any other global is refused."""


def _load_rank_file(path: Path) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` allowing ``argparse.Namespace``, NumPy RNG-state arrays and the
    :data:`MEGATRON_ARGS_CLASSES` (as inert records) besides tensors."""
    import numpy as np

    allowed: list[Any] = [argparse.Namespace, np.ndarray, np.dtype]
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            allowed.append(__import__(name, fromlist=["_reconstruct"])._reconstruct)
            break
        except (ImportError, AttributeError):
            continue
    allowed += [type(np.dtype(t)) for t in ("uint32", "int64", "float64", "float32")]
    allowed += [(_Record(name), name) for name in MEGATRON_ARGS_CLASSES]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - name the file, the cause and the way out
        raise ValueError(f"{str(path)!r} cannot be read with torch.load(weights_only=True): {e}. Re-save its model "
                         f"state alone where you trust the file: torch.save({{'model': ckpt['model']}}, path)") from e


def read_args(path: str | os.PathLike[str]) -> argparse.Namespace | None:
    """The ``args`` saved in a legacy rank file (``model_optim_rng.pt``), or None."""
    state = _load_rank_file(Path(path))
    args = state.get("args") if isinstance(state, dict) else None
    return args if isinstance(args, argparse.Namespace) else None


def _rank_files(path: Path) -> dict[tuple[int, int], Path]:
    """``(tp, pp) -> model_optim_rng.pt`` of one iteration."""
    if path.is_file():
        return {(0, 0): path}
    d = _iteration_dir(path)
    files = {}
    for sub in d.iterdir():
        m = _RANK_DIR.match(sub.name)
        if m and (sub / "model_optim_rng.pt").is_file():
            files[(int(m.group(1)), int(m.group(2) or 0))] = sub / "model_optim_rng.pt"
    if not files:
        raise FileNotFoundError(f"no mp_rank_*/model_optim_rng.pt under {str(d)!r}")
    return files


def read_legacy_checkpoint(path: str | os.PathLike[str], adapter: StateDictAdapter) -> MegatronCheckpoint:
    """Merge the per-rank ``model_optim_rng.pt`` files of one iteration (any TP/PP/VP) by the family's
    TP layout."""
    path = Path(path)
    files = _rank_files(path)
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    if len(files) != tp * pp:
        raise ValueError(f"{str(path)!r}: expected {tp} x {pp} rank files (TP x PP), found {len(files)}")
    args = None
    stages: dict[int, list[dict[str, torch.Tensor]]] = {}  # stage -> per virtual chunk, TP-merged
    for p in range(pp):
        per_tp = [_load_rank_file(files[(t, p)]) for t in range(tp)]
        args = per_tp[0].get("args", args)
        chunk_keys = sorted((k for k in per_tp[0] if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))
        if not chunk_keys:
            raise ValueError(f"{str(files[(0, p)])!r} has no 'model' state dict")
        stages[p] = []
        for k in chunk_keys:
            shards = [normalize_megatron_keys(x[k]) for x in per_tp]
            stages[p].append(merge_tp_shards(shards, adapter.tp_layout(shards[0])))
    vp = len(stages[0])
    local_layers = [len({m.group(2) for m in map(_LAYER.fullmatch, c) if m}) for p in range(pp) for c in stages[p]]
    per_chunk = local_layers[0]
    if any(n != per_chunk for n in local_layers):
        raise ValueError(f"uneven layers per pipeline chunk {local_layers} are not supported")
    full: dict[str, torch.Tensor] = {}
    for p in range(pp):
        for c, sd in enumerate(stages[p]):
            offset = (c * pp + p) * per_chunk  # Megatron's (interleaved) layer assignment
            for key, value in sd.items():
                m = _LAYER.fullmatch(key)
                if m:
                    key = f"{m.group(1)}.layers.{offset + int(m.group(2))}.{m.group(3)}"
                full.setdefault(key, value)  # a tied output layer's last-stage copy: the family checks it
    return MegatronCheckpoint(state_dict=full, args=args if isinstance(args, argparse.Namespace) else None,
                              num_layers=per_chunk * pp * vp, layout={"tp": tp, "pp": pp, "vp": vp})


def read_torch_dist_checkpoint(path: str | os.PathLike[str], adapter: StateDictAdapter) -> MegatronCheckpoint:
    """A megatron-core ``torch_dist`` checkpoint's model tensors (global, layers stacked) on one process:
    the tensors under the family's ``megatron_prefixes``."""
    from lightning_megatron import dcp_io

    d = _iteration_dir(Path(path))
    prefixes = tuple(adapter.megatron_prefixes)
    metadata = dcp_io.read_metadata(d, allow_bytes=True).state_dict_metadata
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in metadata.items()
             if hasattr(md, "size") and k.startswith(prefixes) and not k.endswith("_extra_state")}
    if not state:
        raise ValueError(f"{str(d)!r} holds no model tensors (expected {', '.join(p + '*' for p in prefixes)} keys)")
    dcp_io.load(state, d, single_process=True, allow_bytes=True)
    full: dict[str, torch.Tensor] = {}
    num_layers = 0
    for key, value in normalize_megatron_keys(state).items():
        m = _STACKED.fullmatch(key)
        if m:  # stacked [L, ...]: one tensor per layer
            num_layers = value.size(0)
            for i in range(value.size(0)):
                full[f"{m.group(1)}{i}.{m.group(2)}"] = value[i].clone()
        else:
            full[key] = value
    args = None
    if (d / "common.pt").is_file():  # megatron-core saves its args there
        try:
            args = read_args(d / "common.pt")
        except ValueError as e:
            import warnings

            warnings.warn(f"{str(d / 'common.pt')!r}: the training arguments are not read ({e}); the model's "
                          f"architecture arguments are checked against the tensors' shapes only", UserWarning,
                          stacklevel=2)
    return MegatronCheckpoint(state_dict=full, args=args, num_layers=num_layers)


def _read(path: Path, adapter: StateDictAdapter) -> MegatronCheckpoint:
    d = path if path.is_file() else _iteration_dir(path)
    if _is_torch_dist(d):
        return read_torch_dist_checkpoint(d, adapter)
    return read_legacy_checkpoint(path, adapter)


def read_megatron_checkpoint(path: str | os.PathLike[str], adapter: StateDictAdapter) -> SavedModel:
    """A Megatron-LM checkpoint as our full state dict, with the architecture its ``args`` fix (the family's)."""
    ckpt = _read(Path(path), adapter)
    architecture = adapter.architecture_from_megatron(ckpt.args, ckpt.num_layers)
    return SavedModel(state_dict=adapter.state_dict_from_megatron(ckpt.state_dict, architecture),
                      hparams=architecture, layout=ckpt.layout)


def read_megatron_architecture(path: str | os.PathLike[str], adapter: StateDictAdapter) -> dict[str, Any]:
    """The module arguments a Megatron-LM checkpoint's ``args`` fix: from one legacy rank file when its
    ``args`` give ``num_layers``, else from the whole checkpoint (layers counted from the tensors)."""
    path = Path(path)
    d = path if path.is_file() else _iteration_dir(path)
    if not _is_torch_dist(d):
        first = path if path.is_file() else next((sub / "model_optim_rng.pt" for sub in sorted(d.iterdir())
                                                  if _RANK_DIR.match(sub.name)), None)
        args = read_args(first) if first is not None and first.is_file() else None
        if args is not None and getattr(args, "num_layers", None):
            return adapter.architecture_from_megatron(args, int(args.num_layers))
    return read_megatron_checkpoint(path, adapter).hparams
