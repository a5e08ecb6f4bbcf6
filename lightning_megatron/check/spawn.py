"""Run a function on N ranks in spawned processes, with a timeout (the check and the tests).

:func:`run_distributed` is what ``lightning-megatron check`` runs every layout with, and what every
multi-process test uses (``tests/dist_utils.py``):
- each rank is a fresh process with ``torch.set_num_threads(1)`` (2 cores here), started from a
  forkserver that has imported torch and Lightning, nothing of ours (``spawn`` where there is none):
  a rank costs a fork instead of a Python start and those imports (~1 s and ~3 s on 2 cores), and
  holds what a spawned rank holds: freshly imported modules, the caller's current working folder,
  ``sys.path`` and environment (passed at each call: a forkserver's own environment is the one it
  started with);
- the default process group is initialized (gloo on CPU; an accelerator backend such as NCCL
  puts rank ``r`` on device ``r``) with a collective timeout;
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
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["run_distributed", "DistributedTestFailure", "free_port"]


class DistributedTestFailure(AssertionError):
    """A rank raised or died; the message carries that rank's traceback."""


def free_port() -> int:
    """A TCP port free on this host now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch"]
"""What the forkserver imports once for every rank it starts: torch and Lightning (modules of ours, and
the caller's, are imported fresh by each rank, as under ``spawn``)."""


def _context() -> Any:
    """A forkserver context preloading torch, or ``spawn`` where the platform has no forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call); later calls keep it
    return ctx


def _worker(rank: int, world_size: int, port: int, backend: str, timeout: float, environ: dict[str, str],
            fn: Callable[..., Any], args: tuple, kwargs: dict, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.clear()  # the caller's environment now, not the one the forkserver started with
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    if backend != "gloo":  # an accelerator backend (NCCL, ...): one device per rank
        torch.accelerator.set_device_index(rank)
        torch.set_default_device(torch.device(torch.accelerator.current_accelerator().type, rank))
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


def _death(rank: int, exitcode: int) -> str:
    """What ended ``rank`` without a report: its exit status, or the signal that killed it."""
    if exitcode >= 0:
        return f"rank {rank} died with exit code {exitcode} without reporting"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "a signal"
    why = (": on Linux most often the out-of-memory killer (`dmesg` names it), a rank larger than this machine's "
           "free memory" if -exitcode == signal.SIGKILL else "")
    return f"rank {rank} was killed by {name} (signal {-exitcode}) without reporting{why}"


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
                    backend: str = "gloo", weights_only: bool = True, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``fn`` must be importable (a module-level function). Inside it, ``torch.distributed`` is
    initialized and ``dist.get_rank()`` tells the rank. Results travel through ``torch.save`` and
    are read with ``torch.load(weights_only=True)``: tensors, numbers, strings, lists, tuples and
    dicts; ``weights_only=False`` (tests only) accepts any picklable result.
    """
    import torch

    ctx = _context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, timeout, environ, fn, args, kwargs, results),
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
                raise TimeoutError(f"distributed run did not finish within {timeout:.0f}s "
                                   f"(ranks done: {sorted(out)})")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise DistributedTestFailure(_death(dead[0], procs[dead[0]].exitcode))
                continue
            if status == "error":
                raise DistributedTestFailure(f"rank {rank} of {world_size} failed:\n{payload}")
            out[rank] = torch.load(io.BytesIO(payload), weights_only=weights_only)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=0.5 if len(out) == world_size else 0)
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
    return [out[r] for r in range(world_size)]
