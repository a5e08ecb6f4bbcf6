"""Run a function on N ranks in spawned processes, with a timeout, for tests.

Every multi-process test goes through :func:`run_distributed`:
- each rank is a fresh ``spawn``-ed process with ``torch.set_num_threads(1)`` (2 cores here);
- the default process group is initialized with a collective timeout: gloo on CPU; with the test
  device cuda (``pytest --device cuda`` / ``LM_TEST_DEVICE=cuda``) NCCL, one GPU per rank
  (``torch.set_default_device``), and the test is skipped, saying why, with fewer GPUs than ranks;
- as soon as one rank fails, every rank is killed and that rank's traceback is raised in pytest;
- the whole run is bounded by ``timeout`` seconds, after which every rank is killed.

Rank results are sent back with ``torch.save`` so tensors survive the process exit.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["run_distributed", "DistributedTestFailure", "test_device", "accelerator", "DEVICE_ENV"]

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


class DistributedTestFailure(AssertionError):
    """A rank raised; the message carries that rank's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, timeout: float,
            fn: Callable[..., Any], args: tuple, kwargs: dict, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        value = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
                    backend: str | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``fn`` must be importable (a module-level function). Inside it, ``torch.distributed`` is
    initialized and ``dist.get_rank()`` tells the rank. ``backend`` defaults to the test device's
    (gloo on cpu, nccl on cuda).
    """
    import torch

    if backend is None:
        backend = "nccl" if test_device() == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        import pytest

        pytest.skip(f"{world_size} ranks on NCCL need {world_size} GPUs; this machine has "
                    f"{torch.cuda.device_count()}")

    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, timeout, fn, args, kwargs, results),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"distributed test did not finish within {timeout:.0f}s "
                                   f"(ranks done: {sorted(out)})")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise DistributedTestFailure(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} without reporting")
                continue
            if status == "error":
                raise DistributedTestFailure(f"rank {rank} of {world_size} failed:\n{payload}")
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=0.5 if len(out) == world_size else 0)
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
    return [out[r] for r in range(world_size)]
