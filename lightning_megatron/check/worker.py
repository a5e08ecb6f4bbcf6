"""The rank side of a check run: fit one layout for N steps and record what the comparison needs.

Each rank of a layout runs ``Trainer.fit`` with the :class:`~lightning_megatron.strategy.MegatronStrategy`
on its data-parallel share of the same global batches (:func:`global_batch_loader`), and a
:class:`Recorder` callback records, per step: the logged loss, the global gradient norm and, at the
chosen steps, every gradient as its piece of the global tensor (:func:`global_pieces`), and at step 1
the forward output of every module that holds parameters, on the first microbatch
(:class:`ForwardOutputs`), so that the parent can name the first module whose output diverges. The parent
(:mod:`lightning_megatron.check.parity`) puts the pieces together and compares layouts.

Gradients are read in ``on_before_optimizer_step``: after the whole microbatch schedule and the
strategy's gradient finalization (TP, DP and tied-embedding reductions), before clipping and the
optimizer step. With the distributed optimizer (ZeRO-1) the DP reduction happens inside its step, so
the recorder takes the DP mean of its own copy of ``main_grad`` (the same mean the optimizer's
reduce-scatter computes); when the strategy's gradient buffer reduce-scatters (each rank holds the mean
of its piece only), the recorder puts the pieces together.
"""

from __future__ import annotations


from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, is_dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.parallel_state import process_group
from lightning_megatron.tensor_parallel.param_facts import is_counted, param_facts

__all__ = ["CheckRun", "global_batch_loader", "global_pieces", "run_layouts"]


@dataclass(frozen=True, kw_only=True)
class CheckRun:
    """What every layout of a check runs (picklable: factories must be module-level callables or
    ``functools.partial`` of them, so that spawned ranks can import them)."""

    module_factory: Callable[[], Any]
    """Builds a fresh LightningModule following the strategy's protocol, with dropout off."""
    dataset_factory: Callable[[], Dataset]
    """Builds the map-style dataset; step ``s`` trains on samples ``[s*G, (s+1)*G)``."""
    global_batch_size: int
    """G: samples per optimizer step over all data-parallel ranks (the same in every layout)."""
    micro_batch_size: int
    """Samples per microbatch (the same in every layout, so every layout sees the same microbatches)."""
    steps: int = 3
    """Optimizer steps per layout."""
    seed: int = 1234
    """Seeds torch/NumPy/Python before the module is built, and the strategy's RNG streams."""
    callbacks_factory: Callable[[ParallelDims], list] | None = None
    """Extra callbacks per layout (e.g. the MegatronOptimizerCallback, the scheduler)."""
    strategy_kwargs: dict = field(default_factory=dict)
    """More MegatronStrategy arguments, the same for every layout."""
    trainer_kwargs: dict = field(default_factory=dict)
    """More Trainer arguments (e.g. ``precision``)."""
    grad_steps: tuple[int, ...] = (1,)
    """Steps (1-based) after which every gradient is gathered as a global tensor."""
    record_params: bool = False
    """Also gather the initial and final parameters as global tensors (the final ones are compared
    relative to the reference's update, final minus initial)."""
    measure_memory: bool = False
    """Measure per-rank bytes of params, grads, optimizer state and saved activations at step 1."""
    measure_traffic: bool = False
    """Count the bytes each rank sends in step 1, by part
    (:class:`~lightning_megatron.check.traffic.TrafficCounter`)."""
    record_outputs: bool = True
    """Record every module's forward output of step 1's first microbatch (DP rank 0)."""
    round_params_to: str | None = None
    """Round every parameter to this dtype (``"bfloat16"``, ``"float16"``) in place before the first step, keeping
    its own dtype: the fp32 truth a 16-bit check is judged against starts from the 16-bit run's weights
    (:func:`~lightning_megatron.check.parity.judge_against_truth`)."""
    accelerator: str = "cpu"


