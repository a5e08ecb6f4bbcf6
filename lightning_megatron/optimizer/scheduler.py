"""Megatron's OptimizerParamScheduler: learning rate and weight decay set on every step.

Learning rate at step n (warm-up W = ``lr_warmup_steps``, decay end D = ``lr_decay_steps``):

    n <= W (W > 0):     lr = init_lr + (max_lr - init_lr) * n / W
    constant:           lr = max_lr
    n > D:              lr = min_lr
    inverse-square-root lr = max(min_lr, max_lr * sqrt(max(W, 1)) / sqrt(max(n, 1)))
    otherwise           r = (n - W) / (D - W),  lr = min_lr + c(r) * (max_lr - min_lr) with
      linear  c = 1 - r        cosine  c = (1 + cos(pi r)) / 2
      WSD     c = 1 until n <= D - S (S = wsd_decay_steps), then with s = (n - D + S) / S:
              linear 1 - s | cosine (1 + cos(pi s)) / 2 | exponential 2 * 0.5^s - 1 | minus_sqrt 1 - sqrt(s)

Weight decay at step n (I = ``wd_incr_steps``): ``end_wd`` when n > I or the style is constant; else
with r = n / I, ``start_wd + c(r) (end_wd - start_wd)``, c = r (linear) or (1 + cos(pi (1 - r))) / 2
(cosine). Every param group gets ``lr = get_lr(group) * lr_mult`` and
``weight_decay = get_wd(group) * wd_mult``; a group may override ``max_lr``, ``min_lr``,
``start_wd`` and ``end_wd``.

Works on any object with ``param_groups`` (a torch optimizer or a Megatron wrapper). No Lightning.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

__all__ = ["OptimizerParamScheduler", "LR_DECAY_STYLES", "WSD_DECAY_STYLES", "WD_INCR_STYLES", "warmup_problem",
           "warmup_for_run", "lr_problems", "style_problems", "missing_state_problem", "resume_problem"]

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def warmup_problem(lr_warmup_steps: int, lr_decay_steps: int, source: str = "lr_decay_steps") -> str | None:
    """The rule "the warm-up ends before the decay does", for a decay length the user set; the one
    validator the scheduler (at set-up) and ``config_checks`` (before launch) both call."""
    if lr_decay_steps > 0 and not lr_warmup_steps < lr_decay_steps:
        return (f"lr_warmup_steps={lr_warmup_steps!r} must be < {source}={lr_decay_steps!r}; shorten the warm-up "
                f"or decay later")
    return None


def style_problems(lr_decay_style: Any = "linear", lr_wsd_decay_style: Any = None, wd_incr_style: Any = "constant",
                   wsd_decay_steps: Any = None, lr_decay_steps: Any = None, start_wd: Any = 0.01,
                   end_wd: Any = 0.01) -> list[str]:
    """The rules on the schedule's styles (and the weight decay's bounds), the callback's defaults for what is not
    given; the one validator the scheduler (at set-up) and ``config_checks`` (before launch) both call (an
    ``lr_decay_steps`` of None, the run's length, skips WSD's bound on it)."""
    out = []
    if lr_decay_style not in LR_DECAY_STYLES:
        out.append(f"lr_decay_style={lr_decay_style!r} is not one of {LR_DECAY_STYLES}")
    elif lr_decay_style == "WSD":
        if not isinstance(wsd_decay_steps, int) or not 0 < wsd_decay_steps <= (lr_decay_steps or wsd_decay_steps):
            out.append(f"wsd_decay_steps={wsd_decay_steps!r} must be in (0, lr_decay_steps={lr_decay_steps}] "
                       f"for lr_decay_style='WSD'")
        if lr_wsd_decay_style not in WSD_DECAY_STYLES:
            out.append(f"lr_wsd_decay_style={lr_wsd_decay_style!r} is not one of {WSD_DECAY_STYLES} (needed for WSD)")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (start_wd, end_wd))
    if numbers and start_wd < 0.0:
        out.append(f"start_wd={start_wd!r} must be >= 0")
    if numbers and end_wd < start_wd:
        out.append(f"end_wd={end_wd!r} must be >= start_wd={start_wd!r}")
    if wd_incr_style not in WD_INCR_STYLES:
        out.append(f"wd_incr_style={wd_incr_style!r} is not one of {WD_INCR_STYLES}")
    elif wd_incr_style == "constant" and numbers and start_wd != end_wd:
        out.append(f"wd_incr_style='constant' needs start_wd == end_wd (got {start_wd} and {end_wd}); "
                   f"choose 'linear' or 'cosine' to increase weight decay")
    return out


def lr_problems(init_lr: float | None, max_lr: float | None, min_lr: float | None) -> list[str]:
    """The rules on the three learning rates (None: unknown, its rules skipped)."""
    out = []
    if min_lr is not None and min_lr < 0.0:
        out.append(f"min_lr={min_lr!r} must be >= 0")
    if max_lr is not None and min_lr is not None and max_lr < min_lr:
        out.append(f"max_lr={max_lr!r} must be >= min_lr={min_lr!r}")
    if max_lr is not None and init_lr is not None and init_lr > max_lr:
        out.append(f"init_lr={init_lr!r} must be <= max_lr={max_lr!r}")
    return out


def resume_problem(use_checkpoint_opt_param_scheduler: bool, override_opt_param_scheduler: bool) -> str | None:
    if use_checkpoint_opt_param_scheduler and override_opt_param_scheduler:
        return ("override_opt_param_scheduler=True and use_checkpoint_opt_param_scheduler=True contradict "
                "each other; set use_checkpoint_opt_param_scheduler=False to override")
    return None


def missing_state_problem(step: int, applied: int, override_opt_param_scheduler: bool) -> str | None:
    """Why a run resumed at ``step`` (``applied`` of them not skipped) from a checkpoint that holds no state of the
    schedule must not start it from its first step (a second warm-up mid-run, a decay ending past the run's end);
    None with ``override_opt_param_scheduler``, which starts it at ``applied`` (the callback and the check before
    launch both ask this)."""
    if override_opt_param_scheduler or step <= 0:
        return None
    return (f"OptimizerParamSchedulerCallback: the run resumes at step {step} from a checkpoint that holds no state "
            f"of this schedule (it was trained with another LR schedule, or none): the schedule would warm up again "
            f"from its first step there. Resume with the schedule the run was trained with (its --lr_scheduler ..., "
            f"or --lr_schedule null), or take the configured schedule, started at step {applied} as if it had run "
            f"from the first step: override_opt_param_scheduler=True with use_checkpoint_opt_param_scheduler=False "
            f"(--lr_schedule.override_opt_param_scheduler true --lr_schedule.use_checkpoint_opt_param_scheduler "
            f"false)")


def warmup_for_run(lr_warmup_steps: int, max_steps: int) -> tuple[int, str | None]:
    """The warm-up of a schedule whose decay length is the run's (``lr_decay_steps=None`` ->
    ``max_steps``): one as long as the run (a recipe's, run for a few steps) is shortened to 10% of
    it, with a message saying so; else unchanged (message None)."""
    if max_steps > 0 and lr_warmup_steps >= max_steps:
        new = max(0, max_steps // 10)
        return new, (f"lr_warmup_steps={lr_warmup_steps} is not below the decay length {max_steps} (lr_decay_steps="
                     f"null: trainer.max_steps): using lr_warmup_steps={new} (10% of it); set lr_warmup_steps "
                     f"(--lr_schedule.lr_warmup_steps) to choose")
    return lr_warmup_steps, None


class OptimizerParamScheduler:
    """Anneals the learning rate and increments weight decay, with Megatron's checkpoint rules.

    ``use_checkpoint_opt_param_scheduler``: on load, take the values stored in the checkpoint.
    ``override_opt_param_scheduler``: on load, keep the constructor's values (only the step count
    is restored). With neither, the two must agree or loading fails, listing every differing field.
    Both at once is an error. After a load, :attr:`resume_differences` lists the fields where the
    checkpoint and the constructor disagree (``(field, configured, checkpoint)``) and
    :meth:`describe_resume_differences` says which were used; ``load_state_dict(warn=True)`` warns.
    """

    def __init__(
        self,
        optimizer: Any,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool = True,
        override_opt_param_scheduler: bool = False,
        wsd_decay_steps: int | None = None,
        lr_wsd_decay_style: str | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        problems = lr_problems(init_lr, max_lr, min_lr)
        if problems:
            raise ValueError(problems[0])

        self.lr_warmup_steps = lr_warmup_steps
        self.num_steps = 0
        self.lr_decay_steps = lr_decay_steps
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        if not lr_decay_steps > 0:
            raise ValueError(f"lr_decay_steps={lr_decay_steps!r} must be > 0")
        problem = warmup_problem(lr_warmup_steps, lr_decay_steps)
        if problem:
            raise ValueError(problem)
        problems = style_problems(lr_decay_style, lr_wsd_decay_style, wd_incr_style, wsd_decay_steps, lr_decay_steps,
                                  start_wd, end_wd)
        if problems:
            raise ValueError(problems[0])
        self.lr_decay_style = lr_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        if wd_incr_style != "constant" and not wd_incr_steps > 0:
            raise ValueError(f"wd_incr_steps={wd_incr_steps!r} must be > 0 for wd_incr_style={wd_incr_style!r}")
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style

        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        problem = resume_problem(use_checkpoint_opt_param_scheduler, override_opt_param_scheduler)
        if problem:
            raise ValueError(problem)

        self.resume_differences: list[tuple[str, Any, Any]] = []
        """(field, configured value, checkpoint value) for each field that differed at the last load."""

        # Megatron sets the initial lr and wd on construction.
        self.step(0)
        logger.info("learning rate decay style: %s", self.lr_decay_style)

    def get_wd(self, param_group: dict | None = None) -> float:
        """Weight decay at ``self.num_steps`` (Megatron's increment functions)."""
        if param_group is not None:
            start_wd = param_group.get("start_wd", self.start_wd)
            end_wd = param_group.get("end_wd", self.end_wd)
        else:
            start_wd = self.start_wd
            end_wd = self.end_wd

        if self.num_steps > self.wd_incr_steps:
            return end_wd

        if self.wd_incr_style == "constant":
            assert start_wd == end_wd
            return end_wd

        incr_ratio = float(self.num_steps) / float(self.wd_incr_steps)
        assert incr_ratio >= 0.0
        assert incr_ratio <= 1.0
        delta_wd = end_wd - start_wd

        if self.wd_incr_style == "linear":
            coeff = incr_ratio
        elif self.wd_incr_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        else:
            raise Exception(f"{self.wd_incr_style} weight decay increment style is not supported.")

        return start_wd + coeff * delta_wd

    def get_lr(self, param_group: dict) -> float:
        """Learning rate at ``self.num_steps`` (Megatron's decay functions, kept exactly)."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)

        # Linear warm-up from init_lr.
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + ((max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps))

        if self.lr_decay_style == "constant":
            return max_lr

        # Past the decay horizon: min_lr.
        if self.num_steps > self.lr_decay_steps:
            return min_lr

        if self.lr_decay_style == "inverse-square-root":
            warmup_steps = max(self.lr_warmup_steps, 1)
            num_steps = max(self.num_steps, 1)
            lr = max_lr * warmup_steps**0.5 / (num_steps**0.5)
            return max(min_lr, lr)

        num_steps_ = self.num_steps - self.lr_warmup_steps
        decay_steps_ = self.lr_decay_steps - self.lr_warmup_steps
        decay_ratio = float(num_steps_) / float(decay_steps_)
        assert decay_ratio >= 0.0
        assert decay_ratio <= 1.0
        delta_lr = max_lr - min_lr

        coeff = None
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        elif self.lr_decay_style == "WSD":
            wsd_anneal_start_ = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= wsd_anneal_start_:
                coeff = 1.0
            else:
                wsd_steps = self.num_steps - wsd_anneal_start_
                wsd_decay_ratio = float(wsd_steps) / float(self.wsd_decay_steps)
                if self.lr_wsd_decay_style == "linear":
                    coeff = 1.0 - wsd_decay_ratio
                elif self.lr_wsd_decay_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * wsd_decay_ratio) + 1.0)
                elif self.lr_wsd_decay_style == "exponential":
                    coeff = (2.0 * math.pow(0.5, wsd_decay_ratio)) - 1.0
                elif self.lr_wsd_decay_style == "minus_sqrt":
                    coeff = 1.0 - math.sqrt(wsd_decay_ratio)
        else:
            raise Exception(f"{self.lr_decay_style} decay style is not supported.")
        assert coeff is not None

        return min_lr + coeff * delta_lr

    def step(self, increment: int) -> None:
        """Advance ``num_steps`` by ``increment`` and set lr and weight decay on every group."""
        self.num_steps += increment
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = self.get_lr(param_group) * param_group.get("lr_mult", 1.0)
            param_group["weight_decay"] = self.get_wd(param_group) * param_group.get("wd_mult", 1.0)

    def state_dict(self) -> dict[str, Any]:
        """Megatron's keys (the schedule's values and ``num_steps``), and what Megatron's leave out but the lr
        depends on: ``init_lr`` (the warm-up's start), ``wsd_decay_steps`` and ``lr_wsd_decay_style`` (WSD's
        anneal)."""
        return {
            "init_lr": self.init_lr,
            "wsd_decay_steps": self.wsd_decay_steps,
            "lr_wsd_decay_style": self.lr_wsd_decay_style,
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, cls_value: Any, sd_value: Any, name: str) -> Any:
        """Pick the constructor's or the checkpoint's value per the override / use-checkpoint flags.

        ``name`` is the field (``lr_decay_steps``...); a difference is recorded in ``resume_differences``.
        """
        if cls_value != sd_value:
            self.resume_differences.append((name, cls_value, sd_value))
        if self.override_opt_param_scheduler:
            logger.info("overriding %s value to %s", name, cls_value)
            return cls_value
        logger.info("using checkpoint value %s for %s", sd_value, name)
        return sd_value

    def _sometimes(self, cls_value: Any, state_dict: dict[str, Any], name: str, matters: bool) -> Any:
        """:meth:`_check_and_set` of a field some values depend on, where ``matters``."""
        if name not in state_dict:
            return cls_value
        if matters:
            return self._check_and_set(cls_value, state_dict[name], name)
        return cls_value if self.override_opt_param_scheduler else state_dict[name]

    def describe_resume_differences(self) -> str:
        """One line per differing field and which value the schedule now uses; "" when none differ."""
        if not self.resume_differences:
            return ""
        fields = "; ".join(f"{name}: configured {cfg!r}, checkpoint {ckpt!r}"
                           for name, cfg, ckpt in self.resume_differences)
        if self.override_opt_param_scheduler:
            return (f"the resumed lr/wd schedule differs from the checkpoint's ({fields}); using the configured "
                    f"values (override_opt_param_scheduler=True), only the step count comes from the checkpoint")
        return (f"the resumed lr/wd schedule differs from the configured one ({fields}); using the checkpoint's "
                f"values (use_checkpoint_opt_param_scheduler=True). To continue with the configured values set "
                f"override_opt_param_scheduler=True and use_checkpoint_opt_param_scheduler=False")

    def load_state_dict(self, state_dict: dict[str, Any], warn: bool = False) -> None:
        """Restore from Megatron's keys or their legacy names (``start_lr``, ``warmup_iter``/
        ``warmup_steps``, ``end_iter``/``decay_steps``, ``decay_style``, ``num_iters``).

        Megatron's rule per field: ``override_opt_param_scheduler`` keeps the constructor's value,
        ``use_checkpoint_opt_param_scheduler`` takes the checkpoint's, with neither a difference is a
        ``ValueError`` listing every differing field. ``warn``: warn when any field differs.
        """
        self.resume_differences = []
        self._load_fields(state_dict)
        if self.resume_differences and not (self.override_opt_param_scheduler
                                            or self.use_checkpoint_opt_param_scheduler):
            fields = "; ".join(f"{name}: configured {cfg!r}, checkpoint {ckpt!r}"
                               for name, cfg, ckpt in self.resume_differences)
            raise ValueError(
                f"OptimizerParamScheduler: the checkpoint's schedule differs from the configured one ({fields}); "
                "set use_checkpoint_opt_param_scheduler=True to take the checkpoint's values or "
                "override_opt_param_scheduler=True to keep yours")
        if warn and self.resume_differences:
            warnings.warn(f"OptimizerParamScheduler: {self.describe_resume_differences()}", stacklevel=2)

    def _load_fields(self, state_dict: dict[str, Any]) -> None:
        max_lr_ = state_dict["start_lr"] if "start_lr" in state_dict else state_dict["max_lr"]
        self.max_lr = self._check_and_set(self.max_lr, max_lr_, "max_lr")
        self.min_lr = self._check_and_set(self.min_lr, state_dict["min_lr"], "min_lr")

        if "warmup_iter" in state_dict:
            lr_warmup_steps_ = state_dict["warmup_iter"]
        elif "warmup_steps" in state_dict:
            lr_warmup_steps_ = state_dict["warmup_steps"]
        else:
            lr_warmup_steps_ = state_dict["lr_warmup_steps"]
        self.lr_warmup_steps = self._check_and_set(self.lr_warmup_steps, lr_warmup_steps_, "lr_warmup_steps")

        if "end_iter" in state_dict:
            lr_decay_steps_ = state_dict["end_iter"]
        elif "decay_steps" in state_dict:
            lr_decay_steps_ = state_dict["decay_steps"]
        else:
            lr_decay_steps_ = state_dict["lr_decay_steps"]
        self.lr_decay_steps = self._check_and_set(self.lr_decay_steps, lr_decay_steps_, "lr_decay_steps")

        lr_decay_style_ = state_dict["decay_style"] if "decay_style" in state_dict else state_dict["lr_decay_style"]
        self.lr_decay_style = self._check_and_set(self.lr_decay_style, lr_decay_style_, "lr_decay_style")
        num_steps = state_dict["num_iters"] if "num_iters" in state_dict else state_dict["num_steps"]
        # Fields a value depends on only sometimes (WSD's anneal under WSD, the warm-up's start while the warm-up
        # goes on): compared where they do (a difference that changes no value is none), else the checkpoint's
        # kept as the other fields are. A checkpoint of before (or Megatron's) has none: the configured ones.
        wsd = self.lr_decay_style == "WSD"
        self.wsd_decay_steps = self._sometimes(self.wsd_decay_steps, state_dict, "wsd_decay_steps", wsd)
        self.lr_wsd_decay_style = self._sometimes(self.lr_wsd_decay_style, state_dict, "lr_wsd_decay_style", wsd)
        self.init_lr = self._sometimes(self.init_lr, state_dict, "init_lr", num_steps < self.lr_warmup_steps)
        if self.lr_decay_style == "WSD" and (self.wsd_decay_steps is None or self.lr_wsd_decay_style is None
                                             or not 0 < self.wsd_decay_steps <= self.lr_decay_steps):
            raise ValueError(
                f"lr_decay_style='WSD' of the checkpoint needs wsd_decay_steps in (0, lr_decay_steps="
                f"{self.lr_decay_steps}] and lr_wsd_decay_style (configured {self.wsd_decay_steps!r} and "
                f"{self.lr_wsd_decay_style!r}; a checkpoint written before 2026-12-06 does not record them): set "
                f"--lr_schedule.wsd_decay_steps and --lr_schedule.lr_wsd_decay_style to the run's")
        # Megatron adds num_steps to a freshly built scheduler (num_steps == 0). Resetting first gives
        # the same result there and restores, rather than adds, when loading into a used scheduler.
        self.num_steps = 0
        self.step(increment=num_steps)

        if "start_wd" in state_dict:
            self.start_wd = self._check_and_set(self.start_wd, state_dict["start_wd"], "start_wd")
            self.end_wd = self._check_and_set(self.end_wd, state_dict["end_wd"], "end_wd")
            if self.wd_incr_style == state_dict["wd_incr_style"] == "constant":
                # wd_incr_steps of a constant weight decay changes no value (null: max_steps, another in an
                # extended run): no difference, so neither a warning nor, with neither flag, an error
                self.wd_incr_steps = self.wd_incr_steps if self.override_opt_param_scheduler else state_dict[
                    "wd_incr_steps"]
            else:
                self.wd_incr_steps = self._check_and_set(self.wd_incr_steps, state_dict["wd_incr_steps"],
                                                         "wd_incr_steps")
            self.wd_incr_style = self._check_and_set(self.wd_incr_style, state_dict["wd_incr_style"], "wd_incr_style")
            # Megatron set lr/wd above with the old wd values; refresh so the groups match the state.
            self.step(0)
