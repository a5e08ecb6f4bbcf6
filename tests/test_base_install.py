"""The README's first command in the library's own install, not the test tools': ``fit --config
recipes/bert_tiny.yaml`` (shortened) run by an interpreter that sees only what ``pip install -e .`` installs, the
base dependencies of pyproject.toml and theirs (extras and markers evaluated as pip does). That interpreter is a
virtual environment without pip whose site-packages links to those distributions of this environment, and to this
checkout. A package the library imports without declaring it fails here at once (rich, which transformers'
dependencies had brought, stopped the README's first command once transformers left the base install); without
the ``hf`` extra, ``export hf`` of the checkpoint it wrote stops in one line naming the extra."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement
from project_file import ROOT, canonical, distributions, project


def base_install() -> dict[str, importlib.metadata.Distribution]:
    """The distributions ``pip install -e .`` brings, by canonical name: the project's dependencies and, recursively,
    theirs (each requirement's extras followed, its markers evaluated for this interpreter)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "") for r in project()["dependencies"]]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonical(requirement.name)
        dist = found.setdefault(name, importlib.metadata.distribution(requirement.name))
        for wanted in ("", *requirement.extras):
            if (name, wanted) not in seen:
                seen.add((name, wanted))
                todo += [(Requirement(r), wanted) for r in dist.requires or ()]
    return found


def _environment(where: Path) -> Path:
    """A virtual environment holding links to the base install's files and a path entry for this checkout."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(where), "platbase": str(where)}))
    linked: set[str] = set()
    for dist in base_install().values():
        for file in dist.files or ():
            top = file.parts[0]
            if top != ".." and top not in linked and not top.endswith(".pth"):
                linked.add(top)
                (site / top).symlink_to(Path(dist.locate_file(top)))
    (site / "lightning_megatron_checkout.pth").write_text(f"{ROOT}\n")
    return where / "bin" / "python"


def test_the_base_install_leaves_transformers_and_scipy_to_the_extras():
    """Neither is in what the README's first command installs, directly or through a dependency: torchmetrics,
    imported by Lightning, imports both whenever they are installed (docs/benchmarks.md, "Start-up without
    transformers"); the ``hf`` extra and the test tools have transformers."""
    names = set(base_install())
    assert {"torch", "lightning", "rich", "jsonargparse", "docstring-parser"} <= names, sorted(names)
    assert not names & {"transformers", "scipy", "scikit-learn", "sentence-transformers", "datasets", "pytest"}, (
        sorted(names))
    extras = project()["optional-dependencies"]
    assert "transformers" in distributions(extras["hf"]) and "transformers" in distributions(extras["test"])


def test_the_readme_first_command_runs_in_the_librarys_own_install(tmp_path):
    python = _environment(tmp_path / "venv")
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": ""}
    fit = subprocess.run(
        [str(python), "-m", "lightning_megatron.cli", "fit", "--config", str(ROOT / "recipes/bert_tiny.yaml"),
         "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--model.config.num_layers", "1",
         "--data.global_batch_size", "8", "--data.micro_batch_size", "4", "--data.max_seq_length", "64",
         "--model.config.max_sequence_length", "64"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert fit.returncode == 0 and "`Trainer.fit` stopped: `max_steps=2` reached." in fit.stdout + fit.stderr, (
        fit.stdout[-3000:] + fit.stderr[-3000:])
    probe = subprocess.run([str(python), "-c", "import lightning_megatron, rich, transformers"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert "No module named 'transformers'" in probe.stderr, probe.stderr  # the environment is what it claims
    ckpt = tmp_path / "runs" / "bert_tiny" / "checkpoints" / "last.ckpt"
    export = subprocess.run([str(python), "-m", "lightning_megatron.cli", "export", "hf", "--ckpt_path", str(ckpt),
                             "--output", str(tmp_path / "hf")], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert export.returncode == 1 and "pip install 'lightning-megatron[hf]'" in export.stderr, export.stderr[-3000:]
    assert "Traceback" not in export.stderr and not (tmp_path / "hf").exists()
