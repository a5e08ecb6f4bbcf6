"""Megatron-LM (megatron-core) checkpoints -> one full state dict under megatron-core's names, any family.

Two formats, any TP/PP (and VP, EP) layout they were saved at:

- legacy per-rank files (``--ckpt-format torch``): ``[iter_XXXXXXX/]mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``,
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
``linear_fc1.layer_norm_weight`` -> ``pre_mlp_layernorm.weight``).

Mixture-of-experts layers come out as megatron-core's ``SequentialMLP`` names under the **global** expert
index (``<stack>.layers.L.mlp.experts.local_experts.<e>.linear_fc1.weight`` ``[2f, h]`` = ``[gate; up]``,
``linear_fc2.weight`` ``[h, f]``), whatever the checkpoint holds:

- legacy files at expert parallelism ``ep > 1`` (``mp_rank_TT_EEE`` without pipeline parallelism,
  ``mp_rank_TT_PPP_EEE`` with it: which of the two a ``mp_rank_TT_XXX`` directory is, its ``args`` say)
  number each rank's experts from 0: rank ``r``'s ``local_experts.i`` is expert ``r E/ep + i``. The TP
  shards of each EP rank are merged first (an expert's ``linear_fc1`` as a SwiGLU one); the tensors that are
  not experts' must be equal on every EP rank. A Transformer-Engine ``TEGroupedMLP``'s per-expert
  ``experts.linear_fc1.weight<i>`` are renamed to ``local_experts.<i>`` (same layout per expert); the legacy
  ``GroupedMLP``'s fused ``experts.weight1`` / ``weight2`` are refused, by name, as is an expert
  tensor-parallel size other than the TP size (its shards are laid out over other ranks);
- ``torch_dist`` keeps every expert of a layer in one global tensor ``<stack>.layers.mlp.experts.experts.
  linear_fc1.weight`` ``[L, E, ...]`` (the same for ``SequentialMLP``, ``GroupedMLP`` and ``TEGroupedMLP``),
  or with ``singleton_local_shards`` one per layer and expert (``<stack>.layers.L.mlp.experts.experts.<e>.
  linear_fc1.weight``, a SwiGLU ``linear_fc1`` as ``..._w`` (gate) and ``..._v`` (up)): split per expert.

Megatron pads its vocabulary: the
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
_RANK_DIR = re.compile(r"mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")
_ITERATION_DIR = re.compile(r"iter_(\d+)|release")
"""A legacy rank directory: ``mp_rank_TT``, ``mp_rank_TT_XXX`` (a pipeline stage, or an expert rank without
pipeline parallelism: the ``args`` say which) or ``mp_rank_TT_PPP_EEE``."""
_LAYER = re.compile(r"(\w+)\.layers\.(\d+)\.(.*)")
"""A transformer layer's tensor (``encoder.layers.3.*``, ``decoder.layers.3.*``): stack, number, rest."""
_STACKED = re.compile(r"(\w+\.layers\.)(\D.*)")
"""A ``torch_dist`` tensor of all layers stacked (``decoder.layers.mlp.linear_fc1.weight`` [L, ...])."""
_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")
"""An expert's tensor in a ``state_dict()`` (``SequentialMLP``): before the index, the index, after it."""
_TE_GROUPED_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)")
"""A Transformer-Engine ``TEGroupedMLP`` expert's tensor in a ``state_dict()`` (``linear_fc1.weight3``)."""
_FUSED_GROUPED_EXPERTS = re.compile(r".*\.mlp\.experts\.weight[12]")
"""The legacy ``GroupedMLP``'s experts fused into one tensor (``experts.weight1`` [h, E_local * 2f])."""
_DIST_EXPERTS = re.compile(r"(.*\.mlp\.experts\.)experts\.(?:(\d+)\.)?(linear_fc[12]\.(?:weight|bias))")
"""A ``torch_dist`` experts' tensor: every expert of the layer (``experts.experts.linear_fc1.weight`` [E, ...])
or, with ``singleton_local_shards``, one (``experts.experts.3.linear_fc1.weight``, its SwiGLU halves joined)."""


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
    """The layout it was saved at (``tp``, ``pp``, ``vp``, ``ep``), legacy files only."""


