"""Model and optimizer state as DCP shards of global, layout-independent tensors.

:class:`ShardedStateMapper` turns this rank's parameters and optimizer state into the dictionary
``torch.distributed.checkpoint`` saves, and builds the destination dictionary it loads into:

- ``model.<name>``: parameters under global names (``sharded_named_parameters``: global layer
  numbers), TP-sharded ones as ShardedTensor chunks of the global (vocab-unpadded) tensor;
- ``optim.<i>.main.<name>``: fp32 main copies of bf16/fp16 parameters;
- ``optim.<i>.state.<name>.<key>``: optimizer state, sharded like its parameter (scalars such as
  Adam's ``step`` replicated).

The DistributedOptimizer's flat per-DP-rank state is gathered and split into the same per-parameter
keys, so checkpoints of both optimizers are interchangeable and reshard across TP, PP and DP.
The tied word embedding is stored once, by the first pipeline stage. No Lightning here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron import checkpoint as ckpt
from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.tensor_parallel.random import get_rng_tracker

__all__ = ["ShardedStateMapper", "is_distributed_optimizer", "optimizer_extra", "plain", "rng_state", "set_rng_state"]


def _tied_copy(p: torch.Tensor, ps: ParallelState) -> bool:
    """The last stage's copy of the tied word embedding (stored by the first stage)."""
    return bool(getattr(p, "shared_embedding", False)) and not ps.is_pipeline_first_stage()


