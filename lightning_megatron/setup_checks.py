"""What :class:`~lightning_megatron.strategy.MegatronStrategy` checks at set-up, before any step:
Trainer settings the strategy would silently ignore, the precision against the parameters' dtype, the
optimizers against the grad buffer, and the batch sizes (the one place ``micro_batch_size`` and
``global_batch_size`` are read from).

Each check raises ``ValueError`` naming the value and the fix. Config-only checks that run before
any process starts are in :mod:`lightning_megatron.config_checks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_megatron.config_checks import (PRECISION_PARAMS_DTYPE, grad_scaler_problem, normalize_precision,
                                              save_last_problem)
from lightning_megatron.optimizer.config import gradient_clip_val_problem
from lightning_megatron.parallel_dims import ParallelDims, ParallelDimsError
from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.pipeline.registry import PipelineSchedule
from lightning_megatron.protocols import is_sharded
from lightning_megatron.saved_model import flat_hparams
from lightning_megatron.step import BatchSizes
from lightning_megatron.trainer_checks import callback_problem

__all__ = ["check_strategy_arguments", "check_trainer", "check_precision", "check_optimizers", "resolve_batch_sizes",
           "describe_setup", "check_nodes", "gather_node_ranks", "tp_groups_across_nodes", "run_settings",
           "check_same_settings"]


def check_strategy_arguments(dims: dict[str, Any], *, micro_batch_size: int | None, ddp_bucket_size_mb: float,
                             overlap_param_gather: bool) -> ParallelDims:
    """``MegatronStrategy(...)``'s arguments on their own, at construction (before any process starts);
    returns the layout's record built from ``dims`` (:class:`ParallelDims`' fields)."""
    try:
        record = ParallelDims(**dims)
        unsupported = record.unsupported()
        if unsupported:
            raise ParallelDimsError(unsupported)
        BatchSizes(micro_batch_size=micro_batch_size, global_batch_size=None)
    except ValueError as e:
        raise ValueError(f"MegatronStrategy: {e}") from None
    if not ddp_bucket_size_mb > 0:
        raise ValueError(f"MegatronStrategy: ddp_bucket_size_mb={ddp_bucket_size_mb} must be > 0")
    if not isinstance(overlap_param_gather, bool):  # it needs a DistributedOptimizer: checked at the start of fit
        raise ValueError(f"MegatronStrategy: overlap_param_gather={overlap_param_gather!r} must be True or False")
    return record


def check_trainer(trainer: Trainer) -> None:
    """Trainer options the microbatch schedule replaces."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"MegatronStrategy: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not "
            f"supported: gradient accumulation is the microbatch schedule. Set accumulate_grad_batches=1 and "
            f"choose global_batch_size = micro_batch_size x num_microbatches x data-parallel size instead")
    problem = gradient_clip_val_problem(trainer.gradient_clip_val)
    if problem is not None:
        raise ValueError(f"MegatronStrategy: {problem}")
    for callback in trainer.checkpoint_callbacks:
        problem = save_last_problem(getattr(callback, "save_last", None))
        if problem is not None:
            raise ValueError(problem)
    for callback in trainer.callbacks:
        problem = callback_problem(type(callback))
        if problem is not None:
            raise ValueError(problem)


