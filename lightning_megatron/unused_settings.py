"""Settings a run would not use, said once by rank 0 before launch with the flag that does what was meant: the
model's lr and weight decay under an ``lr_schedule`` (it sets both every step), the model's optimizer arguments
under an ``--optimizer`` class of one's own, a ``--seed_everything`` typed (the run's numbers follow three seeds
of their own). Each once trained without a word.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["say_unused_settings"]


def say_unused_settings(config: Any, argv: list[str]) -> None:
    """Every warning of this module for a parsed ``config`` (``argv``: the command line's own flags)."""
    _weight_decay_the_schedule_sets(config)
    _lr_the_schedule_sets(config, argv)
    _optimizer_arguments_of_the_model(config, argv)
    _seed_everything_typed(config, argv)
    _schedule_fields_of_other_styles(config)


def _section(config: Any, key: str) -> tuple[Any, str]:
    """(a section's arguments, its command-line prefix: ``--model.`` or ``--model.init_args.``); (None, "")."""
    section = config.get(key) if hasattr(config, "get") else None
    if section is None or not hasattr(section, "get"):
        return None, ""
    if section.get("class_path"):
        args = section.get("init_args")
        return (args if hasattr(args, "get") else None), f"--{key}.init_args."
    return section, f"--{key}."


def _schedule_and_model(config) -> tuple[Any, Any]:
    """(the ``lr_schedule`` section's arguments, the model's) of a parsed config; ``(None, None)`` without both."""
    schedule = config.get("lr_schedule") if hasattr(config, "get") else None
    model = config.get("model") if hasattr(config, "get") else None
    if not schedule or model is None or not hasattr(model, "get"):
        return None, None
    model = model.get("init_args") if model.get("class_path") else model
    return schedule.get("init_args") or schedule, model if hasattr(model, "get") else None


def _weight_decay_the_schedule_sets(config) -> None:
    """With an ``lr_schedule`` section, the schedule sets every parameter group's weight decay each step (from
    ``start_wd`` to ``end_wd``): a ``model.weight_decay`` that is neither is not used, which is said, with the flags
    that set the decay (a LoRA recipe's ``weight_decay: 0.0`` under the pretraining schedule's 0.1 decayed the
    adapters at 0.1, unsaid)."""
    from lightning.pytorch.utilities import rank_zero_warn

    args, model = _schedule_and_model(config)
    if args is None or model is None:
        return
    decay, start, end = model.get("weight_decay"), args.get("start_wd"), args.get("end_wd")
    if isinstance(decay, (int, float)) and start is not None and decay not in (start, end):
        rank_zero_warn(f"model.weight_decay={decay} is not used: the lr_schedule section sets the weight decay every "
                       f"step (start_wd={start}, end_wd={end}); to train with {decay}: --lr_schedule.start_wd {decay} "
                       f"--lr_schedule.end_wd {decay}")


def _lr_the_schedule_sets(config, argv: list[str]) -> None:
    """Under an ``lr_schedule`` (it sets the lr every step) a ``--model.lr`` typed other than ``max_lr`` is unused:
    said (Megatron-LM's ``--lr`` is ``--lr_schedule.max_lr``; the recipes' own ``lr`` is a placeholder)."""
    from lightning.pytorch.utilities import rank_zero_warn

    args, model = _schedule_and_model(config)
    typed = any(a in ("--model.lr", "--model.init_args.lr") or a.startswith(("--model.lr=", "--model.init_args.lr="))
                for a in argv)
    if not typed or args is None or model is None:
        return
    lr, peak = model.get("lr"), args.get("max_lr")
    if isinstance(lr, (int, float)) and peak is not None and lr != peak:
        rank_zero_warn(f"model.lr={lr} is not used: the lr_schedule section sets the lr every step (init_lr="
                       f"{args.get('init_lr')} -> max_lr={peak} -> min_lr={args.get('min_lr')}); to peak at {lr}: "
                       f"--lr_schedule.max_lr {lr}")


_MODEL_OPTIMIZER_ARGUMENTS = {"betas": ("adam_beta1", "adam_beta2"), "eps": ("adam_eps",),
                              "momentum": ("sgd_momentum",)}
"""The optimizer arguments the model builds its own optimizer with, by the torch argument they become."""


def _optimizer_arguments_of_the_model(config: Any, argv: list[str]) -> None:
    """``--optimizer torch.optim.AdamW`` builds that class with its own arguments: the model's ``adam_beta2`` (a
    decoder recipe's 0.95) gave way to torch's 0.999, unsaid. Said where they differ and the class's argument is its
    default, not typed (``argv``), with the ``--optimizer.*`` flag that keeps the model's."""
    from lightning.pytorch.utilities import rank_zero_warn

    from lightning_megatron.module import torch_class

    section = config.get("optimizer") if hasattr(config, "get") else None
    model, _ = _section(config, "model")
    class_path = section.get("class_path") if hasattr(section, "get") else None
    if not class_path or model is None:
        return
    try:
        import torch

        cls = torch_class(class_path, torch.optim, torch.optim.Optimizer, "optimizer", "optimizer", "")
    except ValueError:
        return  # refused where the optimizer is built
    given = section.get("init_args") or {}
    parameters = inspect.signature(cls).parameters
    for argument, fields in _MODEL_OPTIMIZER_ARGUMENTS.items():
        typed = any(a.split("=")[0] in (f"--optimizer.{argument}", f"--optimizer.init_args.{argument}") for a in argv)
        if argument not in parameters or typed or any(model.get(f) is None for f in fields):
            continue
        ours, theirs = tuple(model.get(f) for f in fields), _numbers(given.get(argument, parameters[argument].default))
        if theirs is None or theirs != _numbers(parameters[argument].default) or theirs == _numbers(ours):
            continue  # an argument set for the class (not its default) is the one meant
        said = ", ".join(f"model.{f}={v}" for f, v in zip(fields, ours))
        value = f"[{','.join(map(str, ours))}]" if len(ours) > 1 else str(ours[0])
        rank_zero_warn(f"{said} not used: --optimizer {class_path} builds with its own {argument}="
                       f"{theirs if len(theirs) > 1 else theirs[0]}; to train with the model's: --optimizer.{argument} "
                       f"{value}", category=UserWarning)


def _numbers(value: Any) -> tuple[float, ...] | None:
    """A number or a sequence of numbers as a tuple of floats (None: anything else)."""
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    try:
        return tuple(float(v) for v in values)
    except (TypeError, ValueError):
        return None


def _seed_everything_typed(config: Any, argv: list[str]) -> None:
    """``--seed_everything N`` seeds Python's, NumPy's and torch's global generators, and none of this run's numbers
    comes from them: the weights from ``init_seed``, dropout from the strategy's ``seed``, the samples from the data's
    ``seed`` (a replicate run with another seed_everything was the same run). Said when typed."""
    from lightning.pytorch.utilities import rank_zero_warn

    if not any(a == "--seed_everything" or a.startswith("--seed_everything=") for a in argv):
        return
    value = config.get("seed_everything") if hasattr(config, "get") else None
    model, model_flag = _section(config, "model")
    data, data_flag = _section(config, "data")
    if not isinstance(value, int) or isinstance(value, bool) or model is None or "init_seed" not in model:
        return
    seeds = [f"{model_flag}init_seed {value}", f"--trainer.strategy.init_args.seed {value}"]
    if data is not None and "seed" in data:
        seeds.append(f"{data_flag}seed {value}")
    rank_zero_warn(f"seed_everything={value} does not change this run's numbers: the weights follow the model's "
                   f"init_seed, dropout the strategy's seed, the samples the data's seed; for another replicate set "
                   f"them: {' '.join(seeds)}", category=UserWarning)


def _schedule_fields_of_other_styles(config: Any) -> None:
    """The ``lr_schedule`` fields of a style the schedule does not run: WSD's (``wsd_decay_steps``,
    ``lr_wsd_decay_style``) under another ``lr_decay_style``, ``wd_incr_steps`` under a constant weight decay."""
    from lightning.pytorch.utilities import rank_zero_warn

    schedule = config.get("lr_schedule") if hasattr(config, "get") else None
    args = (schedule.get("init_args") or schedule) if hasattr(schedule, "get") else None
    if not hasattr(args, "get"):
        return
    unused = []
    if args.get("lr_decay_style") != "WSD":
        unused += [(n, f"lr_decay_style={args.get('lr_decay_style')!r} (WSD's)")
                   for n in ("wsd_decay_steps", "lr_wsd_decay_style") if args.get(n) is not None]
    if args.get("wd_incr_style") == "constant" and args.get("wd_incr_steps") is not None:
        unused.append(("wd_incr_steps", "wd_incr_style='constant' (the weight decay start_wd throughout)"))
    for name, why in unused:
        rank_zero_warn(f"lr_schedule.{name}={args.get(name)!r} is not used under {why}", category=UserWarning)