def _iteration_dir(path: Path) -> Path:
    """The directory holding ``mp_rank_*`` dirs or a torch_dist checkpoint (root -> latest iteration); a tracker
    holding no iteration, or naming a folder that is not there, is refused naming both."""
    tracker = path / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        iterations = sorted(p.name for p in path.iterdir() if p.is_dir() and _ITERATION_DIR.fullmatch(p.name)) \
            if path.is_dir() else []
        if iterations and not any(_RANK_DIR.match(p.name) or p.name == ".metadata" for p in path.iterdir()):
            raise ValueError(f"{str(path)!r} has no latest_checkpointed_iteration.txt: give one of its iteration "
                             f"folders ({', '.join(iterations)})")
        return path
    it = tracker.read_text().strip()
    if it != "release" and not it.isdigit():
        raise ValueError(f"{str(tracker)!r} holds {it!r}: an iteration number or 'release' was expected (Megatron-LM "
                         f"writes the number of the iteration it saved last)")
    d = path / ("release" if it == "release" else f"iter_{int(it):07d}")
    if not d.is_dir():
        there = sorted(p.name for p in path.iterdir() if p.is_dir() and _ITERATION_DIR.fullmatch(p.name))
        raise ValueError(f"{str(tracker)!r} says {it}, and {str(d)!r} is not there (iterations there: "
                         f"{', '.join(there) or 'none'}): give the folder of the iteration to read, or copy the "
                         f"missing one in")
    return d


def _is_torch_dist(d: Path) -> bool:
    return d.is_dir() and (d / ".metadata").is_file()


def is_megatron_checkpoint(path: str | os.PathLike[str]) -> bool:
    path = Path(path)
    if path.is_file():
        return path.name == "model_optim_rng.pt"
    if _RANK_DIR.match(path.name) and (path / "model_optim_rng.pt").is_file():  # one rank's folder
        return True
    d = _iteration_dir(path)
    return d.is_dir() and (any(_RANK_DIR.match(p.name) for p in d.iterdir())
                           or (d / "metadata.json").is_file() and (d / ".metadata").is_file())


