"""The CLI's rewrites of a parsed LightningCLI config before its classes are built.

Called in order by ``lightning_megatron.cli``'s ``before_instantiate_classes``: the named Megatron
callback sections into ``trainer.callbacks``, the progress bar and model summary, ``--model.init_from``'s
architecture, one run folder for logs and checkpoints, ``--ckpt_path last`` (an interrupted save
recovered), the W&B mode and the W&B run a checkpoint continues. No Lightning import at module level.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["prepare_config"]


def prepare_config(config: Any, argv: list[str], model_class: type | None = None) -> None:
    """Every rewrite, in the order they depend on each other (``argv``: the command line's own flags;
    ``model_class``: the module class when the config does not name one by ``class_path``)."""
    _named_callbacks_into_trainer(config)
    _display_callbacks(config)
    _architecture_of_init_from(config, argv, model_class)
    _one_run_folder(config)
    _recover_last(config)
    _wandb_mode(config)
    _continue_wandb_run(config)


def _wandb_mode(config) -> None:
    """A WandbLogger runs online when W&B has credentials (``WANDB_API_KEY``, or the ``~/.netrc`` entry
    ``wandb login`` writes: :func:`~lightning_megatron.loggers.wandb_credentials`); without any it would
    ask for a key or hang without network, so the run is offline (``WANDB_MODE=offline``, inherited by
    the ranks launched next) and a warning says so. An explicit ``WANDB_MODE`` or ``offline: true`` wins."""
    from lightning.pytorch.loggers import WandbLogger
    from lightning.pytorch.utilities import rank_zero_warn

    from lightning_megatron.loggers import wandb_credentials

    trainer = config.get("trainer") if hasattr(config, "get") else None
    loggers = [lg for lg in _entries(trainer.get("logger") if trainer else None)
               if _is_subclass(lg.class_path, WandbLogger)]
    if not loggers:
        return
    os.environ.setdefault("WANDB_SILENT", "true")
    if "WANDB_MODE" in os.environ or all(lg.init_args.get("offline") for lg in loggers):
        return
    if wandb_credentials() is None:
        os.environ["WANDB_MODE"] = "offline"
        folder = loggers[0].init_args.get("save_dir") or "."
        rank_zero_warn(f"W&B: no credentials (no WANDB_API_KEY, no `wandb login` entry in ~/.netrc): this run logs "
                       f"offline to {os.path.join(folder, 'wandb')}; upload it later with `wandb sync "
                       f"{os.path.join(folder, 'wandb', 'offline-run-*')}`, or set WANDB_MODE=offline to say so "
                       f"and silence this", category=UserWarning)


def _named_callbacks_into_trainer(config) -> None:
    """The ``megatron_optimizer`` / ``lr_schedule`` sections (class_path + init_args once parsed) join
    ``trainer.callbacks``, where Lightning instantiates them with the others."""
    trainer = config.get("trainer") if hasattr(config, "get") else None
    if trainer is None:
        return
    for key in ("megatron_optimizer", "lr_schedule"):
        spec = config.get(key)
        if spec:
            if key == "megatron_optimizer":  # the section is the callback's OptimizerConfig
                from jsonargparse import Namespace

                spec = Namespace(class_path="lightning_megatron.callbacks.MegatronOptimizerCallback",
                                 init_args=Namespace(config=spec))
            callbacks = trainer.get("callbacks") or []
            trainer.callbacks = [*(callbacks if isinstance(callbacks, list) else [callbacks]), spec]
            config[key] = None


def _display_callbacks(config) -> None:
    """With the progress bar (the model summary) on and none configured, Lightning's bar counting
    optimizer steps (:class:`~lightning_megatron.callbacks.MegatronProgressBar`) and the summary of the
    whole model (:class:`~lightning_megatron.callbacks.MegatronModelSummary`, in place of Lightning's:
    ``enable_model_summary`` becomes false) join ``trainer.callbacks``."""
    from jsonargparse import Namespace
    from lightning.pytorch.callbacks import ModelSummary, ProgressBar

    trainer = config.get("trainer") if hasattr(config, "get") else None
    if trainer is None:
        return
    for switch, base, name in (("enable_progress_bar", ProgressBar, "MegatronProgressBar"),
                               ("enable_model_summary", ModelSummary, "MegatronModelSummary")):
        callbacks = trainer.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if trainer.get(switch) is False or any(_is_subclass(c.class_path, base) for c in _entries(callbacks)):
            continue
        entry = Namespace(class_path=f"lightning_megatron.callbacks.{name}", init_args=Namespace())
        trainer.callbacks = [*callbacks, entry]
        if switch == "enable_model_summary":
            trainer[switch] = False  # Lightning's default summary is replaced (else it says so on every run)


def _entries(value: Any) -> list[Any]:
    """The class_path/init_args entries of a parsed ``trainer.logger`` or ``trainer.callbacks`` value."""
    items = value if isinstance(value, list) else [value]
    return [v for v in items if hasattr(v, "get") and v.get("class_path") and v.get("init_args") is not None]


def _class(class_path: str) -> type | None:
    import importlib

    module, _, name = class_path.rpartition(".")
    try:  # already imported by the parser
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) else None


def _is_subclass(class_path: str, base: type) -> bool:
    cls = _class(class_path)
    return cls is not None and issubclass(cls, base)


def _one_run_folder(config) -> None:
    """One run folder, ``trainer.default_root_dir``: a logger without a ``save_dir`` (a WandbLogger at
    its default ``"."``) and a ModelCheckpoint without a ``dirpath`` (-> ``<root>/checkpoints``) follow
    it, and a WandbLogger without a ``name`` is named after it; explicit values are kept."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import WandbLogger

    trainer = config.get("trainer") if hasattr(config, "get") else None
    if not trainer:
        return
    root = os.fspath(trainer.get("default_root_dir") or os.getcwd())
    for logger in _entries(trainer.get("logger")):
        args = logger.init_args
        if "save_dir" not in args:
            continue
        if args.save_dir is None or (_is_subclass(logger.class_path, WandbLogger) and args.save_dir == "."
                                     and not args.get("dir")):
            args.save_dir = root
    for logger in _entries(trainer.get("logger")):
        if _is_subclass(logger.class_path, WandbLogger) and not logger.init_args.get("name"):
            logger.init_args.name = os.path.basename(os.path.normpath(root))
    for callback in _entries(trainer.get("callbacks")):
        if _is_subclass(callback.class_path, ModelCheckpoint) and callback.init_args.get("dirpath") is None:
            callback.init_args.dirpath = os.path.join(root, "checkpoints")


