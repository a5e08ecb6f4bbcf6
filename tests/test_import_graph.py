"""The package's import graph: no cycles between files or between folders (imports inside functions count:
they are dependencies too), and no upward imports from the inner layers (``tensor_parallel/``,
``transformer/``, ``pipeline/``, ``optimizer/``, ``data/``, ``cost/`` and ``interop/`` import neither
Lightning nor the strategy, the CLI, callbacks, checks, the LightningDataModules or a model family; the
model-agnostic base imports no model family; ``check/`` names no family and no family imports ``check/``;
families never import each other). And what it imports from outside is declared: a dependency of the base
install, or an optional extra's imported only inside a function."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

from project_file import canonical, distributions, project

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_megatron"

ABOVE_INNER = ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_megatron.strategy",
               "lightning_megatron.cli", "lightning_megatron.cli_lightning", "lightning_megatron.cli_config",
               "lightning_megatron.config_checks",
               "lightning_megatron.callbacks", "lightning_megatron.check", "lightning_megatron.models",
               "lightning_megatron.module", "lightning_megatron.setup_checks", "lightning_megatron.step",
               "lightning_megatron.datamodules")
"""What no inner layer imports: Lightning, and the parts of this package built on it."""
INNER: dict[str, tuple[str, ...]] = {
    "lightning_megatron.tensor_parallel": (*ABOVE_INNER, "lightning_megatron.optimizer"),
    "lightning_megatron.transformer": (*ABOVE_INNER, "lightning_megatron.optimizer"),
    "lightning_megatron.pipeline": ABOVE_INNER,
    "lightning_megatron.optimizer": ABOVE_INNER,
    "lightning_megatron.data": ABOVE_INNER,
    "lightning_megatron.cost": ABOVE_INNER,
    "lightning_megatron.interop": (*ABOVE_INNER, "lightning_megatron.export"),
}
"""Inner layer -> what it never imports (the layers and the optimizer's mixed precision, clipping and
ZeRO-1 sit below the Lightning glue; the datamodules over data/ are that glue; the cost contracts and the
generic interop readers reach a family only through what its module class hands them)."""

APART: dict[str, tuple[str, ...]] = {
    "lightning_megatron.check": ("lightning_megatron.models",),
    "lightning_megatron.models": ("lightning_megatron.check", "lightning_megatron.cli",
                                  "lightning_megatron.cli_lightning"),
}
"""Outer parts that never import each other: ``check`` works for any module class (it asks the class for its
costs and its layer), and a family's files never reach up into ``check`` or the CLI."""

KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()
"""Edges allowed to close a cycle, each with the change that removes it (none: h-owner's change removed
strategy -> setup_checks -> callbacks.optimizer -> strategy)."""


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module_level_only: bool, name: str | None = None) -> set[str]:
    """Absolute names this file imports (``from a import b``: ``a.b`` when it is a module, else ``a``);
    ``name``: the module's name when the file lies outside the package (a test's planted file)."""
    tree = ast.parse(path.read_text(), str(path))
    me = name or _name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if module_level_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue  # annotations only: not imported at run time
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in _MODULES else base)
    return out


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in PACKAGE.rglob("*.py")}


_MODULES = _modules()


def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its file. A package's ``__init__``
    reached through ``from package import submodule`` is not an edge (Python runs it first anyway)."""
    return {name: {m for m in _imports(path, module_level_only=False) if m in _MODULES and m != name}
            for name, path in _MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if (node, nxt) in KNOWN_CYCLE_EDGES:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _folder(name: str) -> str:
    """The folder a module lies in (a top-level file is a node of its own)."""
    path = _MODULES.get(name)
    if path is not None and path.name == "__init__.py" or name.count(".") < 2:
        return name
    return name.rpartition(".")[0]


def _folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Folder -> the folders its files import (a folder's own subfolders and parents left out)."""
    out: dict[str, set[str]] = {}
    for name, imported in graph.items():
        mine = _folder(name)
        for other in map(_folder, imported):
            if other != mine and not _under(mine, other) and not _under(other, mine):
                out.setdefault(mine, set()).add(other)
    return out


def test_no_import_cycles_between_folders():
    """Folders form layers too: ``datamodules/`` -> ``strategy`` -> ``config_checks`` -> ``datamodules/`` was
    one (the fine-tuning datamodule now reads the strategy's ``parallel_state`` without importing it)."""
    graph = _folder_graph(_graph())
    assert "lightning_megatron.models.bert" in graph and "lightning_megatron.cost" in graph
    files = {"lightning_megatron.aa.x": {"lightning_megatron.bb.y"}, "lightning_megatron.bb.z": {"lightning_megatron.aa.w"}}
    assert find_cycle(files) is None and find_cycle(_folder_graph(files)) == [
        "lightning_megatron.aa", "lightning_megatron.bb", "lightning_megatron.aa"]  # no file cycle, a folder one
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between folders: " + " -> ".join(cycle)


