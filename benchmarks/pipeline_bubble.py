"""Measured pipeline bubble at PP=4: 1F1B vs interleaved, beside the theory.

Theory (uniform stages, forward + backward of one microbatch on one stage takes ``t``):

    1F1B          bubble = (p - 1) / (m + p - 1)          step = (m + p - 1) t
    interleaved   bubble = (p - 1) / (v m + p - 1)        step = (m + (p - 1) / v) t

Measured: 4 gloo processes run the real schedules of :mod:`lightning_megatron.pipeline.schedules`
with ``trace``; each rank's busy time is the sum of its forward/backward events, the step time is
from the common start (after a barrier) to the last rank's end, and

    bubble_r = 1 - busy_r / step_time,     reported: mean over ranks (and the worst rank).

Two kinds of stage work:

- ``sleep`` (default): each chunk's forward sleeps ``t_f / v`` and its backward ``2 t_f / v``
  inside an autograd Function. Sleeping takes no core, so the 4 stages behave like 4 devices even
  on this 2-core machine; what is measured is the schedule plus the real gloo transfers.
- ``compute``: each chunk runs real fp32 matmuls of the same total cost. With 4 processes on 2
  cores, stages that overlap in time slow each other down, which inflates busy time and hides the
  bubble; shown for honesty, not as the reference.

Interleaved rows run twice, with ``overlap_p2p_comm`` off and on (``overlap``: each steady-state
step's exchanges posted before, and waited for after, the other pass's compute).

Run: ``.venv/bin/python benchmarks/pipeline_bubble.py [--mode sleep|compute] [--t-forward-ms 10] [--pp 4]``
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lightning_megatron.parallel_state import initialize_model_parallel  # noqa: E402
from lightning_megatron.parallel_dims import ParallelDims  # noqa: E402
from lightning_megatron.pipeline import (  # noqa: E402
    ScheduleEvent,
    get_forward_backward_func,
    get_schedule,
    stage_chunks,
)

__all__ = ["collect", "theory_bubble"]

S, B, H = 8, 2, 64  # activations [s, b, h]


def theory_bubble(p: int, m: int, v: int) -> float:
    """The layout's schedule's bubble: (p - 1) / (v m + p - 1); v = 1 is plain 1F1B (pipeline/registry.py)."""
    vp = v if v > 1 else None
    return get_schedule("auto", p, vp).bubble(p, vp, m)


class _Work(torch.autograd.Function):
    """Identity whose forward costs ``seconds`` and backward ``2 * seconds`` of wall time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float, matmul: torch.Tensor | None) -> torch.Tensor:
        ctx.seconds, ctx.matmul = seconds, matmul
        _spend(seconds, matmul)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _spend(2 * ctx.seconds, ctx.matmul)
        return grad, None, None


_GEMM_SECONDS: float | None = None


def _spend(seconds: float, matmul: torch.Tensor | None) -> None:
    if matmul is None:
        time.sleep(seconds)
        return
    for _ in range(max(1, round(seconds / _GEMM_SECONDS))):  # calibrated, uncontended
        matmul @ matmul


class BenchChunk(nn.Module):
    """One model chunk: a Linear on the activation plus the emulated stage work."""

    def __init__(self, pre_process: bool, seconds: float, matmul: torch.Tensor | None) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.pre_process, self.seconds, self.matmul = pre_process, seconds, matmul
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.pre_process else self.input_tensor
        return _Work.apply(torch.tanh(self.lin(h)), self.seconds, self.matmul)


def _forward_step(microbatch: torch.Tensor, chunk: BenchChunk):
    return chunk(microbatch), lambda out: ((out.float() ** 2).mean(), {})


