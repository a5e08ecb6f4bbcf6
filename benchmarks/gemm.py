"""The machine's limit: dense matrix-multiply FLOP/s (``C = A @ B``, square, 2 n^3 FLOPs).

Measured in a fresh process at every thread count asked (all cores in one process is the ceiling
a training step on one process is held against; one thread is what each of two ranks gets).
Each point is the best of ``repeats`` timed products after one warm-up product.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from _common import CPU_COUNT

__all__ = ["gemm_rank"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def gemm_rank(sizes: list[int], dtypes: list[str], thread_counts: list[int], repeats: int = 3) -> list[dict[str, Any]]:
    """[{dtype, n, threads, flops_per_s}] for every combination (run inside a spawned process)."""
    rows = []
    for threads in thread_counts:
        torch.set_num_threads(min(threads, CPU_COUNT))
        for dtype in dtypes:
            for n in sizes:
                a = torch.randn(n, n).to(_DTYPES[dtype])
                b = torch.randn(n, n).to(_DTYPES[dtype])
                a @ b  # warm-up (and oneDNN kernel selection)
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    a @ b
                    best = min(best, time.perf_counter() - t0)
                rows.append({"dtype": dtype, "n": n, "threads": torch.get_num_threads(),
                             "flops_per_s": 2.0 * n**3 / best})
    return rows
