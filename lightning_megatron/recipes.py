"""Recipe files: a recipe may start from another one (``base:``), so that recipes share what they share.

    base: _bert_pretraining.yaml      # relative to this file; or a list of files, applied in order

A recipe is read with ``yaml.safe_load`` (no code runs), its bases first (recursively), and merged:

- mappings merge key by key at any depth, and a value in the recipe replaces the base's, ``null``
  included (``lr_schedule: null`` drops the base's section);
- lists replace the base's list, except lists of ``class_path`` entries (``trainer.callbacks``,
  ``trainer.logger``): those merge entry by entry on ``class_path``; an entry the base has gets its
  ``init_args`` merged, a new one is appended;
- a mapping with a ``class_path`` other than the base's (or where the base has none) replaces it
  whole: another class's arguments do not carry over.

``lightning-megatron fit|validate|test|predict|finetune ... --config RECIPE`` and ``check --config
RECIPE`` read recipes this way (:func:`resolve_config_arguments`, :func:`read_recipe`); a recipe
without ``base:`` is passed to LightningCLI as it is.

A class path that has moved (:data:`MOVED_CLASS_PATHS`), in a recipe or on the command line, is refused
before anything is built, in one line naming the new path (:func:`refuse_moved_class_paths`); it is never
rewritten behind the user's back.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import yaml

__all__ = ["BASE_KEY", "config_recipes", "DEFAULT_DATA_CLASS", "DEFAULT_MODEL_CLASS", "MOVED_CLASS_PATHS", "RecipeError", "import_class",
           "merge_recipes", "read_recipe", "refuse_moved_class_paths", "resolve_config_arguments"]

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


def _refuse(where: str, old: str) -> None:
    raise RecipeError(f"{where} names {old}, which has moved: use class_path {MOVED_CLASS_PATHS[old]} "
                      f"(the LightningDataModules left lightning_megatron.data for lightning_megatron.datamodules)")


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
    except yaml.YAMLError as e:  # e.g. a !!python/object tag: safe_load refuses it, say so in one line
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"recipe {str(path)!r}{named_by} is not plain YAML at{where}: {problem} (recipes hold "
                          f"plain values; tags such as !!python/object are never constructed)") from None
    if not isinstance(recipe, dict):
        raise RecipeError(f"recipe {str(path)!r}: the top level must be a mapping, not {type(recipe).__name__}")
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


def merge_recipes(base: Any, override: Any) -> Any:
    """``override`` on top of ``base`` (the rules of the module docstring); neither is modified."""
    if isinstance(base, dict) and isinstance(override, dict):
        if "class_path" in override and base.get("class_path") != override["class_path"]:
            return override
        out = dict(base)
        for key, value in override.items():
            out[key] = merge_recipes(base[key], value) if key in base else value
        return out
    if _class_path_list(base) and _class_path_list(override):
        out = list(base)
        index = {entry["class_path"]: i for i, entry in enumerate(out)}
        for entry in override:
            if entry["class_path"] in index:
                out[index[entry["class_path"]]] = merge_recipes(out[index[entry["class_path"]]], entry)
            else:
                out.append(entry)
        return out
    return override


def _class_path_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) and "class_path" in v for v in value)


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
    return yaml.safe_dump(read_recipe(path), sort_keys=False)


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
