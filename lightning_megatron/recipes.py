"""Recipe files: a recipe may start from another one (``base:``), so that recipes share what they share.

    base: _bert_pretraining.yaml      # relative to this file; or a list of files, applied in order

A recipe is read with ``yaml.safe_load`` (no code runs), its bases first (recursively), and merged:

- mappings merge key by key at any depth, and a value in the recipe replaces the base's, ``null``
  included (``lr_schedule: null`` drops the base's section);
- lists replace the base's list, except lists of ``class_path`` entries (``trainer.callbacks``,
  ``trainer.logger``, whose entries may be bare class names too): those merge entry by entry on the class; an
  entry of a class the base lists once gets its ``init_args`` merged, a new class is appended, and a class either
  side lists more than once is the recipe's entries of it (which would merge into which is not guessed);
- arguments written flat over a base's mapping that has a ``class_path`` are its ``init_args`` (as the command
  line's ``--data.NAME``);
- a mapping with a ``class_path`` other than the base's (or where the base has none) replaces it
  whole: another class's arguments do not carry over. A class is compared as jsonargparse resolves it (a bare
  name, another module path of the same class: :func:`_same_class`).

``lightning-megatron fit|validate|test|predict|finetune ... --config RECIPE`` and ``check --config
RECIPE`` read recipes this way (:func:`resolve_config_arguments`, :func:`read_recipe`); a recipe
without ``base:`` is passed to LightningCLI as it is.

A class path that has moved (:data:`MOVED_CLASS_PATHS`), in a recipe or on the command line, is refused
before anything is built, in one line naming the new path (:func:`refuse_moved_class_paths`); it is never
rewritten behind the user's back.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any

import yaml

__all__ = ["BASE_KEY", "config_recipes", "DEFAULT_DATA_CLASS", "DEFAULT_MODEL_CLASS", "MOVED_CLASS_PATHS", "RecipeError", "import_class",
           "merge_recipes", "read_recipe", "refuse_moved_class_paths", "refuse_unknown_config_fields",
           "refuse_unreadable_recipes",
           "resolve_config_arguments", "MERGED_FROM", "typed_arguments"]

DEFAULT_MODEL_CLASS = "lightning_megatron.models.bert.module.BertLightningModule"
"""The module a recipe's ``model:`` section builds when it names no ``class_path`` (the CLI's and
``check``'s default: the one place either names a model family)."""
DEFAULT_DATA_CLASS = "lightning_megatron.datamodules.pretraining.BertDataModule"
"""The datamodule a recipe's ``data:`` section builds when it names no ``class_path``."""

BASE_KEY = "base"
"""The top-level key naming the recipe(s) a recipe starts from."""


class RecipeError(ValueError):
    """A recipe that cannot be read: a missing base, a cycle, a top level that is not a mapping."""


_PRETRAINING = "lightning_megatron.datamodules.pretraining"
_FINETUNE = "lightning_megatron.datamodules.finetune"
MOVED_CLASS_PATHS: dict[str, str] = {
    "lightning_megatron.data.datamodule.BertDataModule": f"{_PRETRAINING}.BertDataModule",
    "lightning_megatron.data.datamodule.PretrainingDataModule": f"{_PRETRAINING}.PretrainingDataModule",
    "lightning_megatron.data.BertDataModule": f"{_PRETRAINING}.BertDataModule",
    "lightning_megatron.data.gpt_datamodule.GPTDataModule": "lightning_megatron.datamodules.gpt.GPTDataModule",
    "lightning_megatron.data.GPTDataModule": "lightning_megatron.datamodules.gpt.GPTDataModule",
    "lightning_megatron.data.labelled_text.LabelledTextDataModule": f"{_FINETUNE}.LabelledTextDataModule",
    "lightning_megatron.data.labelled_text.FinetuneDataModule": f"{_FINETUNE}.FinetuneDataModule",
    "lightning_megatron.data.LabelledTextDataModule": f"{_FINETUNE}.LabelledTextDataModule",
}
"""Class paths recipes could name that have moved -> where the class is now: the LightningDataModules left
``lightning_megatron.data`` (which imports no Lightning) for ``lightning_megatron.datamodules``."""

_MOVED = re.compile("|".join(rf"(?<![\w.]){re.escape(old)}(?![\w.])" for old in MOVED_CLASS_PATHS))


def import_class(path: str) -> type:
    """The class at ``module.Name`` (what LightningCLI does with a ``class_path``)."""
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"class_path {path!r} cannot be imported: {e}") from None
    if not isinstance(cls, type):
        raise ValueError(f"class_path {path!r} is not a class")
    return cls