def normalize_megatron_keys(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Drop ``_extra_state`` and non-tensors; rename Transformer-Engine fused norms to ours, and a
    ``TEGroupedMLP``'s experts (``experts.linear_fc1.weight<i>``) to ``SequentialMLP``'s
    (``experts.local_experts.<i>.linear_fc1.weight``); refuse the legacy ``GroupedMLP``'s fused experts."""
    out = {}
    for key, value in sd.items():
        if key.endswith("_extra_state") or not torch.is_tensor(value):
            continue
        if _FUSED_GROUPED_EXPERTS.fullmatch(key):
            raise ValueError(f"the Megatron-LM checkpoint holds {key!r}: the experts of megatron-core's legacy "
                             f"GroupedMLP (--moe-grouped-gemm --moe-use-legacy-grouped-gemm) fused into one tensor, "
                             f"which this reader does not split; save the model with --ckpt-format torch_dist (whose "
                             f"expert tensors are per expert whatever the implementation) or with SequentialMLP / "
                             f"TEGroupedMLP experts")
        m = _TE_GROUPED_EXPERT.fullmatch(key)
        if m:
            key = f"{m.group(1)}local_experts.{m.group(4)}.{m.group(2)}.{m.group(3)}"
        for fused, ours in _FUSED_NORMS.items():
            if key.endswith(fused):
                key = key[: -len(fused)] + ours
                break
        out[key] = value
    return out


def _merge_expert_ranks(parts: list[dict[str, torch.Tensor]], names: list[str]) -> dict[str, torch.Tensor]:
    """One state dict of the expert-parallel ranks' ``parts`` (EP rank order, each TP-merged): rank ``r``'s
    ``local_experts.i`` becomes expert ``r * local + i``; every other tensor must be the same on every rank
    (``names``: the ranks' files, for the errors)."""
    if len(parts) == 1:
        return parts[0]
    counts = [len({int(m.group(2)) for m in map(_LOCAL_EXPERT.fullmatch, sd) if m}) for sd in parts]
    if len(set(counts)) != 1 or not counts[0]:
        raise ValueError(f"the expert-parallel rank files {names} hold {counts} experts per layer: expected the same "
                         f"number on each, at least one")
    local = counts[0]
    out: dict[str, torch.Tensor] = {}
    for r, sd in enumerate(parts):
        for key, value in sd.items():
            m = _LOCAL_EXPERT.fullmatch(key)
            if m:
                out[f"{m.group(1)}{r * local + int(m.group(2))}{m.group(3)}"] = value
            elif key not in out:
                out[key] = value
            elif not torch.equal(out[key], value):
                raise ValueError(f"{key} differs between {names[0]!r} and {names[r]!r}, which the checkpoint's layout "
                                 f"makes expert-parallel ranks of one pipeline stage (holding the same non-expert "
                                 f"tensors): the files are not one checkpoint, or its args name another layout")
    return out


def _join_swiglu_halves(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``singleton_local_shards``' SwiGLU ``linear_fc1.weight_w`` (gate) and ``_v`` (up) joined into ``weight``."""
    out: dict[str, torch.Tensor] = {}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        m = re.fullmatch(r"(.*\.linear_fc1\.(?:weight|bias))_([wv])", key)
        if m:
            halves.setdefault(m.group(1), {})[m.group(2)] = value
        else:
            out[key] = value
    for key, parts in halves.items():
        if set(parts) != {"w", "v"}:
            raise ValueError(f"the torch_dist checkpoint has {key}_{next(iter(parts))} without its other half "
                             f"(a SwiGLU linear_fc1 is saved as _w and _v)")
        out[key] = torch.cat([parts["w"], parts["v"]])
    return out


def _split_dist_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``torch_dist``'s experts (``mlp.experts.experts.linear_fc1.weight`` [E, ...] per layer, or one tensor per
    expert ``mlp.experts.experts.<e>.linear_fc1.weight``) under ``SequentialMLP``'s global names."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        m = _DIST_EXPERTS.fullmatch(key)
        if m is None:
            out[key] = value
        elif m.group(2) is not None:
            out[f"{m.group(1)}local_experts.{m.group(2)}.{m.group(3)}"] = value
        else:
            for e in range(value.size(0)):
                out[f"{m.group(1)}local_experts.{e}.{m.group(3)}"] = value[e].clone()
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


def _load_rank_file(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` allowing ``argparse.Namespace``, NumPy RNG-state arrays and the
    :data:`MEGATRON_ARGS_CLASSES` (as inert records) besides tensors (``mmap``: the tensors mapped, not read)."""
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
            return torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except Exception as e:  # noqa: BLE001 - name the file, the cause and the way out
        # torch's text advises loading with pickle: the line that names the refused global, not that advice
        why = re.search(r"WeightsUnpickler error: (.*?\.)(?= Please use|\n|$)", str(e))
        raise ValueError(f"{str(path)!r} cannot be read with torch.load(weights_only=True): "
                         f"{why.group(1) if why else e} No code of the file was run. Where you trust the file, save "
                         f"it again without that class (its 'args' as plain values) and read that") from e


def read_args(path: str | os.PathLike[str]) -> argparse.Namespace | None:
    """The ``args`` saved in a legacy rank file (``model_optim_rng.pt``), or None."""
    state = _load_rank_file(Path(path))
    args = state.get("args") if isinstance(state, dict) else None
    return args if isinstance(args, argparse.Namespace) else None


def _rank_files(path: Path) -> dict[tuple[int, int | None, int | None], Path]:
    """The numbers of each ``mp_rank_*`` directory name (:data:`_RANK_DIR`) -> its ``model_optim_rng.pt``, of one
    iteration."""
    if path.is_file():
        return {(0, None, None): path}
    if _RANK_DIR.match(path.name) and (path / "model_optim_rng.pt").is_file():  # one rank's folder
        return {(0, None, None): path / "model_optim_rng.pt"}
    d = _iteration_dir(path)
    files = {}
    for sub in d.iterdir():
        m = _RANK_DIR.match(sub.name)
        if m and (sub / "model_optim_rng.pt").is_file():
            files[tuple(None if g is None else int(g) for g in m.groups())] = sub / "model_optim_rng.pt"
    if not files:
        raise FileNotFoundError(f"no mp_rank_*/model_optim_rng.pt under {str(d)!r}")
    return files


def _rank_coordinates(names: dict[tuple[int, int | None, int | None], Path],
                      args: argparse.Namespace | None) -> dict[tuple[int, int, int], Path]:
    """``(tp, pp, ep) -> file``: Megatron-LM names a rank ``mp_rank_TT``, ``_PPP`` appended under pipeline
    parallelism and ``_EEE`` under expert parallelism, so ``mp_rank_TT_XXX`` is an expert rank when ``args`` say
    ``expert_model_parallel_size > 1`` and ``pipeline_model_parallel_size == 1``, else a pipeline stage."""
    ep_size = int(getattr(args, "expert_model_parallel_size", None) or 1)
    pp_size = int(getattr(args, "pipeline_model_parallel_size", None) or 1)
    second_is_ep = ep_size > 1 and pp_size == 1
    out = {}
    for (a, b, c), file in names.items():
        if c is not None:
            out[(a, b, c)] = file
        elif b is None:
            out[(a, 0, 0)] = file
        else:
            out[(a, 0, b) if second_is_ep else (a, b, 0)] = file
    return out


def _check_expert_layout(args: argparse.Namespace | None, ep: int, path: Path) -> None:
    """Legacy files of a mixture of experts: an expert tensor-parallel size other than the TP size is refused
    (the experts' shards are laid out over other ranks than the files')."""
    if args is None or not getattr(args, "num_experts", None):
        return
    etp = getattr(args, "expert_tensor_parallel_size", None)
    tp = getattr(args, "tensor_model_parallel_size", None)
    if etp is not None and tp is not None and int(etp) != int(tp):
        raise ValueError(f"{str(path)!r} was saved with expert_tensor_parallel_size={etp} and "
                         f"tensor_model_parallel_size={tp}: the experts' shards of its legacy files are laid out over "
                         f"other ranks than the rest, which this reader does not merge; save it with "
                         f"--ckpt-format torch_dist (global tensors) or with an expert TP size equal to the TP size")
    saved_ep = getattr(args, "expert_model_parallel_size", None)
    if saved_ep is not None and int(saved_ep) != ep:
        raise ValueError(f"{str(path)!r}: its args say expert_model_parallel_size={saved_ep} but its rank files make "
                         f"{ep} expert-parallel ranks")


def _check_whole(path: Path, args: argparse.Namespace | None, tp: int, pp: int) -> None:
    """The rank files make at least the layout the ``args`` were saved at: one rank's file given alone, or folders
    of ranks missing, are refused naming both (the tensors of the others are not there). More files than the args
    say (a checkpoint resharded with its args left as they were) are read."""
    saved = tuple(int(getattr(args, k, None) or 1) for k in ("tensor_model_parallel_size",
                                                             "pipeline_model_parallel_size"))
    if args is None or tp >= saved[0] and pp >= saved[1]:
        return
    layout = f"tensor_model_parallel_size={saved[0]} x pipeline_model_parallel_size={saved[1]}"
    if path.is_file() or _RANK_DIR.match(path.name):
        raise ValueError(f"{str(path)!r} is one rank's file of a checkpoint saved at {layout}: give the checkpoint's "
                         f"folder (the one holding latest_checkpointed_iteration.txt, or its iter_* folder)")
    raise ValueError(f"{str(path)!r}: its args say {layout}, but its rank files make {pp} pipeline stage(s) of {tp} "
                     f"tensor-parallel rank(s): rank folders are missing (copy the whole iteration folder)")


def _check_one_iteration(path: Path, iterations: dict[Path, Any]) -> None:
    """Every rank file holds the same ``iteration`` (the folder's, ``iter_N``): a file of another save among them is
    refused by name (its tensors are another model's)."""
    folder = re.fullmatch(r"iter_(\d+)", next(iter(iterations)).parent.parent.name)
    want = int(folder.group(1)) if folder else None
    seen = [it for it in iterations.values() if it is not None]
    if want is None and seen:
        want = max(set(seen), key=seen.count)
    odd = {file: it for file, it in iterations.items() if it is not None and it != want}
    if odd:
        listed = ", ".join(f"iteration {it} in {str(file)!r}" for file, it in sorted(odd.items()))
        raise ValueError(f"{str(path)!r}: its rank files are not of one save: {listed}, iteration {want} in the "
                         f"others: copy the whole iteration folder again")


def _check_folder(path: Path, args: argparse.Namespace) -> None:
    """:func:`read_legacy_checkpoint`'s checks of the rank files as one save, from their names and their
    ``iteration`` (the files memory-mapped: no tensor is read)."""
    files = _rank_coordinates(_rank_files(path), args)
    _check_whole(path, args, 1 + max(t for t, _, _ in files), 1 + max(p for _, p, _ in files))
    iterations = {}
    for file in sorted(files.values()):
        try:
            state = _load_rank_file(file, mmap=True)
        except ValueError:  # not mmap-able (an old format): read_legacy_checkpoint checks it when it loads it
            return
        iterations[file] = state.get("iteration") if isinstance(state, dict) else None
    _check_one_iteration(path, iterations)


def read_legacy_checkpoint(path: str | os.PathLike[str], adapter: StateDictAdapter) -> MegatronCheckpoint:
    """Merge the per-rank ``model_optim_rng.pt`` files of one iteration (any TP/PP/VP/EP) by the family's
    TP layout, the experts of the expert-parallel ranks under their global index."""
    path = Path(path)
    names = _rank_files(path)
    first_file = names[min(names, key=lambda n: tuple(-1 if x is None else x for x in n))]
    first = _load_rank_file(first_file)  # its args tell the layout the directory names leave open
    args = first.get("args") if isinstance(first, dict) else None
    args = args if isinstance(args, argparse.Namespace) else None
    files = _rank_coordinates(names, args)
    tp = 1 + max(t for t, _, _ in files)
    pp = 1 + max(p for _, p, _ in files)
    ep = 1 + max(e for _, _, e in files)
    if len(files) != tp * pp * ep:
        raise ValueError(f"{str(path)!r}: expected {tp} x {pp} x {ep} rank files (TP x PP x EP), found {len(files)}")
    _check_whole(path, args, tp, pp)
    _check_expert_layout(args, ep, path)
    iterations: dict[Path, Any] = {}

    def load(file: Path) -> dict[str, Any]:
        state = first if file == first_file else _load_rank_file(file)
        iterations[file] = state.get("iteration") if isinstance(state, dict) else None
        return state

    stages: dict[int, list[dict[str, torch.Tensor]]] = {}  # stage -> per virtual chunk, TP- and EP-merged
    for p in range(pp):
        per_ep: list[list[dict[str, torch.Tensor]]] = []
        for e in range(ep):
            per_tp = [load(files[(t, p, e)]) for t in range(tp)]
            args = per_tp[0].get("args", args)
            chunk_keys = sorted((k for k in per_tp[0] if re.fullmatch(r"model\d*", k)),
                                key=lambda k: int(k[5:] or 0))
            if not chunk_keys:
                raise ValueError(f"{str(files[(0, p, e)])!r} has no 'model' state dict")
            chunks = []
            for k in chunk_keys:
                shards = [normalize_megatron_keys(x[k]) for x in per_tp]
                chunks.append(merge_tp_shards(shards, adapter.tp_layout(shards[0])))
            per_ep.append(chunks)
        if len({len(c) for c in per_ep}) != 1:
            raise ValueError(f"{str(path)!r}: the expert-parallel ranks of pipeline stage {p} hold "
                             f"{[len(c) for c in per_ep]} virtual chunks")
        ep_names = [str(files[(0, p, e)]) for e in range(ep)]
        stages[p] = [_merge_expert_ranks([chunks[c] for chunks in per_ep], ep_names) for c in range(len(per_ep[0]))]
    _check_one_iteration(path, iterations)
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
                              num_layers=per_chunk * pp * vp, layout={"tp": tp, "pp": pp, "vp": vp, "ep": ep})


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
    for key, value in normalize_megatron_keys(state).items():
        m = _STACKED.fullmatch(key)
        if m:  # stacked [L, ...]: one tensor per layer
            for i in range(value.size(0)):
                full[f"{m.group(1)}{i}.{m.group(2)}"] = value[i].clone()
        else:  # one layer's (singleton_local_shards), or not a layer's
            full[key] = value
    full = _split_dist_experts(_join_swiglu_halves(full))
    layers = {int(m.group(2)) for m in map(_LAYER.fullmatch, full) if m}
    num_layers = 1 + max(layers) if layers else 0
    # megatron-core saves its args in common.pt: read as a legacy file's are (a file the allow-list refuses is
    # refused: its args say how the model computes, which the tensors' shapes do not)
    args = read_args(d / "common.pt") if (d / "common.pt").is_file() else None
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
        one_rank = path.is_file() or _RANK_DIR.match(path.name) and (path / "model_optim_rng.pt").is_file()
        first = (path if path.is_file() else path / "model_optim_rng.pt") if one_rank else next(
            (sub / "model_optim_rng.pt" for sub in sorted(d.iterdir()) if _RANK_DIR.match(sub.name)), None)
        args = read_args(first) if first is not None and first.is_file() else None
        if args is not None and getattr(args, "num_layers", None):
            if one_rank:  # a whole save of one rank only
                _check_whole(path, args, 1, 1)
            else:  # before any process launches: the rank files one whole save, as reading them checks
                _check_folder(path, args)
            return adapter.architecture_from_megatron(args, int(args.num_layers))
    return read_megatron_checkpoint(path, adapter).hparams
