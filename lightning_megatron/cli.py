"""The ``lightning-megatron`` command.

    lightning-megatron fit --config recipes/bert_tiny.yaml [--trainer.max_steps 50 ...]
    lightning-megatron validate|test|predict --config ... --ckpt_path CKPT
    lightning-megatron preprocess --input a.txt b.jsonl.gz dir/ --output-prefix data/my_corpus [--workers 2]
    lightning-megatron preprocess --input docs.jsonl --tokenizer tok/ --append-eod --output-prefix data/gpt
    lightning-megatron train-tokenizer --input a.txt --vocab-size 8192 --output-dir tok/ [--type bpe]
    lightning-megatron plot RUN_DIR [RUN_DIR ...] --output curves.png
    lightning-megatron check --config recipes/bert_tiny.yaml --layouts tp2,pp2,dp2 [--estimate-memory]
    lightning-megatron export hf --ckpt_path CKPT --output DIR [--vocab_file vocab.txt] [--model-class C]
    lightning-megatron export peft --ckpt_path LORA_CKPT --output DIR     (a LoRA run's adapters, PEFT's format)
    lightning-megatron ... --allow-unverified-checkpoint     (any command: checkpoints without checksums load)

fit/validate/test/predict are LightningCLI subcommands over BertLightningModule and BertDataModule,
or over any LightningModule and LightningDataModule named by class path (``--model.class_path
my_pkg.MyModule``, ``--data.class_path ...``, or ``class_path:`` in the recipe's ``model:`` / ``data:``
section: LightningCLI's subclass mode), so every argument of the Trainer, the strategy, the model and
the data is a dotted override. The
Megatron callbacks are named argument groups: ``--megatron_optimizer.clip_grad 0.5``,
``--lr_schedule.lr_warmup_steps 10`` (recipes configure them in those sections; ``--lr_schedule null``
drops one). ``--optimizer torch.optim.SGD --optimizer.momentum 0.9`` and ``--lr_scheduler ...`` take
any torch optimizer and LR scheduler as LightningCLI does, built by the model on its parameter groups
(a :class:`~lightning_megatron.module.MegatronLightningModule`: ``use_optimizer`` / ``use_lr_scheduler``).
Logs and checkpoints go under ``trainer.default_root_dir``; W&B continues the run of a checkpoint.
The other commands are plain functions in ``COMMANDS`` (name -> (function(argv), one-line help)).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

from lightning_megatron import launch
from lightning_megatron.recipes import config_recipes

__all__ = ["main", "finetune_cli", "plot_runs", "COMMANDS"]


def plot_runs(*args: Any, **kwargs: Any) -> Path:
    """:func:`lightning_megatron.plot.plot_runs` (kept here for existing imports)."""
    from lightning_megatron.plot import plot_runs as plot

    return plot(*args, **kwargs)


_LIGHTNING_COMMANDS = {
    "fit": "train (and validate every val_check_interval steps)",
    "validate": "validation loss of a checkpoint (--ckpt_path)",
    "test": "test-split loss of a checkpoint (--ckpt_path)",
    "predict": "masked-LM ids, pooled or per-token embeddings (--model.predict_output) of a checkpoint; a "
               "decoder's continuations of --data.predict_file",
}


def _lightning_cli(args: list[str] | None, model_class: type | None = None, datamodule_class: type | None = None,
                   *, link_num_classes: bool = False, **kwargs) -> Any:
    """The LightningCLI over BertLightningModule and BertDataModule, the given classes, or any class the
    command line or its recipe names by ``class_path`` (subclass mode) (``run=False`` in kwargs: only
    build). ``args`` (or ``sys.argv`` when None) may name recipes with ``base:``; they are merged first
    (lightning_megatron.recipes). ``link_num_classes``: the model's ``num_classes`` is the datamodule's
    (fine-tuning)."""
    if args is None:  # LightningCLI reads sys.argv; Lightning starts the other ranks with it too
        sys.argv[1:] = _resolve_recipes(sys.argv[1:])
    else:
        args = _resolve_recipes(args)

    given = list(args if args is not None else sys.argv[1:])  # the command line's own flags
    launch.prewarm(given)  # the other local ranks import while this one parses (lightning_megatron.launch)
    try:
        return _megatron_cli(args, given, model_class, datamodule_class, link_num_classes=link_num_classes, **kwargs)
    finally:
        launch.release()  # local ranks started early that no launcher took (a refusal, an error, one device)


def _megatron_cli(args: list[str] | None, given: list[str], model_class: type | None, datamodule_class: type | None,
                  *, link_num_classes: bool, **kwargs) -> Any:
    """:func:`_lightning_cli` once the recipes are resolved: build (and run) the LightningCLI."""
    from lightning.pytorch.cli import LightningCLI, LRSchedulerTypeTuple
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
    from torch.optim import Optimizer

    from lightning_megatron.strategy import MegatronStrategy  # also registers strategy="megatron"
    from lightning_megatron.callbacks import MegatronOptimizerCallback, OptimizerParamSchedulerCallback, PredictionWriter
    from lightning_megatron.loggers import WandbRunIdCallback
    from lightning_megatron.module import MegatronLightningModule
    from lightning_megatron.optimizer.config import OptimizerConfig

    # A class named by class_path (command line or recipe): LightningCLI's subclass mode, and BERT is
    # never imported; otherwise the BERT module and datamodule, whose recipes give plain arguments.
    from lightning_megatron.recipes import DEFAULT_DATA_CLASS, DEFAULT_MODEL_CLASS, import_class

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

    class MegatronCLI(LightningCLI):
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
            from jsonargparse import Namespace

            if isinstance(args, (dict, Namespace)):
                self.config = parser.parse_object(args)
            else:
                self.config = parser.parse_args(args)

        def instantiate_classes(self) -> None:
            super().instantiate_classes()
            strategy = self.trainer.strategy
            if not (isinstance(strategy, MegatronStrategy) and isinstance(strategy.launcher, _SubprocessScriptLauncher)):
                launch.release()  # no launcher that hands local ranks to the waiting ones: they exit
            config = self.config[self.subcommand] if self.subcommand else self.config
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
            prepare_config(config, given, self.model_class, self.subcommand)
            try:
                validate_config(**config_from_cli(config, fitting=self.subcommand in (None, "fit"),
                                                  predicting=self.subcommand == "predict",
                                                  data_class=self.datamodule_class,
                                                  model_class=self.model_class,
                                                  running=self.subcommand is not None))
            except ConfigError as e:
                raise SystemExit(f"lightning-megatron: {e}") from None

        def after_fit(self) -> None:
            if self.trainer.is_global_zero:
                from lightning_megatron.callbacks.summary import run_summary

                print(run_summary(self.trainer), flush=True)

    # Every checkpoint records the W&B run id (see cli_config._continue_wandb_run) and the W&B config gets the run's
    # settings (WandbRunIdCallback); `predict` writes its outputs into the run folder (PredictionWriter);
    # trainer_defaults' callbacks are added to the configured ones.
    defaults = dict(kwargs.pop("trainer_defaults", None) or {})
    extra = defaults.get("callbacks") or []
    defaults["callbacks"] = [*(extra if isinstance(extra, list) else [extra]), WandbRunIdCallback(),
                             PredictionWriter()]
    # A mistyped option that is the prefix of one (--trainer.max_step) is an error, not that option:
    # argparse's abbreviations off (jsonargparse hands the setting to every subcommand's parser).
    kwargs["parser_kwargs"] = {"allow_abbrev": False, **(kwargs.get("parser_kwargs") or {})}
    kwargs.setdefault("subclass_mode_model", model_class is None)  # a class named by class_path
    kwargs.setdefault("subclass_mode_data", datamodule_class is None)
    return MegatronCLI(model_class, datamodule_class, args=args,
                       save_config_kwargs={"overwrite": True}, seed_everything_default=1234,
                       trainer_defaults=defaults, auto_configure_optimizers=False, **kwargs)


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


def _preprocess(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="lightning-megatron preprocess",
                                     description="text/jsonl/Hugging Face corpus -> Megatron indexed dataset "
                                                 "(.bin/.idx, and .vocab.json recording the vocabulary)")
    parser.add_argument("--input", nargs="*", default=None,
                        help=".txt (blank line between documents) or .jsonl files, also .gz, directories "
                             "(recursive) or saved Hugging Face datasets; none: the built-in corpus")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--vocab-file", default=None, help="WordPiece vocab.txt (default: the packaged BERT vocab)")
    parser.add_argument("--tokenizer", default=None,
                        help="any vocabulary: a BPE or WordPiece tokenizer.json, GPT-2 vocab.json (merges.txt beside "
                             "it), vocab.txt, or a folder holding one; BPE: one item per document (GPT data)")
    parser.add_argument("--append-eod", action="store_true",
                        help="end every document with the BPE tokenizer's end-of-document token (Megatron's flag)")
    parser.add_argument("--json-key", default="text", help="JSON field / dataset column holding the text")
    parser.add_argument("--max-seq-length", type=int, default=512,
                        help="WordPiece sentences longer than this minus 3 are split (BPE documents never are)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a = parser.parse_args(argv)
    if a.vocab_file is not None and a.tokenizer is not None:
        parser.error(f"--vocab-file {a.vocab_file} and --tokenizer {a.tokenizer}: pass one of them")
    from lightning_megatron.data.preprocess import preprocess_corpus

    try:
        stats = preprocess_corpus(a.input, a.output_prefix, a.tokenizer or a.vocab_file, json_key=a.json_key,
                                  max_seq_length=a.max_seq_length, workers=a.workers, append_eod=a.append_eod,
                                  progress=not a.no_progress)
    except (ValueError, OSError, ImportError) as error:
        parser.exit(2, f"lightning-megatron preprocess: error: {error}\n")
    for k, v in stats.as_dict().items():
        print(f"{k}: {v}")
    print(f"throughput: {stats.text_bytes / 1e6 / max(stats.seconds, 1e-9):.2f} MB/s")


def _train_tokenizer(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="lightning-megatron train-tokenizer",
                                     description="train a WordPiece vocab.txt (BERT) or a byte-level BPE "
                                                 "tokenizer.json (GPT, with <|endoftext|>)")
    parser.add_argument("--type", choices=("wordpiece", "bpe"), default="wordpiece")
    parser.add_argument("--input", nargs="*", default=None, help="text/jsonl files (also .gz), directories or saved Hugging Face datasets; none: the built-in corpus")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--json-key", default="text", help="JSON field / dataset column holding the text")
    a = parser.parse_args(argv)
    from lightning_megatron.data.bpe_tokenizer import train_bpe_tokenizer
    from lightning_megatron.data.tokenizer import train_wordpiece_tokenizer

    train = train_bpe_tokenizer if a.type == "bpe" else train_wordpiece_tokenizer
    try:
        print(train(a.input, a.vocab_size, a.output_dir, json_key=a.json_key))
    except (ValueError, OSError, ImportError) as error:
        parser.exit(2, f"lightning-megatron train-tokenizer: error: {error}\n")


def _plot(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="lightning-megatron plot",
                                     description="curves of run folders -> PNG: one panel per quantity, one line per "
                                                 "run (resumes joined), validation as markers")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--output", default="loss_curves.png")
    a = parser.parse_args(argv)
    from lightning_megatron.plot import plot_runs

    try:
        print(plot_runs(a.runs, a.output))
    except (ValueError, OSError) as error:
        parser.exit(2, f"lightning-megatron plot: error: {error}\n")


def _export(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="lightning-megatron export",
                                     description="a checkpoint (any TP/PP/DP layout) -> a Hugging Face folder")
    parser.add_argument("format", choices=["hf", "peft"],
                        help="hf: transformers BertForPreTraining (post-norm spec), MegatronBertForPreTraining "
                             "(pre-norm, the default recipe), LlamaForCausalLM or GPT2LMHeadModel (GPT family; a LoRA "
                             "checkpoint's adapters merged into its base); peft: a LoRA checkpoint's adapters as a PEFT "
                             "folder (PeftModel.from_pretrained)")
    parser.add_argument("--ckpt_path", required=True, help="a lightning_megatron checkpoint directory")
    parser.add_argument("--output", required=True, help="the folder to write (config, model.safetensors, tokenizer)")
    parser.add_argument("--vocab_file", default=None,
                        help="the vocab.txt the model was trained with (default: the one the checkpoint names)")
    parser.add_argument("--tokenizer", default=None, help="GPT family: the tokenizer.json (or GPT-2 vocab.json) "
                                                          "the model was trained with (default: the checkpoint's)")
    parser.add_argument("--model-class", default=None,
                        help="the module class that wrote the checkpoint (package.module.Class), whose interop "
                             "adapter exports it; default: the class the checkpoint records, else "
                             "BertLightningModule (checkpoints written before they recorded it)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output folder")
    a = parser.parse_args(argv)
    from lightning_megatron.checkpoint import CheckpointError
    from lightning_megatron.export import export_hf, export_peft

    try:
        if a.format == "peft":
            print(export_peft(a.ckpt_path, a.output, overwrite=a.overwrite))
            return
        print(export_hf(a.ckpt_path, a.output, vocab_file=a.vocab_file, overwrite=a.overwrite, tokenizer=a.tokenizer,
                        model_class=a.model_class))
    except (CheckpointError, OSError, ValueError) as error:
        parser.exit(1, f"lightning-megatron export: error: {error}\n")


def _finetune(argv: list[str]) -> None:
    _leave_in_order(finetune_cli(argv))


def finetune_cli(argv: list[str] | None, **kwargs: Any) -> Any:
    """``finetune fit|validate|test|predict``: a sequence classifier, BertClassificationModule over any
    FinetuneDataModule (``data: {class_path: ...LabelledTextDataModule, init_args: ...}``: your JSONL/CSV/datasets;
    or the built-in StdlibDocstringDataModule; ``model.num_classes`` comes from the data); or a decoder, when the
    recipe or the command line names a decoder class (``model: {class_path: ...GPTLightningModule}``, with
    ``init_from``, ``lora`` and the SFTDataModule: docs/finetune.md), which runs as ``fit`` does."""
    from lightning_megatron.datamodules.finetune import FinetuneDataModule
    from lightning_megatron.models.bert.classification import BertClassificationModule

    named = _model_class_path(_resolve_recipes(list(sys.argv[1:] if argv is None else argv)))
    if named is not None and not _is_classifier(named):
        return _lightning_cli(argv, **kwargs)
    return _lightning_cli(argv, BertClassificationModule, FinetuneDataModule, link_num_classes=True,
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


def _check(argv: list[str]) -> None:
    from lightning_megatron.check.cli import main as check_main  # layout parity and memory per rank

    sys.exit(check_main(argv))


COMMANDS = {
    "check": (_check, "prove layouts equal one process, estimate memory: check --config RECIPE --layouts tp2,pp2"),
    "preprocess": (_preprocess, "text/jsonl corpus -> Megatron indexed dataset (.bin/.idx)"),
    "train-tokenizer": (_train_tokenizer, "train a WordPiece vocabulary or a byte-level BPE tokenizer"),
    "plot": (_plot, "loss curves of run directories -> PNG"),
    "finetune": (_finetune, "fit|validate|test|predict a classifier (finetune fit --config recipes/bert_tiny_finetune.yaml) "
                            "or a decoder with SFT / LoRA (finetune fit --config recipes/llama_tiny_lora.yaml)"),
    "export": (_export, "checkpoint (any layout) -> Hugging Face folder: export hf --ckpt_path CKPT --output DIR"),
}
"""Commands besides LightningCLI's: name -> (function taking the remaining argv, one-line help)."""


