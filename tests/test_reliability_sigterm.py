"""SIGTERM mid-run: a checkpoint is written, the exit status is non-zero, and resuming continues there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_megatron.preemption import SIGTERM_EXIT_CODE, PreemptionHandler

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "reliability_run.py"


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(SCRIPT), str(root), "--devices", "2", *args], capture_output=True,
                          text=True, timeout=400, env=env, cwd=root)


def _steps(root: Path, rank: int) -> list[int]:
    return [int(line.split()[0]) for line in (root / f"progress-{rank}.txt").read_text().split("\n") if line]


def test_sigterm_saves_exits_nonzero_and_resumes(tmp_path):
    # 2 ranks (TP=2, rank 0 is Lightning's launcher); rank 0 gets SIGTERM at the end of step 3 of 20.
    first = _run(tmp_path, "--max-steps", "20", "--fault", "sigterm", "--fault-step", "3", "--every", "100")
    out = first.stdout + first.stderr
    assert first.returncode == SIGTERM_EXIT_CODE, out[-3000:]
    assert "SIGTERM at step 3: saved" in out, out[-3000:]
    assert (tmp_path / "ckpt" / "last.ckpt").is_dir(), out[-3000:]
    assert _steps(tmp_path, 0) == [1, 2, 3] and _steps(tmp_path, 1) == [1, 2, 3]  # stopped, both ranks together

    second = _run(tmp_path, "--max-steps", "5", "--ckpt-path", "last", "--every", "100")
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"start-{rank}.txt").read_text() == "3"  # no step lost, none repeated
        assert _steps(tmp_path, rank) == [1, 2, 3, 4, 5]


def test_handler_flags_and_exit_code():
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_megatron.preemption import on_sigterm

    handler = PreemptionHandler()
    previous = signal.getsignal(signal.SIGTERM)
    handler.install()
    try:
        assert not handler.should_stop(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the test process keeps running
        assert handler.should_stop(torch.device("cpu"))
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGTERM) == previous

    class _Trainer:  # not fitting: nothing to save, only the exit status
        global_step = 0
        state = type("S", (), {"fn": None})()

    exc = SIGTERMException()
    on_sigterm(_Trainer(), exc)
    assert exc.code == SIGTERM_EXIT_CODE == 143
    other = RuntimeError("x")
    on_sigterm(_Trainer(), other)  # other exceptions are left alone
    with pytest.raises(SystemExit) as info:
        raise exc
    assert info.value.code == 143


_LEAVE_SCRIPT = """
import subprocess, sys, time
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning_megatron.preemption import PreemptionHandler

launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)  # Lightning's own
launcher.procs.append(subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(1.0); sys.exit(143)"]))
observer = _ChildProcessObserver(0, launcher.procs, sleep_period=0.2)  # Lightning's own, polling fast
observer._main_pid = __import__("os").getpid()
observer.start()
child = launcher.procs[0]
PreemptionHandler().leave(launcher, wait_s=30)  # no process group here: only the children part
assert child.returncode == 143, child.returncode
time.sleep(1.0)  # the observer has polled several times since the child exited with 143
print("left")
"""


def test_leave_waits_for_children_without_being_killed_by_lightnings_observer():
    # Lightning's child observer SIGKILLs the launching rank when a child exits non-zero, which every
    # child does after a SIGTERM (143): leave() waits for the children with the observer disarmed.
    proc = subprocess.run([sys.executable, "-c", _LEAVE_SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and "left" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr[-2000:])