class ShardedStateMapper:
    """The DCP view of one rank's ``named_parameters`` and ``optimizers`` under ``parallel_state``."""

    def __init__(self, parallel_state: ParallelState, named_parameters: list[tuple[str, nn.Parameter]],
                 optimizers: list[Any]) -> None:
        self.ps = parallel_state
        self.named = [(n, p) for n, p in named_parameters if not _tied_copy(p, parallel_state)]
        self.all_named = named_parameters
        self.optimizers = optimizers
        ps = parallel_state
        self._tp_ranks = ps.layout.tp_groups()[ps.pp_rank * ps.dp_size + ps.dp_rank]

    def _info(self, like: torch.Tensor) -> ckpt.ShardInfo | None:
        ps = self.ps
        return ckpt.shard_info(like, ps.tp_rank, ps.tp_size, self._tp_ranks, getattr(like, "real_vocab_size", None))

    def put(self, state: dict[str, Any], key: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
        """``state[key]``: ``tensor`` (shaped like parameter ``like``) as its shard of the global tensor."""
        info = self._info(like)
        if info is None:
            state[key] = tensor
        else:
            sharded = ckpt.to_sharded(tensor, info)
            if sharded is not None:
                state[key] = sharded

    def checkpoint_shape(self, like: torch.Tensor) -> tuple[int, ...]:
        """The global shape under which a tensor shaped like ``like`` is stored."""
        info = self._info(like)
        return tuple(like.shape) if info is None else tuple(info.global_shape)

    # ------------------------------------------------------------------ save

    def save_state(self, include_optimizer: bool) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for name, p in self.named:
            self.put(state, f"model.{name}", p.detach(), p)
        if not include_optimizer:
            return state
        for i, opt in enumerate(self.optimizers):
            for name, p, main, tensors, scalars in self._optimizer_tensors(opt):
                if main is not None:
                    self.put(state, f"optim.{i}.main.{name}", main, p)
                for k, t in tensors.items():
                    self.put(state, f"optim.{i}.state.{name}.{k}", t, p)
                for k, t in scalars.items():
                    state[f"optim.{i}.state.{name}.{k}"] = t
        return state

    def _optimizer_tensors(self, opt: Any):
        """(name, param, main or None, param-shaped state, scalar state) for every parameter."""
        if is_distributed_optimizer(opt):
            # Gathered over DP: per-parameter tensors under the non-distributed optimizer's keys.
            views = _distributed_optimizer_views(opt, opt.full_state_dict())
            for name, p in self.named:
                v = views.get(id(p))
                if v is not None:
                    yield name, p, v["main"], v["state"], v["scalars"]
            return
        inner = getattr(opt, "optimizer", opt)
        for name, p in self.named:
            opt_param = getattr(p, "main_param", p)
            st = inner.state.get(opt_param, {})
            tensors = {k: v for k, v in st.items() if torch.is_tensor(v) and v.shape == p.shape}
            scalars = {k: v for k, v in st.items() if torch.is_tensor(v) and v.shape != p.shape}
            yield name, p, (opt_param.detach() if opt_param is not p else None), tensors, scalars

    # ------------------------------------------------------------------ load

    def load_targets(self, metadata: Mapping[str, Any], include_optimizer: bool) -> tuple[dict[str, Any], list]:
        """The dict DCP loads into (model params in place; optimizer state into new tensors) and,
        per optimizer, the per-parameter targets :meth:`finish_optimizer_load` applies."""
        state = self.save_state(include_optimizer=False)
        targets: list[dict[int, dict[str, Any]]] = []
        if not include_optimizer:
            return state, targets
        for i, _ in enumerate(self.optimizers):
            per_param: dict[int, dict[str, Any]] = {}
            for name, p in self.named:
                entry: dict[str, Any] = {"main": None, "state": {}, "scalars": {}}
                main_key = f"optim.{i}.main.{name}"
                if main_key in metadata:
                    entry["main"] = torch.zeros_like(p, dtype=torch.float32)
                    self.put(state, main_key, entry["main"], p)
                prefix = f"optim.{i}.state.{name}."
                for key, md in metadata.items():
                    if not key.startswith(prefix) or not hasattr(md, "size"):
                        continue
                    k = key[len(prefix):]
                    if tuple(md.size) == self.checkpoint_shape(p):
                        entry["state"][k] = torch.zeros_like(p, dtype=md.properties.dtype)
                        self.put(state, key, entry["state"][k], p)
                    else:
                        entry["scalars"][k] = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
                        state[key] = entry["scalars"][k]
                per_param[id(p)] = entry
            targets.append(per_param)
        return state, targets

    def finish_optimizer_load(self, targets: list, saved_extras: list[dict[str, Any]]) -> None:
        """Install the loaded tensors into the optimizers (after DCP filled ``targets``)."""
        for opt, per_param, saved in zip(self.optimizers, targets, saved_extras):
            if is_distributed_optimizer(opt):
                opt.load_full_state_dict(_distributed_optimizer_full_state(opt, per_param, saved))
                continue
            inner = getattr(opt, "optimizer", opt)
            for _, p in self.named:
                entry = per_param.get(id(p))
                if entry is None:
                    continue
                opt_param = getattr(p, "main_param", p)
                if entry["main"] is not None and opt_param is not p:
                    with torch.no_grad():
                        opt_param.copy_(entry["main"])
                        p.copy_(entry["main"])
                # Fused/capturable Adam keep ``step`` on the parameter's device, the others on the CPU.
                on_device = bool(inner.defaults.get("fused") or inner.defaults.get("capturable"))
                scalars = {k: v.to(opt_param.device) if on_device else v for k, v in entry["scalars"].items()}
                loaded = {**scalars, **{k: v.to(opt_param.device) for k, v in entry["state"].items()}}
                if loaded:
                    inner.state[opt_param] = loaded
            _load_optimizer_extra(opt, saved)

    def sync_shared_embeddings(self) -> None:
        """The last stage's tied copy takes the first stage's weights (and fp32 main copy)."""
        ps = self.ps
        if ps.pp_size == 1 or ps.embedding_group is None or len(ps.embedding_ranks) < 2:
            return
        with torch.no_grad():
            for _, p in self.all_named:
                if getattr(p, "shared_embedding", False):
                    dist.broadcast(p.data, src=ps.embedding_ranks[0], group=ps.embedding_group)
                    main = getattr(p, "main_param", None)
                    if main is not None:
                        dist.broadcast(main.data, src=ps.embedding_ranks[0], group=ps.embedding_group)


def rng_state() -> dict[str, Any]:
    tracker = get_rng_tracker().get_states()
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    for name, (cpu, accel) in tracker.items():
        state[f"tracker.{name}.cpu"] = cpu
        if accel is not None:
            state[f"tracker.{name}.accel"] = accel
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    tracker = get_rng_tracker()
    current = tracker.get_states()
    for name in list(current):
        cpu = state.get(f"tracker.{name}.cpu")
        if cpu is not None:
            current[name] = (cpu, state.get(f"tracker.{name}.accel", current[name][1]))
    tracker.set_states(current)


def is_distributed_optimizer(opt: Any) -> bool:
    return bool(getattr(opt, "reduces_gradients", False)) and hasattr(opt, "full_state_dict")


def _distributed_optimizer_views(opt: Any, full: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Split a DistributedOptimizer's full (DP-gathered) flat state into per-parameter tensors."""
    views: dict[int, dict[str, Any]] = {}
    offset = 0
    for g, group in enumerate(opt.model_groups):
        scalars = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in full["group_state"][g].items()}
        for p in group:
            n = p.numel()
            views[id(p)] = {
                "main": full["full_main_params"][offset:offset + n].view(p.shape),
                "state": {k: v[offset:offset + n].view(p.shape) for k, v in full["full_state"].items()},
                "scalars": scalars,
            }
            offset += n
    return views


def _distributed_optimizer_full_state(opt: Any, targets: dict[int, dict[str, Any]],
                                      saved: dict[str, Any]) -> dict[str, Any]:
    """Reassemble loaded per-parameter tensors into DistributedOptimizer.load_full_state_dict's format."""
    mains, states, group_state = [], {}, []
    for group in opt.model_groups:
        scalars: dict[str, Any] = {}
        for p in group:
            entry = targets.get(id(p))
            main = entry["main"] if entry is not None and entry["main"] is not None else p.detach().float()
            mains.append(main.reshape(-1))
            for k in (entry or {}).get("state", {}):
                states.setdefault(k, [])
            for k, t in (entry or {}).get("scalars", {}).items():
                scalars.setdefault(k, t.clone())
        group_state.append(scalars)
    for k in states:
        states[k] = torch.cat([
            (targets[id(p)]["state"][k] if id(p) in targets and k in targets[id(p)]["state"]
             else torch.zeros_like(p, dtype=torch.float32)).reshape(-1)
            for group in opt.model_groups for p in group])
    return {"full_main_params": torch.cat(mains), "full_state": states, "group_state": group_state,
            "param_groups": saved.get("param_groups", [{} for _ in opt.model_groups]),
            "grad_scaler": saved.get("grad_scaler"),
            "param_shapes": [[tuple(p.shape) for p in g] for g in opt.model_groups]}


def optimizer_extra(opt: Any) -> dict[str, Any]:
    inner = getattr(opt, "optimizer", opt)
    groups = [{k: plain(v) for k, v in g.items() if k != "params"} for g in inner.param_groups]
    out: dict[str, Any] = {"param_groups": groups}
    scaler = getattr(opt, "grad_scaler", None)
    if scaler is not None:
        out["grad_scaler"] = scaler.state_dict()
    if hasattr(opt, "num_skipped_steps"):
        out["num_skipped_steps"] = int(opt.num_skipped_steps)
    return out


def _load_optimizer_extra(opt: Any, saved: dict[str, Any]) -> None:
    inner = getattr(opt, "optimizer", opt)
    groups = saved.get("param_groups", [])
    if len(groups) != len(inner.param_groups):
        raise ckpt.CheckpointError(f"the checkpoint has {len(groups)} optimizer parameter groups, "
                                   f"this optimizer has {len(inner.param_groups)}")
    for group, saved_group in zip(inner.param_groups, groups):
        group.update(saved_group)
    scaler = getattr(opt, "grad_scaler", None)
    if scaler is not None and saved.get("grad_scaler") is not None:
        scaler.load_state_dict(saved["grad_scaler"])
    if "num_skipped_steps" in saved and hasattr(opt, "num_skipped_steps"):
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
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    return repr(value)