def _architecture_of_init_from(config, argv: list[str], model_class: type | None) -> None:
    """``--model.init_from SOURCE``: the architecture arguments come from the source (the module class's
    ``read_architecture``: BERT reads a config.json, saved hyper-parameters or Megatron-LM args) and
    replace the recipe's; a flag given on the command line that disagrees with the source is refused,
    listing every such flag."""
    import warnings

    from lightning_megatron.module import MegatronLightningModule

    model = config.get("model") if hasattr(config, "get") else None
    if model is None or not hasattr(model, "get"):
        return
    if model.get("class_path"):  # named by class path: its arguments are the init_args
        model_class, model = _class(model.class_path), model.get("init_args")
    source = model.get("init_from") if model is not None and hasattr(model, "get") else None
    if not source or config.get("ckpt_path"):  # a resumed run restores its own weights
        return
    if not (isinstance(model_class, type) and issubclass(model_class, MegatronLightningModule)):
        return  # a module of its own: init_from is its business
    from lightning_megatron.checkpoint import CheckpointError

    try:
        architecture = model_class.read_architecture(source)
    except (CheckpointError, OSError, ValueError) as error:
        raise SystemExit(f"lightning-megatron: --model.init_from {source}: {error}") from None
    # An architecture dict is flat (num_layers, ...); the module's argument may live in its config record.
    moved = model_class.moved_arguments()
    where = {k: moved.get(k, k) for k in architecture if moved.get(k, k).split(".")[0] in model}
    for record in {w.split(".")[0] for w in where.values() if "." in w}:
        if model.get(record) is None:
            from jsonargparse import Namespace

            model[record] = Namespace()  # the record's defaults, then the source's fields
    flags = {a.split("=", 1)[0].removeprefix("--model.").removeprefix("init_args.") for a in argv
             if a.startswith("--model.")}
    current = {k: model.get(w) for k, w in where.items() if w in model}
    architecture_conflicts = model_class.architecture_conflicts
    wrong = architecture_conflicts({k: v for k, v in current.items() if where[k] in flags}, architecture)
    if wrong:
        listed = ", ".join(f"--model.{where[k]} {h} (the source has {w})" for k, h, w in wrong)
        raise SystemExit(f"lightning-megatron: --model.init_from {source} fixes the architecture, and these flags "
                         f"disagree with it: {listed}. Drop them.")
    replaced = architecture_conflicts(current, architecture)
    for key, value in architecture.items():
        if key in where and where[key] not in flags and not (key == "vocab_size" and value is None):
            model[where[key]] = value
    if replaced:
        warnings.warn("--model.init_from: the architecture of " + str(source) + " replaces the recipe's " + ", ".join(
            f"{where[k]}={h!r} (now {w!r})" for k, h, w in replaced), UserWarning, stacklevel=1)