def _moved_in(value: Any, where: str) -> tuple[str, str] | None:
    """(where, old class path) of the first string in ``value`` (walked through mappings and lists)
    that is a moved class path."""
    if isinstance(value, str):
        return (where, value.strip()) if _MOVED.fullmatch(value.strip()) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _moved_in(item, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def refuse_moved_class_paths(value: dict[str, Any] | list[str], source: str = "the command line") -> None:
    """Raise :class:`RecipeError` naming the new class path when ``value`` names a class path that has
    moved (:data:`MOVED_CLASS_PATHS`): a recipe (``source``: its file), or command-line arguments
    (``--data lightning_megatron.data.BertDataModule``; the recipes of ``--config`` are read too)."""
    if isinstance(value, dict):
        found = _moved_in(value, "")
        if found is not None:
            _refuse(f"{source} ({found[0]})", found[1])
        return
    for i, arg in enumerate(value):
        config = value[i + 1] if arg in ("--config", "-c") and i + 1 < len(value) else (
            arg[len("--config="):] if arg.startswith("--config=") else None)
        if config is not None:
            recipe = _recipe_or_none(config)
            if recipe is not None:
                refuse_moved_class_paths(recipe, "the recipe" if "\n" in config else f"recipe {config!r}")
        elif not (i and value[i - 1] in ("--config", "-c")):
            found = _MOVED.search(arg)
            if found is not None:
                _refuse(source, found.group(0))


def refuse_unknown_config_fields(argv: list[str], model_class: type | None = None) -> None:
    """Raise :class:`RecipeError` when a ``--config`` recipe's ``model`` section, or a ``--model.config.<field>``
    (``--model.init_args.config.<field>``) flag, gives its module's config record (``config:``, a
    ``LanguageModelConfig``) a field the record does not have, naming it, its close matches and the record:
    LightningCLI printed its whole usage and a 70-line dump of the parse, the one line that matters near the end
    ("Option 'moe_router_enable_expert_bias' is not accepted"). ``model_class``: the class the command builds
    where nothing names one by class_path (the CLI's default otherwise)."""
    named_by: Any = None  # the model's class_path, the last one given (a recipe's, then the command line's)
    for recipe in config_recipes(argv):
        model = recipe.get("model")
        if not isinstance(model, dict):
            continue
        named = model.get("class_path")
        named_by = named or named_by
        args = model.get("init_args") if named else model
        config = args.get("config") if isinstance(args, dict) else None
        if isinstance(config, dict):
            _refuse_unknown_fields(named or model_class, config, "the recipe's",
                                   "model.init_args.config" if named else "model.config")
    flags: dict[str, list[str]] = {}
    for i, arg in enumerate(argv):
        flag = arg.split("=", 1)[0]
        if flag in ("--model", "--model.class_path") and "=" not in arg and i + 1 < len(argv):
            named_by = argv[i + 1]
        elif flag in ("--model", "--model.class_path"):
            named_by = arg.split("=", 1)[1]
        for prefix in ("--model.config.", "--model.init_args.config."):
            if flag.startswith(prefix) and "." not in flag[len(prefix):]:
                flags.setdefault(prefix[2:-1], []).append(flag[len(prefix):])
    for spelled, fields in flags.items():
        _refuse_unknown_fields(named_by or model_class, dict.fromkeys(fields), "the command line's", spelled)


def _refuse_unknown_fields(named: Any, config: dict[str, Any], whose: str, spelled: str) -> None:
    import difflib
    import inspect

    try:  # a class, or its class path
        cls = named if inspect.isclass(named) else import_class(str(named or DEFAULT_MODEL_CLASS))
    except (ImportError, AttributeError, ValueError):
        return  # LightningCLI names a class it cannot import
    record = getattr(cls, "config_class", None)
    if not (inspect.isclass(record) and dataclasses.is_dataclass(record)):
        return
    fields = sorted(f.name for f in dataclasses.fields(record) if f.init)
    unknown = sorted(set(config) - set(fields))
    if unknown:
        close = {u: difflib.get_close_matches(u, fields, n=2) for u in unknown}
        hints = "; ".join(f"{spelled}.{u}" + (f" (did you mean {' or '.join(close[u])}?)" if close[u] else "")
                          for u in unknown)
        raise RecipeError(f"{whose} {hints}: not a field of {record.__module__}.{record.__name__} "
                          f"(the {cls.__name__} config record); its fields: {', '.join(fields)}")


def _refuse(where: str, old: str) -> None:
    raise RecipeError(f"{where} names {old}, which has moved: use class_path {MOVED_CLASS_PATHS[old]} "
                      f"(the LightningDataModules left lightning_megatron.data for lightning_megatron.datamodules)")


def refuse_unreadable_recipes(argv: list[str]) -> None:
    """Raise :class:`RecipeError` for a ``--config`` recipe file :func:`read_recipe` refuses (not plain YAML, not
    UTF-8, nested too deeply, expanding past :data:`MAX_RECIPE_VALUES`, a bad ``base:``), before LightningCLI
    reads it (a recipe without ``base:`` went to it as it was)."""
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else (
            arg[len("--config="):] if arg.startswith("--config=") else None)
        if value is not None and "\n" not in value and Path(value).is_file():
            read_recipe(value)


def _recipe_or_none(value: str) -> dict[str, Any] | None:
    """The recipe a ``--config`` value holds (YAML text, or a file read with its bases), or None when it
    is neither (LightningCLI reports that)."""
    try:
        if "\n" in value:
            recipe = yaml.safe_load(value)
        elif Path(value).is_file():
            recipe = read_recipe(value)
        else:
            return None
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return recipe if isinstance(recipe, dict) else None


MAX_RECIPE_VALUES = 100_000
"""The most values a recipe may expand to (a large recipe holds a few hundred)."""


def _values_past(value: Any, limit: int) -> bool:
    """Whether ``value`` holds more than ``limit`` values, each alias counted where it repeats (stops counting
    there: a billion-value alias chain costs ``limit`` steps)."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        count += 1
        if count > limit:
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe at ``path`` with its bases merged in (see the module docstring); no ``base`` key left."""
    return _read(Path(path), ())


def _read(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in seen:
        chain = " -> ".join(str(p) for p in (*seen, resolved))
        raise RecipeError(f"recipe bases form a cycle: {chain}")
    named_by = f" (the base of {str(seen[-1])!r})" if seen else ""
    if not path.is_file():
        raise RecipeError(f"recipe {str(path)!r}{named_by} is not a file")
    try:
        recipe = yaml.safe_load(path.read_text()) or {}
    except (RecursionError, UnicodeDecodeError) as e:
        what = ("nests too deeply" if isinstance(e, RecursionError)
                else f"is not UTF-8 text ({e.reason} at byte {e.start})")
        raise RecipeError(f"recipe {str(path)!r}{named_by} {what}") from None
    except yaml.YAMLError as e:  # e.g. a !!python/object tag: safe_load refuses it, say so in one line
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"recipe {str(path)!r}{named_by} is not plain YAML at{where}: {problem} (recipes hold "
                          f"plain values; tags such as !!python/object are never constructed)") from None
    if not isinstance(recipe, dict):
        raise RecipeError(f"recipe {str(path)!r}: the top level must be a mapping, not {type(recipe).__name__}")
    if _values_past(recipe, MAX_RECIPE_VALUES):
        raise RecipeError(f"recipe {str(path)!r}{named_by} expands to more than {MAX_RECIPE_VALUES:,} values (YAML "
                          f"anchors and aliases repeat what they name: nine levels of ten make a billion, which hung "
                          f"the command's parser); write the values out")
    bases = recipe.pop(BASE_KEY, None)
    if bases is None:
        return recipe
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise RecipeError(f"recipe {str(path)!r}: {BASE_KEY}: must be a file name or a list of them, not {bases!r}")
    merged: dict[str, Any] = {}
    for base in bases:
        merged = merge_recipes(merged, _read(path.parent / base, (*seen, resolved)))
    return merge_recipes(merged, recipe)


def merge_recipes(base: Any, override: Any, key: str | None = None) -> Any:
    """``override`` on top of ``base`` (the rules of the module docstring); neither is modified. ``key``: the
    name the two values stand under (a ``callbacks`` / ``logger`` list merges its entries, bare names included)."""
    if isinstance(base, dict) and isinstance(override, dict):
        if "class_path" in override and not _same_class(base.get("class_path"), override["class_path"]):
            return override
        flat = {k: v for k, v in override.items() if k not in ("class_path", "init_args", "dict_kwargs")}
        if "class_path" in base and flat:  # a class's arguments written flat: its init_args, as --data.NAME is
            override = {**{k: v for k, v in override.items() if k not in flat},
                        "init_args": {**(override.get("init_args") or {}), **flat}}
        out = dict(base)
        for name, value in override.items():
            out[name] = merge_recipes(base[name], value, name) if name in base else value
        return out
    if _class_path_list(base, key) and _class_path_list(override, key):
        return _merge_entries([_entry(v) for v in base], [_entry(v) for v in override])
    return override


def _merge_entries(base: list[dict[str, Any]], override: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A list of ``class_path`` entries on top of the base's: an entry whose class the base lists once is merged
    into it, a new class appended; a class either side lists more than once is the recipe's entries of it, in
    place of the base's (which merges into which would be a guess)."""
    out = [[entry] for entry in base]  # each base entry's place, holding what replaces it
    done: set[int] = set()
    for i, entry in enumerate(override):
        if i in done:
            continue
        mine = [j for j, other in enumerate(override) if _same_class(other["class_path"], entry["class_path"])]
        done.update(mine)
        at = [j for j, held in enumerate(base) if _same_class(held["class_path"], entry["class_path"])]
        if len(at) == 1 and len(mine) == 1:
            out[at[0]] = [merge_recipes(base[at[0]], entry)]
        elif not at:
            out.append([override[j] for j in mine])
        else:
            for j in at:
                out[j] = []
            out[at[0]] = [override[j] for j in mine]
    return [entry for place in out for entry in place]


_ENTRY_LISTS = ("callbacks", "logger")
"""The keys whose lists hold class entries, written as ``class_path`` mappings or bare class names."""


def _entry(value: Any) -> Any:
    return {"class_path": value} if isinstance(value, str) else value


def _class_path_list(value: Any, key: str | None = None) -> bool:
    if not isinstance(value, list) or not value:
        return False
    if all(isinstance(v, dict) and "class_path" in v for v in value):
        return True
    return key in _ENTRY_LISTS and all(isinstance(v, str) or (isinstance(v, dict) and "class_path" in v)
                                       for v in value)


def _same_class(a: Any, b: Any) -> bool:
    """Whether two class paths name one class as jsonargparse resolves them: equal, a bare name and a path that
    ends with it (``MegatronStrategy``), or two module paths of one class (``lightning.pytorch.callbacks.
    ModelCheckpoint`` and ``lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint``; imported only then)."""
    if not isinstance(a, str) or not isinstance(b, str):
        return False
    if a == b:
        return True
    if a.rpartition(".")[2] != b.rpartition(".")[2]:
        return False
    if "." not in a or "." not in b:
        return True
    try:
        return import_class(a) is import_class(b)
    except (ImportError, AttributeError, ValueError):
        return False


def resolve_config_arguments(argv: list[str]) -> list[str]:
    """Command-line arguments with each ``--config RECIPE`` (``-c``, ``--config=``) of a recipe that has
    ``base:`` replaced by the merged recipe as YAML text (LightningCLI takes a config as a path or as
    text); other arguments unchanged."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg in ("--config", "-c") and i + 1 < len(out):
            out[i + 1] = _merged_text(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + _merged_text(arg[len("--config="):])
    return out


def _merged_text(value: str) -> str:
    # YAML text already (the ranks Lightning starts get this process's sys.argv, merged), or a file
    # that cannot be read: passed on as it is, for LightningCLI to take or to report.
    try:
        path = Path(value)
        if "\n" in value or not path.is_file():
            return value
        raw = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return value
    if not isinstance(raw, dict) or BASE_KEY not in raw:
        return value
    return f"{MERGED_FROM}{value}\n" + yaml.safe_dump(read_recipe(path), sort_keys=False)


MERGED_FROM = "# lightning-megatron: the recipe "
"""The first line of a recipe merged with its bases, as YAML text on a command line: the file it was read from."""


def typed_arguments(argv: list[str]) -> list[str]:
    """Command-line arguments with each merged recipe (:func:`resolve_config_arguments`) named by its file again:
    the command as it was typed, for what a run records of itself; YAML text of another origin is
    ``<recipe text>``."""
    out = []
    for arg in argv:
        prefix = "--config=" if arg.startswith("--config=") else ""
        text = arg[len(prefix):]
        if "\n" in text:
            first = text.split("\n", 1)[0]
            text = first[len(MERGED_FROM):] if first.startswith(MERGED_FROM) else "<recipe text>"
        out.append(prefix + text)
    return out


def config_recipes(argv: list[str]) -> list[dict[str, Any]]:
    """The ``--config`` recipes of ``argv`` (merged YAML text, or files read with their bases), read with
    ``yaml.safe_load``; one that cannot be read is left out (LightningCLI reports it)."""
    out = []
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else (
            arg[len("--config="):] if arg.startswith("--config=") else None)
        recipe = _recipe_or_none(value) if value is not None else None
        if recipe is not None:
            out.append(recipe)
    return out