def check_precision(trainer: Trainer, chunks: Sequence[nn.Module], hparams: dict[str, Any], *,
                    wraps_optimizers: bool) -> None:
    """The Trainer's precision must match the parameters' dtype; 16-bit parameters need fp32 main params
    (``wraps_optimizers``: an OptimizerConfig was handed to the strategy, by MegatronOptimizerCallback).

    Runs before ``convert_module``, which would otherwise silently cast the model to the precision's dtype.
    """
    plugin = trainer.precision_plugin
    precision = normalize_precision(plugin.precision)
    if getattr(plugin, "scaler", None) is not None:  # MixedPrecision's GradScaler (other plugins have none)
        raise ValueError(f"MegatronStrategy: {grad_scaler_problem(precision)}")
    if precision not in PRECISION_PARAMS_DTYPE:
        raise ValueError(f"MegatronStrategy: precision={precision!r} is not supported; use one of "
                         f"{sorted(PRECISION_PARAMS_DTYPE)}")
    expected = getattr(torch, PRECISION_PARAMS_DTYPE[precision])
    dtypes = sorted({str(p.dtype) for chunk in chunks for p in chunk.parameters() if p.is_floating_point()})
    hparams = flat_hparams(hparams)  # a config record's fields (config.params_dtype) at the top level
    named = f" (params_dtype={hparams['params_dtype']!r})" if "params_dtype" in hparams else ""
    if dtypes and dtypes != [str(expected)]:
        fix = {"torch.float32": "Trainer(precision='32-true') (or 'bf16-mixed' for autocast)",
               "torch.bfloat16": "Trainer(precision='bf16-true')", "torch.float16": "Trainer(precision='16-true')"}
        raise ValueError(
            f"MegatronStrategy: Trainer(precision={precision!r}) needs {expected} parameters but the model's "
            f"parameters are {', '.join(dtypes)}{named}; set {fix.get(dtypes[0], 'a matching precision')} or "
            f"build the model with params_dtype={PRECISION_PARAMS_DTYPE[precision]!r}")
    low = [d for d in dtypes if d in ("torch.float16", "torch.bfloat16")]
    if low and trainer.state.fn == TrainerFn.FITTING and not wraps_optimizers:
        raise ValueError(
            f"MegatronStrategy: {low[0]} parameters{named} without MegatronOptimizerCallback would be updated in "
            f"16 bits (fp16 diverges without loss scaling; bf16 drops small updates). Add "
            f"lightning_megatron.callbacks.MegatronOptimizerCallback to the Trainer's callbacks (fp32 main "
            f"params, loss scaling, overflow skip), or train with params_dtype='float32'")


def unsplit_model_warning(chunks: Sequence[nn.Module], ps: ParallelState) -> str | None:
    """A warning when TP > 1 splits none of the model's parameters (parallel layers built without the strategy's
    ``tp_group``, e.g. in ``__init__``): every TP rank then runs the whole model, TP's work repeated; None when some
    parameter is split, or TP is 1."""
    from lightning_megatron.tensor_parallel.param_facts import param_facts

    params = [p for chunk in chunks for p in chunk.parameters()]
    if ps.tp_size == 1 or not params or any(param_facts(p).tensor_model_parallel for p in params):
        return None
    return (f"tensor_model_parallel_size={ps.tp_size} but no parameter of the model is split over the TP ranks: each "
            f"runs the whole model. Build the parallel layers in configure_model with the strategy's "
            f"parallel_state.tp_group (docs/strategy.md), or use tensor_model_parallel_size=1")


def check_optimizers(wrappers: Sequence[Any], grad_buffer: Any, *, overlap_param_gather: bool) -> None:
    """The fit's optimizers (as :class:`~lightning_megatron.protocols.OptimizerWrapper`) against the strategy:
    a ZeRO-1 optimizer shards the strategy's own grad buffer; ``overlap_param_gather`` needs one."""
    for opt in wrappers:
        if is_sharded(opt) and opt.buffer is not grad_buffer:
            raise ValueError(
                "MegatronStrategy: a DistributedOptimizer must shard the strategy's grad buffer: build it "
                "with DistributedOptimizer(..., grad_buffer=trainer.strategy.grad_buffer) or use "
                "MegatronOptimizerCallback(OptimizerConfig(use_distributed_optimizer=True))")
    if overlap_param_gather and not any(is_sharded(opt) for opt in wrappers):
        raise ValueError(
            "MegatronStrategy(overlap_param_gather=True) overlaps the ZeRO-1 parameter all-gather, but no "
            "optimizer is a DistributedOptimizer: add MegatronOptimizerCallback(OptimizerConfig("
            "use_distributed_optimizer=True)) (--megatron_optimizer.use_distributed_optimizer true) "
            "or set overlap_param_gather=False")


