"""Every code block of README.md and docs/*.md: python blocks compile, bash blocks parse (``bash -n``), and
the python blocks of each page run in order as one script, ``python page_blocks.py`` in a process of its own
(a page's blocks share a namespace, as a reader pastes them in order); that process is forked from a server
that imported torch and Lightning (tests/dist_utils.py ``run_python``) instead of a new interpreter.

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
from dist_utils import commands_from_forkserver, run_python

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
    proc = run_python([str(script)], tmp_path, env, timeout=300)
    assert proc.returncode == 0, (f"{page.name}: its python blocks fail when run in order (exit {proc.returncode}):\n"
                                  f"{proc.stderr[-4000:]}")


@pytest.mark.parametrize("page", PARSE_PAGES)
def test_blocks_parse(page):
    for lang, code, _ in page_blocks(page):
        if lang == "python":
            compile(code, f"{page.name} block", "exec")
        else:
            proc = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True, timeout=30)
            assert proc.returncode == 0, f"{page.name}: bash block does not parse:\n{code}\n{proc.stderr}"


_PROBE = """import atexit, json, os, signal, sys, threading, time
print(json.dumps([__name__, getattr(__spec__, "name", None), sys.argv, sys.path, os.getcwd(), os.environ["PROBE"],
                  os.getsid(0) == os.getpid() == os.getpgid(0), str(signal.getsignal(signal.SIGINT)),
                  str(signal.getsignal(signal.SIGTERM))]))
atexit.register(print, "atexit ran")
threading.Thread(target=lambda: (time.sleep(0.3), print("thread ended", flush=True))).start()
print("main ended")
ending = sys.argv[-1]
if ending == "raise":
    raise ValueError("block 2 is wrong")
sys.exit(None if ending in ("none", "new session") else ending if ending.startswith("bye") else int(ending))
"""


def test_python_from_the_forkserver_is_python(tmp_path):
    """``run_python`` (the page runner, and the CLI runs of the tests) gives what a new interpreter gives
    for a script, ``-m module`` and ``-c code``: ``__name__``, ``__spec__``, ``sys.argv``, ``sys.path``, the working
    folder and environment, the signal handlers, a session of its own or not (``start_new_session``), stdout in
    order (a non-daemon thread joined before the ``atexit`` handlers run), the exit status of an exception,
    ``sys.exit(n)``, ``sys.exit(None)`` and ``sys.exit("bye")``, and the error's last line on stderr; and so does
    a command on a shell's line that ``commands_from_forkserver`` runs (stdout, the status, the error's last line)."""
    (tmp_path / "pages").mkdir()
    for where in (tmp_path, tmp_path / "pages"):  # a script's folder, not the working folder, leads sys.path
        (where / "probe.py").write_text(_PROBE)
    env = dict(os.environ, PROBE="set", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for args in (["pages/probe.py", "raise"], [str(tmp_path / "pages" / "probe.py"), "3"], ["-m", "probe", "none"],
                 ["-m", "probe", "bye now"], ["-m", "probe", "raise"], ["-c", _PROBE, "4"], ["probe.py", "new session"]):
        new_session = args[-1] == "new session"
        real = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60, start_new_session=new_session)
        forked = run_python(args, tmp_path, env, timeout=60, start_new_session=new_session)
        assert real.stdout.endswith("main ended\nthread ended\natexit ran\n"), real.stdout
        assert (forked.returncode, forked.stdout) == (real.returncode, real.stdout), (args, forked, real)
        assert forked.stderr.splitlines()[-1:] == real.stderr.splitlines()[-1:], (args, forked.stderr, real.stderr)
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["probe.py", "raise"], tmp_path, env, timeout=0.01)  # killed, as subprocess.run does
    # a command of a shell's line (commands_from_forkserver: the finetune walkthrough's `lightning-megatron`)
    with commands_from_forkserver({"probe": ["-m", "probe"]}, timeout=60) as commands:
        shell_env = dict(env, PATH=commands + os.pathsep + env["PATH"])
        for ending in ("raise", "5"):
            real = subprocess.run([sys.executable, "-m", "probe", ending], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=60)
            shell = subprocess.run(["bash", "-c", f"probe {ending}; echo status $?"], cwd=tmp_path, env=shell_env,
                                   capture_output=True, text=True, timeout=60)
            assert shell.stdout == f"{real.stdout}status {real.returncode}\n", (shell, real)
            assert shell.stderr.splitlines()[-1:] == real.stderr.splitlines()[-1:], (shell.stderr, real.stderr)
