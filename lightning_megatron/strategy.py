"""MegatronStrategy: tensor, pipeline and data parallelism for Lightning's Trainer.

It extends Lightning's DDPStrategy (launching, process-group set-up, cluster environments) through
public hooks only, and replaces what DDP does per step:

- ``setup_environment``: after ``init_process_group``, builds the TP/DP/PP/embedding groups
  (:func:`initialize_model_parallel`) and seeds the RNG tracker; the LightningModule reads
  ``trainer.strategy.parallel_state`` in ``configure_model``.
- ``training_step``: splits this DP rank's batch into ``micro_batch_size`` microbatches and runs the
  microbatch schedule (no pipelining, 1F1B or interleaved) forward and backward, accumulating into
  the fp32 :class:`~lightning_megatron.grads.GradBuffer` (bucketed DP reductions started during the
  last microbatch's backward with ``overlap_grad_reduce``); then ``finalize_model_grads``: DP mean,
  TP sum of sequence-parallel grads, sum of the tied word embedding over the first and last stage.
  The model is not wrapped in DistributedDataParallel; ``backward`` is a no-op because the
  schedule already ran it.
- validation/test/predict run the forward-only schedule.
- checkpoints are sharded and reshardable (:mod:`lightning_megatron.checkpoint`).
- set-up refuses a precision that disagrees with the parameters' dtype and 16-bit parameters
  without MegatronOptimizerCallback; SIGTERM stops every rank before the same step, saves
  ``last.ckpt`` and exits 143 (:mod:`lightning_megatron.preemption`).

Batch semantics: global_batch = micro_batch_size x num_microbatches x DP. The dataloader of each DP
rank yields micro_batch_size x num_microbatches samples per step (every TP and PP rank of a replica
gets the same batch); the logged loss is the mean over the global batch.
"""

from __future__ import annotations

import datetime
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from typing_extensions import override

from lightning_megatron import checkpoint as ckpt
from lightning_megatron.config_checks import PRECISION_PARAMS_DTYPE, normalize_precision
from lightning_megatron.cpu import CPUTuning
from lightning_megatron.grads import GradBuffer, buffer_order, finalize_model_grads
from lightning_megatron.optimizer.mixed_precision import MegatronOptimizer
from lightning_megatron.parallel_state import ParallelLayout, ParallelState, initialize_model_parallel
from lightning_megatron.pipeline.microbatches import split_microbatches
from lightning_megatron.pipeline.schedules import get_forward_backward_func, validate_num_microbatches
from lightning_megatron.preemption import PreemptionHandler, on_sigterm
from lightning_megatron.sharded_state import ShardedStateMapper, is_distributed_optimizer
from lightning_megatron.tensor_parallel.mappings import all_reduce
from lightning_megatron.tensor_parallel.random import model_parallel_seed

__all__ = ["MegatronStrategy"]

# Metrics are reduced over DP and broadcast along the pipeline before logging: sync_dist is not needed.
warnings.filterwarnings("ignore", message=".*when logging on epoch level in distributed setting.*")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"MegatronStrategy: {name}={value!r} must be a positive integer")


