"""The BERT samples mapping, vectorised with numpy and cached on disk (Megatron's ``build_mapping``).

Rows ``[start_sentence, end_sentence, target_length]``: each epoch walks every document of the split
(those with at least ``min_num_sentences`` sentences), cutting it greedily into spans of consecutive
sentences: a span closes at the first sentence where it holds ``>= target`` tokens and
``>= min_num_sentences`` sentences while at least two sentences of the document remain; otherwise it
runs to the end of the document (and is dropped when that leaves it under ``min_num_sentences``).
The rows of one epoch, in document order, are permuted with ``numpy.random.default_rng([seed,
0x5A3])`` (one permutation per epoch, drawn in sequence) and epochs are appended until
``num_samples`` rows (the last epoch cut), or for ``num_epochs`` epochs.

How this differs from a sentence-by-sentence loop: nothing when ``short_seq_prob == 0`` (the same
rows in the same order, which the tests check against the loop). With ``short_seq_prob > 0`` the
loop draws each span's target from the sequential generator as it goes; here the target of a span
that starts at sentence ``s`` in epoch ``e`` is a counter-based draw ``(seed, e, s)``
(splitmix64): shorter with probability ``short_seq_prob``, then uniform in ``[2, max_num_tokens]``.
That makes every span computable independently, so documents are cut in parallel: round ``k``
closes the ``k``-th span of every document at once (one ``searchsorted`` for the short targets);
documents still open after :data:`WALK_ROUNDS` rounds are finished by pointer doubling over their
remaining sentences (``O(m log m)`` however long the document).

:func:`cached_samples_mapping` stores the mapping as ``.npy`` under a key hashing every input that
changes it (the sentence sizes and document boundaries, the documents, every parameter, the
algorithm version): one process builds it under a file lock into a temporary file that is renamed
into place, streaming it epoch by epoch so memory stays at one epoch; every process then
memory-maps it (``np.load(mmap_mode="r")``), so no rank holds the mapping in RAM.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_megatron.atomic_files import publish_once, unique_tag

__all__ = ["NpyStreamWriter", "SAMPLES_INDEX_VERSION", "WALK_ROUNDS", "build_samples_mapping", "cached_npy_files",
           "cached_samples_mapping", "content_key", "samples_mapping_key", "write_npy_stream"]

SAMPLES_INDEX_VERSION = 1
"""Bumped whenever the mapping an input gives changes (invalidates every cached mapping)."""

WALK_ROUNDS = 24
"""Rounds of the parallel walk before the documents still open are finished by pointer doubling."""

_PERMUTATION_SEED = 0x5A3
_M64 = (1 << 64) - 1
_NPY_HEADER_BYTES = 128


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class _Spans:
    """The spans of the unique, sorted documents ``docs`` (each with >= ``min_num`` sentences)."""

    def __init__(self, sizes: np.ndarray, doc_idx: np.ndarray, docs: np.ndarray, *, max_num_tokens: int,
                 seed: int, short_seq_prob: float, min_num: int, walk_rounds: int) -> None:
        self.first = np.asarray(doc_idx[docs], dtype=np.int64)
        self.last = np.asarray(doc_idx[docs + 1], dtype=np.int64)
        self.cum = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, dtype=np.int64, out=self.cum[1:])
        # Where a span of the full target from each sentence reaches it (sorted queries: one fast pass).
        self.reach_max = np.searchsorted(self.cum, self.cum[:-1] + max_num_tokens, side="left") - 1
        self.max_num_tokens = max_num_tokens
        self.seed = seed
        self.short_seq_prob = short_seq_prob
        self.min_num = min_num
        self.walk_rounds = walk_rounds

    # --- one span, vectorised over starts ---------------------------------------------------------

    def _targets(self, epoch: int, starts: np.ndarray) -> np.ndarray:
        if self.short_seq_prob <= 0:
            return np.full(len(starts), self.max_num_tokens, dtype=np.int64)
        key = int(_mix(np.array([(self.seed * 0x632BE59BD9B4E019 + epoch) & _M64], dtype=np.uint64))[0])
        s = starts.astype(np.uint64)
        draw = (_mix(s ^ np.uint64(key)) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
        length = _mix(s ^ np.uint64(key ^ 0xD1B54A32D192ED03))
        short = 2 + (length % np.uint64(max(self.max_num_tokens - 1, 1))).astype(np.int64)
        return np.where(draw < self.short_seq_prob, np.minimum(short, self.max_num_tokens), self.max_num_tokens)

    def _reach(self, starts: np.ndarray, targets: np.ndarray, reach_max: np.ndarray) -> np.ndarray:
        """The first sentence ``j`` where a span from each of ``starts`` holds ``targets`` tokens:
        ``searchsorted(cum, cum[s] + t) - 1``, bisected inside ``(s, reach_max[s]]`` (a shorter
        target ends no later), where the sums are still in cache, instead of over the whole corpus."""
        value = self.cum[starts] + targets
        lo, hi = starts + 1, reach_max + 1  # the first k with cum[k] >= value lies in [lo, hi]
        last = len(self.cum) - 1
        while True:
            open_ = lo < hi
            if not open_.any():
                return lo - 1
            mid = (lo + hi) // 2
            reached = self.cum[np.minimum(mid, last)] >= value
            hi = np.where(open_ & reached, mid, hi)
            lo = np.where(open_ & ~reached, mid + 1, lo)

    def _close(self, starts: np.ndarray, lasts: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """The sentence where a span from each of ``starts`` closes (see the module docstring)."""
        j = self.reach_max[starts]
        short = np.flatnonzero(targets < self.max_num_tokens)
        if len(short):
            j[short] = self._reach(starts[short], targets[short], j[short])
        j = np.maximum(j, starts + (self.min_num - 1))
        return np.where(j <= lasts - 3, j, lasts - 1)

    # --- one epoch -------------------------------------------------------------------------------

    def epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, counts)``: int64 rows ``[start, end, target]`` grouped by document in document
        order, spans in order; ``counts[i]`` rows of document ``i``."""
        n_docs = len(self.first)
        emitted = np.zeros(n_docs, dtype=np.int64)
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # (doc, rank, start, end+target)
        walker = np.arange(n_docs)
        cur = self.first.copy()
        rounds = 0
        while len(walker) and rounds < self.walk_rounds:
            last = self.last[walker]
            targets = self._targets(epoch, cur)
            close = self._close(cur, last, targets)
            keep = close + 1 - cur >= self.min_num
            w = walker[keep]
            parts.append((w, emitted[w], cur[keep], np.stack([close[keep] + 1, targets[keep]], axis=1)))
            emitted[w] += 1
            open_ = close + 1 < last
            walker, cur = walker[open_], close[open_] + 1
            rounds += 1
        if len(walker):
            parts.append(self._doubling(epoch, walker, cur, emitted))
        doc = np.concatenate([p[0] for p in parts])
        rank = np.concatenate([p[1] for p in parts])
        offsets = np.zeros(n_docs + 1, dtype=np.int64)
        np.cumsum(emitted, out=offsets[1:])
        rows = np.empty((int(offsets[-1]), 3), dtype=np.int64)
        position = offsets[doc] + rank
        rows[position, 0] = np.concatenate([p[2] for p in parts])
        rows[position, 1:] = np.concatenate([p[3] for p in parts])
        return rows, emitted

    def _doubling(self, epoch: int, walker: np.ndarray, cur: np.ndarray,
                  emitted: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Finish the documents of ``walker`` from sentence ``cur`` on, all their spans at once:
        every remaining sentence gets the span that would start there, and the chain from ``cur``
        is read off with jump tables ``next^(2^k)``."""
        lengths = self.last[walker] - cur
        base = np.zeros(len(walker) + 1, dtype=np.int64)
        np.cumsum(lengths, out=base[1:])
        m = int(base[-1])
        owner = np.repeat(np.arange(len(walker)), lengths)
        sentence = np.arange(m, dtype=np.int64) - base[owner] + cur[owner]
        last = self.last[walker][owner]
        targets = self._targets(epoch, sentence)
        close = self._close(sentence, last, targets)
        index_dtype = np.int32 if m < 2**31 - 1 else np.int64
        nxt = np.where(close + 1 < last, np.arange(m) + (close + 1 - sentence), m).astype(index_dtype)
        nxt = np.append(nxt, index_dtype(m))  # the terminal maps to itself
        roots = base[:-1].astype(index_dtype)
        tables = [nxt]
        while not np.all(tables[-1][roots] == m):
            tables.append(tables[-1][tables[-1]])
        nodes = roots
        for table in reversed(tables[:-1]):
            nodes = np.concatenate([nodes, table[nodes]])
            nodes = nodes[nodes != m]
        nodes = np.sort(nodes).astype(np.int64)
        keep = close[nodes] + 1 - sentence[nodes] >= self.min_num
        nodes = nodes[keep]
        w = walker[owner[nodes]]
        group_start = np.searchsorted(owner[nodes], owner[nodes], side="left")
        rank = emitted[w] + np.arange(len(nodes)) - group_start
        np.add.at(emitted, w, 1)
        return w, rank, sentence[nodes], np.stack([close[nodes] + 1, targets[nodes]], axis=1)


def _check(num_samples: int | None, num_epochs: int | None) -> tuple[int | None, int | None]:
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be positive (or None for whole epochs)")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs={num_epochs} must be positive (or None)")
    if num_samples is None and num_epochs is None:
        num_epochs = 1
    return num_samples, num_epochs


def _epochs(sizes: np.ndarray, doc_idx: np.ndarray, documents: Sequence[int] | np.ndarray, *,
            max_num_tokens: int, seed: int, num_samples: int | None, num_epochs: int | None,
            short_seq_prob: float, min_num_sentences: int, walk_rounds: int) -> Iterator[np.ndarray]:
    """The mapping, one (permuted, possibly cut) int64 epoch at a time."""
    num_samples, num_epochs = _check(num_samples, num_epochs)
    documents = np.asarray(documents, dtype=np.int64).reshape(-1)
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    if len(documents) and (documents.min() < 0 or documents.max() >= len(doc_idx) - 1):
        raise ValueError(f"documents must be in [0, {len(doc_idx) - 1}); got {documents.min()}..{documents.max()}")
    lengths = doc_idx[documents + 1] - doc_idx[documents]
    documents, lengths = documents[lengths >= min_num_sentences], lengths[lengths >= min_num_sentences]
    if len(documents) == 0:
        raise ValueError(f"no document has {min_num_sentences} or more sentences, so no sample can be built; "
                         f"use more text, or binary_head=None to allow one-sentence documents")
    ordered = bool(np.all(np.diff(documents) > 0))
    unique, inverse = (documents, None) if ordered else np.unique(documents, return_inverse=True)
    spans = _Spans(np.asarray(sizes), doc_idx, unique, max_num_tokens=max_num_tokens, seed=seed,
                   short_seq_prob=short_seq_prob, min_num=min_num_sentences, walk_rounds=walk_rounds)
    rng = np.random.default_rng([seed, _PERMUTATION_SEED])
    fixed: np.ndarray | None = None  # without short targets every epoch has the same rows
    epoch, total = 0, 0
    while (num_epochs is None or epoch < num_epochs) and (num_samples is None or total < num_samples):
        if fixed is not None:
            rows = fixed
        else:
            rows, counts = spans.epoch(epoch)
            if inverse is not None:  # documents in the caller's order, repeats included
                offsets = np.zeros(len(counts) + 1, dtype=np.int64)
                np.cumsum(counts, out=offsets[1:])
                reps = counts[inverse]
                within = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
                rows = rows[np.repeat(offsets[:-1][inverse], reps) + within]
            if short_seq_prob <= 0:
                fixed = rows
        if len(rows) == 0:
            raise ValueError(f"no document has {min_num_sentences} or more sentences, so no sample can be built; "
                             f"use more text, or binary_head=None to allow one-sentence documents")
        permuted = rows[rng.permutation(len(rows))]
        if num_samples is not None and total + len(permuted) > num_samples:
            permuted = permuted[:num_samples - total]
        total += len(permuted)
        epoch += 1
        yield permuted


def build_samples_mapping(sizes: np.ndarray, doc_idx: np.ndarray, documents: Sequence[int] | np.ndarray, *,
                          max_num_tokens: int, seed: int, num_samples: int | None = None,
                          num_epochs: int | None = None, short_seq_prob: float = 0.1,
                          min_num_sentences: int = 2, walk_rounds: int = WALK_ROUNDS) -> np.ndarray:
    """The samples mapping in memory: int64 rows ``[start_sentence, end_sentence, target_length]``.

    ``num_samples`` rows (epochs are repeated as needed, the last one cut), else ``num_epochs``
    full epochs (default 1). Documents with fewer than ``min_num_sentences`` sentences are skipped
    (2 for the binary head: A and B must be non-empty). See the module docstring for the rules;
    :func:`cached_samples_mapping` is the on-disk, memory-mapped version for training.
    """
    return np.concatenate(list(_epochs(sizes, doc_idx, documents, max_num_tokens=max_num_tokens, seed=seed,
                                       num_samples=num_samples, num_epochs=num_epochs,
                                       short_seq_prob=short_seq_prob, min_num_sentences=min_num_sentences,
                                       walk_rounds=walk_rounds)))


def samples_mapping_key(sizes: np.ndarray, doc_idx: np.ndarray, documents: Sequence[int] | np.ndarray, *,
                        max_num_tokens: int, seed: int, num_samples: int | None, num_epochs: int | None,
                        short_seq_prob: float, min_num_sentences: int) -> str:
    """A hex key of every input the mapping depends on (contents, not file names or dates)."""
    num_samples, num_epochs = _check(num_samples, num_epochs)
    return content_key(f"v{SAMPLES_INDEX_VERSION}|{max_num_tokens}|{seed}|{num_samples}|{num_epochs}|"
                       f"{float(short_seq_prob)!r}|{min_num_sentences}|", (sizes, doc_idx, documents))


def content_key(header: str, arrays: Sequence[np.ndarray | Sequence[int]]) -> str:
    """sha256 hex of ``header`` and the int64 contents of ``arrays`` (each preceded by its length): the
    key of a cached index, so that any change of an input it depends on gives another file."""
    digest = hashlib.sha256(header.encode())
    for array in arrays:
        array = np.asarray(array)
        digest.update(f"{len(array)}|".encode())
        # Hash in chunks: converting a huge memory-mapped array at once would load it whole.
        for start in range(0, len(array), 1 << 22):
            digest.update(np.ascontiguousarray(array[start:start + (1 << 22)], dtype=np.int64).tobytes())
    return digest.hexdigest()


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """A version 1.0 ``.npy`` header of exactly :data:`_NPY_HEADER_BYTES` bytes (written last, once the
    number of rows is known)."""
    text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
    body = text.encode("latin1")
    pad = _NPY_HEADER_BYTES - 10 - len(body) - 1
    if pad < 0:
        raise ValueError(f".npy header {text} longer than {_NPY_HEADER_BYTES} bytes")
    return b"\x93NUMPY\x01\x00" + (_NPY_HEADER_BYTES - 10).to_bytes(2, "little") + body + b" " * pad + b"\n"


class NpyStreamWriter:
    """Writes a ``.npy`` at ``path`` chunk by chunk (arrays of equal trailing shape; memory: one chunk)
    into a temporary file, published by :meth:`close` unless another builder published ``path`` first
    (:func:`~lightning_megatron.atomic_files.publish_once`: a cached file is never replaced under a reader);
    an exception inside the ``with`` block removes it. ``rows`` counts what was written."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self.tmp = self.path.with_name(f"{self.path.name}.tmp-{unique_tag()}")
        self.rows, self.tail = 0, None
        self._file = open(self.tmp, "wb")
        self._file.write(b"\0" * _NPY_HEADER_BYTES)

    def write(self, chunk: np.ndarray) -> None:
        self.tail = chunk.shape[1:] if self.tail is None else self.tail
        self._file.write(memoryview(np.ascontiguousarray(chunk, dtype=self.dtype)).cast("B"))  # no copy
        self.rows += len(chunk)

    def close(self) -> None:
        self._file.seek(0)
        self._file.write(_npy_header(self.dtype, (self.rows, *(self.tail or ()))))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        publish_once(self.tmp, self.path)

    def __enter__(self) -> NpyStreamWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()
            self.tmp.unlink(missing_ok=True)


def write_npy_stream(path: Path, chunks: Iterator[np.ndarray], dtype: np.dtype) -> int:
    """Write the concatenation of ``chunks`` (arrays of equal trailing shape) as ``.npy`` at ``path``,
    one chunk at a time (memory: one chunk), into a temporary file published in place; returns the
    number of rows."""
    with NpyStreamWriter(path, dtype) as writer:
        for chunk in chunks:
            writer.write(chunk)
    return writer.rows


def _write_mapping(path: Path, epochs: Iterator[np.ndarray], dtype: np.dtype) -> int:
    """Stream the epochs of a samples mapping into ``path``."""
    return write_npy_stream(path, epochs, dtype)


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def cached_samples_mapping(sizes: np.ndarray, doc_idx: np.ndarray, documents: Sequence[int] | np.ndarray, *,
                           max_num_tokens: int, seed: int, num_samples: int | None = None,
                           num_epochs: int | None = None, short_seq_prob: float = 0.1, min_num_sentences: int = 2,
                           cache_dir: str | os.PathLike[str], name: str = "samples",
                           fallback_cache_dir: str | os.PathLike[str] | None = None) -> np.ndarray:
    """:func:`build_samples_mapping`, built once and memory-mapped: returns a read-only ``np.memmap``
    of ``<cache_dir>/<name>.samples-<key>.npy``.

    The first process builds it (holding ``<file>.lock``; the others block on the lock, then find the
    file), writing one epoch at a time into a temporary file published in place. Rows are ``uint32``
    when every value fits, else ``int64``. ``cache_dir`` not writable: ``fallback_cache_dir`` (the
    default cache) is used instead.
    """
    kwargs = dict(max_num_tokens=max_num_tokens, seed=seed, num_samples=num_samples, num_epochs=num_epochs,
                  short_seq_prob=short_seq_prob, min_num_sentences=min_num_sentences)
    key = samples_mapping_key(sizes, doc_idx, documents, **kwargs)[:24]
    fits = max(len(sizes), max_num_tokens) < 2**32 - 1

    def build(paths: list[Path]) -> None:
        _write_mapping(paths[0], _epochs(sizes, doc_idx, documents, walk_rounds=WALK_ROUNDS, **kwargs),
                       np.dtype(np.uint32 if fits else np.int64))

    (mapping,) = cached_npy_files(cache_dir, [f"{name}.samples-{key}.npy"], build,
                                  fallback_cache_dir=fallback_cache_dir)
    if mapping.ndim != 2 or mapping.shape[1] != 3 or (num_samples is not None and len(mapping) != num_samples):
        raise ValueError(f"cached samples mapping {str(mapping.filename)!r} has shape {mapping.shape}, expected "
                         f"({num_samples if num_samples is not None else 'rows'}, 3); delete it to rebuild")
    return mapping


def cached_npy_files(cache_dir: str | os.PathLike[str], filenames: Sequence[str],
                     build: Callable[[list[Path]], None], *,
                     fallback_cache_dir: str | os.PathLike[str] | None = None) -> list[np.memmap]:
    """The ``.npy`` files ``filenames`` of ``cache_dir``, built once and memory-mapped (read-only).

    When one is missing, ``build(paths)`` writes them all (each atomically, e.g. with
    :class:`NpyStreamWriter`) while this process holds ``<first file>.lock``; the other processes
    block on the lock, then find the files. The names carry a key of every input (:func:`content_key`),
    so a file that exists is the right one. ``cache_dir`` not writable: ``fallback_cache_dir`` (else
    the default cache's ``samples/``) is used instead.
    """
    from lightning_megatron.data.tokenizer import default_cache_dir, file_lock

    directory = Path(cache_dir)
    if not all((directory / f).is_file() for f in filenames) and not _writable(directory):
        directory = Path(fallback_cache_dir) if fallback_cache_dir is not None else default_cache_dir() / "samples"
        directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f for f in filenames]
    if not all(p.is_file() for p in paths):
        with file_lock(directory / f"{filenames[0]}.lock"):
            if not all(p.is_file() for p in paths):
                build(paths)
    return [np.load(p, mmap_mode="r", allow_pickle=False) for p in paths]
