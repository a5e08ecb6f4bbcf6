"""The two contracts between the parts: what a LightningModule gives the strategy, and what an
optimizer wrapper gives the strategy and the checkpoint code.

Both are checked once, at set-up (:func:`megatron_module`, :func:`optimizer_wrapper`), with an error
that names every missing member; afterwards every consumer uses the declared names only.

A LightningModule under :class:`~lightning_megatron.strategy.MegatronStrategy` implements
:class:`MegatronModule`::

    class MyModule(LightningModule):
        def configure_model(self):                             # called by every fit/validate/...:
            if hasattr(self, "model_chunks"):                  # build once
                return
            ps = self.trainer.strategy.parallel_state          # groups and ranks of this process
            self.model_chunks = nn.ModuleList([...])           # one chunk per virtual pipeline stage
        def forward_step(self, microbatch, chunk):             # -> (output, loss_func or None)
            ...
        def pipeline_tensor_shape(self, microbatch):           # [s, b, h] sent between stages
            ...
        def sharded_named_parameters(self):                    # layout-independent names
            ...
        def training_step(self, batch, batch_idx):             # Lightning's Trainer requires it (and
            raise NotImplementedError                          # validation_step for validate, ...);
                                                               # the strategy never calls them

A complete example (a character-level model, TP and PP, checked against one process and through a
checkpoint) is ``tests/test_custom_module.py``.

A plain LightningModule (``training_step``/``validation_step``/... and no ``forward_step``) still
runs without pipelining (``pipeline_model_parallel_size=1``): :class:`LightningStepsModule` adapts it,
each microbatch going through the matching ``*_step`` hook.

Optimizers: the strategy and the checkpoint code read every optimizer through
:class:`OptimizerWrapper` (the :class:`~lightning_megatron.optimizer.mixed_precision.MegatronOptimizer`
wrappers implement it; a plain ``torch.optim.Optimizer`` is adapted by :class:`PlainOptimizer`); a
ZeRO-1 optimizer also implements :class:`ShardedOptimizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_megatron.grads import GradBuffer
    from lightning_megatron.optimizer.config import OptimizerConfig
    from lightning_megatron.optimizer.grad_scaler import MegatronGradScaler

__all__ = [
    "contract_problem",
    "LossFunc",
    "ForwardStepResult",
    "MegatronModule",
    "LightningStepsModule",
    "CountsFlops",
    "PredictsBatches",
    "megatron_module",
    "OptimizerWrapper",
    "ShardedOptimizer",
    "PlainOptimizer",
    "optimizer_wrapper",
    "is_sharded",
    "missing_members",
    "WrapsOptimizers",
]

LossFunc = Callable[[Tensor], tuple[Tensor, dict[str, Any]]]
"""``loss_func(output) -> (loss, {name: scalar tensor to log})``; on the last pipeline stage. ``loss``
is the mean over the microbatch (backpropagated); the logged ``"loss"`` is what Lightning sees as the
step's loss (progress bar, ``outputs["loss"]`` in callbacks; ``val_loss`` when validating): required
when training (its absence is refused at the first step)."""
ForwardStepResult = tuple[Tensor, "LossFunc | None"]
"""``forward_step``'s result: the chunk's output and, on the last stage, the loss function."""


@runtime_checkable
class MegatronModule(Protocol):
    """What the strategy needs from a LightningModule (after ``configure_model``)."""

    model_chunks: Sequence[nn.Module]
    """This rank's model chunks, one per virtual pipeline stage (one without interleaving), as an
    ``nn.ModuleList`` so that ``self.parameters()`` holds them. Each chunk's
    ``set_input_tensor(tensor)`` (required with pipelining) receives the previous stage's output, which
    a chunk that does not start the model reads instead of the microbatch (``pipeline.stage_chunks``
    gives each chunk's layers and whether it starts or ends the model)."""

    def forward_step(self, microbatch: Any, chunk: nn.Module) -> ForwardStepResult:
        """Run ``chunk`` on ``microbatch`` (the previous stage's output arrives through
        ``set_input_tensor``); return the output and, where ``chunk`` ends the model, the loss function.
        Called on every stage with the same microbatch: a slice along dim 0 of the batch (a tensor,
        or each tensor of a dict, tuple or list), ``micro_batch_size`` samples.

        The same method serves training, validation, test and prediction (``self.trainer.training``
        etc. tell which); while predicting, a loss function that logs ``predictions`` gets them
        concatenated over the microbatches as the batch's prediction."""

    def pipeline_tensor_shape(self, microbatch: Any) -> Sequence[int]:
        """Shape of the activation sent between pipeline stages for ``microbatch``."""

    def sharded_named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        """(name, parameter) pairs under names that do not depend on the layout (global layer
        numbers, no chunk index): the keys of the sharded checkpoint. A TP-sharded parameter is saved
        as one global tensor assembled along its ``partition_dim`` (the parallel layers set it;
        ``tensor_parallel.set_tensor_model_parallel_attributes`` for parameters of your own)."""


@runtime_checkable
class CountsFlops(Protocol):
    """Optional: a module that knows its FLOPs (for ``ThroughputCallback``'s TFLOP/s and MFU)."""

    def training_flops(self, batch: Any, data_parallel_size: int) -> float | Tensor:
        """Model FLOPs of one training step whose per-rank batch is ``batch``, over all
        ``data_parallel_size`` replicas (forward + backward, recomputation not counted)."""


@runtime_checkable
class PredictsBatches(Protocol):
    """Optional: a module whose ``predict`` is a loop of its own over every rank of the model rather than one
    pass of the microbatch schedule (a decoder generates token by token, each token through every pipeline
    stage: ``GPTLightningModule``). The strategy calls it on every rank with this data-parallel rank's batch."""

    def predict_batch(self, batch: Any, batch_idx: int) -> Any:
        """The batch's predictions (on the last pipeline stage at least; the PredictionWriter reads them there)."""


_MODULE_MEMBERS = ("model_chunks", "forward_step", "pipeline_tensor_shape", "sharded_named_parameters")


def missing_members(obj: Any, members: Iterable[str]) -> list[str]:
    """The names in ``members`` that ``obj`` does not provide (``None`` counts as missing)."""
    return [m for m in members if getattr(obj, m, None) is None]


class LightningStepsModule:
    """:class:`MegatronModule` over a plain LightningModule: one chunk (the module), each microbatch
    through ``training_step``/``validation_step``/``test_step``/``predict_step``. No pipelining."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.model_chunks: Sequence[nn.Module] = [module]

    def forward_step(self, microbatch: Any, chunk: nn.Module) -> ForwardStepResult:
        trainer = self.module.trainer
        if trainer.predicting:
            out = self.module.predict_step(microbatch, self.batch_idx)

            def predictions(output: Tensor) -> tuple[Tensor, dict[str, Any]]:
                return torch.zeros(()), {"predictions": out}

            return out, predictions
        hook = (self.module.training_step if trainer.training else
                self.module.test_step if trainer.testing else self.module.validation_step)
        out = hook(microbatch, self.batch_idx)
        loss = out["loss"] if isinstance(out, Mapping) else out

        def loss_func(output: Tensor) -> tuple[Tensor, dict[str, Any]]:
            return output, {"loss": output.detach()}

        return loss, loss_func

    batch_idx: int = 0
    """The index of the step's batch, passed on to the ``*_step`` hooks (set by the strategy)."""

    def pipeline_tensor_shape(self, microbatch: Any) -> Sequence[int]:
        raise TypeError("a LightningModule without forward_step runs without pipelining only")

    def sharded_named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()


def contract_problem(module: Any, *, pipelined: bool, built: bool = True) -> str | None:
    """Why the strategy cannot run ``module``, or None: it implements the :class:`MegatronModule` contract, or none
    of it (a plain LightningModule) without pipelining. ``built=False``: before ``configure_model`` (before the
    ranks start), its methods only (``model_chunks`` comes from ``configure_model``)."""
    members = _MODULE_MEMBERS if built else _MODULE_MEMBERS[1:]
    missing = missing_members(module, members)
    if not missing or (len(missing) == len(members) and not pipelined):
        return None
    why = "pipeline_model_parallel_size > 1 needs it" if len(missing) == len(members) else "it implements part of it"
    return (f"MegatronStrategy: {type(module).__name__} does not implement the MegatronModule contract ({why}); "
            f"missing: {', '.join(missing)}. Set self.model_chunks in configure_model and implement "
            f"forward_step(microbatch, chunk) -> (output, loss_func), pipeline_tensor_shape(microbatch) and "
            f"sharded_named_parameters() (lightning_megatron.protocols.MegatronModule, docs/architecture.md)")


def megatron_module(module: Any, *, pipelined: bool, num_chunks: int) -> MegatronModule:
    """``module`` as a :class:`MegatronModule`, checked (:func:`contract_problem`), with ``num_chunks`` model
    chunks."""
    problem = contract_problem(module, pipelined=pipelined)
    if problem:
        raise TypeError(problem)
    name = type(module).__name__
    if missing_members(module, _MODULE_MEMBERS):  # none of it: a plain LightningModule, no pipelining
        contract: MegatronModule = LightningStepsModule(module)
    else:
        contract = module
        _warn_ignored_hooks(module)
    chunks = list(contract.model_chunks)
    if len(chunks) != num_chunks:
        raise ValueError(
            f"MegatronStrategy: {name} built {len(chunks)} model chunk(s) but the layout needs {num_chunks} "
            f"(virtual_pipeline_model_parallel_size, or 1 without it); build one chunk per virtual stage in "
            f"configure_model (docs/pipeline.md)")
    return contract


def _warn_ignored_hooks(module: Any) -> None:
    """A subclass overriding ``training_step`` (etc.) of a module whose ``forward_step`` the strategy
    runs: the override would be silently ignored."""
    import warnings

    def defining(name: str) -> type | None:
        return next((k for k in type(module).__mro__ if name in k.__dict__), None)

    fwd = defining("forward_step")
    for hook in ("training_step", "validation_step", "test_step", "predict_step"):
        cls = defining(hook)
        if cls is not None and fwd is not None and cls is not fwd and issubclass(cls, fwd):
            warnings.warn(f"{type(module).__name__} overrides {hook}, which the MegatronStrategy does not call: it "
                          f"runs forward_step(microbatch, chunk) -> (output, loss_func) through the microbatch "
                          f"schedule. Override forward_step instead (docs/strategy.md)", UserWarning, stacklevel=3)


@runtime_checkable
class OptimizerWrapper(Protocol):
    """What the strategy, the callbacks and the checkpoint code need from an optimizer wrapper.

    The contract, not a base class: a wrapper of your own (e.g. an Adam that keeps its state in host
    memory) implements these members in one file, without subclassing anything of this package, and
    the strategy takes it as it is. It reads its gradients from ``trainer.strategy.grad_buffer``
    (``main_grad_of(param)``; reduced over data parallelism when its ``step`` runs). Our wrappers
    (:class:`~lightning_megatron.optimizer.mixed_precision.MegatronOptimizer` and its subclasses)
    are one implementation. A plain ``torch.optim.Optimizer`` (none of the members) is adapted by
    :class:`PlainOptimizer`; an object with some of the members but not all is refused.
    """

    optimizer: torch.optim.Optimizer
    """The inner torch optimizer: its ``param_groups`` and ``state`` are what is saved."""
    grad_scaler: MegatronGradScaler | None
    """The loss scaler, saved with the checkpoint (None: no scaling)."""
    num_skipped_steps: int
    """Steps skipped on inf/nan gradients so far, saved with the checkpoint."""
    reduces_gradients: bool
    """True for a :class:`ShardedOptimizer`, which reads reduce-scattered gradient shards."""
    last_step_skipped: bool
    """Whether the last ``step`` skipped the update (inf/nan gradients): the lr schedule does not advance."""
    last_grad_norm: float | None
    """The global gradient norm of the last step (None: skipped, or not computed); logged."""

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss`` times the loss scale, before backward."""

    def main_param(self, param: nn.Parameter) -> Tensor:
        """The tensor the inner optimizer updates for the model parameter ``param`` (an fp32 main
        copy for 16-bit parameters, else ``param`` itself)."""


@runtime_checkable
class ShardedOptimizer(OptimizerWrapper, Protocol):
    """A ZeRO-1 optimizer: main params and state sharded over the data-parallel ranks. It may also have
    ``params_from_mains()`` (the model params gathered from the mains, as after a step), which a checkpoint load calls
    when the saved params are 16-bit and the optimizer's fp32 ones."""

    buffer: GradBuffer
    """The strategy's gradient buffer whose reduce-scattered shards this optimizer reads."""
    model_groups: list[list[nn.Parameter]]
    """The model parameters of each of the inner optimizer's param groups."""

    def sharded_state_for_checkpoint(self) -> list[dict[str, Any]]:
        """This rank's pieces: ``{"param", "start", "end", "tensors": {"main_param", <state>...}}``,
        elements ``[start, end)`` of the flattened TP-local ``param``."""


_WRAPPER_MEMBERS = ("optimizer", "grad_scaler", "num_skipped_steps", "reduces_gradients", "last_step_skipped",
                    "last_grad_norm", "scale_loss", "main_param")
_SHARDED_MEMBERS = ("buffer", "model_groups", "sharded_state_for_checkpoint")


def _absent(obj: Any, members: Iterable[str]) -> list[str]:
    """The members ``obj`` does not have at all (a member that is None is present: ``grad_scaler``)."""
    return [m for m in members if not hasattr(obj, m)]


class PlainOptimizer:
    """:class:`OptimizerWrapper` over a plain ``torch.optim.Optimizer`` (fp32, no loss scaling)."""

    grad_scaler = None
    num_skipped_steps = 0
    reduces_gradients = False
    last_step_skipped = False
    last_grad_norm = None

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss

    def main_param(self, param: nn.Parameter) -> Tensor:
        return param


def optimizer_wrapper(optimizer: Any) -> OptimizerWrapper:
    """``optimizer`` as an :class:`OptimizerWrapper`, checked: an object with every member is taken
    as it is (whatever its class), a plain ``torch.optim.Optimizer`` with none of them is adapted
    (:class:`PlainOptimizer`); anything else is refused with the missing members named."""
    name = type(optimizer).__name__
    missing = _absent(optimizer, _WRAPPER_MEMBERS)
    if not missing:
        if optimizer.reduces_gradients:
            lacking = missing_members(optimizer, _SHARDED_MEMBERS)
            if lacking:
                raise TypeError(f"{name} reduces gradients (ZeRO-1) but lacks {', '.join(lacking)} of "
                                f"lightning_megatron.protocols.ShardedOptimizer")
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer) and len(missing) == len(_WRAPPER_MEMBERS):
        return PlainOptimizer(optimizer)
    kind = ("implements part of lightning_megatron.protocols.OptimizerWrapper" if len(missing) < len(_WRAPPER_MEMBERS)
            else "is neither a torch.optim.Optimizer nor a lightning_megatron.protocols.OptimizerWrapper")
    raise TypeError(f"{name} {kind}; missing: {', '.join(missing)}. Implement every member (a wrapper of "
                    f"your own), or none (a plain torch optimizer: fp32 updates from .grad)")


@runtime_checkable
class WrapsOptimizers(Protocol):
    """A strategy that wraps the optimizers itself (the MegatronStrategy): the optimizer callback hands
    it the :class:`~lightning_megatron.optimizer.OptimizerConfig` in its ``setup`` hook, and the strategy
    wraps every optimizer right after ``configure_optimizers``, where it owns the parallel state and
    the gradient buffer."""

    def set_optimizer_config(self, config: OptimizerConfig) -> None:
        """Wrap the optimizers of the coming fit with ``config`` (a second, different config is refused)."""


def is_sharded(optimizer: OptimizerWrapper) -> bool:
    """Whether ``optimizer`` is a :class:`ShardedOptimizer` (ZeRO-1)."""
    return optimizer.reduces_gradients