class MegatronStrategy(DDPStrategy):
    """Megatron-style TP x PP x DP training under ``lightning.Trainer``.

    Args:
        tensor_model_parallel_size: ranks each linear layer is split across (TP).
        pipeline_model_parallel_size: number of pipeline stages (PP).
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (interleaved 1F1B).
        sequence_parallel: split activations outside the TP regions along the sequence.
        micro_batch_size: samples per microbatch; None reads ``micro_batch_size`` from the datamodule
            (then the LightningModule), else the whole per-rank batch is one microbatch.
        seed: seed of the default and model-parallel RNG streams (dropout); weights are seeded by the model.
        ddp_bucket_size_mb: size of the buckets of the fp32 grad buffer, the unit of the
            data-parallel gradient reduction (all-reduce, or reduce-scatter with ZeRO-1).
        overlap_grad_reduce: start each bucket's DP reduction during the last microbatch's backward,
            as soon as its grads are final, and wait for it only before the optimizer step
            (megatron-core's name). ``None`` (default): on, except with the CPU tuning's
            shared-memory collectives, which are synchronous: each bucket would wait for the slower
            DP rank inside backward (measured 1.4-2.4x slower steps at DP=2). Results are bitwise
            equal either way.
        overlap_param_gather: ZeRO-1 parameter all-gather overlapped with the next forward: not
            implemented; ``True`` is refused.
        cpu_tuning: opt-in tuning for CPU runs (:class:`lightning_megatron.cpu.CPUTuning`: shared-memory
            collectives, glibc allocator setting, CPU dropout and attention kernels); ``True`` is
            ``CPUTuning()``. Default ``None``: the same code path as on accelerators. It acts only
            when the root device is a CPU.
        timeout: collective timeout; a failing rank ends the job after at most this long.
        Others as :class:`lightning.pytorch.strategies.DDPStrategy`.
    """

    strategy_name = "megatron"

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None,
        sequence_parallel: bool = False,
        *,
        micro_batch_size: int | None = None,
        seed: int = 1234,
        ddp_bucket_size_mb: float = 25.0,
        cpu_tuning: CPUTuning | bool | None = None,
        overlap_grad_reduce: bool | None = None,
        overlap_param_gather: bool = False,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | int | None = datetime.timedelta(minutes=30),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        _positive("tensor_model_parallel_size", tensor_model_parallel_size)
        _positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
        if virtual_pipeline_model_parallel_size is not None:
            _positive("virtual_pipeline_model_parallel_size", virtual_pipeline_model_parallel_size)
            if pipeline_model_parallel_size < 2:
                raise ValueError(
                    f"MegatronStrategy: virtual_pipeline_model_parallel_size="
                    f"{virtual_pipeline_model_parallel_size} needs pipeline_model_parallel_size >= 2 "
                    f"(got {pipeline_model_parallel_size}); leave it None without pipelining")
        if micro_batch_size is not None:
            _positive("micro_batch_size", micro_batch_size)
        if sequence_parallel and tensor_model_parallel_size == 1:
            raise ValueError("MegatronStrategy: sequence_parallel=True has no effect with "
                             "tensor_model_parallel_size=1; set tensor_model_parallel_size > 1 or turn it off")
        if ddp_bucket_size_mb <= 0:
            raise ValueError(f"MegatronStrategy: ddp_bucket_size_mb={ddp_bucket_size_mb} must be > 0")
        if overlap_param_gather:
            raise NotImplementedError(
                "MegatronStrategy: overlap_param_gather=True is not implemented: the DistributedOptimizer "
                "all-gathers the updated parameters at the end of its step; set overlap_param_gather=False")
        if isinstance(timeout, int):
            timeout = datetime.timedelta(seconds=timeout)
        if cpu_tuning is True:
            cpu_tuning = CPUTuning()
        elif cpu_tuning is False:
            cpu_tuning = None
        if cpu_tuning is not None and not isinstance(cpu_tuning, CPUTuning):
            raise TypeError(f"MegatronStrategy: cpu_tuning={cpu_tuning!r} must be a "
                            f"lightning_megatron.cpu.CPUTuning, True, False or None")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.pipeline_model_parallel_size = pipeline_model_parallel_size
        self.virtual_pipeline_model_parallel_size = virtual_pipeline_model_parallel_size
        self.sequence_parallel = sequence_parallel
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.ddp_bucket_size_mb = ddp_bucket_size_mb
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.cpu_tuning: CPUTuning | None = cpu_tuning
        self.parallel_state: ParallelState | None = None
        self._logged_keys: dict[str, list[str]] = {}  # per stage: metric names known on every pipeline rank
        self._grad_buffer: GradBuffer | None = None
        self._preemption = PreemptionHandler()
        self.schedule_trace: list | None = None
        """Set to a list to record the schedule's events of the next steps (for pictures and benchmarks)."""

    # ------------------------------------------------------------------ set-up

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(world_size=self.num_nodes * self.num_processes,
                              tensor_model_parallel_size=self.tensor_model_parallel_size,
                              pipeline_model_parallel_size=self.pipeline_model_parallel_size,
                              virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size)

    @override
    def setup_environment(self) -> None:
        _ = self.layout  # validate sizes against the world size before launching collectives
        super().setup_environment()
        self.parallel_state = initialize_model_parallel(
            self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
            self.virtual_pipeline_model_parallel_size, timeout=self._timeout)
        model_parallel_seed(self.seed + 100 * self.parallel_state.pp_rank, self.parallel_state.tp_rank)
        if self.cpu_tuning is not None:  # opt-in; acts on CPU only
            self.cpu_tuning.setup(self.parallel_state, device=self.root_device, timeout=self._timeout)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every TP and PP rank of one replica reads the same samples: shard data over DP only.
        ps = self.parallel_state
        if ps is None:
            layout = self.layout
            tp_rank, dp_rank, _ = layout.coordinates(self.global_rank)
            return {"num_replicas": layout.data_parallel_size, "rank": dp_rank}
        return {"num_replicas": ps.dp_size, "rank": ps.dp_rank}

    @override
    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: gradients are reduced by finalize_model_grads after
        # the microbatch schedule (DDP would all-reduce once per microbatch backward).
        assert isinstance(self.model, LightningModule)

    @override
    def setup(self, trainer: Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"MegatronStrategy: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not "
                f"supported: gradient accumulation is the microbatch schedule. Set accumulate_grad_batches=1 and "
                f"choose global_batch_size = micro_batch_size x num_microbatches x data-parallel size instead")
        if trainer.gradient_clip_val:
            raise ValueError(
                f"MegatronStrategy: Trainer(gradient_clip_val={trainer.gradient_clip_val}) would clip each rank's "
                f"shard separately. Use lightning_megatron.callbacks.MegatronOptimizerCallback(clip_grad=...), "
                f"which clips by the norm over all tensor- and pipeline-parallel ranks")
        self._validate_model()
        self._validate_precision(trainer)
        self._validate_batch_sizes(trainer)
        # DDPStrategy.setup minus the DDP wrapper and minus _sync_module_states (which would
        # broadcast rank 0's tensor-parallel shards over every rank when not fitting).
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.cpu_tuning is not None:
            self.cpu_tuning.configure_model(self.model, self.root_device)
        if trainer.state.fn == TrainerFn.FITTING:
            self._build_grad_buffer()  # before configure_optimizers, which may shard it (ZeRO-1)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @property
    def grad_buffer(self) -> GradBuffer | None:
        """The fp32 main-grad buffer of this rank's chunks (built in ``setup`` when fitting)."""
        return self._grad_buffer

    def _build_grad_buffer(self) -> GradBuffer:
        ps = self.parallel_state
        assert ps is not None
        if self._grad_buffer is not None:
            self._grad_buffer.remove()
        dp_group = ps.dp_group if ps.dp_size > 1 else None
        overlap = self.overlap_grad_reduce
        if overlap is None:
            # On by default (one code path for every device). The opt-in CPU tuning's shared-memory
            # collectives are synchronous, so there each bucket would wait for the slower DP rank
            # inside backward (benchmarks/overlap.py, docs/strategy.md): off with it.
            overlap = dp_group is not None and not (
                self.cpu_tuning is not None and self.cpu_tuning.synchronous_collectives(self.root_device))
        self._grad_buffer = GradBuffer(
            buffer_order(self.model_chunks), bucket_bytes=self.ddp_bucket_size_mb * 2**20, pad_to=ps.dp_size,
            separate_shared_embedding=ps.pp_size > 1 and ps.embedding_group is not None,
            dp_group=dp_group, overlap_grad_reduce=overlap)
        return self._grad_buffer

    def _validate_model(self) -> None:
        ps = self.parallel_state
        assert ps is not None
        chunks = self.model_chunks
        expected = self.virtual_pipeline_model_parallel_size or 1
        if len(chunks) != expected:
            raise ValueError(
                f"MegatronStrategy: the LightningModule built {len(chunks)} model chunk(s) but "
                f"virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size} needs {expected}; "
                f"build one chunk per virtual stage in configure_model (see docs/pipeline.md)")
        if ps.pp_size > 1 and not hasattr(self.lightning_module, "forward_step"):
            raise ValueError(
                "MegatronStrategy: pipeline_model_parallel_size > 1 needs the LightningModule to implement "
                "forward_step(microbatch, chunk) -> (output_tensor, loss_func) and pipeline_tensor_shape(microbatch)")

    def _validate_precision(self, trainer: Trainer) -> None:
        """The Trainer's precision must match the parameters' dtype; 16-bit parameters need fp32 main params.

        Runs before ``convert_module``, which would otherwise silently cast the model to the precision's dtype.
        """
        from lightning_megatron.callbacks.optimizer import MegatronOptimizerCallback

        plugin = self.precision_plugin
        precision = normalize_precision(getattr(plugin, "precision", None))
        if getattr(plugin, "scaler", None) is not None:
            raise ValueError(
                f"MegatronStrategy: precision={precision!r} scales the loss with torch's GradScaler in Lightning's "
                f"backward, which the strategy's microbatch schedule replaces (the gradients would be unscaled "
                f"without ever being scaled). Use precision='bf16-mixed' (autocast, no scaling), or "
                f"params_dtype='float16' with precision='16-true' and MegatronOptimizerCallback (dynamic loss scaling)")
        if precision not in PRECISION_PARAMS_DTYPE:
            raise ValueError(f"MegatronStrategy: precision={precision!r} is not supported; use one of "
                             f"{sorted(PRECISION_PARAMS_DTYPE)}")
        expected = getattr(torch, PRECISION_PARAMS_DTYPE[precision])
        dtypes = sorted({str(p.dtype) for chunk in self.model_chunks for p in chunk.parameters()
                         if p.is_floating_point()})
        hparams = getattr(self.lightning_module, "hparams", {})
        named = f" (params_dtype={hparams['params_dtype']!r})" if "params_dtype" in hparams else ""
        if dtypes and dtypes != [str(expected)]:
            fix = {"torch.float32": "Trainer(precision='32-true') (or 'bf16-mixed' for autocast)",
                   "torch.bfloat16": "Trainer(precision='bf16-true')", "torch.float16": "Trainer(precision='16-true')"}
            raise ValueError(
                f"MegatronStrategy: Trainer(precision={precision!r}) needs {expected} parameters but the model's "
                f"parameters are {', '.join(dtypes)}{named}; set {fix.get(dtypes[0], 'a matching precision')} or "
                f"build the model with params_dtype={PRECISION_PARAMS_DTYPE[precision]!r}")
        low = [d for d in dtypes if d in ("torch.float16", "torch.bfloat16")]
        if low and trainer.state.fn == TrainerFn.FITTING and not any(
                isinstance(cb, MegatronOptimizerCallback) for cb in trainer.callbacks):
            raise ValueError(
                f"MegatronStrategy: {low[0]} parameters{named} without MegatronOptimizerCallback would be updated in "
                f"16 bits (fp16 diverges without loss scaling; bf16 drops small updates). Add "
                f"lightning_megatron.callbacks.MegatronOptimizerCallback to the Trainer's callbacks (fp32 main "
                f"params, loss scaling, overflow skip), or train with params_dtype='float32'")

    def _validate_batch_sizes(self, trainer: Trainer) -> None:
        """global_batch_size = micro_batch_size x num_microbatches x DP, checked before any step."""
        ps = self.parallel_state
        assert ps is not None
        dm = getattr(trainer, "datamodule", None)
        global_batch = getattr(dm, "global_batch_size", None)
        micro = self._micro_batch_size()
        if global_batch is None or micro is None:
            return
        if global_batch % (micro * ps.dp_size) != 0:
            raise ValueError(
                f"MegatronStrategy: global_batch_size={global_batch} is not divisible by micro_batch_size={micro} "
                f"x data-parallel size={ps.dp_size} (= {micro * ps.dp_size}); choose a global batch that is a "
                f"multiple of it")
        validate_num_microbatches(global_batch // (micro * ps.dp_size), ps.pp_size, ps.vp_size)

    @property
    def model_chunks(self) -> list[nn.Module]:
        """This rank's model chunks: ``lightning_module.model_chunks`` or the module itself."""
        module = self.lightning_module
        chunks = getattr(module, "model_chunks", None)
        if chunks is None:
            return [module]
        return list(chunks)

    # ------------------------------------------------------------------ the step

    def _micro_batch_size(self) -> int | None:
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        trainer = self.lightning_module.trainer
        dm = getattr(trainer, "datamodule", None)
        for source in (dm, self.lightning_module):
            mbs = getattr(source, "micro_batch_size", None)
            if mbs is not None:
                return int(mbs)
        return None

    def split_microbatches(self, batch: Any) -> list[Any]:
        """Split the per-rank batch along dim 0 into microbatches of ``micro_batch_size``."""
        return split_microbatches(batch, self._micro_batch_size())

    def _grad_scale_func(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        # The MegatronOptimizerCallback wraps the optimizer; a wrapper with a loss scale exposes it.
        for opt in self.optimizers:
            scale_loss = getattr(opt, "scale_loss", None)
            if scale_loss is not None:
                return scale_loss
        return None

    def _forward_step_func(self, stage: str, batch_idx: int) -> Callable:
        module = self.lightning_module
        if hasattr(module, "forward_step"):
            return module.forward_step

        hook = {"train": module.training_step, "val": module.validation_step,
                "test": module.test_step, "predict": module.predict_step}[stage]

        def forward_step(microbatch: Any, chunk: nn.Module):
            out = hook(microbatch, batch_idx)
            loss = out["loss"] if isinstance(out, Mapping) else out

            def loss_func(output: torch.Tensor):
                return output, {"loss": output.detach()}

            return loss, loss_func

        return forward_step

    def run_schedule(self, batch: Any, batch_idx: int, stage: str, forward_only: bool) -> dict[str, torch.Tensor]:
        """Run all microbatches of ``batch`` through this rank's chunks; return the logged means."""
        ps = self.parallel_state
        assert ps is not None
        microbatches = self.split_microbatches(batch)
        validate_num_microbatches(len(microbatches), ps.pp_size, ps.vp_size)
        module = self.lightning_module
        chunks = self.model_chunks
        tensor_shape: tuple[int, ...] = ()
        dtype = next(iter(module.parameters())).dtype
        if ps.pp_size > 1:
            tensor_shape = tuple(module.pipeline_tensor_shape(microbatches[0]))
        fb = get_forward_backward_func(ps.pp_size, ps.vp_size)
        if not forward_only:
            # Lightning zeroes grads only after the training step (before its backward), too late
            # for a schedule that runs backward inside the step: start every step from no grads.
            buffer = self._grad_buffer if self._grad_buffer is not None else self._build_grad_buffer()
            for opt in self.optimizers:
                if is_distributed_optimizer(opt) and getattr(opt, "buffer", None) is not buffer:
                    raise ValueError(
                        "MegatronStrategy: a DistributedOptimizer must shard the strategy's grad buffer: build it "
                        "with DistributedOptimizer(..., grad_buffer=trainer.strategy.grad_buffer) or use "
                        "MegatronOptimizerCallback(use_distributed_optimizer=True)")
            buffer.start(len(microbatches))
        logged = fb(forward_step_func=self._forward_step_func(stage, batch_idx), microbatches=microbatches,
                    model=chunks, num_microbatches=len(microbatches), parallel_state=ps,
                    tensor_shape=tensor_shape, dtype=dtype, forward_only=forward_only,
                    grad_scale_func=None if forward_only else self._grad_scale_func(),
                    trace=self.schedule_trace)
        if not forward_only:
            self.finalize_model_grads()
        return self._reduce_logged(logged, stage)

    def _reduce_logged(self, logged: list[dict[str, Any]], stage: str = "train") -> dict[str, torch.Tensor]:
        """Mean over microbatches (last stage), mean over DP, then broadcast along the pipeline.

        The pipeline broadcast is one tensor op (no host sync): the metric names are sent as objects
        only on the first step of ``stage``; a loss function whose names change later is refused.
        """
        ps = self.parallel_state
        assert ps is not None
        keys: list[str] = []
        values: torch.Tensor | None = None
        if ps.is_pipeline_last_stage() and logged:
            keys = sorted(k for k, v in logged[0].items() if torch.is_tensor(v) and v.numel() == 1)
            stacked = torch.stack([torch.stack([d[k].detach().float().reshape(()) for k in keys]) for d in logged])
            values = stacked.mean(dim=0)
            if ps.dp_size > 1:
                all_reduce(values, ps.dp_group)
                values /= ps.dp_size
        if ps.pp_size > 1:
            keys, values = self._broadcast_logged(keys, values, stage)
        return {} if values is None else dict(zip(keys, values.unbind(0)))

    def _broadcast_logged(self, keys: list[str], values: torch.Tensor | None, stage: str
                          ) -> tuple[list[str], torch.Tensor | None]:
        ps = self.parallel_state
        assert ps is not None
        src, last = ps.pp_ranks[-1], ps.is_pipeline_last_stage()
        cached = self._logged_keys.get(stage)
        if cached is None:  # first step of this stage: every pipeline rank learns the names
            holder = [keys if last else None]
            dist.broadcast_object_list(holder, src=src, group=ps.pp_group)
            cached = self._logged_keys[stage] = list(holder[0])
        if not cached:
            return [], None
        if last and keys != cached:
            # Still send (NaN) so that the other stages do not wait, then refuse.
            dist.broadcast(torch.full((len(cached),), float("nan"), device=self.root_device), src=src,
                           group=ps.pp_group)
            raise ValueError(f"MegatronStrategy: the {stage} loss function returned the metrics {keys} after "
                             f"{cached} in an earlier step; with pipeline parallelism every step must log the "
                             f"same metric names")
        buf = values.to(self.root_device) if last and values is not None else \
            torch.empty(len(cached), device=self.root_device)
        dist.broadcast(buf, src=src, group=ps.pp_group)
        return list(cached), buf

    def finalize_model_grads(self) -> None:
        """After the schedule: every gradient in fp32 ``param.main_grad``, reduced
        (:func:`lightning_megatron.grads.finalize_model_grads`: DP mean, or this rank's reduced
        shard with a DistributedOptimizer; TP sum of sequence-parallel grads; the tied word
        embedding summed over the first and last stage). ``.grad`` stays None: the Megatron
        optimizer wrappers read ``main_grad``; a plain torch optimizer gets ``.grad`` in
        :meth:`optimizer_step`, after Lightning's ``zero_grad``.
        """
        assert self.parallel_state is not None and self._grad_buffer is not None
        finalize_model_grads(self._grad_buffer, self.parallel_state)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        buffer = self._grad_buffer

        def closure_with_grads() -> Any:
            out = closure()  # training_step: the whole microbatch schedule, then Lightning's zero_grad
            if buffer is not None and not isinstance(optimizer, MegatronOptimizer):
                buffer.set_param_grads()  # a plain torch optimizer reads .grad
            return out

        return super().optimizer_step(optimizer, closure_with_grads, model, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        assert self.lightning_module is not None
        with self.precision_plugin.train_step_context():
            means = self.run_schedule(batch, batch_idx, "train", forward_only=False)
        self._log(means, "train", on_step=True, on_epoch=False)
        loss = means.get("loss")
        if loss is None:
            loss = torch.zeros((), device=self.root_device)
        # Returned for Lightning's bookkeeping (progress bar, callbacks); backward already ran.
        return {"loss": loss}

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The microbatch schedule ran backward for every microbatch (with loss scaling); nothing to do.
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("val", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test", *args, **kwargs)

    def _eval_step(self, stage: str, *args: Any, **kwargs: Any) -> Any:
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        ctx = self.precision_plugin.val_step_context() if stage == "val" else self.precision_plugin.test_step_context()
        with ctx:
            means = self.run_schedule(batch, batch_idx, stage, forward_only=True)
        self._log(means, stage, on_step=False, on_epoch=True)
        return means.get("loss")

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        ps = self.parallel_state
        assert ps is not None
        if ps.pp_size == 1:
            return super().predict_step(*args, **kwargs)
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        microbatches = self.split_microbatches(batch)
        module = self.lightning_module
        fb = get_forward_backward_func(ps.pp_size, ps.vp_size)
        with self.precision_plugin.predict_step_context():
            logged = fb(forward_step_func=module.forward_step, microbatches=microbatches, model=self.model_chunks,
                        num_microbatches=len(microbatches), parallel_state=ps,
                        tensor_shape=tuple(module.pipeline_tensor_shape(microbatches[0])),
                        dtype=next(iter(module.parameters())).dtype, forward_only=True)
        # Predictions live on the last pipeline stage; other stages return None. A loss_func that logs
        # ``predictions`` gets them concatenated over the microbatches (the batch's predictions).
        if not ps.is_pipeline_last_stage():
            return None
        if logged and all(torch.is_tensor(d.get("predictions")) for d in logged):
            return torch.cat([d["predictions"] for d in logged])
        return logged

    def _log(self, means: dict[str, torch.Tensor], stage: str, on_step: bool, on_epoch: bool) -> None:
        module = self.lightning_module
        for key, value in means.items():
            name = key if stage == "train" and key == "loss" else f"{stage}_{key}"
            # Values are already reduced over DP and broadcast along the pipeline: no sync_dist.
            module.log(name, value, on_step=on_step, on_epoch=on_epoch, prog_bar=key in ("loss", "lm_loss"),
                       sync_dist=False, batch_size=1)

    # ------------------------------------------------------------------ checkpoints

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Sharded optimizer state is loaded into the optimizers, which exist only after setup.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint already restored them

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the sharded model state is written by save_checkpoint from the live parameters

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, torch.Tensor]:
        return {}  # likewise: written sharded by save_checkpoint

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        module = self.lightning_module
        named = getattr(module, "sharded_named_parameters", None)
        if named is not None:
            return list(named())
        return list(module.named_parameters())

    def _state_mapper(self) -> ShardedStateMapper:
        assert self.parallel_state is not None
        return ShardedStateMapper(self.parallel_state, self._named_parameters(), list(self.optimizers))

    def _layout_record(self) -> dict[str, int | None]:
        ps = self.parallel_state
        assert ps is not None
        return {"world_size": ps.layout.world_size, "tp": ps.tp_size, "pp": ps.pp_size, "vp": ps.vp_size,
                "dp": ps.dp_size}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("MegatronStrategy.save_checkpoint does not take storage_options")
        ckpt.save(self._state_mapper(), checkpoint, filepath, self._layout_record())

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        module = self.lightning_module
        hparams = dict(getattr(module, "hparams", {}) or {})
        defaults = {name: p.default for name, p in inspect.signature(type(module).__init__).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        return ckpt.load(self._state_mapper(), checkpoint_path, hparams, self._layout_record(),
                         load_optimizer=bool(self.optimizers), hparam_defaults=defaults)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # The model was loaded in place by load_checkpoint (sharded); nothing left to do.
        return None

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        return None

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            ckpt.remove(filepath)

    @override
    def on_train_start(self) -> None:
        self._preemption.install(self.launcher)  # SIGTERM: see lightning_megatron.preemption

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._preemption.should_stop(self.root_device):  # every rank stops before the same step
            raise SIGTERMException()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # SIGTERM: save a checkpoint (when configured) and exit non-zero (lightning_megatron.preemption).
        if isinstance(exception, SIGTERMException) and self.lightning_module is not None:
            on_sigterm(self.lightning_module.trainer, exception)

    @override
    def teardown(self) -> None:
        self._preemption.uninstall()
        if self._grad_buffer is not None:
            self._grad_buffer.remove()
            self._grad_buffer = None
        if self.cpu_tuning is not None:
            self.cpu_tuning.teardown(self.parallel_state)
        super().teardown()


# ---------------------------------------------------------------------- helpers


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if "megatron" not in StrategyRegistry:
        StrategyRegistry.register("megatron", MegatronStrategy,
                                  description="Megatron-style tensor, pipeline and data parallelism")


_register()
