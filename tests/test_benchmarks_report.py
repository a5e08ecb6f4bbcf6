"""benchmarks/report.py rewrites only its own part of docs/benchmarks.md: sections recorded by hand around
the ``report:begin`` / ``report:end`` markers survive a regeneration, and a page without the markers is
refused, not overwritten."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import report  # noqa: E402

META = dict(command="benchmarks/run.py", date="2026-12-01 00:00 UTC", elapsed_min=1.0, git="abc1234",
            cpu="test CPU", versions={"torch": "2.13.0"}, rounds=1, omp_wait_policy="PASSIVE", quiet_waited_s=0)
GEMM = {"rows": [], "peak": {"fp32": 1e11, "bf16": 2e11}}


def _rows(step_s: float) -> list[dict]:
    rank = {"max_rss": 2**30, "rss_before_model": 2**29, "state_bytes": {"total": 2**20},
            "optimizer_stepped": True, "threads": 2}
    rows = [{"size": "tiny", "framework": "ours", "precision": "fp32", "tp": 1, "pp": 1, "world": 1,
             "step_s": step_s, "cpu_s": 2 * step_s, "background": 0.0, "ranks": [rank], "profile_ranks": []}]
    report.derive(rows, GEMM["peak"])
    return rows


def _write(path: Path, step_s: float) -> str:
    report.write_markdown(str(path), META, GEMM, _rows(step_s), [], None, [])
    return path.read_text()


HAND = "## GPU check\n\nRecorded by hand on 2026-12-01: 1.23x.\n\n## Checkpoint memory\n\n| rank | peak |\n"


def test_regenerating_keeps_the_hand_written_sections(tmp_path):
    page = tmp_path / "benchmarks.md"
    first = _write(page, step_s=0.5)  # no page yet: the generated part between the markers, nothing else
    assert first.startswith(report.BEGIN + "\n# Benchmarks\n") and first.endswith(report.END + "\n")
    assert "| 0.500 |" in first

    intro = "<!-- a note above the report -->\n"
    page.write_text(intro + first + "\n" + HAND)
    second = _write(page, step_s=0.25)
    assert second.startswith(intro + report.BEGIN + "\n")
    assert second.endswith(report.END + "\n\n" + HAND)  # verbatim, in place
    assert "| 0.250 |" in second and "| 0.500 |" not in second  # the generated part was replaced
    assert second.count(report.BEGIN) == second.count(report.END) == 1
    assert _write(page, step_s=0.25) == second  # regenerating is idempotent


def test_a_page_without_markers_is_refused(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n" + HAND)
    with pytest.raises(ValueError, match="report:begin"):
        _write(page, step_s=0.5)
    assert page.read_text() == "# Benchmarks\n\n" + HAND  # untouched


def test_the_committed_page_has_the_markers():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    before, after = report._surroundings(str(ROOT / "docs" / "benchmarks.md"))
    assert text.startswith(before + report.BEGIN) and text.endswith(report.END + "\n" + after)
    assert "## GPU check" in after and "## Checkpoint memory (ZeRO-1)" in after


def test_the_background_load_does_not_count_ranks_a_forkserver_reaped(tmp_path: Path) -> None:
    """run.py's *background* is the machine's busy time less ours. Our ranks are grandchildren (the spawn
    helper's forkserver, our child, forks and reaps them), so counting only the children we reaped reported
    them as other processes' load: the CPU time of a grandchild its parent reaped must count as ours."""
    import subprocess

    import run

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    done = tmp_path / "reaped"
    parent = (f"import subprocess, sys, time\nsubprocess.run([sys.executable, '-c', {burn!r}], check=True)\n"
              f"open({str(done)!r}, 'w').close()\ntime.sleep(60)\n")
    before = run._descendants_cpu_seconds()
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.monotonic() + 30
        while not done.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the grandchild did not finish"
            time.sleep(0.05)
        counted = run._descendants_cpu_seconds() - before  # the child lives on; its reaped grandchild burned 0.4 s
    finally:
        proc.kill()
        proc.wait()
    assert counted >= 0.35, f"{counted:.2f} CPU s counted as ours; the grandchild alone used 0.4"


def test_norm_bytes_counts_what_docs_benchmarks_quotes():
    """benchmarks/norm_bytes.py, whose figures docs/benchmarks.md quotes ("GPU check"): our RMSNorm's eager fp32
    arithmetic moves 40 + 108 bytes per element, torch's fused LayerNorm 4 + 6 (a smaller shape: bytes per element
    barely depend on it). A fused RMSNorm would change these numbers and the page."""
    import norm_bytes

    rms = norm_bytes.norm_bytes("RMSNorm", hidden=1024, tokens=256)
    layer = norm_bytes.norm_bytes("LayerNorm", hidden=1024, tokens=256)
    assert (round(rms["forward"]), round(rms["backward"])) == (40, 108), rms["ops"]
    assert (round(layer["forward"]), round(layer["backward"])) == (4, 6), layer["ops"]