def resolve_batch_sizes(micro_batch_size: int | None, datamodule: Any, ps: ParallelState,
                        schedule: PipelineSchedule) -> BatchSizes:
    """The step's batch sizes, from one place: the strategy's ``micro_batch_size`` or else the
    datamodule's, and the datamodule's ``global_batch_size`` (both optional attributes of a
    datamodule); checked against the data-parallel size and the ``schedule``."""
    dm_micro = getattr(datamodule, "micro_batch_size", None)
    if micro_batch_size is not None and dm_micro is not None and int(dm_micro) != micro_batch_size:
        raise ValueError(
            f"MegatronStrategy(micro_batch_size={micro_batch_size}) disagrees with the datamodule's "
            f"micro_batch_size={dm_micro}; set it in one place (the datamodule's, with the strategy's left None)")
    micro = micro_batch_size if micro_batch_size is not None else (None if dm_micro is None else int(dm_micro))
    glob = getattr(datamodule, "global_batch_size", None)
    try:
        sizes = BatchSizes(micro_batch_size=micro, global_batch_size=None if glob is None else int(glob),
                           data_parallel_size=ps.dp_size)
    except ValueError as e:
        raise ValueError(f"MegatronStrategy: {e}") from None
    if sizes.num_microbatches is not None:
        schedule.validate(ps.pp_size, ps.vp_size, sizes.num_microbatches)
    return sizes


