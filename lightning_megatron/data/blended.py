"""Weighted blends of datasets, Megatron's way (``data_prefix: [0.3, path_a, 0.7, path_b]``), and a path or blend
per split (``data_prefix: {train: ..., valid: ..., test: ...}``, :func:`split_blends`).

Sample ``i`` of the blend is sample ``sample_index[i]`` of dataset ``dataset_index[i]``, where
``dataset_index`` is Megatron's greedy (``helpers.cpp: build_blending_indices``): at every position
``i`` it takes the dataset whose count lags its share most, ``argmax_d(w_d * max(i, 1) - count_d)``
(first on ties), and ``sample_index`` counts each dataset's samples in order. Every prefix of the
blend therefore holds each dataset's weight share of its samples to within one sample, and the
blend position is simply the sample index: resuming at ``consumed_samples`` continues it exactly.

Building the index is sequential. Two datasets are done in closed form (``count_0(i) =
floor(w_0 (i - 1)) + 1`` for ``i >= 2``), checked against the greedy's own comparison at every position with numpy;
more datasets, or any position where the check fails, run the greedy in a Python loop (see
docs/benchmarks.md for its speed). The index is cached like the samples mapping: built once under a file
lock, memory-mapped by every process.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

__all__ = ["BlendedDataset", "SPLIT_NAMES", "blend_num_samples", "build_blending_indices", "parse_data_prefix",
           "split_blends"]

BLEND_INDEX_VERSION = 1
_BLEND_DTYPE = np.dtype([("dataset", "<i2"), ("sample", "<i8")])


def parse_data_prefix(data_prefix: Sequence[Any]) -> tuple[list[float], list[str]]:
    """``[w0, prefix0, w1, prefix1, ...]`` (or ``[prefix]``) -> (normalised weights, prefixes)."""
    items = list(data_prefix)
    if len(items) == 1 and isinstance(items[0], (str, os.PathLike)):
        return [1.0], [os.fspath(items[0])]
    if len(items) < 2 or len(items) % 2:
        raise ValueError(f"data_prefix={items!r} must be a path or a list [weight, path, weight, path, ...]")
    weights, prefixes = items[0::2], items[1::2]
    try:
        weights = [float(w) for w in weights]
    except (TypeError, ValueError):
        raise ValueError(f"data_prefix={items!r}: every other item must be a weight, "
                         f"like [0.3, path_a, 0.7, path_b]") from None
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"data_prefix={items!r}: weights must be positive numbers")
    if not all(isinstance(p, (str, os.PathLike)) for p in prefixes):
        raise ValueError(f"data_prefix={items!r}: expected [weight, path, weight, path, ...]")
    if len(set(map(os.fspath, prefixes))) != len(prefixes):
        raise ValueError(f"data_prefix={items!r} lists a path twice; merge its weights")
    total = sum(weights)
    return [w / total for w in weights], [os.fspath(p) for p in prefixes]


SPLIT_NAMES = ("train", "valid", "test")
"""The splits, in Megatron's order (``splits: "949,50,1"`` weighs them so; a per-split ``data_prefix`` names them)."""


def split_blends(data_prefix: Any) -> list[tuple[list[float], list[str]] | None]:
    """The (normalised weights, prefixes) each split (:data:`SPLIT_NAMES`) reads, None for a split without data.

    ``data_prefix`` is a path or a blend ``[w, path, ...]`` (every split's: the datamodule cuts each dataset's
    documents by ``splits``), or a mapping of a path or blend per split, ``{train: ..., valid: ..., test: ...}``
    (Megatron-LM's ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``, NeMo's per-split
    ``data_prefix``), each read whole by its split; ``train`` is required there, and a key that is not a split is
    refused by name."""
    if isinstance(data_prefix, Mapping):
        for key in data_prefix:
            if key not in SPLIT_NAMES:
                hint = " (valid is the validation split)" if key in ("validation", "val", "dev") else ""
                raise ValueError(f"data_prefix: {key!r} is not a split: use train, valid and test{hint}")
        if data_prefix.get("train") is None:
            raise ValueError(f"data_prefix per split needs a train entry (the data a run trains on); got the splits "
                             f"{sorted(data_prefix)}")
        return [_one_blend(data_prefix[k]) if data_prefix.get(k) is not None else None for k in SPLIT_NAMES]
    return [_one_blend(data_prefix)] * len(SPLIT_NAMES)


