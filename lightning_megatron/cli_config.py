"""The CLI's rewrites of a parsed LightningCLI config before its classes are built.

Called in order by ``lightning_megatron.cli``'s ``before_instantiate_classes``: the named Megatron
callback sections into ``trainer.callbacks``, the progress bar and model summary, ``--model.init_from``'s
architecture, one run folder for logs and checkpoints, one run's checkpoints per checkpoint folder
(``--ckpt_path last`` resolved to this run's newest state, an interrupted save recovered; a new ``fit``
refused where checkpoints are), where ``validate``/``test``/``predict`` log (beside the training run, not
in it), the W&B mode and the W&B run a checkpoint continues. No Lightning import at module level.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_megatron.unused_settings import say_unused_settings

__all__ = ["prepare_config"]


EVALUATION_COMMANDS = ("validate", "test", "predict")
"""The subcommands that evaluate a checkpoint: they log beside the training run (:func:`_evaluation_logs`)."""


def prepare_config(config: Any, argv: list[str], model_class: type | None = None,
                   subcommand: str | None = "fit") -> list[tuple[Any, str, Any]]:
    """Every rewrite, in the order they depend on each other (``argv``: the command line's own flags;
    ``model_class``: the module class when the config does not name one by ``class_path``;
    ``subcommand``: fit, validate, test or predict; None: only building, no command to run). Returns what it
    rewrote that the configuration the run saves holds as given, ``(section, key, value as given)``: the values derived
    from the run folder (:func:`_one_run_folder`), so that it runs again elsewhere (``--trainer.default_root_dir``),
    and the callbacks' sections and list, so that ``--lr_schedule.max_lr ...`` applies to it as to a recipe."""
    say_unused_settings(config, argv)
    trainer = config.get("trainer") if hasattr(config, "get") else None
    # the callbacks' sections and the display callbacks are saved as given: a run of the saved file (with
    # --lr_schedule.max_lr ...) derives them again, once
    given = [(config, key, config.get(key)) for key in ("megatron_optimizer", "lr_schedule")] + (
        [(trainer, key, trainer.get(key)) for key in ("callbacks", "enable_model_summary")] if trainer else [])
    _named_callbacks_into_trainer(config)
    _display_callbacks(config)
    _no_checkpointing(config)
    _our_wandb_logger(config)
    derived = [*given, *_one_run_folder(config)]
    _one_run_per_checkpoint_folder(config, fitting=subcommand == "fit")  # resolves --ckpt_path last
    _architecture_of_init_from(config, argv, model_class)  # (a resumed run's own training settings: its checkpoint's)
    _evaluation_logs(config, subcommand or "fit")
    _wandb_mode(config)
    _continue_wandb_run(config, subcommand or "fit")
    return derived


def _our_wandb_logger(config) -> None:
    """Lightning's ``WandbLogger`` named in a recipe becomes :class:`lightning_megatron.loggers.WandbLogger`
    (its subclass, same arguments: the history indexed by the trainer's step, an offline resume recorded,
    no deprecated ``anonymous`` setting), as the progress bar and the model summary are replaced by ours. A
    subclass of your own is kept."""
    trainer = config.get("trainer") if hasattr(config, "get") else None
    for logger in _entries(trainer.get("logger") if trainer else None):
        if logger.class_path in ("lightning.pytorch.loggers.WandbLogger", "lightning.pytorch.loggers.wandb.WandbLogger",
                                 "pytorch_lightning.loggers.WandbLogger"):
            logger.class_path = "lightning_megatron.loggers.WandbLogger"


