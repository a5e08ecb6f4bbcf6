"""Optimizer memory per parameter, with and without the distributed optimizer, measured.

For DP size d = 1, 2, 4 (one spawned gloo run of d ranks each) and model params fp32 / bf16, take
one AdamW step and count the bytes of the tensors each rank actually holds (``numel *
element_size`` of every buffer, not RSS), divided by the model's parameter count:

- ``model``: the model params (4 fp32, 2 bf16);
- ``grads``: fp32 gradients (the distributed optimizer's flat buffer; the baseline's fp32 grads /
  main grads, measured before ``zero_grad``);
- ``main``: fp32 main params (the baseline keeps none for an fp32 model);
- ``adam``: the inner optimizer's state tensors (exp_avg, exp_avg_sq).

Expected (Megatron's table): baseline fp32 16, bf16 18; distributed fp32 8 + 12/d, bf16 6 + 12/d
(plus < d padding elements). Run: ``python benchmarks/optimizer_memory.py [--numel 2000000]``.
"""

from __future__ import annotations

import argparse

import _common  # noqa: F401  (puts the repo and tests/ on sys.path)
from _common import launch


def _model(numel: int, dtype):
    import torch

    torch.manual_seed(0)
    hidden = int((numel / 2) ** 0.5)
    # two matrices and two odd-sized vectors: the total is not a multiple of 4, so padding shows
    shapes = [(hidden, hidden), (hidden, hidden), (hidden + 1,), (3,)]
    return [torch.nn.Parameter(torch.randn(*s).to(dtype)) for s in shapes]


def _state_bytes(opt) -> int:
    import torch

    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _measure(numel: int, distributed: bool) -> dict:
    import torch
    import torch.distributed as dist

    from lightning_megatron.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
    from lightning_megatron.optimizer.distrib_optimizer import DistributedOptimizer

    rows = {}
    d = dist.get_world_size()
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        params = _model(numel, dtype)
        n = sum(p.numel() for p in params)
        inner = torch.optim.AdamW(params, lr=1e-3)
        if distributed:
            opt = DistributedOptimizer(inner, data_parallel_group=dist.group.WORLD if d > 1 else None)
        elif dtype == torch.float32:
            opt = FP32Optimizer(inner)
        else:
            opt = Float16OptimizerWithFloat16Params(inner)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        model = sum(p.numel() * p.element_size() for p in params)
        if distributed:
            mem = opt.memory_bytes()
            grads, main, adam = mem["grad_buffer"], mem["main_params"], mem["optimizer_state"]
        else:
            # grads as they are before zero_grad: fp32 main grads (bf16) or the fp32 model grads
            main_params = opt.get_parameters()
            grads = sum(p.grad.numel() * p.grad.element_size() for p in main_params if p.grad is not None)
            grads += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None
                         and all(p is not m for m in main_params))
            main = 0 if dtype == torch.float32 else sum(p.numel() * 4 for p in main_params)
            adam = _state_bytes(opt.optimizer)
        rows[name] = {"numel": n, "model": model / n, "grads": grads / n, "main": main / n, "adam": adam / n}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2_000_000, help="approximate parameter count")
    args = parser.parse_args()

    results = [("baseline", 1, launch(_measure, 1, args.numel, False)[0])]
    for d in (1, 2, 4):
        per_rank = launch(_measure, d, args.numel, True)
        results.append(("distributed", d, per_rank[0]))  # rank 0 (the last rank has the padding)

    print(f"bytes per parameter, AdamW, {results[0][2]['fp32']['numel']:,} params, measured on rank 0")
    print(f"{'optimizer':<12} {'d':>2} {'dtype':<5} {'model':>6} {'grads':>6} {'main':>6} {'adam':>6} "
          f"{'total':>7} {'expected':>8}")
    for kind, d, rows in results:
        for name, r in rows.items():
            total = r["model"] + r["grads"] + r["main"] + r["adam"]
            if kind == "baseline":
                expected = 16.0 if name == "fp32" else 18.0
            else:
                expected = (8.0 if name == "fp32" else 6.0) + 12.0 / d
            print(f"{kind:<12} {d:>2} {name:<5} {r['model']:>6.2f} {r['grads']:>6.2f} {r['main']:>6.2f} "
                  f"{r['adam']:>6.2f} {total:>7.2f} {expected:>8.2f}")


if __name__ == "__main__":
    main()
