"""Checks of what a command loads, before any process is launched: ``--ckpt_path`` is a complete checkpoint
(:func:`ckpt_path_problem`), ``validate`` / ``test`` / ``predict`` evaluate the model meant
(:func:`evaluated_model_problem`), and a resumed ``fit`` is one the ranks would not refuse at set-up
(:func:`resume_problems`). :func:`~lightning_megatron.config_checks.check_config` lists them with the rest.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_megatron.data_checks import int_or_none as _int
from lightning_megatron.module import MegatronLightningModule, torch_class

__all__ = ["ckpt_path_problem", "evaluated_model_problem", "resume_problems"]


_LIGHTNING_CKPT_NAMES = ("last", "best", "hpc")
"""``--ckpt_path`` values Lightning resolves itself (and ``registry[:...]``)."""


def ckpt_path_problem(ckpt_path: Any) -> str | None:
    """What is wrong with a ``--ckpt_path`` before launch (it does not exist, is a file: ours are directories, or
    is not a complete checkpoint: its marker, format and files), or None; Lightning's names (``last``, ``best``,
    ``hpc``, ``registry``) are left to it. The files' checksums are verified at set-up
    (:func:`lightning_megatron.checkpoint.verify_checkpoint`)."""
    import os

    if not isinstance(ckpt_path, (str, os.PathLike)):
        return None
    path = os.fspath(ckpt_path)
    if path in _LIGHTNING_CKPT_NAMES or path.startswith("registry"):
        return None
    if not os.path.exists(path):
        return (f"ckpt_path={path!r} does not exist (relative paths start at {os.getcwd()!r}); pass a checkpoint "
                f"directory (<default_root_dir>/checkpoints/last.ckpt), or --ckpt_path last for the run folder's "
                f"newest")
    if not os.path.isdir(path):
        return (f"ckpt_path={path!r} is a file, not a lightning_megatron checkpoint directory (was it written by "
                f"another strategy?)")
    from pathlib import Path

    from lightning_megatron.checkpoint_verify import CheckpointError, read_marker

    try:  # its marker, format and files' sizes (the checksums are read at set-up, by every rank)
        read_marker(Path(path))
    except CheckpointError as e:
        return str(e)
    return None


def evaluated_model_problem(command: str, ckpt_path: Any, init_from: Any, model_class: type | None,
                             lora: Any = None) -> str | None:
    """Why ``validate`` / ``test`` / ``predict`` would not evaluate the model meant: no ``--ckpt_path`` and no
    ``--model.init_from`` (its random initialization), a module whose fine-tuning head ``init_from`` never loads
    (:attr:`~lightning_megatron.module.MegatronLightningModule.fine_tuning_heads`) without its checkpoint, or LoRA
    adapters (``lora``) without theirs (they start at zero: the base)."""
    if ckpt_path is not None:
        return None
    if init_from is None:
        return (f"{command} without --ckpt_path or --model.init_from would evaluate the model's random "
                f"initialization: pass --ckpt_path with a checkpoint (a run's checkpoints/last.ckpt, or last for the "
                f"run folder's newest), or --model.init_from with pretrained weights")
    name = getattr(model_class, "__name__", "the model")
    if lora is not None:
        return (f"{command} of {name} with model.lora needs the fine-tuned checkpoint (--ckpt_path): "
                f"--model.init_from loads the base and the LoRA adapters start at zero, so it would evaluate the "
                f"base; pass --ckpt_path, or --model.lora null to evaluate the base itself")
    heads = getattr(model_class, "fine_tuning_heads", ())
    if heads:
        return (f"{command} of {model_class.__name__} needs the fine-tuned checkpoint (--ckpt_path): "
                f"--model.init_from loads the pretrained weights and leaves {', '.join(h + '*' for h in heads)} at "
                f"its initialization")
    return None


def resume_problems(path: str, model_hparams: dict[str, Any], model_class: type | None, optimizer_class: str | None,
                     scheduler_args: dict[str, Any], max_steps: int | None, *, data: dict[str, Any] | None = None,
                     data_class: type | None = None) -> list[str]:
    """What the ranks refuse at set-up when ``fit`` resumes from ``path``, read from its ``extra.pt``: another
    optimizer class (:func:`~lightning_megatron.sharded_state.optimizer_class_problem`) and an lr schedule it holds
    no state of (:func:`~lightning_megatron.optimizer.scheduler.missing_state_problem`), in the same words; a
    ``max_steps`` the checkpoint has reached (Lightning trained nothing and exited 0); and a random shuffle
    (``data.shuffle``) going on mid-epoch from a sample count the global batch does not divide (the sampler's
    refusal)."""
    from pathlib import Path

    from lightning_megatron.data_checks import checkpoint_extra
    from lightning_megatron.optimizer.scheduler import missing_state_problem
    from lightning_megatron.sharded_state import optimizer_class_name, optimizer_class_problem

    extra = checkpoint_extra(Path(path))
    if extra is None:
        return []
    problems: list[str] = []
    saved = (extra.get("megatron_optimizers") or [None])[0]
    if optimizer_class is not None:
        try:
            cls: type | None = torch_class(optimizer_class, torch.optim, torch.optim.Optimizer, "optimizer",
                                           "optimizer", "torch.optim.SGD")
        except ValueError:
            cls = None  # the CLI's parser names a class that is not there
    elif isinstance(model_class, type) and issubclass(model_class, MegatronLightningModule):
        cls = model_class.default_optimizer_class(model_hparams)
    else:
        cls = None
    if cls is not None and (problem := optimizer_class_problem(saved, optimizer_class_name(cls), path)):
        problems.append(f"checkpoint {path!r}: {problem}")
    step = int(extra.get("global_step") or 0)
    if max_steps is not None and 0 <= max_steps <= step:
        problems.append(f"fit --ckpt_path {path!r} resumes at step {step}, and trainer.max_steps={max_steps} ends the "
                        f"run there: nothing would be trained; raise --trainer.max_steps above {step}")
    state = extra.get(data_class.__qualname__) if data_class is not None else None
    consumed, batch = (state or {}).get("consumed_samples"), _int((data or {}).get("global_batch_size"))
    if (data or {}).get("shuffle") == "random" and isinstance(consumed, int) and batch and consumed % batch:
        was = (extra.get("datamodule_hyper_parameters") or {}).get("global_batch_size")
        problems.append(f"data.shuffle='random' goes on from sample {consumed} of the checkpoint {path!r}, mid-epoch, "
                        f"which global_batch_size={batch} does not divide: resume with a global batch that divides "
                        f"{consumed}" + (f" (the run's was {was})" if was else "")
                        + ", or with data.shuffle='sequential'")
    if scheduler_args and "OptimizerParamSchedulerCallback" not in (extra.get("callbacks") or {}):
        skipped = int(saved.get("num_skipped_steps", 0)) if isinstance(saved, dict) else 0
        problems += [p for p in [missing_state_problem(step, step - skipped,
                                                       bool(scheduler_args.get("override_opt_param_scheduler")))] if p]
    return problems
