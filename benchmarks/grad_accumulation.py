"""Adding a bf16 microbatch gradient into its fp32 main gradient on one core: torch's mixed-dtype
``add_`` against the CPU tuning's :func:`lightning_megatron.cpu.accumulate.accumulate_grad`; and a
pipeline first stage's word-embedding gradient per microbatch, torch's dense backward plus that
accumulation against the CPU tuning's rows (:mod:`lightning_megatron.cpu.embedding_grad`).

Shapes of bert-base: the [30592, 768] word embedding, the [3072, 768] FFN weights, a [768, 768]
projection; a microbatch of 2 x 128 tokens. Best of 5 after a warm-up, and a bitwise check of the
two results.

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
    out["word_embedding_backward"] = _embedding(SHAPES["word_embedding"])
    print(json.dumps(out, indent=1))


def _embedding(shape: tuple[int, int], tokens: tuple[int, int] = (2, 128)) -> dict:
    """One later microbatch of a first stage: the lookup's backward and its accumulation into main_grad."""
    import torch.nn.functional as F

    from lightning_megatron.cpu.embedding_grad import row_sums

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape[0], tokens, generator=gen)
    grad = torch.randn(*tokens, shape[1], generator=gen).bfloat16()
    weight = torch.randn(shape, generator=gen).bfloat16().requires_grad_()
    main_grad = torch.zeros(shape)

    def dense() -> None:
        weight.grad = None
        F.embedding(ids, weight).backward(grad)
        accumulate_grad(main_grad, weight.grad)

    def rows() -> None:
        r, sums = row_sums(ids, grad)
        main_grad.index_add_(0, r, sums.float())

    dense_ms, rows_ms = _best(dense) * 1e3, _best(rows) * 1e3
    a, b = torch.randn(shape), None
    b = a.clone()
    weight.grad = None
    F.embedding(ids, weight).backward(grad)
    accumulate_grad(a, weight.grad)
    r, sums = row_sums(ids, grad)
    b.index_add_(0, r, sums.float())
    return {"tokens": tokens[0] * tokens[1], "dense_ms": round(dense_ms, 2), "rows_ms": round(rows_ms, 2),
            "speedup": round(dense_ms / rows_ms, 1), "bitwise_equal": bool(torch.equal(a, b))}


if __name__ == "__main__":
    main()
