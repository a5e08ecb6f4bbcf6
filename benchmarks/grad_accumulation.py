"""Adding a bf16 microbatch gradient into its fp32 main gradient on one core: torch's mixed-dtype
``add_`` against the CPU tuning's :func:`lightning_megatron.cpu.accumulate.accumulate_grad`.

Shapes of bert-base: the [30592, 768] word embedding, the [3072, 768] FFN weights, a [768, 768]
projection. Best of 5 after a warm-up, and a bitwise check of the two results.

Run: ``python benchmarks/grad_accumulation.py [--threads 1]``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lightning_megatron.cpu.accumulate import accumulate_grad

SHAPES = {"word_embedding": (30592, 768), "ffn": (3072, 768), "projection": (768, 768)}


def _best(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = {"threads": args.threads, "shapes": {}}
    for name, shape in SHAPES.items():
        main_grad, grad = torch.zeros(shape), torch.randn(shape).bfloat16()
        add_ms = _best(lambda: main_grad.add_(grad)) * 1e3
        pieces_ms = _best(lambda: accumulate_grad(main_grad, grad)) * 1e3
        a, b = torch.randn(shape), torch.randn(shape).bfloat16()
        a2 = a.clone()
        a.add_(b)
        accumulate_grad(a2, b)
        out["shapes"][name] = {"elements": main_grad.numel(), "add_ms": round(add_ms, 2),
                               "pieces_ms": round(pieces_ms, 2), "speedup": round(add_ms / pieces_ms, 2),
                               "bitwise_equal": bool(torch.equal(a, a2))}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
