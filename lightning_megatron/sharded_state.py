"""Model and optimizer state as DCP chunks of global, layout-independent tensors.

:class:`ShardedStateMapper` turns this rank's parameters and optimizer state into the dictionary
:mod:`lightning_megatron.dcp_io` saves, and builds the destination dictionary it loads into:

- ``model.<name>``: parameters under global names (``sharded_named_parameters``: global layer
  numbers), TP-sharded ones as their chunk of the global (vocab-unpadded) tensor;
- ``optim.<i>.main.<name>``: fp32 main copies (of bf16/fp16 parameters; of every parameter under
  the DistributedOptimizer);
- ``optim.<i>.state.<name>.<key>``: optimizer state, sharded like its parameter (scalars such as
  Adam's ``step`` replicated).

The DistributedOptimizer (ZeRO-1) saves and loads from its shards: a DP rank holds the flat range
``[start, end)`` of each TP-local parameter (``sharded_state_for_checkpoint``), which splits into at
most ``2 * ndim - 1`` rectangles (:func:`flat_range_boxes`: a partial first row, full rows, a
partial last row for a matrix); each is a chunk of the global tensor under the same keys as the
non-distributed optimizer's. Both optimizers' checkpoints are therefore interchangeable and
reshard across TP, PP and DP, and no rank ever holds more than its own shard.
The tied word embedding is stored once, by the first pipeline stage. No Lightning here.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.dcp_io import CheckpointError, Chunks
from lightning_megatron.optimizer.mixed_precision import MegatronOptimizer
from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.protocols import OptimizerWrapper, PlainOptimizer, ShardedOptimizer, is_sharded
from lightning_megatron.tensor_parallel.param_facts import param_facts
from lightning_megatron.tensor_parallel.random import default_rng_states, get_rng_tracker, set_default_rng_states

__all__ = ["ShardInfo", "ShardedStateMapper", "duplicate_names_problem", "flat_range_boxes", "optimizer_class_name", "optimizer_class_problem",
           "optimizer_extra",
           "plain", "rng_state", "set_rng_state", "shard_info"]


@dataclass(frozen=True)
class ShardInfo:
    """Where this rank's TP-local tensor sits in the global tensor."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    partition_dim: int
    local_rows: int
    """How many leading rows along ``partition_dim`` are real (fewer for vocab padding)."""
    pieces: tuple[tuple[int, int, int], ...] = ()
    """``(local start, global start, rows)`` along ``partition_dim``: one block for a contiguous shard,
    ``stride`` blocks for Megatron's strided partitions (a gated fc1's [gate_r; up_r])."""


def shard_info(param: torch.Tensor, coordinates: Mapping[str, int], sizes: Mapping[str, int]) -> ShardInfo | None:
    """The global layout of a sharded or vocab-padded ``param`` (None when it is stored as is), from its
    :class:`~lightning_megatron.tensor_parallel.ParamFacts` and this rank's ``coordinates`` among the
    dimension ``sizes`` (``ParallelState.coordinates``, ``ParallelDims.sizes()``)."""
    facts = param_facts(param)
    real_vocab_size = facts.real_vocab_size
    tp_rank, tp_size = facts.shard(coordinates, sizes)  # this rank's piece of all the sharded dimensions
    sharded = tp_size > 1
    if not sharded and real_vocab_size is None:
        return None
    dim = facts.partition_dim % param.dim()
    per, stride = param.shape[dim], facts.partition_stride if sharded else 1
    if stride != 1:
        # With stride s the global dimension is s blocks, each split over the TP ranks; this rank's
        # tensor is its piece of every block, in order.
        if real_vocab_size is not None or per % stride != 0:
            raise CheckpointError(f"a strided TP partition (stride={stride}) of {per} local rows with "
                                  f"real_vocab_size={real_vocab_size} is not supported")
        block = per // stride
        pieces = tuple((j * block, (j * tp_size + tp_rank) * block, block) for j in range(stride))
        global_shape = tuple(per * tp_size if d == dim else n for d, n in enumerate(param.shape))
        offsets = tuple(pieces[0][1] if d == dim else 0 for d in range(param.dim()))
        return ShardInfo(global_shape, offsets, dim, per, pieces)
    real = per * tp_size if real_vocab_size is None else min(real_vocab_size, per * tp_size)
    start = tp_rank * per
    global_shape = tuple(real if d == dim else s for d, s in enumerate(param.shape))
    offsets = tuple(start if d == dim else 0 for d in range(param.dim()))
    rows = max(0, min(per, real - start))
    return ShardInfo(global_shape, offsets, dim, rows, ((0, start, rows),))


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Rectangles ``(offsets, sizes, flat_offset)`` covering elements ``[start, end)`` of a row-major
    tensor of ``shape``, in order; each is a contiguous flat range starting at ``flat_offset``."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), ((end - start),) * len(shape), start)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner

    def sub(row: int, a: int, b: int) -> list:
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in flat_range_boxes(shape[1:], a, b)]

    if first == last:
        return sub(first, start - first * inner, end - first * inner)
    out = []
    if start % inner:
        out += sub(first, start % inner, inner)
        first += 1
    full_end = last + 1 if end % inner == 0 else last
    if full_end > first:
        out.append(((first, *(0,) * (len(shape) - 1)), (full_end - first, *shape[1:]), first * inner))
    if end % inner:
        out += sub(last, 0, end % inner)
    return out


