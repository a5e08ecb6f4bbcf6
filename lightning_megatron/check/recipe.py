"""A recipe (the YAML of ``lightning-megatron fit --config``) as the factories of a check run.

The check takes the recipe's ``model`` and ``data`` sections: the classes they name by ``class_path``
(any LightningModule following the strategy's contract, any LightningDataModule), else
BertLightningModule and BertDataModule. It turns dropout off (every constructor argument of the
module named ``*dropout``, every such field of a language model's config record, ``config.*dropout``, and of
any other record the recipe gives as a mapping, ``lora.dropout``),
refuses a model argument written where it was before it moved (``num_layers`` -> ``config.num_layers``),
and keeps, of the Trainer's callbacks,
those that change the update: ``MegatronOptimizerCallback`` (clipping, loss scaling) and
``OptimizerParamSchedulerCallback`` (learning rate, weight decay). Loggers, checkpointing and throughput callbacks are left out. Only
classes of ``lightning_megatron.callbacks`` are built from a recipe. The top-level ``optimizer:`` / ``lr_scheduler:``
sections go to the module as ``fit`` gives them (``use_optimizer`` / ``use_lr_scheduler``), and the strategy's
``cpu_tuning`` to every layout's strategy.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.recipes import (DEFAULT_DATA_CLASS, DEFAULT_MODEL_CLASS, import_class, read_recipe,
                                        refuse_moved_class_paths)

if TYPE_CHECKING:
    from lightning_megatron.cpu import CPUTuning

__all__ = ["RecipeCheck", "as_trained", "load_recipe", "parse_overrides", "with_dropout"]

_SECTIONS = {"megatron_optimizer": "MegatronOptimizerCallback", "lr_schedule": "OptimizerParamSchedulerCallback"}
"""The recipe sections the CLI turns into callbacks (see lightning_megatron.cli)."""
_CALLBACKS = {"lightning_megatron.callbacks.MegatronOptimizerCallback",
              "lightning_megatron.callbacks.optimizer.MegatronOptimizerCallback",
              "lightning_megatron.callbacks.OptimizerParamSchedulerCallback",
              "lightning_megatron.callbacks.scheduler.OptimizerParamSchedulerCallback"}


def _arguments(cls: type) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(cls).parameters)


def _section(section: Any) -> tuple[str | None, dict[str, Any]]:
    """(class_path or None, arguments) of a recipe's ``model:`` / ``data:`` section."""
    section = dict(section or {})
    if "class_path" in section:
        return str(section["class_path"]), dict(section.get("init_args") or {})
    return None, section


@dataclass(kw_only=True)
class RecipeCheck:
    """The pieces of a recipe a check run needs."""

    model: dict[str, Any]
    """The module's arguments (dropout off)."""
    model_class: str = DEFAULT_MODEL_CLASS
    """The module's class path (the recipe's ``model.class_path``)."""
    data_class: str = DEFAULT_DATA_CLASS
    """The datamodule's class path (the recipe's ``data.class_path``)."""
    dropout: dict[str, float] = field(default_factory=dict)
    """The recipe's own dropout probabilities by argument (``config.hidden_dropout``, ...: what training
    uses; the memory estimate of ``--gpus`` counts their masks)."""
    schedule_only: dict[str, Any] = field(default_factory=dict)
    """The recipe's own schedule-only options the check turns off by argument
    (``config.defer_embedding_wgrad_compute``, ``config.wgrad_deferral_limit``): what training runs, which the
    estimates plan with (:func:`as_trained`)."""
    data: dict[str, Any]
    """The datamodule's arguments."""
    callbacks: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """(class path, init args) of the kept callbacks."""
    skipped_callbacks: list[str] = field(default_factory=list)
    precision: str | None = None
    max_steps: int | None = None
    """The recipe's ``trainer.max_steps`` (its scheduler decays over it)."""
    layout: ParallelDims | None = None
    """The recipe's own layout: its MegatronStrategy's sizes, ``megatron_optimizer.use_distributed_optimizer``
    as ``zero1``, ``dp`` from ``trainer.devices`` x ``num_nodes`` (None: no MegatronStrategy, or sizes that
    do not make a layout)."""
    optimizer: tuple[str, dict[str, Any]] | None = None
    """The recipe's top-level ``optimizer:`` section (class path, init args), as ``fit`` builds it
    (``MegatronLightningModule.use_optimizer``); None: the module's own optimizer."""
    lr_scheduler: tuple[str, dict[str, Any]] | None = None
    """The recipe's top-level ``lr_scheduler:`` section (a torch scheduler stepped every step), as ``fit`` builds it."""
    trainer_options: dict[str, Any] = field(default_factory=dict)
    """The recipe's Trainer options ``fit`` refuses with a MegatronStrategy (``accumulate_grad_batches``,
    ``gradient_clip_val``): checked before launch as ``fit`` checks them."""
    cpu_tuning: CPUTuning | None = None
    """The recipe's MegatronStrategy's ``cpu_tuning`` as the strategy reads it (``true``: every piece but the weight
    gradients once a step; a mapping: those fields; None: off, a CPU run takes the library's code path): what a CPU
    run of the recipe switches on, which ``--estimate-time --device this`` measures and times."""

    def trainer_kwargs(self, steps: int) -> dict[str, Any]:
        out: dict[str, Any] = {"max_steps": max(steps, self.max_steps or steps)}
        if self.precision is not None:
            out["precision"] = self.precision
        return out

    @property
    def global_batch_size(self) -> int:
        return int(self.data.get("global_batch_size", 32))

    @property
    def micro_batch_size(self) -> int:
        return int(self.data.get("micro_batch_size", 8))