def _worker(rank: int, world: int, port: int, configs: list[tuple[int, int, int, bool]], t_forward: float, mode: str,
            steps: int, queue: Any) -> None:
    global _GEMM_SECONDS
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    matmul = None
    if mode == "compute":
        matmul = torch.randn(128, 128)
        start = time.perf_counter()
        for _ in range(50):
            matmul @ matmul
        _GEMM_SECONDS = (time.perf_counter() - start) / 50
    results = []
    for p, v, m, overlap in configs:
        ps = initialize_model_parallel(ParallelDims(tp=1, pp=p, vp=v if v > 1 else None))
        vp = v if v > 1 else None
        chunks = [BenchChunk(c.pre_process, t_forward / v, matmul) for c in stage_chunks(p * v, p, ps.pp_rank, vp)]
        schedule = get_forward_backward_func(p, vp)
        microbatches = [torch.randn(S, B, H) for _ in range(m)]
        runs = []
        for step in range(steps + 1):  # the first step warms up gloo connections
            trace: list[ScheduleEvent] = []
            dist.barrier()
            t0 = time.perf_counter()
            schedule(forward_step_func=_forward_step, microbatches=microbatches, model=chunks, num_microbatches=m,
                     parallel_state=ps, tensor_shape=(S, B, H), dtype=torch.float32, trace=trace,
                     overlap_p2p_comm=overlap)
            t1 = time.perf_counter()
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, (t0, t1, trace))
            if step > 0:
                runs.append(gathered)
        results.append(((p, v, m, overlap), runs))
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def collect(configs: list[tuple[int, int, int, bool]], *, t_forward: float = 0.01, mode: str = "sleep", steps: int = 3
            ) -> list[tuple[tuple[int, int, int, bool], list[list[tuple[float, float, list[ScheduleEvent]]]]]]:
    """Run each ``(p, v, m, overlap_p2p_comm)`` for ``steps`` steps on ``p`` ranks; return per step, per
    rank ``(t0, t1, trace)``."""
    world = max(c[0] for c in configs)
    if any(c[0] != world for c in configs):
        raise ValueError(f"all configs must use the same pp (one world), got {configs}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.start_processes(_worker, args=(world, port, configs, t_forward, mode, steps, queue), nprocs=world,
                               join=False, start_method="spawn")
    results = queue.get(timeout=600)
    procs.join()
    return results


def bubble(step: list[tuple[float, float, list[ScheduleEvent]]]) -> tuple[float, float, float]:
    """``(step_time, mean bubble, worst bubble)`` of one step from per-rank stamps and traces."""
    t0 = min(r[0] for r in step)
    makespan = max(r[1] for r in step) - t0
    fractions = [1 - sum(e.end - e.start for e in r[2]) / makespan for r in step]
    return makespan, sum(fractions) / len(fractions), max(fractions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["sleep", "compute"], default="sleep")
    parser.add_argument("--t-forward-ms", type=float, default=10.0, help="forward time of one full stage")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16], help="values of m")
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages (= processes)")
    parser.add_argument("--vp", type=int, nargs="+", default=[1, 2, 4], help="values of v (1: plain 1F1B)")
    args = parser.parse_args()
    p = args.pp
    configs = [(p, v, m, overlap) for m in args.microbatches for v in args.vp
               for overlap in ((False, True) if v > 1 else (False,))]
    results = collect(configs, t_forward=args.t_forward_ms / 1e3, mode=args.mode, steps=args.steps)
    t = 3 * args.t_forward_ms  # forward + backward of one microbatch on one full stage
    print(f"PP={p}, mode={args.mode}, t_f={args.t_forward_ms:g} ms, t_b=2 t_f per stage, median of {args.steps} steps")
    print(f"{'schedule':<24}{'m':>4}{'theory':>9}{'measured':>10}{'worst rank':>12}"
          f"{'step ms':>10}{'ideal ms':>10}")
    for (pp, v, m, overlap), runs in results:
        rows = sorted(bubble(step) for step in runs)
        makespan, mean_b, worst_b = rows[len(rows) // 2]
        name = "1F1B" if v == 1 else f"interleaved v={v}" + (" overlap" if overlap else "")
        ideal = (m + (pp - 1) / v) * t
        print(f"{name:<24}{m:>4}{theory_bubble(pp, m, v):>9.3f}{mean_b:>10.3f}{worst_b:>12.3f}"
              f"{makespan * 1e3:>10.0f}{ideal:>10.0f}")


if __name__ == "__main__":
    main()