def _evaluation_logs(config, subcommand: str) -> None:
    """``validate``/``test``/``predict`` of a checkpoint log beside the training run, not into it: a CSV
    (or TensorBoard) logger writes ``<name>/<subcommand>/version_N`` (``csv/validate/version_0``), not
    one more ``csv/version_N`` among the training run's (``plot`` joins those by step); W&B is handled
    by :func:`_continue_wandb_run`; ``predict`` logs no metrics (Lightning does not let ``predict_step``
    log), so it gets no W&B run. ``--log_to_training_run true`` (validate/test) puts the evaluation into
    the training run's W&B history instead, at the checkpoint's step."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

    joined = bool(config.get("log_to_training_run")) if hasattr(config, "get") else False
    if joined and subcommand not in ("validate", "test"):
        why = ("fit continues the W&B run of its checkpoint already" if subcommand == "fit" else
               "predict logs no metrics")
        raise SystemExit(f"lightning-megatron: --log_to_training_run is for validate and test: {why}")
    trainer = config.get("trainer") if hasattr(config, "get") else None
    if subcommand not in EVALUATION_COMMANDS or not trainer:
        return
    for logger in _entries(trainer.get("logger")):
        if _is_subclass(logger.class_path, (CSVLogger, TensorBoardLogger)):
            name = logger.init_args.get("name")
            logger.init_args.name = f"{name or 'lightning_logs'}/{subcommand}"
    if subcommand == "predict":
        value = trainer.get("logger")
        items = value if isinstance(value, list) else [value]
        kept = [lg for lg in items if not (_entries(lg) and _is_subclass(lg.class_path, WandbLogger))]
        if len(kept) < len(items):
            trainer.logger = kept if isinstance(value, list) else False


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
            kind = "MegatronOptimizerCallback" if key == "megatron_optimizer" else "OptimizerParamSchedulerCallback"
            there = [c for c in _entries(trainer.get("callbacks")) if str(c.class_path).rsplit(".", 1)[-1] == kind]
            if there:  # Lightning (or every rank) failed on the two; a config.yaml saved before 2026-12-07 holds this
                raise SystemExit(f"lightning-megatron: the {key} section and trainer.callbacks both give the {kind}, "
                                 f"which a run takes once: keep one (a run's config.yaml saved before 2026-12-07 holds "
                                 f"it in trainer.callbacks: change its values there, or move them into the {key} "
                                 f"section and remove the entry)")
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


def _no_checkpointing(config) -> None:
    """``--trainer.enable_checkpointing false`` over a recipe's ModelCheckpoint (Lightning's traceback): left out."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities import rank_zero_info

    trainer = config.get("trainer") if hasattr(config, "get") else None
    if trainer is None or trainer.get("enable_checkpointing") is not False:
        return
    callbacks = trainer.get("callbacks") if isinstance(trainer.get("callbacks"), list) else [trainer.get("callbacks")]
    if dropped := [c for c in _entries(callbacks) if _is_subclass(c.class_path, ModelCheckpoint)]:
        trainer.callbacks = [c for c in callbacks if not any(c is d for d in dropped)]
        rank_zero_info("enable_checkpointing=False: the configured ModelCheckpoint left out; no checkpoint is saved")


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


def _is_subclass(class_path: str, base: type | tuple[type, ...]) -> bool:
    cls = _class(class_path)
    return cls is not None and issubclass(cls, base)