def _tied_copy(p: torch.Tensor, ps: ParallelState) -> bool:
    """The last stage's copy of the tied word embedding (stored by the first stage)."""
    return param_facts(p).shared_embedding and not ps.is_pipeline_first_stage()


def duplicate_names_problem(named_parameters: list[tuple[str, nn.Parameter]], ps: ParallelState) -> str | None:
    """Why the checkpoint could not hold these parameters, or None: every name the checkpoint stores (the tied
    embedding's later copy aside) must be one tensor's, across this rank's chunks and the pipeline stages; a
    checkpoint stores one tensor a name, so a second one of that name is silently dropped. Collective over the
    PP group when there is one (one gather of the names, at set-up)."""
    names = [n for n, p in named_parameters if not _tied_copy(p, ps)]
    stages = [names]
    if ps.pp_size > 1:
        stages = [None] * ps.pp_size
        dist.all_gather_object(stages, names, group=ps.pp_group)
    owners: dict[str, list[int]] = {}
    for stage, stage_names in enumerate(stages):
        for name in stage_names:
            owners.setdefault(name, []).append(stage)
    for name, where in owners.items():
        if len(where) > 1:
            places = (f"pipeline stages {' and '.join(map(str, sorted(set(where))))}" if len(set(where)) > 1
                      else f"{len(where)} model chunks of pipeline stage {where[0]}")
            return (f"parameter name {name!r} is on {places}: a checkpoint stores one tensor a name, so all but one "
                    f"would be lost; sharded_named_parameters must give layout-independent names (a layer keyed by "
                    f"its global number, not its place on the stage or chunk)")
    return None


