"""MegatronStrategy: tensor, pipeline and data parallelism for Lightning's Trainer.

It extends Lightning's DDPStrategy (launching, process groups, cluster environments) through public
hooks only, and orchestrates: the layout's groups (:mod:`~lightning_megatron.parallel_state`), the
module's contract (:mod:`~lightning_megatron.protocols`), set-up checks and batch sizes
(:mod:`~lightning_megatron.setup_checks`), the fp32 :class:`~lightning_megatron.grads.GradBuffer` (no
DDP wrapper), one step's microbatch schedule for train, val, test and predict alike
(:class:`~lightning_megatron.step.StepRunner`; ``backward`` is a no-op because the schedule ran it),
sharded checkpoints (:mod:`~lightning_megatron.checkpoint`) recording the run that wrote them
(:attr:`MegatronStrategy.run_id`), and SIGTERM / Ctrl-C (:mod:`~lightning_megatron.preemption`).
docs/architecture.md draws who calls whom in a step.

Batch semantics: global_batch = micro_batch_size x num_microbatches x DP. The dataloader of each DP
rank yields micro_batch_size x num_microbatches samples per step (every TP and PP rank of a replica
gets the same batch); the logged loss is the mean over the global batch.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_megatron import checkpoint as ckpt
from lightning_megatron import launch
from lightning_megatron.config_checks import timeout_problem
from lightning_megatron.cpu import CPUTuning
from lightning_megatron.grads import GradBuffer
from lightning_megatron.module import MegatronLightningModule, checkpoint_rules, context_parallel_problem
from lightning_megatron.optimizer.config import OptimizerConfig
from lightning_megatron.optimizer.grad_scaler import DynamicGradScaler
from lightning_megatron.optimizer.mixed_precision import route_non_finite_grads
from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.parallel_state import ParallelState, initialize_model_parallel
from lightning_megatron.pipeline.registry import AUTO, get_schedule, pipeline_schedule_problem
from lightning_megatron.preemption import (PreemptionHandler, count_steps_as_taken, leave_stop_signals_to_the_trainer,
                                          on_stop_signal, save_the_final_step, say_ctrl_c_in_start_up,
                                          stop_before_this_batch)
from lightning_megatron.protocols import (
    LightningStepsModule,
    MegatronModule,
    OptimizerWrapper,
    PlainOptimizer,
    PredictsBatches,
    contract_problem,
    megatron_module,
    optimizer_wrapper,
)
from lightning_megatron.run_lock import claim_at_setup
from lightning_megatron.setup_checks import (
    check_nodes,
    check_precision,
    check_optimizers,
    check_same_settings,
    check_strategy_arguments,
    check_trainer,
    describe_setup,
    resolve_batch_sizes,
    run_settings,
    unsplit_model_warning,
)
from lightning_megatron.sharded_state import ShardedStateMapper, duplicate_names_problem
from lightning_megatron.step import BatchSizes, StepRunner
from lightning_megatron.tensor_parallel.backward import WeightGradPolicy
from lightning_megatron.tensor_parallel.param_facts import mark_replicated
from lightning_megatron.tensor_parallel.random import model_parallel_seed

__all__ = ["MegatronStrategy"]


class _PrewarmedLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, whose local ranks are the ones the ``lightning-megatron``
    command started early where they wait (:mod:`lightning_megatron.launch`: same command,
    environment and folder); the others it starts itself."""

    @override
    def launch(self, function: Any, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:  # refused once, before the ranks start: Trainer options the schedule replaces, a
            check_trainer(trainer)  # module the contract cannot run
            module, strategy = trainer.lightning_module, trainer.strategy
            if module is not None and isinstance(strategy, MegatronStrategy):
                problem = contract_problem(module, pipelined=strategy.parallel_dims.pp > 1, built=False)
                if problem:
                    raise TypeError(problem)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _call_children_scripts(self) -> None:
        os.environ[launch.CHILD_ENV] = "1"  # in the children's environment (Lightning copies this one), not rank 0's
        try:
            with launch.hand_to_waiting(sys.modules[_SubprocessScriptLauncher.__module__]):
                super()._call_children_scripts()
        finally:
            os.environ.pop(launch.CHILD_ENV, None)


class MegatronStrategy(DDPStrategy):
    """Megatron-style TP x PP x DP training under ``lightning.Trainer``.

    The layout is one record, :attr:`parallel_dims` (:class:`~lightning_megatron.parallel_dims.ParallelDims`),
    built from the sizes below (Megatron's names) and resolved against the world size at launch.

    Args:
        tensor_model_parallel_size: ranks each linear layer is split across (TP).
        pipeline_model_parallel_size: number of pipeline stages (PP).
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (interleaved 1F1B).
        sequence_parallel: split activations outside the TP regions along the sequence.
        context_parallel_size, expert_model_parallel_size, expert_tensor_parallel_size: the context-
            and expert-parallel dimensions of the record (CP for modules that take it, EP for models with
            experts, docs/moe.md; an expert TP size other than the TP size is refused).
        pipeline_schedule: the microbatch schedule, a registered name (``no_pipelining``, ``1f1b``,
            ``interleaved``, or one registered with ``lightning_megatron.pipeline.register_schedule``) or
            ``"auto"``: the layout's (PP=1 no_pipelining, PP>1 1f1b, PP>1 and VP>1 interleaved).
        micro_batch_size: samples per microbatch; None reads ``micro_batch_size`` from the datamodule,
            else the whole per-rank batch is one microbatch (both set and different: refused).
        seed: seed of the default and model-parallel RNG streams (dropout); weights are seeded by the model.
        ddp_bucket_size_mb: size of the buckets of the fp32 grad buffer, the unit of the
            data-parallel gradient reduction (all-reduce, or reduce-scatter with ZeRO-1).
        overlap_grad_reduce: start each bucket's DP reduction in the last microbatch's backward and wait
            for it before the optimizer step (megatron-core's name; bitwise equal either way). ``None``:
            on, except where the CPU tuning installed its synchronous shared-memory collectives on the DP
            group (docs/strategy.md).
        overlap_param_gather: with the DistributedOptimizer (ZeRO-1), launch each bucket's parameter
            all-gather asynchronously after the step and wait for it in the forward pre-hook of the
            first module that uses it, so it hides behind the next forward (megatron-core's name;
            bitwise equal either way). Needs ``MegatronOptimizerCallback(OptimizerConfig(use_distributed_optimizer=True))``.
        overlap_p2p_comm: interleaved schedule (VP): post each steady-state step's pipeline sends and
            receives before the other pass's compute and wait for them after it (megatron-core's name
            and default; bitwise equal either way). No effect on the other schedules.
        cpu_tuning: opt-in tuning for CPU runs (:class:`lightning_megatron.cpu.CPUTuning`); ``True`` is
            ``CPUTuning()``. Default ``None``: the same code path as on accelerators.
        timeout: collective timeout; a failing rank ends the job after at most this long.
        check_for_nan_in_loss_and_grad: stop the run when a training step's loss or any gradient is
            NaN/Inf, before any optimizer (wrapped or plain) steps: ``NonFiniteLossOrGradError`` on every
            rank naming the step and the parameter (megatron-core's option and default; an fp16
            overflow that the dynamic loss scaler skips is not an error). :mod:`lightning_megatron.step`.
        check_replicated_grads: at the first training step, stop every rank with ``ReplicaGradientError`` when a
            parameter replicated over TP got different gradients on the TP ranks (one applied to TP-split
            activations without its facts saying so). :mod:`lightning_megatron.replica_check`.
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
        context_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: int | None = None,
        pipeline_schedule: str = AUTO,
        micro_batch_size: int | None = None,
        seed: int = 1234,
        ddp_bucket_size_mb: float = 25.0,
        cpu_tuning: CPUTuning | bool | None = None,
        overlap_grad_reduce: bool | None = None,
        overlap_param_gather: bool = False,
        overlap_p2p_comm: bool = True,
        check_for_nan_in_loss_and_grad: bool = True,
        check_replicated_grads: bool = True,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | int | None = datetime.timedelta(minutes=30),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.parallel_dims: ParallelDims = check_strategy_arguments(
            dict(tp=tensor_model_parallel_size, pp=pipeline_model_parallel_size, vp=virtual_pipeline_model_parallel_size,
                 cp=context_parallel_size, ep=expert_model_parallel_size, etp=expert_tensor_parallel_size,
                 sequence_parallel=sequence_parallel, schedule=pipeline_schedule),
            micro_batch_size=micro_batch_size, ddp_bucket_size_mb=ddp_bucket_size_mb,
            overlap_param_gather=overlap_param_gather)
        """The layout (sizes, sequence parallel, ZeRO-1, schedule); ``dp`` resolved at launch, ``zero1``
        from the MegatronOptimizerCallback's config."""
        if timeout_problem(timeout):
            raise ValueError(f"MegatronStrategy: {timeout_problem(timeout)}")
        schedule_problem = pipeline_schedule_problem(pipeline_schedule, pipeline_model_parallel_size,
                                                     virtual_pipeline_model_parallel_size)
        if schedule_problem:
            raise ValueError(f"MegatronStrategy: {schedule_problem}")
        if isinstance(timeout, int):
            timeout = datetime.timedelta(seconds=timeout)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.ddp_bucket_size_mb = ddp_bucket_size_mb
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.overlap_p2p_comm = overlap_p2p_comm
        self.check_for_nan_in_loss_and_grad = check_for_nan_in_loss_and_grad
        self.check_replicated_grads = check_replicated_grads
        self.cpu_tuning: CPUTuning | None = CPUTuning.from_argument(cpu_tuning)
        self.parallel_state: ParallelState | None = None
        self._groups_world: Any = None  # the default group parallel_state's groups were built on
        self.batch_sizes: BatchSizes | None = None
        """The step's batch sizes, resolved once in ``setup`` (the one place they are read from)."""
        self._module: MegatronModule | None = None  # the LightningModule under its contract, after setup
        self._runner: StepRunner | None = None
        self.schedule_trace: list | None = None
        """Set to a list to record the schedule's events of the next steps (for pictures and benchmarks)."""
        self._grad_buffer: GradBuffer | None = None
        self._optimizer_config: OptimizerConfig | None = None  # handed over by MegatronOptimizerCallback.setup
        self._grads_checked_by_optimizers = False  # the NaN guard's gradient check rides on the optimizers' norm
        self._loss_checked_by_optimizers = False  # and its loss check, where they decide on the device
        self._preemption = PreemptionHandler()
        self._busy: str | None = None  # why the run folder is not this run's (run_lock.claim_at_setup, rank 0)
        self.run_id: str | None = None
        """The run this fit continues or starts: the run id of the checkpoint it resumed, else the W&B
        run id when it logs to W&B, else a random one (set in ``setup`` and ``load_checkpoint`` when
        fitting). Every checkpoint it saves records it, and a save never replaces a checkpoint of
        another run (:func:`lightning_megatron.checkpoint.other_run_problem`)."""
        self._described = False
        self._node_ranks: list[int] | None = None  # the node of every rank, gathered at set-up

    # ------------------------------------------------------------------ set-up

    def _resolved_dims(self) -> ParallelDims:
        """:attr:`parallel_dims` with the data-parallel size of this job's world (refused when the sizes
        do not divide it)."""
        try:
            return self.parallel_dims.for_world_size(self.num_nodes * self.num_processes)
        except ValueError as e:
            raise ValueError(f"MegatronStrategy: {e}") from None

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher:
            self._launcher = _PrewarmedLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        if self.global_rank == 0:  # known now: rank 0's W&B run starts while the rendezvous waits for the others
            self._busy = self._busy or claim_at_setup(0)  # the run folder's lock under a launcher: said at the gather
            if self._busy is None:  # a folder another run holds gets no W&B run of this one
                for logger in getattr(getattr(self.lightning_module, "_trainer", None), "loggers", ()):
                    getattr(logger, "start_in_background", lambda: None)()  # WandbLogger.start_in_background

    @override
    def setup_environment(self) -> None:
        if self.local_rank > 0 and launch.started_by_rank_0():  # started by rank 0, which hosts the
            # rendezvous: its death ends this rank's waits at once (not a rank torchrun, srun or a script started)
            with launch.exit_when_parent_dies(f"local rank {self.local_rank}", "connecting to the other ranks"):
                self._setup_environment()
        else:
            self._setup_environment()

    def _setup_environment(self) -> None:
        self.parallel_dims = self._resolved_dims()  # before launching collectives
        super().setup_environment()
        trainer = getattr(self.lightning_module, "_trainer", None)
        check_same_settings(run_settings(dims=self.parallel_dims, micro_batch_size=self.micro_batch_size,
                                         seed=self.seed, trainer=trainer, module=self.lightning_module,
                                         callbacks=[] if trainer is None else trainer.callbacks), self.root_device,
                            busy=self._busy or claim_at_setup(self.global_rank))  # the run folder's lock
        self.parallel_state = self._groups()
        model_parallel_seed(self.seed + 100 * self.parallel_state.pp_rank, self.parallel_state.tp_rank)
        self._node_ranks = check_nodes(self.parallel_state, self.node_rank, self.root_device, self.num_processes)
        if isinstance(self.lightning_module, MegatronLightningModule):
            # As Lightning's ModelParallelStrategy hands its device mesh: the groups, before configure_model.
            self.lightning_module.connect_parallel_state(self.parallel_state)
        if self.cpu_tuning is not None:  # opt-in; acts on CPU only
            self.cpu_tuning.setup(self.parallel_state, device=self.root_device, timeout=self._timeout)

    def _groups(self) -> ParallelState:
        """This layout's process groups: the ones an earlier run of this strategy built (``fit`` then ``test``) while
        the default group and the layout are the same (a new set per run: on NCCL each holds GPU memory), else new."""
        ps, world = self.parallel_state, dist.group.WORLD
        if ps is not None and self._groups_world is world and ps.dims == self.parallel_dims.for_world_size(
                dist.get_world_size()):
            return ps
        self._groups_world = world
        return initialize_model_parallel(self.parallel_dims, timeout=self._timeout)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # its workers leave SIGTERM, Ctrl-C and the requeue signal to the training process (a job-wide signal ended
        # them, and PyTorch's error about it ended the rank before its stop checkpoint)
        return leave_stop_signals_to_the_trainer(super().process_dataloader(dataloader), self.cluster_environment)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every TP and PP rank of one replica reads the same samples: shard data over DP only.
        dims = self._resolved_dims()
        return {"num_replicas": dims.dp, "rank": dims.coordinates(self.global_rank)["dp"]}

    @override
    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: gradients are reduced by finalize_model_grads after
        # the microbatch schedule (DDP would all-reduce once per microbatch backward).
        assert isinstance(self.model, LightningModule)

    @override
    def setup(self, trainer: Trainer) -> None:
        ps = self.parallel_state
        assert ps is not None and self.accelerator is not None
        check_trainer(trainer)
        problem = context_parallel_problem(self.lightning_module, ps.cp_size)
        if problem:
            raise ValueError(f"MegatronStrategy: {problem}")
        self._module = megatron_module(self.lightning_module, pipelined=ps.pp_size > 1, num_chunks=ps.vp_size or 1)
        # Parameters no parallel layer described are replicated across TP: said once, here (param_facts).
        mark_replicated(p for chunk in self.model_chunks for p in chunk.parameters())
        problem = duplicate_names_problem(list(self._module.sharded_named_parameters()), ps)
        if problem:
            raise ValueError(f"MegatronStrategy: {problem}")
        warning = unsplit_model_warning(self.model_chunks, ps)
        if warning:
            rank_zero_warn(f"MegatronStrategy: {warning}")
        check_precision(trainer, self.model_chunks, dict(self.lightning_module.hparams),
                        wraps_optimizers=self._optimizer_config is not None)
        schedule = get_schedule(ps.dims.schedule, ps.pp_size, ps.vp_size)
        self.batch_sizes = resolve_batch_sizes(self.micro_batch_size, trainer.datamodule, ps, schedule)
        self._runner = StepRunner(ps, self._module, schedule=schedule,
                                  micro_batch_size=self.batch_sizes.micro_batch_size, device=self.root_device,
                                  overlap_p2p_comm=self.overlap_p2p_comm,
                                  check_for_nan_in_loss_and_grad=self.check_for_nan_in_loss_and_grad,
                                  check_replicated_grads=self.check_replicated_grads,
                                  named_parameters=list(self._module.sharded_named_parameters()))
        # DDPStrategy.setup minus the DDP wrapper and minus _sync_module_states (which would
        # broadcast rank 0's tensor-parallel shards over every rank when not fitting).
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.cpu_tuning is not None:
            self.cpu_tuning.configure_model(self.model, self.root_device)
        if trainer.state.fn == TrainerFn.FITTING:
            ckpt.check_shared_storage([c.dirpath for c in trainer.checkpoint_callbacks], self._node_ranks)
            self.run_id = self._new_run_id(trainer)  # replaced by the checkpoint's when the fit resumes one
            self._build_grad_buffer()  # before configure_optimizers, which may shard it (ZeRO-1)
            self.setup_optimizers(trainer)
            self._wrap_optimizers()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        if not self._described:  # once per strategy: what it resolved
            self._described = True
            rank_zero_info(describe_setup(ps, buffer=self._grad_buffer,
                                          micro_batch_size=self.batch_sizes.micro_batch_size, nodes=self._node_ranks))

    def _new_run_id(self, trainer: Trainer) -> str:
        """Rank 0's: the id of its W&B run (the experiment exists by now when the CLI's WandbRunIdCallback
        logged the run config) or a random 8 characters; the same on every rank."""
        chosen = [None]
        if self.global_rank == 0:
            wandb = [lg.version for lg in trainer.loggers if isinstance(lg, WandbLogger) and lg.version]
            chosen = [str(wandb[0]) if wandb else uuid.uuid4().hex[:8]]
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.world_size > 1:
            torch.distributed.broadcast_object_list(chosen, src=0)
        return chosen[0]

    @property
    def grad_buffer(self) -> GradBuffer | None:
        """The fp32 main-grad buffer of this rank's chunks (built in ``setup`` when fitting)."""
        return self._grad_buffer

    def _build_grad_buffer(self) -> None:
        assert self.parallel_state is not None
        if self._grad_buffer is not None:  # a second fit: hooks of the old buffer off first
            self._grad_buffer.remove()
        overlap = self.overlap_grad_reduce
        if overlap is None:  # on, except where the CPU tuning installed its synchronous shared-memory collectives
            tuning = self.cpu_tuning
            overlap = not (tuning is not None and tuning.synchronous_collectives(self.root_device, self.parallel_state))
        tuned = {} if self.cpu_tuning is None else self.cpu_tuning.grad_buffer_options(self.root_device)
        self._grad_buffer = GradBuffer.for_chunks(self.model_chunks, self.parallel_state,
                                                  bucket_bytes=self.ddp_bucket_size_mb * 2**20, overlap_grad_reduce=overlap,
                                                  overlap_param_gather=self.overlap_param_gather, **tuned)
        if self.cpu_tuning is not None:
            assert self._runner is not None
            self.cpu_tuning.configure_grads(self._runner.weight_grads, self.model_chunks, self.parallel_state,
                                            self.root_device)

    @property
    def weight_grads(self) -> WeightGradPolicy | None:
        """The step's weight-gradient policy: which layers defer their weight gradient (after ``setup``)."""
        return None if self._runner is None else self._runner.weight_grads

    @property
    def module_contract(self) -> MegatronModule:
        """The LightningModule as :class:`~lightning_megatron.protocols.MegatronModule` (after ``setup``)."""
        assert self._module is not None, "MegatronStrategy.setup has not run"
        return self._module

    @property
    def model_chunks(self) -> list[nn.Module]:
        """This rank's model chunks (the module's ``model_chunks``; the module itself without them)."""
        return list(self.module_contract.model_chunks)

    # ------------------------------------------------------------------ the step

    def set_optimizer_config(self, config: OptimizerConfig) -> None:
        """The :class:`~lightning_megatron.protocols.WrapsOptimizers` contract: wrap the optimizers of
        the coming fit with ``config`` (MegatronOptimizerCallback hands it over in its ``setup``)."""
        if not isinstance(config, OptimizerConfig):
            raise TypeError(f"MegatronStrategy.set_optimizer_config takes an OptimizerConfig, got {type(config).__name__}")
        if self._optimizer_config is not None and self._optimizer_config != config:
            raise ValueError(f"MegatronStrategy: two optimizer configs for one fit ({self._optimizer_config} and "
                             f"{config}); keep one MegatronOptimizerCallback")
        self._optimizer_config = config
        self.parallel_dims = replace(self.parallel_dims, zero1=config.use_distributed_optimizer)
        if self.parallel_state is not None:
            self.parallel_state.dims = replace(self.parallel_state.dims, zero1=config.use_distributed_optimizer)

    def _wrap_optimizers(self) -> None:
        """Right after ``configure_optimizers``: wrap with the config handed over (if any), then check
        that every optimizer implements the wrapper contract and that a ZeRO-1 one shards our buffer."""
        if self._optimizer_config is not None:
            self.optimizers = [self._optimizer_config.wrap(opt, parallel_state=self.parallel_state,
                                                           grad_buffer=self._grad_buffer) for opt in self.optimizers]
        wrappers = self._optimizer_wrappers()
        check_optimizers(wrappers, self._grad_buffer, overlap_param_gather=self.overlap_param_gather)
        # The NaN guard's gradient check rides on the optimizers' norm where they read every gradient, and its
        # loss check too where they decide on the device (one read of the device a step, after the update).
        self._grads_checked_by_optimizers = self._loss_checked_by_optimizers = False
        if self.check_for_nan_in_loss_and_grad and self._grad_buffer is not None:
            self._grads_checked_by_optimizers, self._loss_checked_by_optimizers = route_non_finite_grads(
                wrappers, self._grad_buffer.params, self._non_finite_grads, self._non_finite_loss)

    def _non_finite_grads(self) -> None:
        assert self._runner is not None and self._grad_buffer is not None
        self._runner.non_finite_grads(self._grad_buffer, self.lightning_module.trainer.global_step)

    def _non_finite_loss(self, loss: torch.Tensor, loss_sum: float, grad_sum: float) -> None:
        assert self._runner is not None and self._grad_buffer is not None
        self._runner.non_finite_loss(self._grad_buffer, loss, loss_sum, grad_sum,
                                     self.lightning_module.trainer.global_step)

    def finish_param_gather(self) -> None:
        """Wait for every pending ZeRO-1 parameter all-gather (``overlap_param_gather``): after this the
        model params hold the last step's values. Done before anything reads them outside a forward."""
        if self._grad_buffer is not None:
            self._grad_buffer.finish_param_gather()

    def _optimizer_wrappers(self) -> list[OptimizerWrapper]:
        return [optimizer_wrapper(opt) for opt in self.optimizers]

    def _run(self, batch: Any, batch_idx: int, stage: str) -> Any:
        assert self._runner is not None
        if stage != "train":
            return self._runner.run(batch, batch_idx, stage, trace=self.schedule_trace)
        # Lightning zeroes grads only after the training step (before its backward), too late for a
        # schedule that runs backward inside the step: the grad buffer starts every step from zero.
        wrappers = self._optimizer_wrappers()
        return self._runner.run(batch, batch_idx, stage, grad_buffer=self._grad_buffer,
                                grad_scale_func=wrappers[0].scale_loss if wrappers else None, trace=self.schedule_trace,
                                iteration=self.lightning_module.trainer.global_step,
                                overflow_is_skipped=any(isinstance(w.grad_scaler, DynamicGradScaler) for w in wrappers),
                                grads_checked_by_optimizer=self._grads_checked_by_optimizers,
                                loss_checked_by_optimizer=self._loss_checked_by_optimizers)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        buffer = self._grad_buffer

        def closure_with_grads() -> Any:
            out = closure()  # training_step: the whole microbatch schedule, then Lightning's zero_grad
            if buffer is not None and isinstance(optimizer_wrapper(optimizer), PlainOptimizer):
                buffer.set_param_grads()  # a plain torch optimizer reads .grad
            return out

        return super().optimizer_step(optimizer, closure_with_grads, model, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            means = self._run(*_batch_and_index(args, kwargs), "train")
        if self._loss_checked_by_optimizers and "loss" in means:
            for wrapper in self._optimizer_wrappers():
                wrapper.loss_to_check = means["loss"]  # read with the gradients' check, after the update is queued
        if "loss" not in means:  # the same keys on every rank (broadcast along the pipeline)
            raise ValueError(f"MegatronStrategy: the loss function of forward_step logged {sorted(means)} without "
                             f"'loss', which Lightning reports as the step's loss; return (loss, {{'loss': "
                             f"loss.detach(), ...}}) from loss_func")
        self._log(means, "train")
        # Returned for Lightning's bookkeeping (progress bar, callbacks); backward already ran.
        return {"loss": means["loss"]}

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The microbatch schedule ran backward for every microbatch (with loss scaling); nothing to do.
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("val", self.precision_plugin.val_step_context(), *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test", self.precision_plugin.test_step_context(), *args, **kwargs)

    def _eval_step(self, stage: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        self._stop_before_this_evaluation_batch()
        with context:
            means = self._run(*_batch_and_index(args, kwargs), stage)
        self._log(means, stage)
        return means.get("loss")

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's predictions on the last pipeline stage (``None`` on the others); a module that predicts by
        a loop of its own (:class:`~lightning_megatron.protocols.PredictsBatches`: generation) runs it instead."""
        batch, batch_idx = _batch_and_index(args, kwargs)
        self._stop_before_this_evaluation_batch()
        with self.precision_plugin.predict_step_context():
            if isinstance(self._module, PredictsBatches):
                return self._module.predict_batch(batch, batch_idx)
            out = self._run(batch, batch_idx, "predict")
        if out is None:  # a stage before the last, by design: not the mistake Lightning's loop warns of once
            cache = self.lightning_module.trainer.predict_loop._warning_cache
            cache.add("predict returned None if it was on purpose, ignore this warning...")
        return out

    def _log(self, means: dict[str, torch.Tensor], stage: str) -> None:
        if isinstance(self._module, LightningStepsModule):
            # A plain LightningModule logs what its own *_step hooks log (as under any strategy): logging
            # "loss" here too would collide with its self.log("loss", ...). Lightning's loop and callbacks
            # still get the global-batch mean as outputs["loss"].
            return
        module = self.lightning_module
        # An evaluation step weighs in by the tokens it counted (the epoch's loss is the split's token mean), else 1.
        weight = int(means["num_tokens"]) if stage != "train" and "num_tokens" in means else 1
        if weight == 0:
            return  # evaluation padding alone: no loss to report
        for key, value in means.items():
            if key == "num_tokens" and stage != "train":
                continue  # the weight of the step: its epoch mean would say nothing
            name = key if stage == "train" and key == "loss" else f"{stage}_{key}"
            # Reduced over DP and broadcast along the pipeline already: every rank holds the value. The
            # epoch-level metrics of evaluation are averaged over the world anyway (one all-reduce at
            # the end of the epoch) so that Lightning has nothing to warn about.
            module.log(name, value, on_step=stage == "train", on_epoch=stage != "train",
                       prog_bar=key == "loss", sync_dist=stage != "train", batch_size=weight)

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

    def _state_mapper(self) -> ShardedStateMapper:
        assert self.parallel_state is not None
        return ShardedStateMapper(self.parallel_state, list(self.module_contract.sharded_named_parameters()),
                                  self._optimizer_wrappers())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("MegatronStrategy.save_checkpoint does not take storage_options")
        assert self.parallel_state is not None
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.fast_dev_run:
            # Lightning's ModelCheckpoint still writes save_last at the end of a fast_dev_run: a one-step
            # check run must not leave a checkpoint that `--ckpt_path last` would resume from.
            rank_zero_info(f"MegatronStrategy: fast_dev_run saves no checkpoint (not {filepath})")
            return
        self.finish_param_gather()  # the params are saved from the live tensors
        ckpt.save(self._state_mapper(), checkpoint, filepath, self.parallel_dims.as_record(), run_id=self.run_id)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.parallel_state is not None
        module = self.lightning_module
        loaded = ckpt.load(self._state_mapper(), checkpoint_path, dict(module.hparams),
                           self.parallel_dims.as_record(), load_optimizer=bool(self.optimizers),
                           **checkpoint_rules(module))
        if module.trainer.state.fn == TrainerFn.FITTING:
            # A resumed fit continues the run that wrote the checkpoint (verified by now); one written
            # before checkpoints recorded their run keeps the id chosen at setup.
            self.run_id = ckpt.checkpoint_identity(checkpoint_path)[0] or self.run_id
        return loaded

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
        if self.overlap_param_gather and self._grad_buffer is not None:
            self._grad_buffer.add_param_gather_hooks(self.model_chunks)
        self._install_stop_signals()

    def _install_stop_signals(self) -> None:
        """SIGTERM, Ctrl-C and SLURM's requeue signal (:meth:`PreemptionHandler.install_for`): a fit's from its sanity
        check on; validate, test and predict from their start."""
        self._preemption.install_for(self.lightning_module.trainer, self.launcher, self.cluster_environment,
                                     self.root_device)

    def _stop_before_this_evaluation_batch(self) -> None:
        self._preemption.stop_before_evaluation_batch(self.lightning_module.trainer, self.root_device)

    @override
    def on_validation_start(self) -> None:
        # The forward pre-hooks would wait bucket by bucket; a module's own hooks may read params first.
        self.finish_param_gather()
        self._install_stop_signals()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._install_stop_signals()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._install_stop_signals()
        super().on_predict_start()

    @override
    def on_train_end(self) -> None:
        self.finish_param_gather()  # fit returns a model that holds its last step's params
        save_the_final_step(self.lightning_module.trainer)  # `last` holds the final step, not the last interval's
        super().on_train_end()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        count_steps_as_taken(self.lightning_module.trainer)  # the logged step after a resume from a run's end
        if self._preemption.should_stop(self.root_device):  # every rank stops before the same step
            stop_before_this_batch(self.lightning_module.trainer)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # SIGTERM / Ctrl-C: save a checkpoint (when configured) and exit 143 / 130 (lightning_megatron.preemption).
        if isinstance(exception, SIGTERMException) and self.lightning_module is not None:
            on_stop_signal(self.lightning_module.trainer, exception, self._preemption.received or signal.SIGTERM,
                           self.run_id, requeue=self._preemption.requeue)
            self._preemption.exiting = True
        else:
            self._preemption.failed = True
        if isinstance(exception, KeyboardInterrupt):  # Lightning's own path: our stop handler was not in place yet
            say_ctrl_c_in_start_up(self.lightning_module)

    @override
    def teardown(self) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None:
            self._preemption.say_if_after_the_end(trainer)
        self._preemption.uninstall(getattr(trainer, "_signal_connector", None))
        self._optimizer_config = None  # handed over again by the callback's setup of the next fit
        self._grads_checked_by_optimizers = self._loss_checked_by_optimizers = False
        if self._grad_buffer is not None:
            self._grad_buffer.remove()
            self._grad_buffer = None
        if self.cpu_tuning is not None:
            self.cpu_tuning.teardown(self.parallel_state)
        super().teardown()
        if self._preemption.exiting:  # the process exits with 143 / 130 next: process groups go first, in order
            self._preemption.leave(self.launcher)

    def leave(self) -> None:
        """Shut distributed state down in order before this process exits (the ``lightning-megatron``
        command calls it once its subcommand has run; a script may too, after its last stage): the ranks
        meet at a barrier, the launching rank waits for the ranks it started, which destroy their process
        groups and exit, and destroys its own, with the rendezvous store it hosts, last. Left to
        interpreter exit, the launching rank was seen aborting on its way out ("terminate called without
        an active exception", status -6; docs/reliability.md)."""
        self._preemption.leave(self.launcher)

    def leave_after_the_command(self) -> None:
        """The command calls :meth:`leave` once its subcommand has run: Ctrl-C keeps the stop handler until then."""
        self._preemption.leave_follows = True


def _batch_and_index(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, int]:
    """``(batch, batch_idx)`` of a ``*_step(batch, batch_idx)`` call, however Lightning passed them."""
    return args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if "megatron" not in StrategyRegistry:  # Trainer(strategy="megatron")
        StrategyRegistry.register("megatron", MegatronStrategy, description="Megatron-style TP x PP x DP")


_register()