def _get(arguments: dict[str, Any], path: str, default: Any = None) -> Any:
    """``arguments["config"]["num_layers"]`` for ``path="config.num_layers"`` (``default`` when absent)."""
    *parents, leaf = path.split(".")
    for part in parents:
        arguments = arguments.get(part) or {}
    return arguments.get(leaf, default)


def _set(arguments: dict[str, Any], path: str, value: Any) -> None:
    """``arguments["config"]["num_layers"] = value`` for ``path="config.num_layers"`` (mappings made on the way)."""
    *parents, leaf = path.split(".")
    for part in parents:
        arguments[part] = dict(arguments.get(part) or {})
        arguments = arguments[part]
    arguments[leaf] = value


def with_dropout(model: dict[str, Any], dropout: dict[str, Any]) -> dict[str, Any]:
    """A copy of the module's arguments ``model`` with the dropout probabilities ``dropout`` (a
    :class:`RecipeCheck`'s: the recipe's own, which the check turns off) put back where they live."""
    model = copy.deepcopy(model)
    for where, p in dropout.items():
        _set(model, where, p)
    return model


def as_trained(recipe: RecipeCheck) -> dict[str, Any]:
    """The module's arguments as the recipe trains with them: its dropout and its schedule-only options (the
    output layer's deferred weight gradient) put back, which the check's runs turn off."""
    return with_dropout(recipe.model, {**recipe.dropout, **recipe.schedule_only})


def _dropout_arguments(cls: type) -> dict[str, float]:
    """Where ``cls`` takes a dropout probability -> its default: constructor arguments named ``*dropout``,
    and the ``*dropout`` fields of a language model's config record (``config.hidden_dropout``)."""
    import dataclasses

    from lightning_megatron.language.module import LanguageLightningModule

    out = {k: p.default for k, p in _arguments(cls).items()
           if k.endswith("dropout") and isinstance(p.default, (int, float))}
    if issubclass(cls, LanguageLightningModule):
        out.update({f"config.{f.name}": f.default for f in dataclasses.fields(cls.config_class)
                    if f.name.endswith("dropout") and isinstance(f.default, (int, float))})
    return out