def global_batch_loader(dataset: Dataset, global_batch: int, dp_size: int, dp_rank: int, steps: int) -> DataLoader:
    """This DP rank's contiguous share of global batch ``s``: samples ``s*G + [r*G/d, (r+1)*G/d)``.

    With the same micro-batch size, every layout cuts each global batch into the same consecutive
    microbatches, whatever its DP size: only the summation order can differ, never the samples.
    """
    if global_batch % dp_size:
        raise ValueError(f"global batch {global_batch} is not divisible by the data-parallel size {dp_size}")
    per_rank = global_batch // dp_size
    if len(dataset) < steps * global_batch:  # type: ignore[arg-type]
        raise ValueError(f"the dataset has {len(dataset)} samples, {steps} steps of {global_batch} need "  # type: ignore[arg-type]
                         f"{steps * global_batch}")

    class _Batches:
        def __len__(self) -> int:
            return steps

        def __iter__(self) -> Iterator[list[int]]:
            for s in range(steps):
                start = s * global_batch + dp_rank * per_rank
                yield list(range(start, start + per_rank))

    return DataLoader(dataset, batch_sampler=_Batches())


def _tied_copy(p: torch.Tensor, ps: Any) -> bool:
    return param_facts(p).shared_embedding and not ps.is_pipeline_first_stage()


def global_pieces(named: list[tuple[str, nn.Parameter]], tensors: dict[str, torch.Tensor],
                  ps: Any) -> dict[str, tuple[torch.Tensor, tuple[int, ...] | None, tuple[int, ...]]]:
    """``name -> (piece, offsets or None, global shape)`` this rank contributes to the global tensors.

    One copy of everything over the ranks: DP rank 0 only; a replicated tensor from rank 0 of the
    dimensions it is replicated over and the tied word embedding from the first stage (``is_counted``);
    shards at their offsets in the global tensor without vocab padding (the checkpoint's
    :func:`~lightning_megatron.sharded_state.shard_info`).
    """
    from lightning_megatron.sharded_state import shard_info

    out: dict[str, tuple[torch.Tensor, tuple[int, ...] | None, tuple[int, ...]]] = {}
    for name, p in named:
        # One data-parallel copy: the experts' replicas are their expert-data-parallel ranks.
        replica = ps.coordinates["edp"] if param_facts(p).data_parallel == "expert_dp" else ps.dp_rank
        if replica != 0 or _tied_copy(p, ps):
            continue
        t = tensors[name].detach().float().cpu()
        info = shard_info(p, ps.coordinates, ps.dims.sizes())
        if info is None:
            if is_counted(p, ps.coordinates):
                out[name] = (t.clone(), None, tuple(t.shape))
            continue
        d = info.partition_dim
        for i, (local, global_start, rows) in enumerate(info.pieces):
            if rows > 0:  # a strided shard (gated fc1) is several pieces: "name", "name#1", ...
                offsets = tuple(global_start if k == d else o for k, o in enumerate(info.offsets))
                out[name if i == 0 else f"{name}#{i}"] = (t.narrow(d, local, rows).clone(), offsets,
                                                         tuple(info.global_shape))
    return out


def module_names(named: list[tuple[str, nn.Parameter]], chunks: list[nn.Module]) -> dict[nn.Module, str]:
    """Each module that holds parameters -> its layout-independent name, read off the global name of
    one of its parameters (``encoder.layers.3.mlp.linear_fc2.weight`` -> ``encoder.layers.3.mlp.linear_fc2``).
    A module with a strided TP weight (a gated fc1: [gate_r; up_r] per rank) is left out: its TP
    outputs are not slices of the reference's."""
    global_of = {id(p): n for n, p in named}
    out: dict[nn.Module, str] = {}
    for chunk in chunks:
        for _, mod in chunk.named_modules():
            if any(param_facts(p).partition_stride > 1 for p in mod.parameters(recurse=False)):
                continue
            for local, p in mod.named_parameters():
                name = global_of.get(id(p))
                if name is not None and name.endswith("." + local):
                    out[mod] = name[:-len(local) - 1]
                    break
    return out