def _one_run_folder(config) -> list[tuple[Any, str, Any]]:
    """One run folder, ``trainer.default_root_dir``: a logger without a ``save_dir`` (a WandbLogger at
    its default ``"."``) and a ModelCheckpoint without a ``dirpath`` (-> ``<root>/checkpoints``) follow
    it, and a WandbLogger without a ``name`` is named after it; explicit values are kept. Returns what it set,
    ``(init_args, key, the value given)``."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import WandbLogger

    trainer = config.get("trainer") if hasattr(config, "get") else None
    if not trainer:
        return []
    derived: list[tuple[Any, str, Any]] = []

    def derive(args: Any, key: str, value: Any) -> None:
        derived.append((args, key, args.get(key)))
        args[key] = value

    root = os.fspath(trainer.get("default_root_dir") or os.getcwd())
    for logger in _entries(trainer.get("logger")):
        args = logger.init_args
        if "save_dir" not in args:
            continue
        if args.save_dir is None or (_is_subclass(logger.class_path, WandbLogger) and args.save_dir == "."
                                     and not args.get("dir")):
            derive(args, "save_dir", root)
    for logger in _entries(trainer.get("logger")):
        if _is_subclass(logger.class_path, WandbLogger) and not logger.init_args.get("name"):
            derive(logger.init_args, "name", os.path.basename(os.path.normpath(root)))
    for callback in _entries(trainer.get("callbacks")):
        if _is_subclass(callback.class_path, ModelCheckpoint) and callback.init_args.get("dirpath") is None:
            derive(callback.init_args, "dirpath", os.path.join(root, "checkpoints"))
    return derived


def _architecture_of_init_from(config, argv: list[str], model_class: type | None) -> None:
    """``--model.init_from SOURCE``: the architecture arguments come from the source (the module class's
    ``read_architecture``: BERT reads a config.json, saved hyper-parameters or Megatron-LM args) and
    replace the recipe's; a flag given on the command line that disagrees with the source is refused,
    listing every such flag."""
    from lightning_megatron.module import MegatronLightningModule

    model = config.get("model") if hasattr(config, "get") else None
    if model is None or not hasattr(model, "get"):
        return
    if model.get("class_path"):  # named by class path: its arguments are the init_args
        model_class, model = _class(model.class_path), model.get("init_args")
    source = model.get("init_from") if model is not None and hasattr(model, "get") else None
    if not source:
        return
    if not (isinstance(model_class, type) and issubclass(model_class, MegatronLightningModule)):
        return  # a module of its own: init_from is its business
    from lightning_megatron.checkpoint import CheckpointError

    # A command with a checkpoint (a resume, an evaluation) builds the model the run was built as, init_from's
    # architecture included; the checkpoint's weights replace init_from's.
    try:
        architecture = model_class.read_architecture(source)
    except (CheckpointError, OSError, ValueError, ImportError) as error:  # ImportError: the hf extra not installed
        if config.get("ckpt_path") and not model.get("lora"):
            return  # the source gone since: the checkpoint holds every weight (its fit is checked before launch)
        raise SystemExit(f"lightning-megatron: --model.init_from {source}: {error}") from None
    # The training settings the source suggests (its dropouts): a resumed run's are its checkpoint's, as it trained
    architecture.update(_saved_settings(config.get("ckpt_path"), model_class, architecture))
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
    written = _written_model_arguments(argv)
    replaced = architecture_conflicts(current, architecture)
    # an argument free in both (a rope model's length: no conflict) is replaced by the source's unless flagged: said
    replaced += [(k, current[k], architecture[k]) for k in model_class.free_arguments(architecture)
                 if k in current and where[k] not in flags and architecture.get(k) not in (None, current[k])
                 and k not in {r[0] for r in replaced}]
    # the training settings the source suggests (a decoder folder's dropouts): replaced, said when the recipe wrote them
    replaced += [(k, current[k], v) for k, v in architecture.items() if k not in model_class.architecture_keys
                 and k in current and where[k] not in flags and v is not None and v != current[k]]
    for key, value in architecture.items():
        if key in where and where[key] not in flags and not (key == "vocab_size" and value is None):
            model[where[key]] = value
    replaced = [r for r in replaced if where[r[0]] in written]  # a default the recipe never wrote is no news
    if replaced:  # said once: every rank parses the command line
        import warnings

        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        if getattr(rank_zero_only, "rank", 0) == 0:
            warnings.warn("--model.init_from: the architecture of " + str(source) + " replaces the recipe's "
                          + ", ".join(f"{where[k]}={h!r} (now {w!r})" for k, h, w in replaced), UserWarning,
                          stacklevel=1)


def _saved_settings(ckpt_path: Any, model_class: type, architecture: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's values of the settings ``architecture`` suggests without fixing them (a source's dropouts):
    a run resumed with ``init_from`` keeps what it trained with (a source read otherwise now, or the defaults of an
    earlier version, would change them mid-run). Its ``extra.pt`` only (weights-only; the load verifies it all)."""
    from lightning_megatron import checkpoint as ckpt
    from lightning_megatron.saved_model import flat_hparams

    suggested = [k for k in architecture if k not in model_class.architecture_keys]
    if not suggested or not isinstance(ckpt_path, (str, os.PathLike)) or not os.path.isdir(ckpt_path):
        return {}
    try:
        extra = ckpt.load_plain(Path(ckpt_path) / "extra.pt", Path(ckpt_path))
        saved = flat_hparams(model_class.upgrade_hparams(dict(extra.get("hyper_parameters") or {})))
    except Exception:  # noqa: BLE001 - not readable here: the load says why, after the checks
        return {}
    return {k: saved[k] for k in suggested if saved.get(k) is not None}