class ShardedStateMapper:
    """The DCP view of one rank's ``named_parameters`` and ``optimizers`` under ``parallel_state``."""

    def __init__(self, parallel_state: ParallelState, named_parameters: list[tuple[str, nn.Parameter]],
                 optimizers: list[OptimizerWrapper]) -> None:
        self.ps = parallel_state
        self.named = [(n, p) for n, p in named_parameters if not _tied_copy(p, parallel_state)]
        self.all_named = named_parameters
        self.optimizers = optimizers
        self._optim_named = self.named  # + the tied copy under the first stage's name when loading

    def _info(self, like: torch.Tensor) -> ShardInfo | None:
        return shard_info(like, self.ps.coordinates, self.ps.dims.sizes())

    def checkpoint_shape(self, like: torch.Tensor) -> tuple[int, ...]:
        """The global shape under which a tensor shaped like ``like`` is stored."""
        info = self._info(like)
        return tuple(like.shape) if info is None else info.global_shape

    def put(self, state: dict[str, Any], key: str, tensor: torch.Tensor, like: torch.Tensor,
            start: int = 0, end: int | None = None) -> None:
        """``state[key]``: ``tensor`` as its chunks of the global tensor. ``tensor`` holds elements
        ``[start, end)`` of the TP-local tensor ``like`` (flattened; all of it by default)."""
        info = self._info(like)
        end = like.numel() if end is None else end
        if info is None and start == 0 and end == like.numel():
            state[key] = tensor.view(like.shape)
            return
        chunks = state.get(key)
        if not isinstance(chunks, Chunks):
            chunks = state[key] = Chunks(info.global_shape if info is not None else tuple(like.shape))
        flat = tensor.reshape(-1)
        for offsets, sizes, f in flat_range_boxes(tuple(like.shape), start, end):
            box = flat[f - start: f - start + math.prod(sizes)].view(sizes)
            if info is None:
                chunks.add(offsets, box)
                continue
            # Each piece of the shard: drop vocab padding rows, move to the piece's global rows.
            d = info.partition_dim
            for local, global_start, rows in info.pieces:
                lo, hi = max(offsets[d], local), min(offsets[d] + sizes[d], local + rows)
                if hi <= lo:
                    continue
                at = tuple(global_start + lo - local if k == d else o + g
                           for k, (o, g) in enumerate(zip(offsets, info.offsets)))
                chunks.add(at, box.narrow(d, lo - offsets[d], hi - lo))
        if not chunks.pieces:
            del state[key]

    # ------------------------------------------------------------------ save

    def save_state(self, include_optimizer: bool) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for name, p in self.named:
            self.put(state, f"model.{name}", p.detach(), p)
        if include_optimizer:
            for i, opt in enumerate(self.optimizers):
                if is_sharded(opt):
                    self._put_distributed(state, i, opt)
                else:
                    self._put_plain(state, i, opt)
        return state

    def _put_plain(self, state: dict[str, Any], i: int, opt: OptimizerWrapper) -> None:
        for name, p in self.named:
            opt_param = opt.main_param(p)
            if opt_param is not p:
                self.put(state, f"optim.{i}.main.{name}", opt_param.detach(), p)
            for k, v in _param_state(opt, opt_param).items():
                if torch.is_tensor(v):
                    if v.shape == p.shape:
                        self.put(state, f"optim.{i}.state.{name}.{k}", v, p)
                    else:
                        state[f"optim.{i}.state.{name}.{k}"] = v

    def _distributed_pieces(self, opt: ShardedOptimizer) -> Iterator[tuple[str, dict[str, Any], dict[str, torch.Tensor]]]:
        """(name, piece, scalar state of the piece's group) for every piece of a saved parameter."""
        names = {id(p): n for n, p in self._optim_named}
        # Scalar state (Adam's ``step``) is equal for every flat main param of one group: read it
        # from the first one that has state.
        scalars = []
        for group in opt.optimizer.param_groups:
            states = [opt.optimizer.state.get(main, {}) for main in group["params"]]
            st = next((st for st in states if st), {})
            scalars.append({k: v for k, v in st.items() if torch.is_tensor(v) and v.dim() == 0})
        group_of = {id(p): k for k, params in enumerate(opt.model_groups) for p in params}
        for piece in opt.sharded_state_for_checkpoint():
            name = names.get(id(piece["param"]))
            if name is not None:
                yield name, piece, scalars[group_of[id(piece["param"])]]

    def _put_distributed(self, state: dict[str, Any], i: int, opt: ShardedOptimizer) -> None:
        for name, piece, scalars in self._distributed_pieces(opt):
            p, lo, hi = piece["param"], piece["start"], piece["end"]
            for k, t in piece["tensors"].items():
                key = f"optim.{i}.main.{name}" if k == "main_param" else f"optim.{i}.state.{name}.{k}"
                self.put(state, key, t, p, lo, hi)
            for k, v in scalars.items():
                state[f"optim.{i}.state.{name}.{k}"] = v

    # ------------------------------------------------------------------ load

    def load_targets(self, metadata: Mapping[str, Any], include_optimizer: bool) -> tuple[dict[str, Any], list]:
        """The dict DCP loads into (model params and ZeRO-1 shards in place, other optimizer state
        into new tensors) and, per optimizer, what :meth:`finish_optimizer_load` installs."""
        state = self.save_state(include_optimizer=False)
        targets: list[Any] = []
        if include_optimizer:
            self._optim_named = self.named + self._tied_aliases()
            for i, opt in enumerate(self.optimizers):
                if is_sharded(opt):
                    targets.append(self._distributed_targets(state, i, opt, metadata))
                else:
                    targets.append(self._plain_targets(state, i, opt, metadata))
        return state, targets

    def _tied_aliases(self) -> list[tuple[str, nn.Parameter]]:
        """Collective over the embedding group: the last stage's tied embedding copy under the first
        stage's parameter name, so it loads the same optimizer state (it takes the same updates)."""
        ps = self.ps
        if ps.pp_size == 1 or ps.embedding_group is None or len(ps.embedding_ranks) < 2:
            return []
        first = ps.is_pipeline_first_stage()
        name = [next((n for n, p in self.named if param_facts(p).shared_embedding), None) if first else None]
        dist.broadcast_object_list(name, src=ps.embedding_ranks[0], group=ps.embedding_group)
        if first or name[0] is None:
            return []
        return [(name[0], p) for _, p in self.all_named if _tied_copy(p, ps)]

    def _state_keys(self, metadata: Mapping[str, Any], i: int, name: str, p: torch.Tensor):
        """(elementwise keys, scalar keys -> metadata) saved for parameter ``name``."""
        prefix = f"optim.{i}.state.{name}."
        tensors, scalars = [], {}
        for key, md in metadata.items():
            if key.startswith(prefix) and hasattr(md, "size"):
                if tuple(md.size) == self.checkpoint_shape(p):
                    tensors.append(key[len(prefix):])
                else:
                    scalars[key[len(prefix):]] = md
        return tensors, scalars

    def _plain_targets(self, state: dict[str, Any], i: int, opt: OptimizerWrapper, metadata: Mapping[str, Any]) -> dict:
        per_param: dict[int, dict[str, Any]] = {}
        for name, p in self._optim_named:
            entry: dict[str, Any] = {"main": None, "state": {}, "scalars": {}}
            main_key, model_key = f"optim.{i}.main.{name}", f"model.{name}"
            if main_key in metadata:  # the saved fp32 main: the main's, and the parameter's (bf16 resumed in fp32)
                entry["main"] = torch.zeros_like(p, dtype=torch.float32)
                self.put(state, main_key, entry["main"], p)
            elif opt.main_param(p) is not p and model_key in state:
                # saved parameters that were their own mains (an fp32 run resumed in 16 bits): the main is the saved
                # tensor read in fp32, the parameter its copy (the main kept the weights it was built with)
                entry["main"] = torch.zeros_like(p, dtype=torch.float32)
                del state[model_key]
                self.put(state, model_key, entry["main"], p)
            keys, scalars = self._state_keys(metadata, i, name, p)
            for k in keys:
                entry["state"][k] = torch.zeros_like(p, dtype=metadata[f"optim.{i}.state.{name}.{k}"].properties.dtype)
                self.put(state, f"optim.{i}.state.{name}.{k}", entry["state"][k], p)
            for k, md in scalars.items():
                entry["scalars"][k] = state[f"optim.{i}.state.{name}.{k}"] = torch.zeros(tuple(md.size),
                                                                                       dtype=md.properties.dtype)
            per_param[id(p)] = entry
        return per_param

    def _distributed_targets(self, state: dict[str, Any], i: int, opt: ShardedOptimizer, metadata: Mapping[str, Any]) -> dict:
        """Create the ZeRO-1 optimizer state (zeros) and point DCP at this rank's shards of it."""
        names = {id(p): n for n, p in self._optim_named}
        opt.optimizer.state.clear()
        group_scalars: list[dict[str, torch.Tensor]] = []
        # A group's params are several flat views of the main shard (one per run inside a bucket piece).
        for group, param_group in zip(opt.model_groups, opt.optimizer.param_groups):
            keys: set[str] = set()
            scalars: dict[str, torch.Tensor] = {}
            for p in group:
                if id(p) in names:
                    tensor_keys, scalar_md = self._state_keys(metadata, i, names[id(p)], p)
                    keys.update(tensor_keys)
                    for k, md in scalar_md.items():  # replicated: read once per group
                        if k not in scalars:
                            scalars[k] = state[f"optim.{i}.state.{names[id(p)]}.{k}"] = torch.zeros(
                                tuple(md.size), dtype=md.properties.dtype)
            if keys:
                for main in param_group["params"]:
                    opt.optimizer.state[main] = {k: torch.zeros_like(main) for k in sorted(keys)}
            group_scalars.append(scalars)
        missing_main = []
        for name, piece, _ in self._distributed_pieces(opt):
            p, lo, hi = piece["param"], piece["start"], piece["end"]
            for k, t in piece["tensors"].items():
                key = f"optim.{i}.main.{name}" if k == "main_param" else f"optim.{i}.state.{name}.{k}"
                if key in metadata:
                    self.put(state, key, t, p, lo, hi)
                elif k == "main_param":
                    missing_main.append(piece)
        names_all = {id(p) for _, p in self._optim_named}
        missing_main += [piece for piece in opt.sharded_state_for_checkpoint() if id(piece["param"]) not in names_all]
        # saved parameters that were their own mains (an fp32 run resumed in 16 bits): read in fp32 for the mains, the
        # parameter their copy (not the mains rounded through the 16-bit parameter)
        full: dict[int, torch.Tensor] = {}
        for piece in missing_main:
            p = piece["param"]
            model_key = f"model.{names.get(id(p))}"
            if p.dtype != torch.float32 and id(p) not in full and model_key in state and model_key in metadata \
                    and metadata[model_key].properties.dtype == torch.float32:
                full[id(p)] = torch.zeros_like(p, dtype=torch.float32)
                del state[model_key]
                self.put(state, model_key, full[id(p)], p)
        # fp32 parameters saved in 16 bits beside their fp32 mains (a bf16 run resumed in fp32): the mains are the
        # weights, gathered into the parameters once loaded
        widened = any(p.dtype == torch.float32 and f"optim.{i}.main.{n}" in metadata and f"model.{n}" in metadata
                      and metadata[f"model.{n}"].properties.dtype != torch.float32 for n, p in self._optim_named)
        return {"scalars": group_scalars, "main_from_model": missing_main, "full": full, "widened": widened}

    def finish_optimizer_load(self, targets: list, saved_extras: list[dict[str, Any]]) -> None:
        """Install the loaded tensors into the optimizers (after DCP filled ``targets`` and the
        tied embeddings are synchronised)."""
        for opt, target, saved in zip(self.optimizers, targets, saved_extras):
            inner = opt.optimizer
            # Fused/capturable Adam keep ``step`` on the parameter's device, the others on the CPU.
            on_device = bool(inner.defaults.get("fused") or inner.defaults.get("capturable"))
            if is_sharded(opt):
                with torch.no_grad():
                    for piece in target["main_from_model"]:
                        if (loaded := target["full"].get(id(piece["param"]))) is not None:
                            piece["param"].copy_(loaded)
                for param_group, scalars in zip(inner.param_groups, target["scalars"]):
                    for main in param_group["params"] if scalars else ():
                        # One tensor per main param: optimizers increment ``step`` in place.
                        st = inner.state.setdefault(main, {})
                        st.update({k: v.to(main.device if on_device else v.device, copy=True) for k, v in scalars.items()})
                _load_optimizer_extra(opt, saved)
                continue
            for _, p in self._optim_named:
                entry = target.get(id(p))
                if entry is None:
                    continue
                opt_param = opt.main_param(p)
                if entry["main"] is not None:
                    with torch.no_grad():
                        opt_param.copy_(entry["main"])
                        p.copy_(entry["main"])
                scalars = {k: v.to(opt_param.device) if on_device else v for k, v in entry["scalars"].items()}
                loaded = {**scalars, **{k: v.to(opt_param.device) for k, v in entry["state"].items()}}
                if loaded:
                    _load_param_state(opt, opt_param, loaded)
            _load_optimizer_extra(opt, saved)

    def fill_mains_from_model(self, targets: list) -> None:
        """ZeRO-1 main params the checkpoint has none for (fp32 parameters saved by a non-distributed
        optimizer, the last stage's tied embedding) := the loaded parameters, read in fp32 where they were saved in
        fp32; fp32 parameters saved in 16 bits := their loaded mains (gathered). After the tied sync."""
        with torch.no_grad():
            for opt, target in zip(self.optimizers, targets):
                if is_sharded(opt):
                    for piece in target["main_from_model"]:
                        source = target["full"].get(id(piece["param"]), piece["param"])
                        piece["tensors"]["main_param"].copy_(source.detach().reshape(-1)[piece["start"]: piece["end"]])
                    if target["widened"] and hasattr(opt, "params_from_mains"):
                        opt.params_from_mains()

    def sync_shared_embeddings(self) -> None:
        """The last stage's tied copy takes the first stage's weights (and fp32 main copy)."""
        ps = self.ps
        if ps.pp_size == 1 or ps.embedding_group is None or len(ps.embedding_ranks) < 2:
            return
        with torch.no_grad():
            for _, p in self.all_named:
                if param_facts(p).shared_embedding:
                    dist.broadcast(p.data, src=ps.embedding_ranks[0], group=ps.embedding_group)
                    for opt in self.optimizers:
                        main = None if is_sharded(opt) else opt.main_param(p)
                        if main is not None and main is not p:
                            dist.broadcast(main.data, src=ps.embedding_ranks[0], group=ps.embedding_group)


