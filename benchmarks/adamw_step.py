"""AdamW step time on bert-base's parameter shapes: torch's for-loop, ``foreach`` and ``fused`` kernels.

``torch.optim.AdamW()`` with no flag runs the per-parameter for-loop on CPU tensors (``foreach`` is
chosen by default only on accelerators). This isolates what that choice costs in one training step.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from _common import BertSize, median, set_threads

__all__ = ["adamw_rank"]


def _bert_shapes(size: BertSize) -> list[tuple[int, ...]]:
    h, f, v = size.hidden_size, size.ffn_hidden_size, size.vocab_size
    layer = [(3 * h, h), (3 * h,), (h, h), (h,), (f, h), (f,), (h, f), (h,), (h,), (h,), (h,), (h,)]
    return ([(v, h), (size.max_position_embeddings, h), (2, h), (h,), (h,)] + layer * size.num_layers
            + [(h, h), (h,), (h,), (h,), (v,), (h, h), (h,), (2, h), (2,)])


def adamw_rank(size: dict[str, Any], steps: int) -> dict[str, Any]:
    """Median seconds per ``step()`` for each AdamW implementation, fp32 params with random grads."""
    import torch.distributed as dist

    threads = set_threads(dist.get_world_size())
    shapes = _bert_shapes(BertSize(**size))
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    out: dict[str, Any] = {"threads": threads, "numel": sum(p.numel() for p in params)}
    for name, kwargs in (("for-loop (default)", {}), ("foreach=True", {"foreach": True}),
                         ("fused=True", {"fused": True})):
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kwargs)
        opt.step()  # allocates exp_avg / exp_avg_sq
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        out[name] = median(times)
        opt.state.clear()
        del opt
    return out