def gather_node_ranks(node_rank: int, device: torch.device) -> list[int]:
    """The node of every global rank (each rank passes its cluster environment's ``node_rank``).

    Collective over the default group (every rank calls it, once at set-up); ``[node_rank]`` without
    a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [node_rank]
    nodes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(nodes, torch.tensor([node_rank], dtype=torch.int64, device=device))  # on the backend's device
    return [int(n.item()) for n in nodes]


def tp_groups_across_nodes(dims: ParallelDims, nodes: Sequence[int]) -> list[list[int]]:
    """The TP groups of ``dims`` whose ranks sit on more than one node (``nodes[rank]``: the node of
    each rank): their all-reduces, two per layer and pass, cross the network between nodes."""
    return [g for g in dims.group_ranks("tp") if len({nodes[r] for r in g}) > 1]


def _canonical(value: Any) -> str:
    """``value`` as text that is the same on every rank for the same setting: plain values by ``repr``, records and
    containers by their members, any other object by its class (its ``repr`` may hold an address)."""
    import dataclasses
    import os

    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (torch.dtype, os.PathLike)):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return "{" + ", ".join(f"{k}: {_canonical(v)}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_canonical(v) for v in value) + "]"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def run_settings(*, dims: ParallelDims, micro_batch_size: int | None, seed: int, trainer: Any, module: Any,
                 callbacks: Sequence[Any]) -> dict[str, str]:
    """What every rank must be started with, by name (:func:`_canonical` text): the layout and the strategy's
    seed and micro batch, the Trainer's settings that change the steps, the module's and the datamodule's class
    and hyper-parameters, and the settings of the callbacks that declare theirs (``run_settings()``: the
    optimizer's and the lr schedule's)."""
    out = {f"strategy.{k}": v for k, v in dims.strategy_kwargs().items()}
    out.update({"strategy.micro_batch_size": micro_batch_size, "strategy.seed": seed})
    if trainer is not None:
        for name in ("max_steps", "max_epochs", "accumulate_grad_batches", "val_check_interval",
                     "limit_train_batches", "limit_val_batches", "gradient_clip_val", "num_nodes"):
            out[f"trainer.{name}"] = getattr(trainer, name, None)
        out["trainer.precision"] = normalize_precision(trainer.precision_plugin.precision)
    for where, obj in (("model", module), ("data", None if trainer is None else trainer.datamodule)):
        if obj is None:
            continue
        out[f"{where}.class"] = f"{type(obj).__module__}.{type(obj).__qualname__}"
        out.update({f"{where}.{k}": v for k, v in flat_hparams(dict(getattr(obj, "hparams", {}))).items()})
    for cb in callbacks:
        declared = getattr(type(cb), "run_settings", None)
        if callable(declared):
            out.update({f"{type(cb).__name__}.{k}": v for k, v in cb.run_settings().items()})
    return {k: _canonical(v) for k, v in out.items()}


def check_same_settings(settings: dict[str, str], device: torch.device, *, busy: str | None = None) -> None:
    """Refuse, on every rank, a job whose ranks were started with different :func:`run_settings` (each node runs
    its own command: one node's edited recipe or flag), or whose run folder another run holds (``busy``: why, from
    global rank 0's :func:`~lightning_megatron.run_lock.claim_at_setup`). Collective over the default group, before
    the model's groups are made (another layout would wait in their set-up until the timeout): one all-gather of a
    digest and the busy flag, and the settings themselves only when the digests differ."""
    import hashlib
    import json

    from lightning_megatron.run_lock import RunFolderBusy

    if not dist.is_initialized() or dist.get_world_size() == 1:
        if busy is not None:
            raise RunFolderBusy(busy)
        return
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[i:i + 8], "little", signed=True) for i in range(0, 32, 8)]
                        + [int(busy is not None)], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)  # on the backend's device
    if any(int(d[-1]) for d in every):  # said by global rank 0 (the command quiets the others)
        raise RunFolderBusy(busy or "global rank 0 found the run folder in use by another run")
    if all(torch.equal(d, every[0]) for d in every):
        return
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, settings)
    differ = []
    for key in sorted({k for r in ranks for k in r}):
        first = ranks[0].get(key, "(none)")
        other = next((r for r in range(1, len(ranks)) if ranks[r].get(key, "(none)") != first), None)
        if other is not None:
            differ.append(f"{key}: rank {other} has {ranks[other].get(key, '(none)')}, rank 0 has {first}")
    shown = "; ".join(differ[:8]) + (f"; and {len(differ) - 8} more" if len(differ) > 8 else "")
    raise ValueError(f"MegatronStrategy: the ranks were started with different settings (each node's command or "
                     f"recipe): {shown}; every node must run the same command")


def check_nodes(ps: ParallelState, node_rank: int, device: torch.device, devices: int) -> list[int]:
    """The node of every rank (:func:`gather_node_ranks`, collective); warns when a TP group spans nodes."""
    nodes = gather_node_ranks(node_rank, device)
    across = tp_groups_across_nodes(ps.dims, nodes)
    if across:
        rank_zero_warn(f"MegatronStrategy: TP groups {across} span nodes (the node of each rank: {nodes}): their "
                       f"all-reduces, two per layer and pass, cross the network between nodes. Keep "
                       f"tensor_model_parallel_size={ps.tp_size} <= the processes per node (devices={devices}) "
                       f"and devices a multiple of it")
    return nodes


def describe_setup(ps: ParallelState, *, buffer: Any,
                   micro_batch_size: int | None, nodes: Sequence[int] | None = None) -> str:
    """What the strategy resolved, in one message for the start of a run (rank 0's view): the layout,
    rank 0's groups, the communicator of each group, whether the DP reduction overlaps the backward and
    the grad buffer's bucket count (``buffer``: the GradBuffer, None when not fitting), and with
    ``nodes`` (the node of each rank, :func:`gather_node_ranks`) the ranks of each node and whether
    every TP group stays within one."""
    dims = ps.dims
    ranks = {name: ps.members.get(name, [ps.rank]) for name in ("tp", "dp", "pp")}
    comms = {name: type(ps.communicators[name]).__name__ if name in ps.communicators else "torch.distributed"
             for name in ("tp", "dp", "mp")}
    extra = "".join(f" x {n.upper()} {getattr(dims, n)}" for n in ("cp", "ep") if getattr(dims, n) > 1)
    lines = [f"MegatronStrategy: world {dims.world_size} = TP {ps.tp_size} x PP {ps.pp_size} x DP {ps.dp_size}{extra}"
             f"{f' (VP {ps.vp_size})' if ps.vp_size else ''} ({dims.name}), "
             f"sequence parallel {'on' if dims.sequence_parallel else 'off'}, "
             f"micro batch {micro_batch_size or 'the whole per-rank batch'}",
             "  groups of rank 0: " + ", ".join(f"{n} {r}" for n, r in ranks.items()),
             "  communicators: " + ", ".join(f"{n} {c}" for n, c in comms.items())]
    if nodes is not None:
        by_node: dict[int, list[int]] = {}
        for rank, node in enumerate(nodes):
            by_node.setdefault(node, []).append(rank)
        across = tp_groups_across_nodes(ps.dims, nodes)
        where = ", ".join(f"node {n}: ranks {r}" for n, r in sorted(by_node.items()))
        within = f"no, {' '.join(map(str, across))} span nodes" if across else "yes"
        lines.append(f"  nodes: {len(by_node)} ({where}), every TP group within one node: {within}")
    if buffer is not None:
        lines.append(f"  grad buffer: {len(buffer.buckets)} bucket(s), DP reduction overlapped with the backward: "
                     f"{'on' if buffer.overlap_grad_reduce else 'off'}, ZeRO-1 parameter gather overlapped with the "
                     f"forward: {'on' if buffer.overlap_param_gather else 'off'}")
    return "\n".join(lines)