def _param_state(opt: OptimizerWrapper, main: torch.Tensor) -> dict[str, Any]:
    """The optimizer state of ``main`` (``opt.main_param(p)``): our wrappers' view of it (a flat step keeps it in
    runs of several parameters), another wrapper's inner optimizer's."""
    if isinstance(opt, MegatronOptimizer):
        return opt.param_state(main)
    return opt.optimizer.state.get(main, {})


def _load_param_state(opt: OptimizerWrapper, main: torch.Tensor, state: dict[str, Any]) -> None:
    """Install ``state`` (:func:`_param_state`'s form, loaded) as ``main``'s."""
    if isinstance(opt, MegatronOptimizer):
        opt.load_param_state(main, state)
    else:
        opt.optimizer.state[main] = state


def rng_state() -> dict[str, Any]:
    """This rank's generators: the CPU's, the accelerator's default one (a GPU's dropout outside the tensor-parallel
    streams draws from it) and the tracker's streams."""
    tracker = get_rng_tracker().get_states()
    cpu, accel = default_rng_states()
    state: dict[str, Any] = {"cpu": cpu, **({} if accel is None else {"accel": accel})}
    for name, (cpu, accel) in tracker.items():
        state[f"tracker.{name}.cpu"] = cpu
        if accel is not None:
            state[f"tracker.{name}.accel"] = accel
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """The generators of :func:`rng_state` restored (the accelerator's where both runs have one)."""
    set_default_rng_states((state["cpu"], state.get("accel")))
    tracker = get_rng_tracker()
    current = tracker.get_states()
    for name in list(current):
        cpu = state.get(f"tracker.{name}.cpu")
        if cpu is not None:
            current[name] = (cpu, state.get(f"tracker.{name}.accel", current[name][1]))
    tracker.set_states(current)