def _print_help() -> None:
    lines = ["usage: lightning-megatron COMMAND [options]   (COMMAND --help for its options)", "", "commands:"]
    for name, text in {**_LIGHTNING_COMMANDS, **{k: v[1] for k, v in COMMANDS.items()}}.items():
        lines.append(f"  {name:16s} {text}")
    lines += ["", "fit/validate/test/predict take --config recipes/bert_tiny.yaml and dotted overrides "
              "(--trainer.max_steps 50, --model.config.hidden_size 256, --megatron_optimizer.clip_grad 0.5, ...).",
              f"{ALLOW_UNVERIFIED_FLAG} (any command): load checkpoints that carry no checksums (format 1)."]
    print("\n".join(lines))


ALLOW_UNVERIFIED_FLAG = "--allow-unverified-checkpoint"
"""Any command: load checkpoints without checksums (format 1, checksums removed), with a warning; sets
``LIGHTNING_MEGATRON_ALLOW_UNVERIFIED_CHECKPOINT=1`` for this process and the ranks it starts."""


def _take_allow_unverified(argv: list[str]) -> list[str]:
    """``argv`` without :data:`ALLOW_UNVERIFIED_FLAG`; when it was there, the opt-in is set in the
    environment, which the ranks Lightning or torchrun start inherit (they re-read ``sys.argv`` too)."""
    if ALLOW_UNVERIFIED_FLAG not in argv:
        return argv
    from lightning_megatron.checkpoint import ALLOW_UNVERIFIED_ENV

    os.environ[ALLOW_UNVERIFIED_ENV] = "1"
    return [a for a in argv if a != ALLOW_UNVERIFIED_FLAG]


