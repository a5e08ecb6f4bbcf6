"""The LightningCLI of ``lightning-megatron fit|validate|test|predict`` and ``finetune ...``.

:func:`lightning_cli` builds (and runs) it over BertLightningModule and BertDataModule, or over any
LightningModule and LightningDataModule named by class path (LightningCLI's subclass mode): the recipes'
``base:`` merged first, the other local ranks started early (:mod:`lightning_megatron.launch`), the Megatron
callbacks as named argument groups (``--megatron_optimizer.clip_grad``, ``--lr_schedule.max_lr``),
``--optimizer`` / ``--lr_scheduler`` handed to the model, the parsed config rewritten
(:mod:`lightning_megatron.cli_config`) and validated (:mod:`lightning_megatron.config_checks`) before any
process launches, and arguments written where they no longer belong refused, naming the new spelling.
:func:`finetune_cli` picks the classifier or the decoder; :func:`leave_in_order` ends a run's process.
No Lightning import at module level (``lightning-megatron --help`` needs no torch).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from lightning_megatron import launch
from lightning_megatron.recipes import config_recipes

__all__ = ["lightning_cli", "finetune_cli", "leave_in_order", "resolve_recipes"]


def lightning_cli(args: list[str] | None, model_class: type | None = None, datamodule_class: type | None = None,
                   *, link_num_classes: bool = False, command: str = "lightning-megatron", **kwargs) -> Any:
    """The LightningCLI over BertLightningModule and BertDataModule, the given classes, or any class the
    command line or its recipe names by ``class_path`` (subclass mode) (``run=False`` in kwargs: only
    build). ``args`` (or ``sys.argv`` when None) may name recipes with ``base:``; they are merged first
    (lightning_megatron.recipes). ``link_num_classes``: the model's ``num_classes`` is the datamodule's
    (fine-tuning). ``command``: how its errors name the command (``lightning-megatron finetune``)."""
    if args is None:  # LightningCLI reads sys.argv; Lightning starts the other ranks with it too
        sys.argv[1:] = resolve_recipes(sys.argv[1:])
    else:
        args = resolve_recipes(args)

    given = list(args if args is not None else sys.argv[1:])  # the command line's own flags
    # The other local ranks import while this one parses (lightning_megatron.launch), the classes it builds too.
    launch.prewarm(given, also=_default_classes(given, model_class, datamodule_class))
    launch.import_wandb_ahead(given)
    try:
        return _megatron_cli(args, given, model_class, datamodule_class, link_num_classes=link_num_classes,
                             command=command, **kwargs)
    finally:
        launch.release()  # local ranks started early that no launcher took (a refusal, an error, one device)


def _megatron_cli(args: list[str] | None, given: list[str], model_class: type | None, datamodule_class: type | None,
                  *, link_num_classes: bool, command: str, **kwargs) -> Any:
    """:func:`lightning_cli` once the recipes are resolved: build (and run) the LightningCLI."""
    from lightning_megatron.recipes import RecipeError, refuse_unknown_config_fields

    try:  # imports the model's class: here, once the other ranks import too (lightning_megatron.launch)
        refuse_unknown_config_fields(given, model_class)
    except RecipeError as e:
        raise SystemExit(f"lightning-megatron: {e}") from None
    from lightning.pytorch.cli import LightningCLI, LRSchedulerTypeTuple
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
    from torch.optim import Optimizer

    from lightning_megatron.strategy import MegatronStrategy  # also registers strategy="megatron"
    from lightning_megatron.callbacks import MegatronOptimizerCallback, OptimizerParamSchedulerCallback, PredictionWriter
    from lightning_megatron.loggers import WandbRunIdCallback
    from lightning_megatron.module import MegatronLightningModule, check_checkpoint_fits
    from lightning_megatron.optimizer.config import OptimizerConfig

    # A class named by class_path (command line or recipe): LightningCLI's subclass mode, and BERT is
    # never imported; otherwise the BERT module and datamodule, whose recipes give plain arguments.
    from lightning_megatron.recipes import DEFAULT_DATA_CLASS, DEFAULT_MODEL_CLASS, import_class

    launch.resume_collection()  # the command's imports are done (lightning_megatron.launch)
    named = _named_by_class_path(given)
    if model_class is None and "model" not in named:
        model_class = import_class(DEFAULT_MODEL_CLASS)
    if datamodule_class is None and "data" not in named:
        datamodule_class = import_class(DEFAULT_DATA_CLASS)
    moved = _moved_model_arguments(given, model_class)
    if moved:
        raise SystemExit(moved)
    # The section's type: the callback's own arguments, or (megatron_optimizer) the OptimizerConfig the
    # callback takes, so that the section holds its fields (clip_grad: ...) without a config: level.
    _NAMED_CALLBACKS = {"megatron_optimizer": (MegatronOptimizerCallback, OptimizerConfig),
                        "lr_schedule": (OptimizerParamSchedulerCallback, OptimizerParamSchedulerCallback)}

    # LightningCLI builds a parser for each of fit, validate, test and predict, whichever runs (the three unused
    # ones ~0.1-0.2 s of every rank's start on 2 cores): a command line that starts with its subcommand builds
    # that one only.
    every = LightningCLI.subcommands()
    running = {given[0]: every[given[0]]} if given and given[0] in every else every

    from lightning.pytorch.cli import SaveConfigCallback

    class SaveConfigAsGiven(SaveConfigCallback):
        """Lightning's ``config.yaml`` of the run, with the paths the run folder gave (``derived``:
        cli_config.prepare_config) as they were given: the file runs again elsewhere with
        ``--trainer.default_root_dir`` moving logs, W&B and checkpoints together."""

        def __init__(self, *args: Any, derived: list[tuple[Any, str, Any]] = (), **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.derived = list(derived)

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            used = [(args, key, args[key]) for args, key, _ in self.derived]
            for args, key, given in self.derived:
                args[key] = given
            try:
                super().setup(trainer, pl_module, stage)
            finally:
                for args, key, value in used:
                    args[key] = value

        def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
            """The whole configuration, as ``config.yaml`` holds it, into each W&B run's config as ``recipe``
            (``recipe.trainer.max_steps``, ...; rank 0, with the paths as given)."""
            from lightning.pytorch.loggers import WandbLogger

            wandb = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)
                     and getattr(logger, "history_step", None) is None]  # not a training run an evaluation joins
            if wandb:
                import yaml

                recipe = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
                for logger in wandb:
                    logger.log_hyperparams({"recipe": recipe})

    class MegatronCLI(LightningCLI):
        def subcommands(self) -> dict[str, set[str]]:  # LightningCLI's staticmethod, called on the instance
            return running

        def add_arguments_to_parser(self, parser) -> None:
            # Named groups, so that every argument is a command-line override (a callback inside
            # trainer.callbacks' list is not). Optional: a section in the config (its arguments, no
            # class_path) or --lr_schedule.max_lr ... adds the callback, --lr_schedule null removes it;
            # before_instantiate_classes moves them into trainer.callbacks.
            for key, (callback, section_type) in _NAMED_CALLBACKS.items():
                parser.add_argument(f"--{key}", type=Optional[section_type], default=None,
                                    help=f"{callback.__name__} (a section of its arguments; null: none)")
            # --optimizer torch.optim.SGD --optimizer.momentum 0.9 (and --lr_scheduler ...), as LightningCLI
            # has them, but handed to the model (MegatronLightningModule.use_optimizer), which builds them on
            # its parameter groups (no weight decay on biases and norms) once its chunks exist: LightningCLI's
            # automatic configure_optimizers (switched off below) would use model.parameters() before
            # configure_model. lr and weight_decay stay the model's (--model.lr; the lr_schedule group
            # drives both).
            parser.add_subclass_arguments((Optimizer,), "optimizer", instantiate=False, required=False,
                                          fail_untyped=False, skip={"params", "lr", "weight_decay"})
            parser.add_subclass_arguments(LRSchedulerTypeTuple, "lr_scheduler", instantiate=False, required=False,
                                          fail_untyped=False, skip={"optimizer"})
            if link_num_classes:  # one place for the classes: the data (labels, or 1 for regression)
                parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
            parser.add_argument("--log_to_training_run", type=bool, default=False,
                                help="validate/test: log into the W&B history of the run that wrote --ckpt_path, "
                                     "at its step (default: a W&B run of their own in its group, and the CSV in "
                                     "csv/<subcommand>/version_N)")

        def parse_arguments(self, parser, args) -> None:
            # --optimizer.lr / --optimizer.weight_decay are the schedule's or the model's (skipped in the
            # optimizer group above): jsonargparse would only say "not accepted"; name the option to use.
            from jsonargparse import Namespace

            argv = None if isinstance(args, (dict, Namespace)) else list(sys.argv[1:] if args is None else args)
            found = _optimizer_hyperparameter(argv) if argv is not None else None
            if found is None:
                self._parse(parser, args)
                return
            name, value, rest = found
            if args is None:
                sys.argv[1:] = rest
            self._parse(parser, None if args is None else rest)  # the rest, to see the lr_schedule
            config = self.config[self.config.subcommand] if self.config.get("subcommand") else self.config
            raise SystemExit(_optimizer_hyperparameter_message(name, value, bool(config.get("lr_schedule"))))

        def _parse(self, parser, args) -> None:
            # LightningCLI.parse_arguments, without its warning about `args` given while sys.argv holds
            # arguments: `finetune` passes them on purpose (sys.argv keeps the word `finetune` for the ranks
            # Lightning starts with it), and the warning printed the whole merged recipe on one line.
            from jsonargparse import ArgumentError, Namespace

            try:
                if isinstance(args, (dict, Namespace)):
                    self.config = parser.parse_object(args)
                else:
                    self.config = parser.parse_args(args)
            except ArgumentError as error:  # the error and a close match, not ~100 lines of usage first
                subcommand = list(running) if len(running) == 1 else []  # the one the command line starts with
                print(_parse_error(parser, error, " ".join([command, *subcommand])), file=sys.stderr, flush=True)
                raise SystemExit(2) from None
            _exit_on_error(parser)  # the command line parsed: later parses (a checkpoint file's hparams) as argparse's

        def instantiate_classes(self) -> None:
            super().instantiate_classes()
            strategy = self.trainer.strategy
            if not (isinstance(strategy, MegatronStrategy) and isinstance(strategy.launcher, _SubprocessScriptLauncher)):
                launch.release()  # no launcher that hands local ranks to the waiting ones: they exit
            if isinstance(strategy, MegatronStrategy):
                strategy.leave_after_the_command()  # leave_in_order, once the subcommand has run
            config = self.config[self.subcommand] if self.subcommand else self.config
            ckpt_path = config.get("ckpt_path")
            if (isinstance(strategy, MegatronStrategy) and isinstance(self.model, MegatronLightningModule)
                    and isinstance(ckpt_path, (str, os.PathLike)) and os.path.isdir(ckpt_path)):
                # a model the checkpoint does not fit: refused here, not in every rank once they all started
                from lightning_megatron.checkpoint import CheckpointError

                try:
                    check_checkpoint_fits(self.model, ckpt_path)
                except CheckpointError as e:
                    raise SystemExit(f"lightning-megatron: {e}") from None
            optimizer, scheduler = config.get("optimizer"), config.get("lr_scheduler")
            if not (optimizer or scheduler):
                return
            if not isinstance(self.model, MegatronLightningModule):
                raise SystemExit(f"lightning-megatron: --optimizer / --lr_scheduler are built by a "
                                 f"lightning_megatron.module.MegatronLightningModule on its parameter groups; "
                                 f"{type(self.model).__name__} is not one: build them in its configure_optimizers")
            self.model.use_optimizer(_class_path(optimizer), _init_args(optimizer))
            self.model.use_lr_scheduler(_class_path(scheduler), _init_args(scheduler))

        def before_instantiate_classes(self) -> None:
            # Config-only checks (lightning_megatron.config_checks) before the Trainer launches any
            # process (a warm-up as long as a short run is shortened at set-up by the schedule callback).
            from lightning_megatron.cli_config import prepare_config
            from lightning_megatron.config_checks import ConfigError, config_from_cli, validate_config

            config = self.config[self.subcommand] if self.subcommand else self.config
            if config.get("lr_scheduler") and config.get("lr_schedule"):
                raise SystemExit(f"lightning-megatron: --lr_scheduler {config.lr_scheduler.class_path} and the "
                                 f"lr_schedule section (OptimizerParamSchedulerCallback) would both set the lr every "
                                 f"step: use one (--lr_schedule null drops the recipe's schedule)")
            # named callbacks, run folder, init_from, one run per checkpoint folder, last, evaluation logs, W&B:
            # cli_config.py
            derived = prepare_config(config, given, self.model_class, self.subcommand)
            _enum_defaults_as_values(config)
            self.save_config_kwargs = {**self.save_config_kwargs, "derived": derived}
            try:
                validate_config(**config_from_cli(config, fitting=self.subcommand in (None, "fit"),
                                                  predicting=self.subcommand == "predict",
                                                  data_class=self.datamodule_class,
                                                  model_class=self.model_class,
                                                  running=self.subcommand is not None,
                                                  split={"validate": "valid", "test": "test",
                                                         "predict": "test"}.get(self.subcommand)))
            except ConfigError as e:
                raise SystemExit(f"lightning-megatron: {e}") from None
            from lightning_megatron.run_lock import one_run_at_a_time

            one_run_at_a_time(config, fitting=self.subcommand == "fit")  # the run folder's lock, held until exit

        def after_fit(self) -> None:
            if self.trainer.is_global_zero:
                from lightning_megatron.callbacks.summary import run_summary

                print(run_summary(self.trainer), flush=True)

        def after_predict(self) -> None:  # each rank that wrote (the last stage's first TP rank of each replica)
            written = [str(path) for cb in self.trainer.callbacks if isinstance(cb, PredictionWriter)
                       for path in cb.written]
            if written:
                print(f"lightning-megatron: predictions: {', '.join(written)}", flush=True)

    # Every checkpoint records the W&B run id (see cli_config._continue_wandb_run) and the W&B config gets the run's
    # settings (WandbRunIdCallback); `predict` writes its outputs into the run folder (PredictionWriter);
    # trainer_defaults' callbacks are added to the configured ones.
    defaults = dict(kwargs.pop("trainer_defaults", None) or {})
    extra = defaults.get("callbacks") or []
    defaults["callbacks"] = [*(extra if isinstance(extra, list) else [extra]), WandbRunIdCallback(),
                             PredictionWriter()]
    # A mistyped option that is the prefix of one (--trainer.max_step) is an error, not that option:
    # argparse's abbreviations off (jsonargparse hands the setting to every subcommand's parser).
    # (Settings for the subcommands not built are dropped: LightningCLI would read them as the main parser's.)
    # Its error comes back to MegatronCLI._parse, which says it with a close match (exit_on_error off).
    kwargs["parser_kwargs"] = {k: v for k, v in {"allow_abbrev": False, "exit_on_error": False,
                                                 **(kwargs.get("parser_kwargs") or {})}.items()
                               if k in running or k not in every}
    kwargs.setdefault("subclass_mode_model", model_class is None)  # a class named by class_path
    kwargs.setdefault("subclass_mode_data", datamodule_class is None)
    return MegatronCLI(model_class, datamodule_class, args=args, save_config_callback=SaveConfigAsGiven,
                       save_config_kwargs={"overwrite": True}, seed_everything_default=1234,
                       trainer_defaults=defaults, auto_configure_optimizers=False, **kwargs)


def _enum_defaults_as_values(config: Any) -> None:
    """A callback's enum default (``Timer``'s ``interval=Interval.step``) as its value: jsonargparse's YAML dump
    cannot represent the enum, and ``--trainer.callbacks+=...Timer`` ended in a traceback (plain LightningCLI's too)."""
    import enum

    trainer = config.get("trainer") if hasattr(config, "get") else None
    callbacks = trainer.get("callbacks") if trainer is not None else None
    for entry in callbacks if isinstance(callbacks, list) else [callbacks]:
        args = entry.get("init_args") if hasattr(entry, "get") else None
        for key, value in (args.items() if args is not None else ()):
            if isinstance(value, enum.Enum):
                args[key] = value.value


def _exit_on_error(parser: Any) -> None:
    """argparse's exit on error again, for the parser and its subcommands' (LightningCLI parses a ``--ckpt_path``
    file's hyper-parameters after the command line, expecting its exit)."""
    import argparse

    stack = [parser]
    while stack:
        p = stack.pop()
        p.exit_on_error = True
        stack += [c for a in p._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices.values()]


def _parse_error(parser: Any, error: Exception, command: str) -> str:
    """argparse's error of a command line the parser refused (exit status 2), with the options closest to each one
    it did not take and where to list them all: LightningCLI printed the whole usage first (~100 lines).
    ``command``: ``lightning-megatron fit`` (``finetune fit``, ...)."""
    import argparse
    import difflib
    import inspect
    import re

    from lightning_megatron.recipes import import_class

    options: set[str] = set()
    stack = [getattr(error, "subcommand_parser", None) or parser]
    while stack:
        p = stack.pop()
        for action in p._actions:
            options.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
    message = str(error).strip()
    hints = []
    unknown = re.search(r"unrecognized arguments: (.*)", message)
    for arg in (unknown.group(1).split() if unknown else []):
        name = arg.split("=", 1)[0]
        close = difflib.get_close_matches(name, sorted(options), n=2) if arg.startswith("--") else []
        hints += [f"{name}: did you mean {' or '.join(close)}?"] if close else []
    key = re.search(r'Parser key "([\w.]+)"', message)
    for class_path, name in re.findall(r"class_path '([\w.]+)':\s*Option '(\w+)' is not accepted", message):
        try:  # a section of a class's arguments (lr_schedule, a config record): its fields
            cls = import_class(class_path)
            fields = [f for f in inspect.signature(cls).parameters if f not in ("self", "args", "kwargs")]
        except (ImportError, AttributeError, ValueError, TypeError):
            continue
        close = difflib.get_close_matches(name, fields, n=2)
        where = f"--{key.group(1)}." if key else "--"
        hints += [f"{where}{name}: did you mean {' or '.join(where + c for c in close)}?"] if close else []
    listed = "every option" if command.split()[-1] in ("fit", "validate", "test", "predict") else "the commands"
    return "\n".join([f"lightning-megatron: error: {message}", *(f"  {h}" for h in hints),
                      f"  ({command} --help lists {listed})"])


def _default_classes(given: list[str], model_class: type | None, datamodule_class: type | None) -> list[str]:
    """The class paths of the model and data classes the command builds when ``given`` names none."""
    from lightning_megatron.recipes import DEFAULT_DATA_CLASS, DEFAULT_MODEL_CLASS

    named = _named_by_class_path(given)
    out = []
    for key, cls, default in (("model", model_class, DEFAULT_MODEL_CLASS),
                              ("data", datamodule_class, DEFAULT_DATA_CLASS)):
        if cls is not None:
            out.append(f"{cls.__module__}.{cls.__qualname__}")
        elif key not in named:
            out.append(default)
    return out


def _named_by_class_path(argv: list[str]) -> set[str]:
    """Which of ``model`` / ``data`` the command line (``--model.class_path X``, ``--model X``) or a
    ``--config`` recipe (``model: {class_path: X}``; merged YAML text or a file) names by class path."""
    named = set()
    for arg in argv:
        for key in ("model", "data"):
            if arg.split("=", 1)[0] in (f"--{key}", f"--{key}.class_path"):
                named.add(key)
    for recipe in config_recipes(argv):
        named |= {k for k in ("model", "data") if isinstance(recipe.get(k), dict) and "class_path" in recipe[k]}
    return named


def _moved_model_arguments(argv: list[str], model_class: type | None) -> str | None:
    """The refusal of model arguments written where they were before they moved (``--model.num_layers``,
    a recipe's ``model: {num_layers: ...}``, now ``config.num_layers``: the module's
    ``moved_arguments``), naming the new spelling of each; None when there is none. Never folded in
    silently: the recipe or the command line says what it means."""
    import re

    from lightning_megatron.cli_config import _class
    from lightning_megatron.module import MegatronLightningModule

    recipes = config_recipes(argv)
    for i, arg in enumerate(argv):  # the class the command line or a recipe names wins over the default
        option, eq, value = arg.partition("=")
        if option in ("--model", "--model.class_path"):
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if re.fullmatch(r"[A-Za-z_][\w.]*\.[A-Za-z_]\w*", value) and not value.endswith((".yaml", ".yml", ".json")):
                model_class = _class(value) or model_class  # a class path (not the model group's config file)
    for recipe in recipes:
        section = recipe.get("model")
        if isinstance(section, dict) and section.get("class_path"):
            model_class = _class(str(section["class_path"])) or model_class
    if not (isinstance(model_class, type) and issubclass(model_class, MegatronLightningModule)):
        return None
    problems = []
    for arg in argv:
        option = arg.partition("=")[0]
        for prefix in ("--model.init_args.", "--model."):
            if option.startswith(prefix):
                problems += model_class.moved_argument_problems([option[len(prefix):]], prefix)
                break
    for recipe in recipes:
        section = recipe.get("model")
        if not isinstance(section, dict):
            continue
        named = "class_path" in section
        arguments = section.get("init_args") if named else section
        if isinstance(arguments, dict):
            problems += [f"the recipe's {p}" for p in model_class.moved_argument_problems(
                arguments, "model.init_args." if named else "model.")]
    if not problems:
        return None
    return (f"lightning-megatron: {model_class.__name__}'s architecture is its config record, written under "
            f"config (--model.config.num_layers 4; in a recipe, model: {{config: {{num_layers: 4}}}}): "
            + "; ".join(dict.fromkeys(problems)))


_OPTIMIZER_HYPERPARAMETERS = ("lr", "weight_decay")


def _optimizer_hyperparameter(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """The first ``--optimizer.lr X`` / ``--optimizer.init_args.weight_decay=X`` in ``argv``:
    (name, value, argv without it), or None."""
    for i, token in enumerate(argv):
        option, eq, value = token.partition("=")
        for name in _OPTIMIZER_HYPERPARAMETERS:
            if option in (f"--optimizer.{name}", f"--optimizer.init_args.{name}"):
                if eq:
                    return name, value, argv[:i] + argv[i + 1:]
                value = argv[i + 1] if i + 1 < len(argv) else "VALUE"
                return name, value, argv[:i] + argv[i + 2:]
    return None


def _optimizer_hyperparameter_message(name: str, value: str, scheduled: bool) -> str:
    """Where ``--optimizer.<name>`` belongs: the lr_schedule section sets lr and weight decay every step."""
    if scheduled and name == "lr":
        where = (f"the lr_schedule section (OptimizerParamSchedulerCallback) sets the learning rate every step: "
                 f"use --lr_schedule.max_lr {value} (the peak after warm-up; --lr_schedule.init_lr and "
                 f"--lr_schedule.min_lr set the start and the end)")
    elif scheduled:
        where = (f"the lr_schedule section (OptimizerParamSchedulerCallback) sets the weight decay every step: "
                 f"use --lr_schedule.start_wd {value} --lr_schedule.end_wd {value}")
    else:
        where = f"the model builds the optimizer with it: use --model.{name} {value}"
    return f"lightning-megatron: --optimizer.{name} is not an optimizer argument here: {where}"


def _class_path(spec: Any) -> str | None:
    return spec.class_path if spec else None


def _init_args(spec: Any) -> dict[str, Any] | None:
    if not spec:
        return None
    args = spec.get("init_args")
    return dict(args.as_dict() if hasattr(args, "as_dict") else args or {})


def finetune_cli(argv: list[str] | None, **kwargs: Any) -> Any:
    """``finetune fit|validate|test|predict``: a sequence classifier, BertClassificationModule over any
    FinetuneDataModule (``data: {class_path: ...LabelledTextDataModule, init_args: ...}``: your JSONL/CSV/datasets;
    or the built-in StdlibDocstringDataModule; ``model.num_classes`` comes from the data); or a decoder, when the
    recipe or the command line names a decoder class (``model: {class_path: ...GPTLightningModule}``, with
    ``init_from``, ``lora`` and the SFTDataModule: docs/finetune.md), which runs as ``fit`` does."""
    resolved = resolve_recipes(list(sys.argv[1:] if argv is None else argv))
    # Before the imports below (torch, Lightning): the other ranks import meanwhile, the classifier's classes
    # too when no model class is named (a named one is imported as the recipe's classes are).
    classifier = ["lightning_megatron.models.bert.classification.BertClassificationModule",
                  "lightning_megatron.datamodules.finetune.FinetuneDataModule"]
    launch.prewarm(resolved, also=classifier if _model_class_path(resolved) is None else [])
    launch.import_wandb_ahead(resolved)
    from lightning_megatron.datamodules.finetune import FinetuneDataModule
    from lightning_megatron.models.bert.classification import BertClassificationModule

    named = _model_class_path(resolved)
    kwargs.setdefault("command", "lightning-megatron finetune")
    if named is not None and not _is_classifier(named):
        return lightning_cli(argv, **kwargs)
    return lightning_cli(argv, BertClassificationModule, FinetuneDataModule, link_num_classes=True,
                          subclass_mode_data=True, **kwargs)


def _model_class_path(argv: list[str]) -> str | None:
    """The model class the command line (``--model.class_path X``, ``--model X``) or the last recipe names."""
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in ("--model", "--model.class_path"):
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if value and not value.lstrip().startswith(("{", "\n")) and "\n" not in value:
                return value
    found = None
    for recipe in config_recipes(argv):
        model = recipe.get("model")
        if isinstance(model, dict) and isinstance(model.get("class_path"), str):
            found = model["class_path"]
    return found


def _is_classifier(class_path: str) -> bool:
    """Whether ``finetune`` builds ``class_path`` as a sequence classifier (anything but a language model of ours
    that is not BERT's classifier: a class it cannot import is LightningCLI's to report)."""
    from lightning_megatron.language.module import LanguageLightningModule
    from lightning_megatron.models.bert.classification import BertClassificationModule
    from lightning_megatron.recipes import import_class

    try:
        cls = import_class(class_path)
    except Exception:  # noqa: BLE001
        return True
    return not (isinstance(cls, type) and issubclass(cls, LanguageLightningModule)) or issubclass(
        cls, BertClassificationModule)


def leave_in_order(cli: Any) -> None:
    """The command's run is done and its process exits next: a ``MegatronStrategy``'s ranks shut their
    process groups down in order first (``MegatronStrategy.leave``)."""
    from lightning_megatron.strategy import MegatronStrategy

    strategy = getattr(cli.trainer, "strategy", None) if cli is not None else None
    if isinstance(strategy, MegatronStrategy):
        strategy.leave()


def resolve_recipes(argv: list[str]) -> list[str]:
    """``--config RECIPE`` with its ``base:`` recipes merged in (lightning_megatron.recipes); a class path
    that has moved (``lightning_megatron.data.gpt_datamodule.GPTDataModule``), in a recipe or on the
    command line, is refused here, before anything is built, naming the new one."""
    from lightning_megatron.recipes import (RecipeError, refuse_moved_class_paths, refuse_unreadable_recipes,
                                            resolve_config_arguments)

    try:
        refuse_unreadable_recipes(argv)
        refuse_moved_class_paths(argv)
        return resolve_config_arguments(argv)
    except RecipeError as e:
        raise SystemExit(f"lightning-megatron: {e}") from None