def parse_overrides(args: list[str], prefixes: tuple[str, ...] = ("model", "data")) -> dict[str, dict[str, Any]]:
    """``["--model.config.num_layers", "24", "--data.micro_batch_size=4"]`` ->
    ``{"model": {"config.num_layers": 24}, "data": {"micro_batch_size": 4}}`` (values read as YAML; a
    dotted name sets a field of a record, :func:`load_recipe`; ``--data.init_args.NAME``, how ``fit`` spells an
    argument of a ``class_path`` section, is ``--data.NAME``)."""
    out: dict[str, dict[str, Any]] = {p: {} for p in prefixes}
    written = " or ".join(f"--{p}.NAME VALUE" for p in prefixes)
    i = 0
    while i < len(args):
        arg = args[i]
        prefix = next((p for p in prefixes if arg.startswith(f"--{p}.")), None)
        if prefix is None:
            raise ValueError(f"unknown argument {arg!r}; overrides are written {written}")
        key = arg[len(prefix) + 3:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ValueError(f"{arg} needs a value")
            value = args[i + 1]
            i += 2
        out[prefix][key.removeprefix("init_args.")] = yaml.safe_load(value)
    return out


_LAYOUTS = "the layouts compared are --layouts (tp2,pp2,dp2,...; --reference the one they are compared with)"
_CHECK_OWN = {"max_steps": "the steps compared are --steps"}


CLASSIFIER_CLASS = "lightning_megatron.models.bert.classification.BertClassificationModule"


def _default_model_class(data_class: str) -> str:
    """The module a recipe that names none trains, as its command builds it: over labelled data
    (a ``FinetuneDataModule``: ``finetune fit``) BERT's classifier, else the CLI's default."""
    from lightning_megatron.datamodules.finetune import FinetuneDataModule

    cls = import_class(data_class)
    return CLASSIFIER_CLASS if isinstance(cls, type) and issubclass(cls, FinetuneDataModule) else DEFAULT_MODEL_CLASS


def load_recipe(path: str | Path, model_overrides: dict[str, Any] | None = None,
                data_overrides: dict[str, Any] | None = None,
                optimizer_overrides: dict[str, Any] | None = None,
                trainer_overrides: dict[str, Any] | None = None) -> RecipeCheck:
    """Read a recipe (``yaml.safe_load``, no code runs; with its ``base:`` recipes); dropout is turned off,
    and ``defer_embedding_wgrad_compute`` (the schedule's business, not the math's). Of the Trainer's options
    only ``precision`` is an override (``--trainer.precision``): the others are the check's own flags."""
    from lightning_megatron.module import MegatronLightningModule

    cfg = read_recipe(path)
    refuse_moved_class_paths(cfg, f"recipe {str(path)!r}")
    model_class, model = _section(cfg.get("model"))
    spelled = "model.init_args." if model_class else "model."
    data_class, data = _section(cfg.get("data"))
    data.update(data_overrides or {})
    data_class = data_class or DEFAULT_DATA_CLASS
    model_class = model_class or _default_model_class(data_class)
    data_arguments = _arguments(import_class(data_class))
    unknown = [k for k in data_overrides or {} if k.split(".")[0] not in data_arguments]
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in data_arguments.values()):
        raise ValueError(f"--data.{unknown[0]} is not an argument of {data_class.rsplit('.', 1)[-1]}; its arguments: "
                         f"{', '.join(data_arguments)}")
    cls = import_class(model_class)
    if issubclass(cls, MegatronLightningModule):  # an argument where it was before it moved: say where it is now
        problems = cls.moved_argument_problems(model, spelled)
        problems += cls.moved_argument_problems(model_overrides or {}, "--model.")
        if problems:
            raise ValueError(f"{cls.__name__}'s architecture is its config record: " + "; ".join(problems))
    for key, value in (model_overrides or {}).items():
        _set(model, key, value)
    if issubclass(cls, MegatronLightningModule) and model.get("init_from") and Path(model["init_from"]).exists():
        # As `fit --model.init_from`: the source fixes the architecture (cli_config._architecture_of_init_from);
        # one not there (a recipe's placeholder) leaves the recipe's, which estimates need, and a run refuses.
        moved = cls.moved_arguments()
        for key, value in cls.read_architecture(model["init_from"]).items():
            if not (key == "vocab_size" and value is None):
                _set(model, moved.get(key, key), value)
    dropout = {}  # every dropout probability, at its value or default, then off
    for where, default in _dropout_arguments(cls).items():
        value = _get(model, where, default)
        if isinstance(value, (int, float)):
            dropout[where] = float(value)
            _set(model, where, 0.0)
    for key, record in model.items():  # a record given as a mapping (``lora: {rank: 8, dropout: 0.05}``): its too
        for name, value in (record.items() if isinstance(record, dict) else ()):
            where = f"{key}.{name}"
            if name.endswith("dropout") and where not in dropout and type(value) in (int, float):
                dropout[where] = float(value)
                record[name] = 0.0
    # A schedule-only option (bitwise equal on or off: tests/test_optimizer_grad_norm.py) that the
    # one-process reference and every layout without pipelining refuse: the check compares the math.
    # The estimates plan with them (schedule_only, as_trained).
    schedule_only: dict[str, Any] = {}
    for where in ("defer_embedding_wgrad_compute", "config.defer_embedding_wgrad_compute"):
        if _get(model, where):
            schedule_only[where] = _get(model, where)
            _set(model, where, False)
    for where in ("wgrad_deferral_limit", "config.wgrad_deferral_limit"):  # bounds the deferral: without it, none
        if _get(model, where):
            schedule_only[where] = _get(model, where)
            _set(model, where, 0)
    trainer = cfg.get("trainer") or {}
    kept, skipped = [], []
    for cb in trainer.get("callbacks") or []:
        path_ = cb.get("class_path", "") if isinstance(cb, dict) else str(cb)
        if path_ in _CALLBACKS:
            kept.append((path_.rsplit(".", 1)[1], dict(cb.get("init_args") or {})))
        else:
            skipped.append(path_)
    # The CLI's named sections (``megatron_optimizer:``, ``lr_schedule:``) are these callbacks too.
    if optimizer_overrides:  # --megatron_optimizer.NAME VALUE: the section's fields
        cfg["megatron_optimizer"] = {**(cfg.get("megatron_optimizer") or {}), **optimizer_overrides}
    for section, name in _SECTIONS.items():
        if cfg.get(section) is not None:  # megatron_optimizer: the fields of the callback's OptimizerConfig
            args = dict(cfg[section])
            kept.append((name, {"config": args} if name == "MegatronOptimizerCallback" else args))
    for key in trainer_overrides or {}:
        if key != "precision":
            instead = _CHECK_OWN.get(key, _LAYOUTS)
            raise ValueError(f"--trainer.{key} is not an override of check: {instead}; of the Trainer's options only "
                             f"--trainer.precision changes what a layout computes")
    precision = (trainer_overrides or {}).get("precision", trainer.get("precision"))
    optimizer, lr_scheduler = _torch_section(cfg, "optimizer", cls), _torch_section(cfg, "lr_scheduler", cls)
    trainer_options = {k: trainer[k] for k in ("accumulate_grad_batches", "gradient_clip_val") if k in trainer}
    return RecipeCheck(optimizer=optimizer, lr_scheduler=lr_scheduler, trainer_options=trainer_options,
                       model=model, model_class=model_class, data_class=data_class, dropout=dropout,
                       schedule_only=schedule_only, data=data, callbacks=kept, skipped_callbacks=skipped,
                       precision=None if precision is None else str(precision), max_steps=trainer.get("max_steps"),
                       layout=_recipe_layout(trainer, cfg.get("megatron_optimizer")),
                       cpu_tuning=_cpu_tuning(trainer))