def _filter_dependency_noise() -> None:
    """Filter what dependencies print on every run that asks nothing of a user, narrowly (by message and
    origin) and only in this process: the entry point of the command, never at import (a library leaves
    process-wide filters alone). Each filter names its reason; everything else is shown."""
    import logging
    import warnings

    # torch >= 2.10 deprecates constructing `LeafSpec`, which Lightning 2.6's CombinedLoader still does at
    # the start of every loop (a FutureWarning per loader): nothing a user can change.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    # Lightning cannot inject drop_last=False into a batch sampler of its own kind and warns that
    # prediction may miss samples; ours pad the last global batch (of each prompt length) and yield every
    # sample once (tests/test_gpt_predict.py, tests/test_cli_recipes.py).
    warnings.filterwarnings("ignore", message=r"You are using a custom batch sampler "
                                              r"`(LengthGroupedBatchSampler|PredictBatchSampler)`",
                            module=r"lightning\.pytorch\.utilities\.data")
    # Lightning's tips for its cloud services (litlogger, litmodels), logged at every Trainer start.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_cloud_tip_filter)  # once: same object


def _cloud_tip_filter(record: Any) -> bool:
    """False for Lightning's "💡 Tip: For seamless cloud ..." records (:func:`_filter_dependency_noise`)."""
    return not str(record.msg).startswith("💡 Tip: For seamless cloud")