def optimizer_class_name(optimizer: torch.optim.Optimizer | type) -> str:
    """The class (of an optimizer) as the CLI's ``--optimizer`` names it: ``torch.optim.AdamW``, or its module and
    name."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_class_problem(saved: Any, current: str, checkpoint: str) -> str | None:
    """Why a resume must not load the optimizer state ``saved`` (a checkpoint's :func:`optimizer_extra`) into an
    optimizer of class ``current``: another optimizer's moments are not this one's state (AdamW's would be dropped
    by SGD without a word, SGD's momentum fails in AdamW's first step). None when the classes agree, or the
    checkpoint predates the record."""
    was = saved.get("optimizer_class") if isinstance(saved, Mapping) else None
    if was is None or was == current:
        return None
    return (f"optimizer class: checkpoint {was}, this run {current} (its state is another optimizer's: resume with "
            f"the optimizer the run was trained with, the recipe's model.optimizer or --optimizer {was} with its "
            f"arguments, or start a new run from its weights alone with --model.init_from {checkpoint!r})")


def optimizer_extra(opt: OptimizerWrapper) -> dict[str, Any]:
    groups = [{k: plain(v) for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
    out: dict[str, Any] = {"param_groups": groups, "num_skipped_steps": int(opt.num_skipped_steps),
                           "optimizer_class": optimizer_class_name(opt.optimizer)}
    if opt.grad_scaler is not None:
        out["grad_scaler"] = opt.grad_scaler.state_dict()
    return out


def _load_optimizer_extra(opt: OptimizerWrapper, saved: dict[str, Any]) -> None:
    inner = opt.optimizer
    groups = saved.get("param_groups", [])
    if len(groups) != len(inner.param_groups):
        raise CheckpointError(f"the checkpoint has {len(groups)} optimizer parameter groups, "
                                   f"this optimizer has {len(inner.param_groups)}")
    for group, saved_group in zip(inner.param_groups, groups):
        group.update(saved_group)
    if opt.grad_scaler is not None and saved.get("grad_scaler"):  # a constant scale saves none ({}): fp16 after bf16
        opt.grad_scaler.load_state_dict(saved["grad_scaler"])       # starts its dynamic scale at its initial value
    if "num_skipped_steps" in saved and not isinstance(opt, PlainOptimizer):
        opt.num_skipped_steps = saved["num_skipped_steps"]


def plain(value: Any) -> Any:
    """Reduce hyper-parameters to types ``torch.load(weights_only=True)`` accepts."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)) or torch.is_tensor(value):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, os.PathLike):  # a path as its text: load_from_checkpoint passes it on as a str
        return os.fspath(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    return repr(value)
