"""Collectives between two CPU processes on this host: gloo (TCP loopback) against our shared memory.

For each message size, both ranks run the same collective ``iters`` times on gloo and through
:class:`lightning_megatron.cpu.shared_memory.SharedMemoryCollectives`, alternating
blocks of the two so both see the same background load; a barrier lines the ranks up before every
block. Reported: median microseconds per call (slowest rank) and the algorithm bandwidth
``bytes of the full tensor / time``. The 3 MiB fp32 row is a bert-base activation ``[128, 8, 768]``,
the message of every tensor-parallel all-reduce in the BERT benchmark.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from _common import median, set_threads

__all__ = ["collectives_rank", "SIZES_BYTES"]

SIZES_BYTES = [64 << 10, 1 << 20, 3 << 20, 16 << 20]
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def collectives_rank(iters: int = 20, blocks: int = 3) -> dict[str, Any]:
    from lightning_megatron.communicator import (
        _all_gather_fn,
        _reduce_scatter_fn,
    )
    from lightning_megatron.cpu.shared_memory import enable_shared_memory_collectives

    set_threads(dist.get_world_size())
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))
    shm = enable_shared_memory_collectives(group)
    if shm is None:
        return {"error": "shared-memory collectives are not available on this host"}
    rows = []
    for nbytes in SIZES_BYTES:
        n = nbytes // 4
        x = torch.randn(n)
        out_full, out_chunk = torch.empty(n), torch.empty(n // world)
        calls = {
            ("gloo", "all_reduce"): lambda: dist.all_reduce(x, group=group),
            ("shm", "all_reduce"): lambda: shm.all_reduce(x),
            ("gloo", "all_gather"): lambda: _all_gather_fn(out_full, x[: n // world], group=group),
            ("shm", "all_gather"): lambda: shm.all_gather(out_full, x[: n // world]),
            ("gloo", "reduce_scatter"): lambda: _reduce_scatter_fn(out_chunk, x, group=group),
            ("shm", "reduce_scatter"): lambda: shm.reduce_scatter(out_chunk, x),
        }
        times: dict[tuple[str, str], list[float]] = {k: [] for k in calls}
        for b in range(blocks):
            for key in (calls if b % 2 == 0 else list(calls)[::-1]):
                dist.barrier(group=group)
                fn = calls[key]
                fn()  # warm
                for _ in range(iters):
                    t0 = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - t0)
                x.normal_()  # keep the values finite after repeated in-place sums
        for op in OPS:
            rows.append({"op": op, "bytes": nbytes, "gloo_s": median(times[("gloo", op)]),
                         "shm_s": median(times[("shm", op)])})
    shm.close()
    return {"rows": rows}