def _written_model_arguments(argv: list[str]) -> set[str]:
    """The model arguments the ``--config`` recipes (with their bases) write, dotted (``config.num_layers``, ``lr``)."""
    from lightning_megatron.recipes import config_recipes

    written: set[str] = set()
    for recipe in config_recipes(argv):
        model = recipe.get("model")
        args = (model.get("init_args") if "class_path" in model else model) if isinstance(model, dict) else None
        for key, value in (args or {}).items():
            written |= {f"{key}.{k}" for k in value} if isinstance(value, dict) else {key}
    return written


def _checkpoint_folders(trainer) -> list[str]:
    """The ``dirpath`` of every configured ModelCheckpoint (filled in by :func:`_one_run_folder`)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    folders = [os.path.abspath(os.fspath(c.init_args.dirpath)) for c in _entries(trainer.get("callbacks"))
               if _is_subclass(c.class_path, ModelCheckpoint) and c.init_args.get("dirpath")]
    return list(dict.fromkeys(folders))


def _saved_entries(folder: str) -> list[str]:
    """The checkpoints in ``folder`` (``*.ckpt``) and the temporaries of interrupted saves (``*.ckpt.tmp-*``)."""
    from lightning_megatron.checkpoint import TMP_INFIX

    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if n.endswith(".ckpt") or f".ckpt{TMP_INFIX}" in n)


def _describe(path: str) -> str:
    """``last.ckpt (run 1a2b3c4d, step 700)`` for messages."""
    from lightning_megatron.checkpoint import checkpoint_identity

    run_id, step = checkpoint_identity(path)
    facts = [f"run {run_id}" if run_id else "run unknown", *([f"step {step}"] if step is not None else [])]
    return f"{os.path.basename(path)} ({', '.join(facts)})"


def _listing(folder: str, names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(_describe(os.path.join(folder, n)) for n in names[:shown]) + more


def _one_run_per_checkpoint_folder(config, fitting: bool) -> None:
    """A checkpoint folder (a ModelCheckpoint's ``dirpath``) holds the checkpoints of one run, and
    ``last`` is the newest state of that run:

    - ``--ckpt_path last``: the newest ``last*.ckpt`` of the folder (by the time its marker was written)
      when all of them belong to one run (:func:`~lightning_megatron.checkpoint.checkpoint_identity`);
      the last checkpoints of several runs there are refused, each named with its run and step (never
      Lightning's "newest file of any run"), or that run's later complete checkpoint written after it (its
      ``last`` save interrupted: :func:`~lightning_megatron.checkpoint.newer_than_last`). None at all: an
      interrupted save ``last.ckpt.tmp-<id>``
      that verifies (:func:`~lightning_megatron.checkpoint.recover_last`), else, for ``fit``, a new run
      (below), for the others Lightning's message;
    - ``fit`` starting a new run (no ``--ckpt_path``) where checkpoints are: refused, naming the folder
      and the two ways on (resume with ``--ckpt_path last``, or a new ``--trainer.default_root_dir``);
    - ``fit --ckpt_path PATH`` of a checkpoint outside the folder, where another run's checkpoints are:
      refused likewise (the folder would hold two runs). A PATH inside the folder continues its run
      there (a folder mixed before this rule: with a warning; its saves never replace the other run's,
      see :func:`lightning_megatron.checkpoint.other_run_problem`).

    Refusals exit before any process is launched. A ``fast_dev_run`` (which saves nothing) is not refused."""
    import warnings

    from lightning.pytorch.utilities import rank_zero_warn

    from lightning_megatron.checkpoint import CheckpointError, checkpoint_identity, newer_than_last, recover_last

    trainer = config.get("trainer") if hasattr(config, "get") else None
    if not trainer:
        return
    folders = _checkpoint_folders(trainer)
    ckpt_path = config.get("ckpt_path")
    root = os.fspath(trainer.get("default_root_dir") or os.getcwd())

    def new_folder(folder: str) -> str:
        if folder == os.path.join(os.path.abspath(root), "checkpoints"):
            return f"--trainer.default_root_dir {os.path.normpath(root)}-2 (any new folder)"
        return f"another ModelCheckpoint dirpath than {folder}"

    if ckpt_path == "last":
        lasts = [os.path.join(f, n) for f in folders for n in _saved_entries(f)
                 if n.startswith("last") and n.endswith(".ckpt")]
        runs = {checkpoint_identity(p)[0] for p in lasts}
        if len(runs) > 1:
            folder = os.path.dirname(lasts[0])
            raise SystemExit(
                f"lightning-megatron: --ckpt_path last is ambiguous: {folder} holds the last checkpoints of "
                f"{len(runs)} runs: {', '.join(_describe(p) for p in sorted(lasts))}. 'last' is the newest state of "
                f"one run: pass the one to continue (--ckpt_path {sorted(lasts)[-1]}), and keep one run's "
                f"checkpoints per folder (a new run: {new_folder(folder)})")
        found = None
        if lasts:
            def written(path: str) -> float:
                marker = os.path.join(path, "lightning_megatron.json")
                return os.path.getmtime(marker if os.path.isfile(marker) else path)

            found = max(lasts, key=written)
            with warnings.catch_warnings(record=True) as said:  # said once, by rank 0 (every rank resolves it)
                warnings.simplefilter("always")
                found = str(newer_than_last(found) or found)  # a save interval behind a later complete checkpoint
            for warning in said:
                rank_zero_warn(str(warning.message), category=warning.category)
        for folder in folders if found is None else []:
            try:
                with warnings.catch_warnings(record=True) as said:  # said once, by rank 0 (every rank resolves it)
                    warnings.simplefilter("always")
                    found = recover_last(folder)
            except CheckpointError as e:
                raise SystemExit(f"lightning-megatron: {e}") from None
            for warning in said:
                rank_zero_warn(str(warning.message), category=warning.category)
            if found is not None:
                break
        if found is not None:
            ckpt_path = config.ckpt_path = str(found)
        elif not fitting:
            return  # Lightning says that there is no last checkpoint
        else:  # fit: a new run, where the rule below applies (a job script that always passes `last` starts so);
            # said here: Lightning's hint to set ModelCheckpoint(save_last=True) misleads, the recipes set it
            ckpt_path = config.ckpt_path = None
            print(f"lightning-megatron: --ckpt_path last: no last checkpoint in {', '.join(folders) or root} yet: "
                  f"a new run from step 0", flush=True)
    if not fitting or (ckpt_path is None and trainer.get("fast_dev_run")):
        return  # a fast_dev_run saves nothing
    if isinstance(ckpt_path, str) and (ckpt_path in ("best", "hpc") or ckpt_path.startswith("registry")):
        return  # Lightning's other names: checkpoints of the configured callbacks themselves
    resumed = None if ckpt_path is None else os.path.abspath(os.fspath(ckpt_path))
    run = None if resumed is None else checkpoint_identity(resumed)[0]
    for folder in folders:
        saved = _saved_entries(folder)
        if resumed is None:
            others = saved
        else:  # checkpoints known to be another run's (an unknown one may be this run's own)
            others = [n for n in saved if checkpoint_identity(os.path.join(folder, n))[0] not in (None, run)]
        if not others:
            continue
        if resumed is None:
            from lightning_megatron.run_lock import holder

            live = holder(root)
            resume = ("Resume that run with --ckpt_path last" if live is None else
                      f"That run is training now ({live}): once it ends, --ckpt_path last resumes it")
            raise SystemExit(
                f"lightning-megatron: {folder} already holds checkpoints ({_listing(folder, saved)}): a new run there "
                f"would mix its checkpoints with theirs. {resume}, or start the new run in a new folder: "
                f"{new_folder(folder)}")
        if os.path.dirname(resumed) != folder:
            raise SystemExit(
                f"lightning-megatron: {folder} holds checkpoints of another run than {resumed} (run {run}): "
                f"{_listing(folder, others)}; continuing that run there would mix two runs' checkpoints. "
                f"Continue it in its own folder or a new one: {new_folder(folder)}")
        warnings.warn(f"{folder} holds checkpoints of other runs besides {os.path.basename(resumed)} (run {run}): "
                      f"{_listing(folder, others)}. This run saves beside them and never replaces them, but "
                      f"--ckpt_path last is ambiguous there: move one run's checkpoints to a folder of their own",
                      UserWarning, stacklevel=1)


def _later_checkpoint(saved: Any, folders: list[str]) -> tuple[str, int] | None:
    """The checkpoint of the same run at the furthest step beyond ``saved``'s (a
    :class:`~lightning_megatron.loggers.SavedWandbRun`) in ``folders``, as (name, step); None when there is none."""
    from lightning_megatron.checkpoint import checkpoint_identity

    if saved.global_step is None:
        return None
    found = None
    for folder in folders:
        for name in _saved_entries(folder):
            run, step = checkpoint_identity(os.path.join(folder, name))
            if run == saved.run_id and step is not None and step > (found[1] if found else saved.global_step):
                found = (name, step)
    return found


def _continue_wandb_run(config, subcommand: str) -> None:
    """The W&B run of a checkpoint (``--ckpt_path CKPT``; ``last`` resolved by
    :func:`_one_run_per_checkpoint_folder`), for a WandbLogger without an ``id``:

    - ``fit`` continues it: the same id, ``resume="must"`` offline (recorded as a resume, see
      :class:`~lightning_megatron.loggers.WandbLogger`), else Lightning's ``resume="allow"``;
    - ``validate``/``test`` start a run of their own in its group (``group`` = its id, ``job_type`` = the
      subcommand), or with ``--log_to_training_run true`` join it at the checkpoint's global step."""
    from lightning.pytorch.loggers import WandbLogger

    from lightning_megatron.loggers import saved_wandb_run

    trainer = config.get("trainer") if hasattr(config, "get") else None
    if not trainer:
        return
    ckpt_path = config.get("ckpt_path")
    saved = saved_wandb_run(ckpt_path)
    joined = bool(config.get("log_to_training_run"))
    offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun")
    for logger in _entries(trainer.get("logger")):
        args = logger.init_args
        if not _is_subclass(logger.class_path, WandbLogger) or args.get("id") or args.get("version"):
            continue
        if subcommand == "fit" or joined:
            if saved is None:
                if joined:
                    raise SystemExit(f"lightning-megatron: --log_to_training_run: the checkpoint {ckpt_path!r} "
                                     f"names no W&B run (it was written without a WandbLogger)")
                continue
            # the run's later checkpoints: in this run's folders and, for a checkpoint of another folder, in its own
            folders = [*_checkpoint_folders(trainer), os.path.dirname(os.path.abspath(os.fspath(ckpt_path)))]
            later = _later_checkpoint(saved, list(dict.fromkeys(folders))) if subcommand == "fit" else None
            if later is not None:  # a fit from an earlier checkpoint of the run: W&B would drop its rows to that step
                args.group = saved.run_id
                print(f"lightning-megatron: {ckpt_path} is step {saved.global_step} of W&B run {saved.run_id}, which "
                      f"went on to step {later[1]} ({later[0]}): W&B keeps a run's steps in order and drops the rows "
                      f"below the last it holds, so this fit logs to a new W&B run in group {saved.run_id}", flush=True)
                continue
            args.id = saved.run_id
            if offline or args.get("offline"):
                args.resume = "must"
            if joined:
                from lightning_megatron.loggers import WandbLogger as OurWandbLogger

                if not _is_subclass(logger.class_path, OurWandbLogger):
                    raise SystemExit(f"lightning-megatron: --log_to_training_run logs at the checkpoint's step "
                                     f"through lightning_megatron.loggers.WandbLogger; {logger.class_path} is not one")
                args.history_step = saved.global_step
        else:
            args.job_type = subcommand
            if saved is not None:
                args.group = saved.run_id
