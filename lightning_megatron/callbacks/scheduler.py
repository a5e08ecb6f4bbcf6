"""OptimizerParamSchedulerCallback: Megatron's lr + weight-decay schedule in a Lightning Trainer.

The scheduler is built at ``on_fit_start`` on the trainer's first optimizer (its constructor sets
the step-0 lr and weight decay), advanced by one after every optimizer step that was not skipped
for overflow (as Megatron: a skipped iteration does not advance the schedule), and saved in the
checkpoint as this callback's state. Lightning restores callback state before ``on_fit_start``
(or after it for strategies with ``restore_checkpoint_after_setup``): both orders are handled.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_megatron.optimizer.scheduler import OptimizerParamScheduler, missing_state_problem, warmup_for_run
from lightning_megatron.protocols import optimizer_wrapper

__all__ = ["OptimizerParamSchedulerCallback"]


class OptimizerParamSchedulerCallback(Callback):
    """Sets lr and weight decay on every param group each step (see :class:`OptimizerParamScheduler`).

    Arguments are the scheduler's, with two defaults resolved at fit time:
    ``lr_decay_steps=None`` -> ``trainer.max_steps`` and ``wd_incr_steps=None`` -> the same.
    Logs ``lr`` and ``wd`` at every step: the values that step's optimizer step used (what
    Lightning's ``LearningRateMonitor`` logs at the same step), before per-group ``lr_mult`` / ``wd_mult``.

    On resume Megatron's rule applies to every field (``max_lr``, ``min_lr``, ``lr_warmup_steps``,
    ``lr_decay_steps``, ``lr_decay_style`` and the weight-decay fields): by default
    (``use_checkpoint_opt_param_scheduler=True``) the checkpoint's values continue, so resuming with
    a larger ``max_steps`` keeps the old decay horizon; ``override_opt_param_scheduler=True`` with
    ``use_checkpoint_opt_param_scheduler=False`` takes the configured ones (the step count always
    comes from the checkpoint); with neither, any difference is an error. Whenever the two differ a
    warning names each field with both values and which one is used.
    """

    def __init__(
        self,
        init_lr: float = 0.0,
        max_lr: float = 1e-4,
        min_lr: float = 0.0,
        lr_warmup_steps: int = 0,
        lr_decay_steps: int | None = None,
        lr_decay_style: str = "linear",
        start_wd: float = 0.01,
        end_wd: float = 0.01,
        wd_incr_steps: int | None = None,
        wd_incr_style: str = "constant",
        use_checkpoint_opt_param_scheduler: bool = True,
        override_opt_param_scheduler: bool = False,
        wsd_decay_steps: int | None = None,
        lr_wsd_decay_style: str | None = None,
    ) -> None:
        self.kwargs: dict[str, Any] = dict(
            init_lr=init_lr,
            max_lr=max_lr,
            min_lr=min_lr,
            lr_warmup_steps=lr_warmup_steps,
            lr_decay_steps=lr_decay_steps,
            lr_decay_style=lr_decay_style,
            start_wd=start_wd,
            end_wd=end_wd,
            wd_incr_steps=wd_incr_steps,
            wd_incr_style=wd_incr_style,
            use_checkpoint_opt_param_scheduler=use_checkpoint_opt_param_scheduler,
            override_opt_param_scheduler=override_opt_param_scheduler,
            wsd_decay_steps=wsd_decay_steps,
            lr_wsd_decay_style=lr_wsd_decay_style,
        )
        self.scheduler: OptimizerParamScheduler | None = None
        self._pending_state: dict[str, Any] | None = None
        self._state_loaded = False
        """Whether this fit loaded the schedule's state from a checkpoint."""
        self._last_global_step = 0
        self._resolved: dict[str, int] = {}

    def run_settings(self) -> dict[str, Any]:
        """The schedule's arguments: what every rank of a run must have been given (the strategy compares them)."""
        return dict(self.kwargs)

    def used_settings(self) -> dict[str, Any]:
        """The schedule this fit runs once it is built (``on_fit_start``): its arguments with ``None`` resolved
        to ``max_steps``, a warm-up shortened for the run, and at a resume the checkpoint's values Megatron's
        rule keeps; before that, :meth:`run_settings`. What the W&B config records."""
        if self.scheduler is None:
            return self.run_settings()
        return {name: getattr(self.scheduler, name, value) for name, value in self.kwargs.items()}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.lr_scheduler_configs:
            raise ValueError(
                "configure_optimizers returned an lr scheduler and OptimizerParamSchedulerCallback also sets the "
                "lr every step; return only the optimizer, or drop the callback"
            )
        if not trainer.optimizers:
            raise ValueError("OptimizerParamSchedulerCallback needs an optimizer from configure_optimizers")
        kwargs = dict(self.kwargs)
        for name in ("lr_decay_steps", "wd_incr_steps"):
            if kwargs[name] is None:
                by_epochs = not (trainer.max_steps or 0) > 0
                if name == "wd_incr_steps" and kwargs["wd_incr_style"] == "constant" and by_epochs:
                    kwargs[name] = kwargs["lr_decay_steps"]  # a constant decay has no horizon (a run by epochs)
                    continue
                if trainer.max_steps is None or trainer.max_steps <= 0:
                    raise ValueError(
                        f"{name}=None means Trainer.max_steps, but max_steps={trainer.max_steps}; "
                        f"set Trainer(max_steps=...) or {name}=..."
                    )
                kwargs[name] = trainer.max_steps
        if trainer.fast_dev_run and self.kwargs["lr_decay_steps"] is None:
            kwargs["lr_decay_steps"] = self._fast_dev_run_horizon(trainer)
        elif self.kwargs["lr_decay_steps"] is None:  # the run's length decides: one rule with the pre-launch check
            kwargs["lr_warmup_steps"], message = warmup_for_run(kwargs["lr_warmup_steps"], trainer.max_steps)
            if message:
                rank_zero_warn(f"OptimizerParamSchedulerCallback: {message}", category=UserWarning)
        self.scheduler = OptimizerParamScheduler(trainer.optimizers[0], **kwargs)
        self._state_loaded = False
        self._resolved = {name: kwargs[name] for name in ("lr_decay_steps", "wd_incr_steps")
                          if self.kwargs[name] is None and kwargs[name] == trainer.max_steps}  # not an epoch run's
        if self._pending_state is not None:
            self._load(self._pending_state)
            self._pending_state = None

    def _start_without_state(self, trainer: pl.Trainer) -> None:
        """A run resumed from a checkpoint that holds no state of this schedule (trained with a torch LR scheduler,
        or a constant lr): from its first step it would warm up again mid-run, its decay ending past the run's end.
        Refused; with ``override_opt_param_scheduler`` it starts at the checkpoint's step (its applied steps), as if
        it had run from the first."""
        assert self.scheduler is not None
        step = trainer.global_step
        applied = step - int(getattr(optimizer_wrapper(trainer.optimizers[0]), "num_skipped_steps", 0) or 0)
        problem = missing_state_problem(step, applied, self.kwargs["override_opt_param_scheduler"])
        if problem is not None:
            from lightning_megatron.checkpoint_verify import CheckpointError

            raise CheckpointError(problem)  # every rank decides alike: the CLI says it once
        rank_zero_warn(f"OptimizerParamSchedulerCallback: the checkpoint holds no state of this schedule; with "
                       f"override_opt_param_scheduler=True it starts at step {applied}, as if it had run from the "
                       f"first step", category=UserWarning)
        self.scheduler.num_steps = applied

    def _fast_dev_run_horizon(self, trainer: pl.Trainer) -> int:
        """``fast_dev_run``: Lightning sets ``max_steps`` to the few batches it runs, so ``lr_decay_steps=None``
        (= max_steps) would end the decay before the warm-up. The horizon becomes ``lr_warmup_steps + max_steps``:
        the steps run are the schedule's first ones (the warm-up from ``init_lr``, or ``max_lr`` at step 0),
        as they are in the real run; nothing else of the schedule changes, and nothing is saved."""
        horizon = max(trainer.max_steps, self.kwargs["lr_warmup_steps"] + trainer.max_steps)
        if horizon != trainer.max_steps:
            rank_zero_info(f"OptimizerParamSchedulerCallback: fast_dev_run runs {trainer.max_steps} step(s): "
                           f"lr_decay_steps=null taken as lr_warmup_steps + {trainer.max_steps} = {horizon} "
                           f"for this check run (the first steps of the schedule, as in the real run)")
        return horizon

    def _load(self, state: dict[str, Any]) -> None:
        """Megatron's resume rule (see OptimizerParamScheduler.load_state_dict), with a warning on any difference."""
        assert self.scheduler is not None
        try:
            self.scheduler.load_state_dict(state)
        except ValueError as e:  # a field differs and neither flag says which value to take
            from lightning_megatron.checkpoint_verify import CheckpointError

            raise CheckpointError(f"OptimizerParamSchedulerCallback: {e}") from None  # the CLI says it once
        self._state_loaded = True
        message = self.scheduler.describe_resume_differences()
        if message:
            resolved = [f"{name}=null resolved to trainer.max_steps={steps}" for name, steps in self._resolved.items()
                        if any(d[0] == name for d in self.scheduler.resume_differences)]
            rank_zero_warn(f"OptimizerParamSchedulerCallback: {message}"
                           + (f" ({'; '.join(resolved)})" if resolved else ""), category=UserWarning)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the checkpoint restore: global_step is where this run continues from.
        self._last_global_step = trainer.global_step
        if self.scheduler is not None and trainer.global_step > 0 and not self._state_loaded:
            self._start_without_state(trainer)
        if self.scheduler is not None:
            # The restored optimizer state carries the lr/wd of the saved step; the schedule (which may
            # have been overridden on resume) sets them for the first step of this run.
            self.scheduler.step(0)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self.scheduler is not None
        # The values this batch's optimizer step used (logged at this step, as LearningRateMonitor
        # logs them), read before the schedule moves on to the next step's.
        lr, wd = self.scheduler.get_lr({}), self.scheduler.get_wd()
        if trainer.global_step > self._last_global_step:  # an optimizer step ran this batch
            self._last_global_step = trainer.global_step
            optimizer = trainer.optimizers[0]
            if not optimizer_wrapper(optimizer).last_step_skipped:
                self.scheduler.step(1)  # an overflow-skipped step does not advance the schedule
        pl_module.log("lr", lr, on_step=True, on_epoch=False, rank_zero_only=True)
        pl_module.log("wd", wd, on_step=True, on_epoch=False, rank_zero_only=True)

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.scheduler is not None:
            return {"opt_param_scheduler": self.scheduler.state_dict()}
        return {} if self._pending_state is None else {"opt_param_scheduler": dict(self._pending_state)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("opt_param_scheduler")
        if state is None:
            return
        if self.scheduler is not None:
            self._load(state)
        else:
            self._pending_state = dict(state)
