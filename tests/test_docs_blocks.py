"""Every code block of README.md and docs/*.md: python blocks compile, bash blocks parse (``bash -n``), and
the python blocks of each page run in order as one script, ``python page_blocks.py`` in a process of its own
(a page's blocks share a namespace, as a reader pastes them in order); that process is forked from a server
that imported torch and Lightning (tests/dist_utils.py ``run_script``) instead of a new interpreter.

A block preceded by ``<!-- doc-test: parse-only (reason) -->`` (a GPU, a cluster, a long run, a dataset
path) is parsed but not run; docs/finetune.md's blocks are run by tests/test_docs_finetune.py, and bash
blocks (commands that launch training) are run where a test names them, not here.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from dist_utils import run_script

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
    returncode, _, stderr = run_script(script, tmp_path, env, timeout=300)
    assert returncode == 0, (f"{page.name}: its python blocks fail when run in order (exit {returncode}):\n"
                             f"{stderr[-4000:]}")


@pytest.mark.parametrize("page", PARSE_PAGES)
def test_blocks_parse(page):
    for lang, code, _ in page_blocks(page):
        if lang == "python":
            compile(code, f"{page.name} block", "exec")
        else:
            proc = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True, timeout=30)
            assert proc.returncode == 0, f"{page.name}: bash block does not parse:\n{code}\n{proc.stderr}"


def test_a_failing_page_fails(tmp_path):
    """The page runner reports what ``python script`` would: the exit code and traceback of a failing block,
    ``__name__ == "__main__"``, ``sys.argv``, the working folder, the environment, no tests/ on ``sys.path``."""
    script = tmp_path / "page_blocks.py"
    script.write_text("import os, sys\nassert __name__ == '__main__' and sys.argv == [__file__]\n"
                      "assert os.getcwd() == os.environ['EXPECTED_CWD']\n"
                      "assert not any(p.endswith('tests') for p in sys.path), sys.path\n"
                      "print('reached')\nraise ValueError('block 2 is wrong')\n")
    env = dict(os.environ, EXPECTED_CWD=str(tmp_path))
    returncode, stdout, stderr = run_script(script, tmp_path, env, timeout=60)
    assert returncode == 1 and stdout == "reached\n" and "ValueError: block 2 is wrong" in stderr, (stdout, stderr)
    script.write_text("import sys\nsys.exit(3)\n")
    assert run_script(script, tmp_path, env, timeout=60)[0] == 3
