"""Parallel layouts of a check run, written as short strings: ``tp2``, ``pp2vp2``, ``tp2pp2``, ``dp2zero1``.

A layout names its sizes; missing ones are 1. The world size is ``tp * pp * dp``.

- ``tp<N>`` tensor parallel, ``pp<N>`` pipeline stages, ``vp<N>`` virtual stages per pipeline rank
  (interleaved 1F1B), ``dp<N>`` data-parallel replicas;
- ``sp``: sequence parallelism (needs ``tp`` > 1);
- ``zero1``: the distributed optimizer (ZeRO stage 1, shards optimizer state over DP).

Separators ``-`` and ``_`` are allowed: ``tp2-pp2-dp2``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Layout", "parse_layout", "parse_layouts"]

_TOKEN = re.compile(r"(tp|pp|vp|dp)(\d+)|(sp)|(zero1)")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One parallel layout: the strategy's sizes plus the data-parallel size and options."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline stages."""
    vp: int | None = None
    """Virtual pipeline stages per rank (interleaved schedule); None: one chunk."""
    dp: int = 1
    """Data-parallel replicas."""
    sequence_parallel: bool = False
    """Split activations along the sequence outside the TP regions."""
    zero1: bool = False
    """Distributed optimizer (optimizer state sharded over DP)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout {name}={getattr(self, name)} must be >= 1")
        if self.vp is not None and (self.vp < 2 or self.pp < 2):
            raise ValueError(f"layout vp={self.vp} needs pp >= 2 and vp >= 2 (got pp={self.pp}); drop vp")
        if self.sequence_parallel and self.tp < 2:
            raise ValueError("layout 'sp' (sequence parallelism) needs tp >= 2")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"] + ([f"vp{self.vp}"] if self.vp else []) + [f"dp{self.dp}"]
        parts += (["sp"] if self.sequence_parallel else []) + (["zero1"] if self.zero1 else [])
        return "".join(p for p in parts if p not in ("tp1", "pp1", "dp1")) or "tp1"

    def strategy_kwargs(self) -> dict:
        return dict(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                    virtual_pipeline_model_parallel_size=self.vp, sequence_parallel=self.sequence_parallel)

    def __str__(self) -> str:
        return self.name


def parse_layout(text: str | Layout) -> Layout:
    """``"tp2pp2"`` -> ``Layout(tp=2, pp=2)``; raises ValueError naming the bad part."""
    if isinstance(text, Layout):
        return text
    s = text.strip().lower().replace("-", "").replace("_", "")
    sizes: dict = {}
    pos = 0
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if m is None:
            raise ValueError(f"layout {text!r}: cannot read {s[pos:]!r}; write e.g. tp2, pp2vp2, tp2pp2dp2, "
                             f"tp2sp, dp2zero1")
        key = m.group(1) or m.group(3) or m.group(4)
        if key in sizes:
            raise ValueError(f"layout {text!r}: {key!r} given twice")
        sizes[key] = int(m.group(2)) if m.group(2) else True
        pos = m.end()
    if not sizes:
        raise ValueError(f"layout {text!r} is empty")
    return Layout(tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), vp=sizes.get("vp"), dp=sizes.get("dp", 1),
                  sequence_parallel=bool(sizes.get("sp", False)), zero1=bool(sizes.get("zero1", False)))


def parse_layouts(text: str | list) -> list[Layout]:
    """A comma-separated list (or a list) of layouts."""
    items = [t for t in text.split(",") if t.strip()] if isinstance(text, str) else list(text)
    return [parse_layout(t) for t in items]