def _one_blend(value: Any) -> tuple[list[float], list[str]]:
    if isinstance(value, (str, os.PathLike)):
        return [1.0], [os.fspath(value)]
    if isinstance(value, (list, tuple)):
        return parse_data_prefix(value)
    raise ValueError(f"data_prefix={value!r} must be a path, a list [weight, path, weight, path, ...] or a mapping "
                     f"of them per split ({{train: ..., valid: ..., test: ...}})")


def blend_num_samples(weights: Sequence[float], size: int) -> list[int]:
    """Samples each dataset must provide for a blend of ``size`` (Megatron's 0.5% margin)."""
    return [int(math.ceil(math.ceil(size * w) * 1.005)) for w in weights]


def _greedy(weights: np.ndarray, first: int, counts: np.ndarray, out: np.ndarray) -> None:
    """Megatron's loop for positions ``first, first + 1, ...`` into ``out``, from ``counts`` so far
    (updated in place)."""
    w = [float(x) for x in weights]
    c = [int(x) for x in counts]
    others = range(1, len(w))
    for j in range(len(out)):
        i = first + j
        x = float(i) if i > 1 else 1.0
        best, best_error = 0, w[0] * x - c[0]
        for d in others:
            error = w[d] * x - c[d]
            if error > best_error:
                best, best_error = d, error
        out[j] = best
        c[best] += 1
    counts[:] = c


def _two_way_prediction(weights: np.ndarray, first: int, n: int) -> np.ndarray:
    """Two datasets in closed form for positions ``first .. first + n - 1``: dataset 0's count before
    position i is 0, then ``[w0 >= w1]`` (position 0 compares with x = 1), then
    ``floor(w0 (i - 1)) + 1``; it is taken at i when that count grows."""
    position = np.arange(first, first + n + 1, dtype=np.float64)
    count0 = np.floor(weights[0] * (position - 1)) + 1
    count0[position == 0] = 0
    count0[position == 1] = float(weights[0] >= weights[1])
    return (count0[1:] == count0[:-1]).astype(np.int16)


def _two_way(weights: np.ndarray, first: int, counts: np.ndarray, out: np.ndarray) -> int:
    """:func:`_two_way_prediction` into ``out``, checked at every position with the greedy's own float
    comparison; returns how many positions are right (the rest is for the loop) and adds them to
    ``counts``."""
    n = len(out)
    out[:] = _two_way_prediction(weights, first, n)
    took1 = (out == 1).astype(np.int64)
    c1 = counts[1] + np.cumsum(took1) - took1
    c0 = counts[0] + np.arange(n) - (c1 - counts[1])
    x = np.maximum(np.arange(first, first + n, dtype=np.float64), 1.0)
    greedy = (weights[1] * x - c1 > weights[0] * x - c0).astype(out.dtype)
    bad = np.flatnonzero(greedy != out)
    good = int(bad[0]) if len(bad) else n
    counts += np.bincount(out[:good], minlength=2)
    return good


def _blend_chunks(weights: Sequence[float], size: int, chunk: int = 1 << 22):
    """``(dataset, sample)`` records of the blend, ``chunk`` positions at a time."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) < 1 or len(w) > np.iinfo(np.int16).max or size < 0:
        raise ValueError(f"weights={list(weights)} / size={size}: need 1..32767 weights and a size >= 0")
    counts = np.zeros(len(w), dtype=np.int64)
    closed_form = len(w) == 2
    for first in range(0, size, chunk):
        out = np.zeros(min(chunk, size - first), dtype=np.int16)
        before = counts.copy()
        if len(w) > 1:
            done = _two_way(w, first, counts, out) if closed_form else 0
            if done < len(out):
                closed_form = False
                _greedy(w, first + done, counts, out[done:])
        else:
            counts[0] += len(out)
        records = np.empty(len(out), dtype=_BLEND_DTYPE)
        records["dataset"] = out
        for d in range(len(w)):
            where = np.flatnonzero(out == d)
            records["sample"][where] = before[d] + np.arange(len(where))
        yield records


def build_blending_indices(weights: Sequence[float], size: int) -> np.ndarray:
    """Megatron's ``dataset_index`` (int16) of a blend of ``size`` samples with normalised ``weights``."""
    chunks = [c["dataset"] for c in _blend_chunks(weights, size)]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)