def _recover_last(config) -> None:
    """``--ckpt_path last`` without ``last.ckpt`` but with the complete save a crash left as
    ``last.ckpt.tmp-<id>``: that one (its checksums verified); an unusable one is an error, never a
    silent start from step 0 (:func:`lightning_megatron.checkpoint.recover_last`)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_megatron.checkpoint import CheckpointError, recover_last

    trainer = config.get("trainer") if hasattr(config, "get") else None
    if not trainer or config.get("ckpt_path") != "last":
        return
    for callback in _entries(trainer.get("callbacks")):
        if _is_subclass(callback.class_path, ModelCheckpoint) and callback.init_args.get("dirpath"):
            try:
                found = recover_last(callback.init_args.dirpath)
            except CheckpointError as e:
                raise SystemExit(f"lightning-megatron: {e}") from None
            if found is not None:
                config.ckpt_path = str(found)
                return


def _last_checkpoint(trainer) -> str | None:
    """What Lightning's ``ckpt_path="last"`` resolves to: the newest ``last.ckpt`` / ``last-N.ckpt`` in
    the ``dirpath`` of the configured ModelCheckpoints (filled in by :func:`_one_run_folder`)."""
    import re

    from lightning.pytorch.callbacks import ModelCheckpoint

    found = []
    for callback in _entries(trainer.get("callbacks")):
        folder = callback.init_args.get("dirpath") if _is_subclass(callback.class_path, ModelCheckpoint) else None
        if folder and os.path.isdir(folder):
            found += [os.path.join(folder, n) for n in os.listdir(folder) if re.match(r"^last(-\d+)?\.ckpt$", n)]
    return max(found, key=os.path.getmtime) if found else None


def _continue_wandb_run(config) -> None:
    """``validate``/``test``/``predict`` or ``fit --ckpt_path CKPT`` (``last`` too): a WandbLogger without
    an ``id`` continues the W&B run that wrote CKPT (Lightning's WandbLogger passes ``resume="allow"``)."""
    from lightning.pytorch.loggers import WandbLogger

    from lightning_megatron.loggers import saved_wandb_run_id

    trainer = config.get("trainer") if hasattr(config, "get") else None
    ckpt_path = config.get("ckpt_path") if trainer else None
    if ckpt_path == "last":
        ckpt_path = _last_checkpoint(trainer)
    run_id = saved_wandb_run_id(ckpt_path) if trainer else None
    if run_id is None:
        return
    for logger in _entries(trainer.get("logger")):
        args = logger.init_args
        if _is_subclass(logger.class_path, WandbLogger) and not args.get("id") and not args.get("version"):
            args.id = run_id