def main(argv: list[str] | None = None) -> None:
    _filter_dependency_noise()
    from_sys_argv = argv is None
    argv = _take_allow_unverified(list(sys.argv[1:] if argv is None else argv))
    if from_sys_argv:
        sys.argv[1:] = argv  # LightningCLI parses sys.argv: it would not know the flag
    if not argv or argv[0] in ("-h", "--help"):
        _print_help()
        return
    try:
        if argv[0] in COMMANDS:
            COMMANDS[argv[0]][0](argv[1:])
            return
        # From the command line LightningCLI reads sys.argv itself (passing args too makes it warn).
        _leave_in_order(_lightning_cli(None if from_sys_argv else argv))
    except Exception as e:
        # Imported here: `plot`, `preprocess`, `train-tokenizer` and `--help` need no torch.
        from lightning_megatron.checkpoint import CheckpointError
        from lightning_megatron.step import NonFiniteLossOrGradError

        if not isinstance(e, (CheckpointError, NonFiniteLossOrGradError)):
            raise
        # Every rank raises it (the ranks agree on the decision before raising): rank 0 says it once, in
        # one line (a full disk was ~240 lines and 10 tracebacks), the others exit quietly.
        from lightning.pytorch.utilities import rank_zero_only

        if rank_zero_only.rank != 0:
            raise SystemExit(1) from None
        raise SystemExit(f"lightning-megatron: {e}") from None


def _leave_in_order(cli: Any) -> None:
    """The command's run is done and its process exits next: a ``MegatronStrategy``'s ranks shut their
    process groups down in order first (``MegatronStrategy.leave``)."""
    from lightning_megatron.strategy import MegatronStrategy

    strategy = getattr(cli.trainer, "strategy", None) if cli is not None else None
    if isinstance(strategy, MegatronStrategy):
        strategy.leave()


def _resolve_recipes(argv: list[str]) -> list[str]:
    """``--config RECIPE`` with its ``base:`` recipes merged in (lightning_megatron.recipes); a class path
    that has moved (``lightning_megatron.data.gpt_datamodule.GPTDataModule``), in a recipe or on the
    command line, is refused here, before anything is built, naming the new one."""
    from lightning_megatron.recipes import RecipeError, refuse_moved_class_paths, resolve_config_arguments

    try:
        refuse_moved_class_paths(argv)
        return resolve_config_arguments(argv)
    except RecipeError as e:
        raise SystemExit(f"lightning-megatron: {e}") from None


if __name__ == "__main__":
    main()