def _torch_section(cfg: dict[str, Any], name: str, cls: type) -> tuple[str, dict[str, Any]] | None:
    """The recipe's top-level ``optimizer:`` / ``lr_scheduler:`` section as (class path, init args), which ``fit``
    hands to the module (``use_optimizer`` / ``use_lr_scheduler``); refused for a module that cannot take it, as
    ``fit`` refuses it."""
    from lightning_megatron.module import MegatronLightningModule

    section = cfg.get(name)
    if not section:
        return None
    class_path, args = (str(section), {}) if isinstance(section, str) else _section(section)
    if class_path is None:
        raise ValueError(f"the recipe's {name}: section names no class_path ({section!r})")
    if not issubclass(cls, MegatronLightningModule):
        raise ValueError(f"the recipe's {name}: section is built by a lightning_megatron.module."
                         f"MegatronLightningModule on its parameter groups; {cls.__name__} is not one: build it in "
                         f"its configure_optimizers")
    return class_path, args


def _cpu_tuning(trainer: dict[str, Any]) -> CPUTuning | None:
    """:attr:`RecipeCheck.cpu_tuning` of a recipe's ``trainer`` section: its MegatronStrategy's ``cpu_tuning``, read as
    the strategy reads the argument (``true``; a mapping of the record's fields, or ``class_path`` and ``init_args``;
    ``false`` or none: off); a field the record lacks is refused, naming the record's fields."""
    from lightning_megatron.cpu import CPUTuning

    strategy = trainer.get("strategy")
    value = (strategy.get("init_args") or {}).get("cpu_tuning") if isinstance(strategy, dict) else None
    if not isinstance(value, dict):
        return CPUTuning.from_argument(value)
    given = dict(value.get("init_args") or {}) if "class_path" in value else value
    known = [f.name for f in fields(CPUTuning)]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"trainer.strategy.init_args.cpu_tuning: {', '.join(unknown)} is not a field of "
                         f"lightning_megatron.cpu.CPUTuning ({', '.join(known)})")
    return CPUTuning(**given)