def _first_tensor(output: Any) -> torch.Tensor | None:
    if torch.is_tensor(output):
        return output
    if isinstance(output, (tuple, list)):
        return next((t for t in output if torch.is_tensor(t)), None)
    return None


class ForwardOutputs:
    """Forward hooks recording each named module's output the first time it runs (step 1's first
    microbatch on this rank's stage): ``name -> ((chunk, order), tensor)``, ``chunk`` the index of the
    model chunk holding the module (interleaved pipelining: chunk ``v`` of stage ``p`` is the model's
    piece ``v x pp + p``), ``order`` the call order on this rank."""

    def __init__(self, names: dict[nn.Module, str], chunks: list[nn.Module]) -> None:
        self.outputs: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}
        self.params = {name: sum(1 for _ in m.parameters()) for m, name in names.items()}
        """Name -> the parameter tensors its module holds on this rank: a module split over pipeline stages (a
        stage's part of the layer stack) holds fewer than the reference's, and its output is not the whole's."""
        chunk_of = {m: i for i, chunk in enumerate(chunks) for m in chunk.modules()}
        self._handles = [m.register_forward_hook(self._hook(name, chunk_of.get(m, 0))) for m, name in names.items()]

    def _hook(self, name: str, chunk: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            t = _first_tensor(output)
            if t is not None and name not in self.outputs:
                self.outputs[name] = ((chunk, len(self.outputs)), t.detach().float().cpu().clone())
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _named_parameters(trainer: Any) -> list[tuple[str, nn.Parameter]]:
    return list(trainer.strategy.module_contract.sharded_named_parameters())


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class _SavedActivations:
    """Live and peak bytes of the tensors autograd saves for backward (parameters excluded)."""

    def __init__(self, param_ptrs: set[int]) -> None:
        self.param_ptrs = param_ptrs
        self.live: dict[int, list[int]] = {}
        self.current = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if ptr == 0 or ptr in self.param_ptrs:
            return t
        return _Held(self, t, ptr, t.untyped_storage().nbytes())

    @staticmethod
    def unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h

    def add(self, ptr: int, nbytes: int) -> None:
        entry = self.live.setdefault(ptr, [0, nbytes])
        if entry[0] == 0:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        entry[0] += 1

    def remove(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]


class _Held:
    __slots__ = ("owner", "t", "ptr")

    def __init__(self, owner: _SavedActivations, t: torch.Tensor, ptr: int, nbytes: int) -> None:
        self.owner, self.t, self.ptr = owner, t, ptr
        owner.add(ptr, nbytes)

    def __del__(self) -> None:
        self.owner.remove(self.ptr)


def _on_shared_memory(group: Any) -> bool:
    """Whether ``group``'s collectives go through the CPU shared-memory path."""
    from lightning_megatron.cpu.shared_memory import SharedMemoryCollectives
    from lightning_megatron.parallel_state import group_communicator

    return isinstance(group_communicator(group), SharedMemoryCollectives)


def _gathered_main_grads(buffer: Any, named: list[tuple[str, nn.Parameter]],
                         grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DP-mean gradients of a buffer reduced by reduce-scatter (ZeRO-1): each DP rank holds the mean
    of its own piece of every bucket only (the rest is its local sum): the pieces, summed over each
    bucket's data-parallel group."""
    full = torch.zeros_like(buffer.data)
    for bucket in buffer.buckets:
        lo, hi = buffer.shard(bucket)
        full[lo:hi] = buffer.data[lo:hi]
        if bucket.group is not None:
            dist.all_reduce(full[bucket.start: bucket.end], group=process_group(bucket.group))
    out = dict(grads)
    for name, p in named:
        if buffer.holds(grads[name]):
            o = buffer.offsets[id(p)]
            out[name] = full[o: o + p.numel()].view(p.shape)
    return out


def _make_recorder(run: CheckRun):
    from lightning.pytorch import Callback

    from lightning_megatron.protocols import is_sharded, optimizer_wrapper

    class Recorder(Callback):
        """Per step: loss, global grad norm; at ``run.grad_steps``: global gradient pieces; memory."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.grad_norms: list[float] = []
            self.grads: dict[int, dict] = {}
            self.memory: dict[str, int] = {}
            self.collectives: dict[str, bool] = {}
            self.traffic: dict[str, float] = {}
            self._counter: Any = None
            self._saved: _SavedActivations | None = None
            self._hooks: Any = None
            self._outputs: ForwardOutputs | None = None
            self.outputs: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}
            self.output_params: dict[str, int] = {}
            self.init_params: dict = {}

        def on_train_start(self, trainer, pl_module) -> None:
            ps = trainer.strategy.parallel_state
            if run.round_params_to is not None:
                with torch.no_grad():
                    for p in pl_module.parameters():
                        p.copy_(p.to(getattr(torch, run.round_params_to)))
            if run.record_params:
                named = _named_parameters(trainer)
                self.init_params = global_pieces(named, dict(named), ps)
            self.collectives = {name: _on_shared_memory(g)
                                for name, g in (("tp", ps.group("tp")), ("dp", ps.group("dp_cp")))
                                if g is not None and g.size > 1}
            if run.measure_traffic and ps.groups:
                from lightning_megatron.check.traffic import TrafficCounter

                self._counter = TrafficCounter()
                self._counter.install(ps)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self._counter is not None and trainer.global_step == 0:
                self._counter.counting = True
            if run.record_outputs and trainer.global_step == 0 and trainer.strategy.parallel_state.dp_rank == 0:
                chunks = list(trainer.strategy.model_chunks)
                self._outputs = ForwardOutputs(module_names(_named_parameters(trainer), chunks), chunks)
            if run.measure_memory and trainer.global_step == 0:
                head = getattr(pl_module, "head_tokens", None)
                tensors = [v for v in batch.values() if torch.is_tensor(v)] if isinstance(batch, dict) else []
                if head is not None and tensors:  # the most tokens a microbatch's head runs on
                    rows, mb = len(tensors[0]), run.micro_batch_size
                    counts = [head({k: v[i:i + mb] if torch.is_tensor(v) else v for k, v in batch.items()})
                              for i in range(0, rows, mb)]
                    if counts and None not in counts:
                        self.memory["head_tokens"] = max(counts)
                ptrs = {p.untyped_storage().data_ptr() for p in pl_module.parameters()}
                self._saved = _SavedActivations(ptrs)
                self._hooks = torch.autograd.graph.saved_tensors_hooks(self._saved.pack, self._saved.unpack)
                self._hooks.__enter__()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            counting = self._counter is not None and self._counter.counting
            if counting:  # the recorder's own gathers are not the step's
                self._counter.counting = False
            try:
                self._record(trainer, pl_module, optimizer)
            finally:
                if counting:
                    self._counter.counting = True

        def _record(self, trainer, pl_module, optimizer) -> None:
            if self._outputs is not None:
                self._outputs.remove()
                self.outputs, self.output_params = self._outputs.outputs, self._outputs.params
                self._outputs = None
            if self._hooks is not None:
                self._hooks.__exit__(None, None, None)
                self._hooks = None
                self.memory["activations_peak"] = self._saved.peak
            strategy = trainer.strategy
            ps = strategy.parallel_state
            named = _named_parameters(trainer)
            grads = {}
            buffer = strategy.grad_buffer
            for name, p in named:
                g = None if buffer is None else buffer.main_grad_of(p)
                g = p.grad if g is None else g
                grads[name] = torch.zeros_like(p, dtype=torch.float32) if g is None else g
            if run.measure_memory and trainer.global_step == 0:  # every parameter held, frozen ones too (LoRA)
                self.memory["params"] = _storage_bytes(list(pl_module.parameters()))
                self.memory["grads"] = _storage_bytes([g for g in grads.values()])
            if buffer is not None and buffer.reduces_by_scatter:  # the buffer's pieces: before any copy of them
                grads = _gathered_main_grads(buffer, named, grads)
            elif any(is_sharded(optimizer_wrapper(o)) for o in strategy.optimizers) and ps.dp_size > 1:
                flat = torch.cat([g.detach().float().reshape(-1) for g in grads.values()])
                dist.all_reduce(flat, group=ps.dp_cp_group)
                flat /= ps.dp_size
                grads = dict(zip(grads, (v.view_as(g) for v, g in
                                         zip(flat.split([g.numel() for g in grads.values()]), grads.values()))))
            scaler = optimizer_wrapper(optimizer).grad_scaler
            scale = 1.0 if scaler is None else float(scaler.scale)
            if scale != 1.0:  # fp16: the gradients of the loss, not of the scaled loss (the optimizer unscales them)
                grads = {n: g.float() / scale for n, g in grads.items()}
            # In float64: torch's fp32 norm of a vocab-sized tensor is off by ~1e-4 relative, differently
            # for each TP split, which would hide the layout's own differences. Under expert parallelism
            # the experts' part is summed over their own model-parallel ranks (each expert once).
            families = [("mp", [n for n, p in named if ps.ep_size == 1
                                or param_facts(p).data_parallel != "expert_dp"])]
            if ps.ep_size > 1:
                families.append(("expert_mp", [n for n, p in named if param_facts(p).data_parallel == "expert_dp"]))
            total = 0.0
            for group_name, names in families:
                wanted = set(names)
                counted = [grads[n] for n, p in named if n in wanted and is_counted(p, ps.coordinates)]
                squares = torch.stack([g.detach().double().pow(2).sum() for g in counted]).sum().reshape(1) \
                    if counted else torch.zeros(1, dtype=torch.float64)
                group = ps.group(group_name)
                if group is not None and group.size > 1:
                    dist.all_reduce(squares, group=group.process_group)
                total += float(squares.item())
            self.grad_norms.append(total ** 0.5)
            step = trainer.global_step + 1
            if step in run.grad_steps:
                self.grads[step] = global_pieces(named, grads, ps)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))
            if self._counter is not None and self._counter.counting:
                self._counter.counting = False
                self.traffic = dict(self._counter.sent)
                self._counter.remove()
            if run.measure_memory and "optimizer" not in self.memory:
                self.memory["optimizer"] = _optimizer_bytes(trainer.strategy.optimizers, pl_module)

    return Recorder()


def _optimizer_bytes(optimizers: list, module: nn.Module) -> int:
    """Optimizer state plus fp32 main copies (tensors the optimizer steps that are not model params)."""
    model = {p.untyped_storage().data_ptr() for p in module.parameters()}
    tensors = []
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)
        inner = getattr(inner, "optimizer", inner)  # LightningOptimizer -> Megatron wrapper -> torch
        for group in inner.param_groups:
            tensors += [p for p in group["params"] if p.untyped_storage().data_ptr() not in model]
        tensors += [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return _storage_bytes(tensors)


def _fit_layout(run: CheckRun, layout: ParallelDims) -> dict[str, Any]:
    from lightning.fabric.utilities.seed import seed_everything
    from lightning.pytorch import Trainer

    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.optimizer.config import OptimizerConfig
    from lightning_megatron.strategy import MegatronStrategy

    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(f"layout {layout} needs {layout.world_size} ranks, this run has {world}")
    seed_everything(run.seed, verbose=False)
    # every gradient is compared with one process here, so a replica's wrong gradient is named, not only stopped at
    strategy = MegatronStrategy(**layout.strategy_kwargs(), micro_batch_size=run.micro_batch_size, seed=run.seed,
                                **{**run.strategy_kwargs, "check_replicated_grads": False})
    module = _one_stage_sizes(run.module_factory(), layout)
    if getattr(module, "hparams", {}).get("compile"):
        _room_to_recompile(getattr(getattr(module, "config", None), "num_layers", 1) or 1)
    callbacks = list(run.callbacks_factory(layout)) if run.callbacks_factory is not None else []
    optimizer_cbs = [c for c in callbacks if isinstance(c, MegatronOptimizerCallback)]
    if layout.zero1 and not optimizer_cbs:  # clip_grad=0: the same update as the plain optimizer of the other layouts
        callbacks.append(MegatronOptimizerCallback(OptimizerConfig(clip_grad=0.0, use_distributed_optimizer=True)))
    for c in optimizer_cbs:  # the layout named is the one run: ZeRO-1 where it says zero1, whatever the recipe's
        c.config = replace(c.config, use_distributed_optimizer=layout.zero1)
    recorder = _make_recorder(run)
    # One epoch over the loader's ``steps`` global batches; ``trainer_kwargs`` may set a larger max_steps
    # (a recipe's: its scheduler decays over max_steps), the run still stops after ``steps``.
    kwargs = dict(accelerator=run.accelerator, devices=world, strategy=strategy, max_steps=run.steps, max_epochs=1,
                  logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False)
    kwargs.update(run.trainer_kwargs)
    trainer = Trainer(callbacks=callbacks + [recorder], **kwargs)
    dp_rank = layout.coordinates(dist.get_rank())["dp"]
    loader = global_batch_loader(run.dataset_factory(), run.global_batch_size, layout.dp, dp_rank, run.steps)
    trainer.fit(module, train_dataloaders=loader)
    ps = strategy.parallel_state
    named = _named_parameters(trainer)
    params = global_pieces(named, {n: p for n, p in named}, ps) if run.record_params else {}
    return {"layout": layout.name, "rank": dist.get_rank(), "coords": (ps.tp_rank, ps.dp_rank, ps.pp_rank),
            "losses": recorder.losses, "grad_norms": recorder.grad_norms, "grads": recorder.grads,
            "params": params, "init_params": recorder.init_params, "memory": recorder.memory,
            "collectives": recorder.collectives, "traffic": recorder.traffic, "outputs": recorder.outputs,
            "output_params": recorder.output_params}


def _room_to_recompile(layers: int) -> None:
    """A compiled model's layers each compile again under the recorder's forward hooks (a hook per module, its name
    guarded) and once more without them: with torch's default limit (8 a function) the later steps of a check ran
    its layers eager, unsaid. Room for each layer's variants."""
    import torch._dynamo

    config = torch._dynamo.config  # torch < 2.7 names them cache_size_limit, accumulated_cache_size_limit
    if hasattr(config, "recompile_limit"):
        config.recompile_limit = max(config.recompile_limit, 4 * layers + 8)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 16 * layers + 64)
    else:
        config.cache_size_limit = max(config.cache_size_limit, 4 * layers + 8)
        config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 16 * layers + 64)


def _one_stage_sizes(module: Any, layout: ParallelDims) -> Any:
    """``module`` with its config's :data:`STAGE_SIZES` unset when ``layout`` has one pipeline stage (the one-process
    reference of a recipe with uneven stages), which a run refuses with them."""
    from lightning_megatron.pipeline.layout import STAGE_SIZES

    config = getattr(module, "config", None)
    if layout.pp == 1 and is_dataclass(config) and any(getattr(config, n, None) for n in STAGE_SIZES):
        module.config = replace(config, **dict.fromkeys(STAGE_SIZES))
    return module


def run_layouts(run: CheckRun, layouts: list[ParallelDims]) -> list[dict[str, Any]]:
    """On every rank: fit each layout in turn (process start-up and imports are paid once)."""
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401  (sets its loggers' level at import: set ours after)

    # In these spawned ranks only: Lightning's per-fit banners and hints would bury the table.
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in (".*defined a `validation_step` but have no `val_dataloader`.*", ".*LeafSpec.*"):
        warnings.filterwarnings("ignore", message=message)
    return [_fit_layout(run, layout) for layout in layouts]

