"""The gradient norm's fp64 sum of squares on bert-base's gradient shapes: 1 M-element temporaries against
the pieces of ``clip_grads.sum_of_squares_fp64``, and the size of those pieces.

    .venv/bin/python benchmarks/grad_norm.py [--repeats 7]

The gradients are views of one flat fp32 buffer, as the grad buffer's ``main_grad`` are, with the glibc
setting of the CPU tuning (``keep_freed_memory``). ``before``: every 1 M-element piece converted into a
new fp64 tensor and dotted with itself (the code until 2026-12-03); ``default``: the library's function by
default (one fused ``torch._foreach_norm`` with fp64 sums: what an accelerator wants; on a CPU it goes tensor by
tensor); ``cpu_tuning``: with the opt-in
CPU tuning's piece (``CPUTuning.norm_piece``: 128 Ki elements per intra-op thread, at least 256 Ki; until
2026-12-04 every device had 64 Ki per thread); ``pieces_<k>K``: pieces of ``k`` Ki elements. Median
milliseconds per call, on 1 and on all threads, measured in alternating order, and the sums (equal to ~1e-14
relative).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from _common import CPU_COUNT, SIZES, median
from adamw_step import _bert_shapes


def _before(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        flat = t.reshape(-1)
        for lo in range(0, flat.numel(), 1 << 20):
            piece = flat[lo: lo + (1 << 20)].double()
            total += torch.dot(piece, piece)
    return total


def _with_pieces(elements: int | None):
    from lightning_megatron.optimizer.clip_grads import sum_of_squares_fp64

    return lambda tensors: sum_of_squares_fp64(tensors, piece=elements)


def run(repeats: int) -> dict:
    from lightning_megatron.cpu import CPUTuning
    from lightning_megatron.cpu.allocator import keep_freed_memory

    keep_freed_memory()
    shapes = _bert_shapes(SIZES["base"])
    numels = [int(torch.Size(s).numel()) for s in shapes]
    flat = torch.randn(sum(numels), generator=torch.Generator().manual_seed(0)) * 1e-3
    grads = list(torch.split(flat, numels))
    out: dict = {"elements": flat.numel(), "rows": []}
    for threads in sorted({1, CPU_COUNT}):
        torch.set_num_threads(threads)
        row: dict = {"threads": threads}
        fns = [("before", _before), ("default", _with_pieces(None)),
               ("cpu_tuning", _with_pieces(CPUTuning().norm_piece(torch.device("cpu"))))]
        fns += [(f"pieces_{k}K", _with_pieces(k << 10)) for k in (64, 128, 256, 512, 1024, 2048)]
        times: dict[str, list[float]] = {name: [] for name, _ in fns}
        for name, fn in fns:
            fn(grads)  # warm
        for r in range(repeats):  # alternating order: a slow spell of the host does not fall on one of them
            for name, fn in (fns if r % 2 == 0 else fns[::-1]):
                t0 = time.perf_counter()
                value = fn(grads)
                times[name].append(time.perf_counter() - t0)
                row[f"{name}_sum"] = float(value)
        for name, _ in fns:
            row[f"{name}_ms"] = round(1000 * median(times[name]), 1)
        out["rows"].append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    print(json.dumps(run(parser.parse_args().repeats), indent=1))


if __name__ == "__main__":
    main()
