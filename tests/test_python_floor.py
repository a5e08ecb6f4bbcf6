"""The code runs on the oldest Python that pyproject.toml's ``requires-python`` admits: vermin reads the package,
the tests and the benchmarks for what each line needs (the standard library's members and arguments included, and
the annotations, which jsonargparse evaluates when it builds the CLI). The suite itself runs on one Python; this is
what stops a 3.11 member from reaching a 3.10 user (``hashlib.file_digest`` did, in the checksum every checkpoint
save and load computes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from project_file import ROOT, project


def _floor() -> str:
    return re.fullmatch(r">=\s*(3\.\d+)", project()["requires-python"]).group(1)


def _vermin(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", "--no-tips",
                           "--violations", "--eval-annotations", "--backport", "typing_extensions",
                           f"-t={_floor()}-", *map(str, paths)], capture_output=True, text=True, timeout=300)


def test_the_package_the_tests_and_the_benchmarks_run_on_the_oldest_python_declared():
    proc = _vermin(ROOT / "lightning_megatron", ROOT / "tests", ROOT / "benchmarks")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_a_newer_member_is_found(tmp_path):
    (tmp_path / "planted.py").write_text("import hashlib\n\ndef f(fh):\n    return hashlib.file_digest(fh, 'sha256')\n")
    proc = _vermin(tmp_path)
    assert proc.returncode != 0 and "hashlib.file_digest" in proc.stdout, proc.stdout + proc.stderr
