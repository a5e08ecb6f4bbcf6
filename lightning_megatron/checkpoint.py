"""Sharded, reshardable checkpoints on ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory:

    <path>/                    the final name appears only after every rank finished writing
      .metadata, __*.distcp    DCP: every tensor as chunks of a GLOBAL tensor (model and optimizer)
      extra.pt                 Lightning's non-tensor state (loops, callbacks, schedulers, ...),
                               written by rank 0, loaded with ``torch.load(weights_only=True)``
      rng/rank_<r>.pt          RNG states of each rank (restored when the layout is unchanged)
      lightning_megatron.json  format version + the layout it was saved at; written last

Each tensor-parallel parameter is described as its shard of the global (unpadded) tensor, with
offsets computed from ``partition_dim`` and the TP rank, so DCP can load it into any other layout:
TP and DP changes reshard (each rank reads only the chunks overlapping its new shard), and PP
changes work because keys are the global parameter names (layer numbers are global).
Vocab-parallel tensors are saved without their padding rows, since padding depends on TP.

Writes go to ``<path>.tmp-<id>`` and are renamed when complete: an interrupted save never leaves
something that looks like a valid checkpoint. Loading checks the marker and DCP metadata first and
raises ``CheckpointError`` naming what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

__all__ = [
    "CheckpointError",
    "FORMAT_VERSION",
    "ShardInfo",
    "shard_info",
    "to_sharded",
    "allocate_like_checkpoint",
    "validate_checkpoint_dir",
    "MARKER",
]

FORMAT_VERSION = 1
MARKER = "lightning_megatron.json"


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, partial or corrupt."""


@dataclass(frozen=True)
class ShardInfo:
    """Where this rank's tensor sits in the global tensor."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_rows: int | None = None
    """For vocab-padded tensors: how many leading rows along the partition dim are real."""
    partition_dim: int | None = None
    peers: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()
    """(global rank, offsets, sizes) of every TP peer's shard, this rank included."""


def shard_info(param: torch.Tensor, tp_rank: int, tp_size: int, tp_ranks: list[int],
               real_vocab_size: int | None = None) -> ShardInfo | None:
    """The global layout of a TP-sharded ``param`` (None when replicated)."""
    sharded = getattr(param, "tensor_model_parallel", False) and tp_size > 1
    if not sharded and real_vocab_size is None:
        return None
    if not sharded:  # a vocab-padded tensor at TP=1: one "shard" holding the real rows
        tp_size, tp_rank, tp_ranks = 1, 0, [dist.get_rank()]
    dim = param.partition_dim % param.dim()
    stride = getattr(param, "partition_stride", 1)
    if stride != 1:
        raise CheckpointError("strided TP partitions are not supported by the sharded checkpoint format")
    local = tuple(param.shape)
    per = local[dim]
    full = per * tp_size
    real = full if real_vocab_size is None else min(real_vocab_size, full)
    peers = []
    for r in range(tp_size):
        start = r * per
        rows = max(0, min(per, real - start))
        if rows == 0:
            continue
        offsets = tuple(start if d == dim else 0 for d in range(len(local)))
        sizes = tuple(rows if d == dim else s for d, s in enumerate(local))
        peers.append((tp_ranks[r], offsets, sizes))
    global_shape = tuple(real if d == dim else s for d, s in enumerate(local))
    start = tp_rank * per
    local_rows = max(0, min(per, real - start))
    offsets = tuple(start if d == dim else 0 for d in range(len(local)))
    return ShardInfo(global_shape, offsets, local_rows, dim, tuple(peers))


def to_sharded(tensor: torch.Tensor, info: ShardInfo) -> ShardedTensor | None:
    """Wrap this rank's ``tensor`` (shaped like the parameter) as a ShardedTensor of the global tensor.

    Returns None when this rank holds only padding (nothing to save or load).
    """
    dim = info.partition_dim
    if info.local_rows == 0:
        return None
    local = tensor.narrow(dim, 0, info.local_rows) if info.local_rows != tensor.size(dim) else tensor
    rank = dist.get_rank()
    metas = [ShardMetadata(shard_offsets=list(off), shard_sizes=list(size), placement=f"rank:{r}/{local.device}")
             for r, off, size in info.peers]
    mine = ShardMetadata(shard_offsets=list(info.offsets), shard_sizes=list(local.shape),
                         placement=f"rank:{rank}/{local.device}")
    # The peers list names TP ranks of *this* DP replica; DCP deduplicates equal chunks across replicas.
    metas = [m if m.shard_offsets != mine.shard_offsets else mine for m in metas]
    props = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size(info.global_shape), tensor_properties=props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(tensor=local.contiguous() if not local.is_contiguous() else local, metadata=mine)], meta)


def validate_checkpoint_dir(path: str | os.PathLike) -> dict[str, Any]:
    """Check that ``path`` is a complete lightning_megatron checkpoint; return its marker contents."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is a file, not a lightning_megatron sharded checkpoint directory "
            f"(was it written by another strategy?)")
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete: {MARKER} is missing (the save was interrupted "
            f"or the directory is not a lightning_megatron checkpoint)")
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r} has a corrupt {MARKER}: {e}") from e
    if info.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has format_version={info.get('format_version')}, "
                              f"this lightning_megatron reads {FORMAT_VERSION}")
    for name in (".metadata", "extra.pt"):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {name} is missing")
    expected = info.get("files", {})
    for name, size in expected.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: {name} has {f.stat().st_size} bytes, "
                                  f"expected {size} (truncated?)")
    return info


def allocate_like_checkpoint(key: str, metadata: Any, like: torch.Tensor | None) -> torch.Tensor:
    """A destination tensor for ``key`` (optimizer state that does not exist yet before loading)."""
    size = tuple(metadata.size)
    dtype = metadata.properties.dtype
    if like is not None:
        return torch.zeros_like(like, dtype=dtype)
    return torch.zeros(size, dtype=dtype)


def write_marker(path: Path, layout: dict[str, int | None]) -> None:
    files = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file() and p.name != MARKER}
    tmp = path / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"format_version": FORMAT_VERSION, "layout": layout, "files": files}, indent=1))
    os.replace(tmp, path / MARKER)


def finalize_directory(tmp: Path, final: Path) -> None:
    """Atomically move a complete ``tmp`` checkpoint to ``final`` (replacing an older one)."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def save_dcp(state: dict[str, Any], path: Path) -> None:
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))


def load_dcp(state: dict[str, Any], path: Path) -> None:
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))


def read_dcp_metadata(path: Path) -> Any:
    return dcp.FileSystemReader(str(path)).read_metadata()
