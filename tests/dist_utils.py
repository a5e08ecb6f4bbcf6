"""Run a function on N ranks in spawned processes, with a timeout, for tests.

Every multi-process test goes through :func:`run_distributed`:
- each rank is a fresh process (:func:`lightning_megatron.check.spawn.run_distributed`: forked from a
  server that imported torch, with the caller's environment) with ``torch.set_num_threads(1)``;
- the default process group is initialized with a collective timeout: gloo on CPU; with the test
  device cuda (``pytest --device cuda`` / ``LM_TEST_DEVICE=cuda``) NCCL, one GPU per rank
  (``torch.set_default_device``), and the test is skipped, saying why, with fewer GPUs than ranks;
- as soon as one rank fails, every rank is killed and that rank's traceback is raised in pytest;
- the whole run is bounded by ``timeout`` seconds, after which every rank is killed.

Rank results are sent back with ``torch.save`` so tensors survive the process exit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lightning_megatron.check.spawn import DistributedTestFailure
from lightning_megatron.check.spawn import run_distributed as _run_distributed

__all__ = ["run_distributed", "run_script", "DistributedTestFailure", "test_device", "accelerator", "DEVICE_ENV"]

DEVICE_ENV = "LM_TEST_DEVICE"


def test_device() -> str:
    """"cpu" or "cuda": the device the tests run on."""
    device = os.environ.get(DEVICE_ENV, "cpu") or "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={device!r}: expected cpu or cuda")
    return device


test_device.__test__ = False  # not a test (pytest collects test_* functions from imported modules)


def accelerator() -> str:
    """The Lightning accelerator for the test device ("cpu" or "gpu")."""
    return "gpu" if test_device() == "cuda" else "cpu"


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
                    backend: str | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results in rank order.

    :func:`lightning_megatron.check.spawn.run_distributed` (the one spawn helper) with the test
    device's backend (gloo on cpu, nccl on cuda) and any picklable result (tests only).
    """
    import torch

    if backend is None:
        backend = "nccl" if test_device() == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        import pytest

        pytest.skip(f"{world_size} ranks on NCCL need {world_size} GPUs; this machine has "
                    f"{torch.cuda.device_count()}")
    return _run_distributed(fn, world_size, *args, timeout=timeout, backend=backend, weights_only=False, **kwargs)


def run_script(script: str | os.PathLike, cwd: str | os.PathLike, env: dict[str, str],
               timeout: float) -> tuple[int, str, str]:
    """Run ``python script`` (its exit code, stdout and stderr), started from the forkserver
    of :func:`run_distributed` instead of a new interpreter: the process skips importing torch and
    Lightning (~10 s on a 2-core host), and is otherwise what ``python script`` starts: ``__main__`` is the
    script (``if __name__ == "__main__"`` runs; launchers that re-run ``sys.argv[0]`` and spawned ranks
    that re-import ``__main__`` find it), ``sys.argv == [script]``, ``sys.path`` the one a fresh interpreter
    computes from ``env``, the working folder ``cwd``. An exception exits 1 with its traceback on stderr;
    past ``timeout`` seconds the process is killed (exit code -9)."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from lightning_megatron.check.spawn import _context

    fresh_path = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                                env=env, cwd=cwd, capture_output=True, text=True, check=True, timeout=60).stdout
    with tempfile.TemporaryDirectory() as scratch:
        outs = [os.path.join(scratch, name) for name in ("stdout", "stderr")]  # paths: the forked process is
        for out in outs:                                                       # not this one's child
            open(out, "w").close()
        proc = _context().Process(target=_script_main, args=(os.fspath(script), os.fspath(cwd), env, fresh_path, outs))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
        stdout, stderr = (Path(out).read_text(errors="replace") for out in outs)
        return proc.exitcode, stdout, stderr


def _script_main(script: str, cwd: str, env: dict[str, str], fresh_path: str, outs: list[str]) -> None:
    import json
    import runpy
    import sys

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script]
    sys.path[:] = [os.path.dirname(script), *json.loads(fresh_path)]
    sys.stdout.flush()
    sys.stderr.flush()
    for stream, out in enumerate(outs, start=1):
        fd = os.open(out, os.O_WRONLY | os.O_TRUNC)
        os.dup2(fd, stream)
        os.close(fd)
    runpy.run_path(script, run_name="__main__")