def _recipe_layout(trainer: dict[str, Any], optimizer: Any) -> ParallelDims | None:
    """:attr:`RecipeCheck.layout` of a recipe's ``trainer`` and ``megatron_optimizer`` sections."""
    strategy = trainer.get("strategy")
    if not isinstance(strategy, dict) or not str(strategy.get("class_path", "")).endswith("MegatronStrategy"):
        return None
    args = strategy.get("init_args") or {}
    zero1 = bool(optimizer.get("use_distributed_optimizer")) if isinstance(optimizer, dict) else False
    try:
        fields = ParallelDims.fields_of_strategy_kwargs(args)
        layout = ParallelDims(**{**fields, "sequence_parallel": bool(fields["sequence_parallel"])}, zero1=zero1)
        devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
        if isinstance(devices, int) and isinstance(nodes, int):
            layout = layout.for_world_size(devices * nodes)
    except ValueError:
        return None
    return layout


def build_module(model_class: str, model: dict[str, Any], optimizer: tuple[str, dict[str, Any]] | None = None,
                 lr_scheduler: tuple[str, dict[str, Any]] | None = None):
    """The recipe's module (module-level: picklable for spawn), with the recipe's top-level ``optimizer`` and
    ``lr_scheduler`` sections as ``fit`` gives them to it."""
    module = import_class(model_class)(**model)
    if optimizer is not None:
        module.use_optimizer(*optimizer)
    if lr_scheduler is not None:
        module.use_lr_scheduler(*lr_scheduler)
    return module


def build_dataset(data_class: str, data: dict[str, Any], num_samples: int):
    """The recipe's map-style training dataset (the one its ``train_dataloader`` reads), at least
    ``num_samples`` long where the datamodule takes ``train_samples`` (BertDataModule; its corpus
    cache must exist)."""
    cls = import_class(data_class)
    if "train_samples" in _arguments(cls):
        data = {**data, "train_samples": num_samples}
    dm = cls(**data)
    dm.setup("fit")
    return dm.train_dataloader().dataset


def build_callbacks(callbacks: list[tuple[str, dict[str, Any]]], layout: ParallelDims) -> list:
    from lightning_megatron import callbacks as lm_callbacks
    from lightning_megatron.optimizer.config import OptimizerConfig

    def build(name: str, kwargs: dict[str, Any]) -> Any:
        if name == "MegatronOptimizerCallback":  # {"config": {clip_grad: ...}} as in trainer.callbacks
            return lm_callbacks.MegatronOptimizerCallback(OptimizerConfig(**dict(kwargs.get("config") or {})))
        return getattr(lm_callbacks, name)(**kwargs)

    return [build(name, kwargs) for name, kwargs in callbacks]


def fill_vocab_size(recipe: RecipeCheck, dm: Any = None) -> None:
    """A module taking ``vocab_size`` (or a config record with one) gets the datamodule's (``dm``, else one built
    from the recipe's data arguments: its tokenizer's, as ``fit`` gives it) in ``recipe.model`` when the recipe
    leaves it unset; a module's own default (``vocab_size: int = 16``) stands."""
    from lightning_megatron.language.module import LanguageLightningModule

    model_cls = import_class(recipe.model_class)
    argument = _arguments(model_cls).get("vocab_size")
    where = ("config.vocab_size" if issubclass(model_cls, LanguageLightningModule)
             else "vocab_size" if argument is not None and argument.default in (inspect.Parameter.empty, None)
             else None)
    if where is None or _get(recipe.model, where) is not None:
        return
    dm = import_class(recipe.data_class)(**recipe.data) if dm is None else dm
    vocab = getattr(dm, "vocab_size", None)
    if vocab is None:
        raise ValueError(f"{recipe.model_class} takes vocab_size, the recipe leaves it unset and "
                         f"{recipe.data_class} has no vocab_size: set --model.{where}")
    _set(recipe.model, where, int(vocab))


def factories(recipe: RecipeCheck, steps: int, global_batch_size: int) -> dict[str, Any]:
    """Prepare the data once here (the corpus cache), then the picklable factories of :func:`check_layouts`
    (the model's vocabulary the datamodule's where the recipe leaves it unset: :func:`fill_vocab_size`)."""
    data_cls = import_class(recipe.data_class)
    dm = data_cls(**recipe.data)
    dm.prepare_data()
    filled = replace(recipe, model=copy.deepcopy(recipe.model))
    fill_vocab_size(filled, dm)
    if recipe.model_class == CLASSIFIER_CLASS and "num_classes" not in filled.model:  # `finetune`: the data's
        filled.model["num_classes"] = dm.num_classes
    return dict(module_factory=functools.partial(build_module, recipe.model_class, filled.model, recipe.optimizer,
                                                 recipe.lr_scheduler),
                dataset_factory=functools.partial(build_dataset, recipe.data_class, recipe.data,
                                                  steps * global_batch_size),
                callbacks_factory=functools.partial(build_callbacks, recipe.callbacks))