def test_check_and_the_families_stay_apart():
    wrong = _upward_imports(_MODULES, APART)
    assert not wrong, "\n".join(wrong)


def test_a_family_imported_from_check_or_another_family_is_found(tmp_path):
    """The rules above see a family imported from ``check/`` (inside a function too), ``check/`` imported from
    a family, and one family imported from another."""
    planted = {}
    for name, text in (("lightning_megatron.check.planted_a", "from lightning_megatron.models.bert import BertModel\n"),
                       ("lightning_megatron.check.planted_b",
                        "def f():\n    import lightning_megatron.models.gpt.cost\n"),
                       ("lightning_megatron.models.gpt.planted", "from lightning_megatron.check import memory_cli\n"),
                       ("lightning_megatron.models.gpt.planted_c", "from lightning_megatron.models.bert import specs\n")):
        path = tmp_path / f"{name.rsplit('.', 1)[1]}_{len(planted)}.py"
        path.write_text(text)
        planted[name] = path
    assert _upward_imports({**_MODULES, **planted}, APART) == [
        "lightning_megatron.check.planted_a imports lightning_megatron.models.bert",
        "lightning_megatron.check.planted_b imports lightning_megatron.models.gpt.cost",
        "lightning_megatron.models.gpt.planted imports lightning_megatron.check.memory_cli"]
    assert _family_imports({**_MODULES, **planted}) == [
        "lightning_megatron.models.gpt.planted_c imports lightning_megatron.models.bert.specs"]


def _upward_imports(modules: dict[str, Path], rules: dict[str, tuple[str, ...]] = INNER) -> list[str]:
    """``"<module> imports <name>"`` for every import of a module under a folder of ``rules`` that its
    folder forbids."""
    wrong = []
    for name, path in sorted(modules.items()):
        for layer, above in rules.items():
            if _under(name, layer):
                wrong += [f"{name} imports {imported}" for imported in sorted(_imports(path, False, name))
                          if any(_under(imported, a) for a in above)]
    return wrong


def test_inner_layers_import_nothing_above_them():
    assert all(any(_under(name, layer) for name in _MODULES) for layer in INNER)
    wrong = _upward_imports(_MODULES)
    assert not wrong, "\n".join(wrong)


def test_an_inner_layer_importing_lightning_is_found(tmp_path):
    """The rule above sees a planted ``import lightning.pytorch`` in data/ (inside a function too), a
    datamodule imported from data/, and Lightning in pipeline/ and optimizer/."""
    planted = {}
    for name, text in (("lightning_megatron.data.planted_a", "import lightning.pytorch as pl\n"),
                       ("lightning_megatron.data.planted_b", "def f():\n    from lightning.pytorch import Trainer\n"),
                       ("lightning_megatron.data.planted_c", "from lightning_megatron.datamodules import GPTDataModule\n"),
                       ("lightning_megatron.pipeline.planted", "from lightning_fabric import Fabric\n"),
                       ("lightning_megatron.optimizer.planted", "from lightning_megatron import callbacks\n")):
        path = tmp_path / f"{name.rsplit('.', 1)[1]}_{len(planted)}.py"
        path.write_text(text)
        planted[name] = path
    assert _upward_imports({**_MODULES, **planted}) == [
        "lightning_megatron.data.planted_a imports lightning.pytorch",
        "lightning_megatron.data.planted_b imports lightning.pytorch",
        "lightning_megatron.data.planted_c imports lightning_megatron.datamodules",
        "lightning_megatron.optimizer.planted imports lightning_megatron.callbacks",
        "lightning_megatron.pipeline.planted imports lightning_fabric"]


def _undeclared_imports(modules: dict[str, Path]) -> list[str]:
    """Imports of a package outside the standard library that pyproject.toml does not declare, or that only an
    optional extra declares and a module imports when it is imported (not inside a function)."""
    declared = project()
    base = distributions(declared["dependencies"])
    extras = set().union(*map(distributions, declared["optional-dependencies"].values()))
    installed = importlib.metadata.packages_distributions()
    wrong = []
    for name, path in sorted(modules.items()):
        at_import = {m.partition(".")[0] for m in _imports(path, module_level_only=True, name=name)}
        for top in sorted({m.partition(".")[0] for m in _imports(path, module_level_only=False, name=name)}):
            if top in sys.stdlib_module_names or top == "lightning_megatron":
                continue
            names = {canonical(d) for d in installed.get(top, [top])}
            if names & base or (names & extras and top not in at_import):
                continue
            why = "an extra's, imported with the module" if names & extras else "not declared"
            wrong.append(f"{name} imports {top} ({', '.join(sorted(names))}: {why})")
    return wrong


