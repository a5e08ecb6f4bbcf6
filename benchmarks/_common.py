"""Shared pieces of the benchmarks: model sizes, the FLOP count, memory probes, launching ranks.

FLOPs of one training step (forward + backward), for ``T`` tokens of sequence length ``s``::

    FLOPs = T * (6 N + 12 L s h)

- ``6 N``: every parameter that multiplies an activation costs 2 FLOPs per token forward and 4
  backward (grad of the input and of the weight). ``N`` counts the word embedding once (the LM
  head's output projection is tied to it and is a real matmul) and leaves out the position and
  token-type embeddings (lookups, no matmul); biases and norms are included (a rounding error).
- ``12 L s h``: attention scores ``Q K^T`` and ``A V`` are ``2 * 2 s^2 h`` FLOPs per layer and
  sequence forward, i.e. ``4 s h`` per token, times 3 for forward + backward.

MFU = achieved FLOP/s / the machine's measured GEMM FLOP/s of the same dtype (all cores, one process).
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, os.path.join(ROOT, "tests"), HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

__all__ = [
    "BertSize",
    "SIZES",
    "matmul_params",
    "step_flops",
    "max_rss_bytes",
    "current_rss_bytes",
    "launch",
    "median",
    "CPU_COUNT",
]

CPU_COUNT = os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True)
class BertSize:
    """A BERT shape (Hugging Face's names in comments)."""

    name: str
    num_layers: int
    """num_hidden_layers"""
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    """intermediate_size"""
    vocab_size: int = 30522
    max_position_embeddings: int = 512
    type_vocab_size: int = 2

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


SIZES = {
    # bert-tiny (Turc et al.): 2 layers, hidden 128, the real 30522 vocabulary (embeddings dominate).
    "tiny": BertSize(name="tiny", num_layers=2, hidden_size=128, num_attention_heads=2, ffn_hidden_size=512),
    "base": BertSize(name="base", num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072),
}


def matmul_params(size: BertSize) -> int:
    """N of the FLOP formula: BertForPreTraining's parameters minus position and token-type embeddings."""
    h, f, v, L = size.hidden_size, size.ffn_hidden_size, size.vocab_size, size.num_layers
    layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 2 * 2 * h  # qkv + proj, fc1 + fc2, two LayerNorms
    embeddings = v * h + 2 * h  # word embedding (tied LM output projection) + embedding LayerNorm
    heads = (h * h + h + 2 * h) + v + (h * h + h) + (2 * h + 2)  # LM transform + vocab bias, pooler, NSP head
    return L * layer + embeddings + heads


def step_flops(size: BertSize, batch: int, seq: int) -> float:
    """FLOPs of one training step: tokens * (6 N + 12 L s h)."""
    tokens = batch * seq
    return float(tokens) * (6 * matmul_params(size) + 12 * size.num_layers * seq * size.hidden_size)


def max_rss_bytes() -> int:
    """This process's resident-set high-water mark (``getrusage``; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def set_threads(world_size: int) -> int:
    """All cores for one process, an equal share each for several (2 cores here: 2 or 1 thread)."""
    import torch

    threads = max(1, CPU_COUNT // world_size)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # Lightning would otherwise pick its own
    return threads


def launch(fn: Any, world_size: int, *args: Any, timeout: float = 600.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh spawned gloo ranks (tests/dist_utils).

    A fresh process per measurement keeps ``getrusage``'s high-water mark about that run only.
    """
    from dist_utils import run_distributed

    return run_distributed(fn, world_size, *args, timeout=timeout, **kwargs)
