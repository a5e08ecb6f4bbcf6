"""Tensor-parallel MLP, ours against megatron-core, same shapes, same weights, on gloo CPU ranks.

    y = RowParallelLinear(gelu(ColumnParallelLinear(x)))       x: [s, b, h] -> [s, b, h], ffn = 4h

Both libraries: column layer with bias and ``gather_output=False``, row layer with
``input_is_parallel=True`` and its bias added after the all-reduce; megatron-core built with
``use_cpu_initialization=True`` and then given our weights, so outputs can be compared. One
iteration = forward + backward (input and weight gradients); the two implementations alternate
iteration by iteration so both see the same background load. Reported: median seconds per
iteration per implementation (max over ranks of each iteration), and the largest output difference.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from _common import median, set_threads
from lightning_megatron.parallel_dims import ParallelDims

__all__ = ["tp_mlp_rank"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _ours(h: int, ffn: int, group: Any, dtype: torch.dtype):
    from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    fc1 = ColumnParallelLinear(h, ffn, tp_group=group, bias=True, gather_output=False, params_dtype=dtype)
    fc2 = RowParallelLinear(ffn, h, tp_group=group, bias=True, input_is_parallel=True, params_dtype=dtype)

    def run(x: torch.Tensor) -> torch.Tensor:
        y, _ = fc1(x)
        out, _ = fc2(F.gelu(y))
        return out

    return run, (fc1, fc2)


def _megatron_core(h: int, ffn: int, tp: int, group: Any, dtype: torch.dtype, weights: tuple):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=dtype,
                                 bf16=dtype == torch.bfloat16)
    init = torch.nn.init.zeros_
    fc1 = ColumnParallelLinear(h, ffn, config=config, init_method=init, bias=True, gather_output=False, tp_group=group)
    fc2 = RowParallelLinear(ffn, h, config=config, init_method=init, bias=True, input_is_parallel=True,
                            skip_bias_add=False, tp_group=group)
    with torch.no_grad():
        for mine, theirs in zip(weights, (fc1, fc2)):
            theirs.weight.copy_(mine.weight)
            theirs.bias.copy_(mine.bias)

    def run(x: torch.Tensor) -> torch.Tensor:
        y, _ = fc1(x)
        out, _ = fc2(F.gelu(y))
        return out

    return run, (fc1, fc2)


def tp_mlp_rank(seq: int, batch: int, hidden: int, dtype_name: str, warmup: int, iters: int) -> dict[str, Any]:
    """Run inside a spawned rank; TP size = world size."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    world, rank = dist.get_world_size(), dist.get_rank()
    threads = set_threads(world)
    from megatron.core import parallel_state as mcore_ps

    from lightning_megatron.parallel_state import initialize_model_parallel

    mcore_ps.initialize_model_parallel(tensor_model_parallel_size=world)
    ours_group = initialize_model_parallel(ParallelDims(tp=world)).tp_group
    mcore_group = mcore_ps.get_tensor_model_parallel_group()
    dtype = _DTYPES[dtype_name]
    torch.manual_seed(0)
    ours_fn, ours_layers = _ours(hidden, 4 * hidden, ours_group, dtype)
    mcore_fn, mcore_layers = _megatron_core(hidden, 4 * hidden, world, mcore_group, dtype, ours_layers)
    x = torch.randn(seq, batch, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    impls = {"ours": (ours_fn, ours_layers), "megatron-core": (mcore_fn, mcore_layers)}

    outputs = {name: fn(x).detach().float() for name, (fn, _) in impls.items()}
    max_diff = float((outputs["ours"] - outputs["megatron-core"]).abs().max())

    times: dict[str, list[float]] = {name: [] for name in impls}
    for i in range(warmup + iters):
        for name, (fn, layers) in impls.items():
            for layer in layers:
                for p in layer.parameters():
                    p.grad = None
            inp = x.clone().requires_grad_(True)
            dist.barrier()
            t0 = time.perf_counter()
            out = fn(inp)
            out.float().sum().backward()
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(elapsed)
    # Per-iteration max over ranks: the slowest rank sets the pace.
    for name in times:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[name] = t.tolist()
    return {"rank": rank, "threads": threads, "max_abs_diff": max_diff,
            "median_s": {name: median(v) for name, v in times.items()}, "times": times}
