"""Every code block of README.md and docs/*.md: python blocks compile, bash blocks parse (``bash -n``), and
the python blocks of each page run in order in one fresh interpreter (a page's blocks share a namespace,
as a reader pastes them in order).

A block preceded by ``<!-- doc-test: parse-only (reason) -->`` (a GPU, a cluster, a long run, a dataset
path) is parsed but not run; docs/finetune.md's blocks are run by tests/test_docs_finetune.py, and bash
blocks (commands that launch training) are run where a test names them, not here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(<!-- doc-test: parse-only[^>]*-->\s*\n)?```(python|bash)\n(.*?)```", re.S)


def page_blocks(page: Path) -> list[tuple[str, str, bool]]:
    """(language, code, run) of every fenced python/bash block."""
    return [(m.group(2), m.group(3), m.group(1) is None) for m in _BLOCK.finditer(page.read_text())]


RUN_PAGES = [pytest.param(p, id=p.name) for p in PAGES if p.name != "finetune.md"
             and any(lang == "python" and run for lang, _, run in page_blocks(p))]
PARSE_PAGES = [pytest.param(p, id=p.name) for p in PAGES]


@pytest.mark.parametrize("page", RUN_PAGES)
def test_python_blocks_run(page, tmp_path):
    code = "\n\n".join(c for lang, c, run in page_blocks(page) if lang == "python" and run)
    script = tmp_path / f"{page.stem}_blocks.py"  # a file: launchers that re-run the script work
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{page.name}: its python blocks fail when run in order:\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("page", PARSE_PAGES)
def test_blocks_parse(page):
    for lang, code, _ in page_blocks(page):
        if lang == "python":
            compile(code, f"{page.name} block", "exec")
        else:
            proc = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True, timeout=30)
            assert proc.returncode == 0, f"{page.name}: bash block does not parse:\n{code}\n{proc.stderr}"