def test_every_package_the_library_imports_is_declared():
    """A fresh ``pip install -e .`` has what the package imports: a module of rich (Lightning's progress bar
    columns), which transformers' dependencies had brought, stopped the README's first command once
    transformers left the base install."""
    wrong = _undeclared_imports(_MODULES)
    assert not wrong, "\n".join(wrong)


def test_an_undeclared_import_is_found(tmp_path):
    planted = {}
    for name, text in (("lightning_megatron.planted_a", "import packaging.version\n"),
                       ("lightning_megatron.planted_b", "from transformers import AutoConfig\n"),
                       ("lightning_megatron.planted_c", "def f():\n    import transformers\n    import yaml, json\n")):
        path = tmp_path / f"{name.rsplit('.', 1)[1]}.py"
        path.write_text(text)
        planted[name] = path
    assert _undeclared_imports(planted) == [
        "lightning_megatron.planted_a imports packaging (packaging: not declared)",
        "lightning_megatron.planted_b imports transformers (transformers: an extra's, imported with the module)"]


def test_the_generic_base_imports_no_model_family_and_no_strategy():
    path = PACKAGE / "module.py"
    above = ("lightning_megatron.models", "lightning_megatron.strategy", "lightning_megatron.cli")
    bad = sorted(m for m in _imports(path, module_level_only=False) if m.startswith(above))
    assert not bad, bad
    bert = PACKAGE / "models" / "bert" / "module.py"
    assert not [m for m in _imports(bert, module_level_only=False) if m.startswith("lightning_megatron.strategy")]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _family_imports(modules: dict[str, Path]) -> list[str]:
    """``"<module> imports <name>"`` for every import of one family's module from another family."""
    families = sorted(p.name for p in (PACKAGE / "models").iterdir() if (p / "__init__.py").is_file())
    wrong = []
    for family in families:
        mine = f"lightning_megatron.models.{family}"
        others = [f"lightning_megatron.models.{f}" for f in families if f != family]
        for name, path in sorted(modules.items()):
            if _under(name, mine):
                wrong += [f"{name} imports {m}" for m in sorted(_imports(path, False, name))
                          if any(_under(m, o) for o in others)]
    return wrong


def test_model_families_never_import_each_other():
    assert {"bert", "gpt"} <= {p.name for p in (PACKAGE / "models").iterdir() if (p / "__init__.py").is_file()}
    wrong = _family_imports(_MODULES)
    assert not wrong, "\n".join(wrong)


def test_every_public_name_exists():
    """Every name a module lists in ``__all__`` is defined there (a moved or deleted function leaves no
    stale entry: clip_grads listed ``is_counted_once`` after it was removed)."""
    import importlib

    missing = []
    for name in sorted(_MODULES):
        module = importlib.import_module(name)
        missing += [f"{name}.{n}" for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
    assert not missing, missing


def test_the_language_layer_imports_no_model_family_and_its_chunks_no_lightning():
    """``language/`` is below the families (they build on it, it names none of them); its config record and
    chunk base are inner code (no Lightning: a chunk is used without a Trainer), its LightningModule half is not."""
    wrong = []
    for name, path in _MODULES.items():
        if not name.startswith("lightning_megatron.language"):
            continue
        for imported in sorted(_imports(path, module_level_only=False)):
            if imported.startswith("lightning_megatron.models"):
                wrong.append(f"{name} imports {imported}")
            if name != "lightning_megatron.language.module" and (imported == "lightning" or imported.startswith(
                    ("lightning.", "lightning_megatron.module", "lightning_megatron.strategy"))):
                wrong.append(f"{name} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_a_family_s_model_and_module_import_no_other_family():
    """The record, the chunk and the LightningModule of a family stand on ``language/`` alone."""
    wrong = []
    for family, other in (("bert", "gpt"), ("gpt", "bert")):
        for stem in ("config", "model", "module", "specs"):
            path = PACKAGE / "models" / family / f"{stem}.py"
            wrong += [f"models/{family}/{stem}.py imports {m}" for m in _imports(path, module_level_only=False)
                      if m.startswith(f"lightning_megatron.models.{other}")]
    assert not wrong, "\n".join(wrong)