def cached_blend_index(weights: Sequence[float], size: int, cache_dir: str | os.PathLike[str]) -> np.ndarray:
    """``(dataset, sample)`` records of the blend, as a read-only memory map of
    ``<cache_dir>/blend-<key>.npy`` (built once under a file lock, streamed to disk)."""
    from lightning_megatron.data.samples_index import write_npy_stream
    from lightning_megatron.data.tokenizer import file_lock

    key = hashlib.sha256(f"v{BLEND_INDEX_VERSION}|{size}|{[float(w) for w in weights]!r}".encode()).hexdigest()
    directory = Path(cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"blend-{key[:24]}.npy"
    if not path.is_file():
        with file_lock(directory / f"{path.name}.lock"):
            if not path.is_file():
                write_npy_stream(path, _blend_chunks(weights, size), _BLEND_DTYPE)
    records = np.load(path, mmap_mode="r", allow_pickle=False)
    if records.dtype != _BLEND_DTYPE or records.shape != (size,):
        raise ValueError(f"cached blend index {str(path)!r} has {records.shape} {records.dtype}, expected "
                         f"({size},) {_BLEND_DTYPE}; delete it to rebuild")
    return records


class BlendedDataset(Dataset):
    """``size`` samples drawn from ``datasets`` in the proportions ``weights`` (see the module
    docstring). Each dataset must hold at least :func:`blend_num_samples` samples.

    Args:
        datasets: the datasets to blend (e.g. one :class:`~.bert_dataset.BertDataset` per prefix).
        weights: their weights (normalised here).
        size: samples in the blend.
        cache_dir: where the index is cached; ``None``: built in memory.
        names: names of the datasets for error messages.
    """

    def __init__(self, datasets: Sequence[Dataset], weights: Sequence[float], size: int, *,
                 cache_dir: str | os.PathLike[str] | None = None, names: Sequence[str] | None = None) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self.datasets = list(datasets)
        names = list(names) if names is not None else [f"dataset {d}" for d in range(len(datasets))]
        if cache_dir is None:
            chunks = list(_blend_chunks(self.weights, size))
            self.index = np.concatenate(chunks) if chunks else np.zeros(0, dtype=_BLEND_DTYPE)
        else:
            self.index = cached_blend_index(self.weights, size, cache_dir)
        counts = np.bincount(np.asarray(self.index["dataset"]), minlength=len(datasets)) if size else \
            np.zeros(len(datasets), dtype=np.int64)
        for name, dataset, count in zip(names, self.datasets, counts):
            if len(dataset) < count:  # type: ignore[arg-type]
                raise ValueError(f"the blend takes {count} samples from {name}, which has only "
                                 f"{len(dataset)}; build it with num_samples >= {count}")  # type: ignore[arg-type]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if isinstance(self.index, np.memmap) and self.index.filename:  # reopen, never copy, in workers
            state["index"] = Path(self.index.filename)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["index"], Path):
            state["index"] = np.load(state["index"], mmap_mode="r", allow_pickle=False)
        self.__dict__.update(state)

    @property
    def order_key(self) -> list[Any] | None:
        """The parts' ``order_key`` (None where no part has one: a prefix-stable order, as BERT's mapping); the blend's
        own index keeps its first samples for any size."""
        keys = [getattr(d, "order_key", None) for d in self.datasets]
        return keys if any(k is not None for k in keys) else None

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, index: int) -> Any:
        record = self.index[index]
        return self.datasets[int(record["dataset"])][int(record["sample"])]
