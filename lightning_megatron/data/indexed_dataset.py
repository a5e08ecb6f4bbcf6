"""Megatron's memory-mapped indexed dataset: token ids in ``<prefix>.bin``, the index in ``<prefix>.idx``.

The layout is Megatron-LM's ``MMapIndexedDataset`` (index version 1), so files are interchangeable:

``<prefix>.bin``: the token ids of every sentence, back to back, in ``dtype`` (uint16 when the
vocabulary has fewer than 65500 pieces, else int32).

``<prefix>.idx`` (little endian)::

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          uint64    1
    dtype code       uint8     Megatron's code (4 = int32, 8 = uint16, ...)
    num_sentences    uint64    n
    num_doc_idx      uint64    d + 1
    sizes            int32[n]  tokens per sentence
    pointers         int64[n]  byte offset of each sentence in .bin
    doc_idx          int64[d+1] sentence index where each document starts; doc_idx[d] = n

The builder writes both files under temporary names and renames them into place only when complete
(the old ``.idx`` is removed first, the new ``.idx`` renamed last), so an interrupted run never leaves
a pair that looks valid. Opening checks the header, every length and the ``.bin`` size, and names
the file and what is wrong.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from types import TracebackType

import numpy as np

from lightning_megatron.atomic_files import unique_tag

__all__ = [
    "CorruptIndexedDatasetError",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "best_dtype",
    "data_file_path",
    "dataset_counts",
    "index_file_path",
]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_HEADER = struct.Struct("<9sQBQQ")


class CorruptIndexedDatasetError(ValueError):
    """An ``.idx``/``.bin`` pair that is truncated, inconsistent or not an indexed dataset."""


def index_file_path(prefix: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def data_file_path(prefix: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def dataset_counts(prefix: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(documents, tokens)`` of the dataset at ``prefix`` from the ``.idx`` header and the ``.bin`` size, without
    opening it (constant time); None when a file is missing or the header is not Megatron's."""
    idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
    try:
        with open(idx_path, "rb") as f:
            magic, _, code, _, n_doc = _HEADER.unpack(f.read(_HEADER.size))
        bin_size = bin_path.stat().st_size
    except (OSError, struct.error):
        return None
    if magic != MAGIC or code not in DTYPE_CODES:
        return None
    return n_doc - 1, bin_size // np.dtype(DTYPE_CODES[code]).itemsize


def best_dtype(vocab_size: int) -> type[np.generic]:
    """Megatron's choice: uint16 for vocabularies under 65500 pieces, int32 above."""
    return np.uint16 if vocab_size < 65500 else np.int32


def _dtype_code(dtype: type[np.generic]) -> int:
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype={dtype} is not supported; use one of {[np.dtype(d).name for d in DTYPE_CODES.values()]}")


class IndexedDatasetBuilder:
    """Writes an indexed dataset sentence by sentence; use as a context manager::

        with IndexedDatasetBuilder(prefix, dtype=best_dtype(tokenizer.vocab_size)) as builder:
            for document in documents:
                for sentence_ids in document:
                    builder.add_item(sentence_ids)
                builder.end_document()

    Leaving the block normally finalizes (renames the files into place); an exception discards the
    temporary files and leaves any previous dataset at ``prefix`` untouched.
    """

    def __init__(self, prefix: str | os.PathLike[str], *, dtype: type[np.generic] = np.int32) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        self._code = _dtype_code(dtype)
        self._limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{unique_tag()}"
        self._tmp_bin = Path(f"{data_file_path(prefix)}{tag}")
        self._tmp_idx = Path(f"{index_file_path(prefix)}{tag}")
        self._bin = open(self._tmp_bin, "wb")
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]
        self._finalized = False

    @property
    def num_sentences(self) -> int:
        return len(self._sizes)

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    def add_item(self, ids: np.ndarray | list[int]) -> None:
        """Append one sentence (a 1-D sequence of token ids)."""
        array = np.asarray(ids)
        if array.ndim != 1:
            raise ValueError(f"add_item expects a 1-D sequence of ids, got shape {array.shape}")
        limits = self._limits
        if limits is not None and array.size and (array.min() < limits.min or array.max() > limits.max):
            raise ValueError(f"token ids in [{array.min()}, {array.max()}] do not fit dtype={self.dtype.name}; "
                             f"build with dtype=np.int32 (best_dtype(vocab_size) picks it)")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(int(array.size))

    def end_document(self) -> None:
        """Close the current document (a no-op when it has no sentences)."""
        if self._doc_idx[-1] != len(self._sizes):
            self._doc_idx.append(len(self._sizes))

    def finalize(self) -> None:
        """Write the index and move both files into place atomically."""
        self.end_document()
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.asarray(self._doc_idx, dtype=np.int64)
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self._code, len(sizes), len(doc_idx)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        # Old .idx gone first, new .idx last: at no moment does a stale index sit beside new data.
        index_file_path(self.prefix).unlink(missing_ok=True)
        os.replace(self._tmp_bin, data_file_path(self.prefix))
        os.replace(self._tmp_idx, index_file_path(self.prefix))
        self._finalized = True

    def discard(self) -> None:
        """Drop the temporary files (after a failure)."""
        if not self._bin.closed:
            self._bin.close()
        self._tmp_bin.unlink(missing_ok=True)
        self._tmp_idx.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.discard()
        elif not self._finalized:
            try:
                self.finalize()
            except BaseException:
                self.discard()
                raise


class IndexedDataset:
    """A read-only, memory-mapped indexed dataset: ``ds[i]`` is sentence ``i``'s ids (a numpy view),
    ``ds.document(d)`` the sentences of document ``d``. Cheap to pickle (reopens by prefix)."""

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = Path(prefix)
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"indexed dataset file {str(path)!r} does not exist "
                                        f"(build it with preprocess_corpus / `lightning-megatron preprocess`)")

        def corrupt(what: str, path: Path = idx_path) -> CorruptIndexedDatasetError:
            return CorruptIndexedDatasetError(f"indexed dataset file {str(path)!r} is corrupt: {what}; "
                                              f"rebuild it with preprocess_corpus")

        idx_size = idx_path.stat().st_size
        if idx_size < _HEADER.size:
            raise corrupt(f"{idx_size} bytes, shorter than the {_HEADER.size}-byte header")
        with open(idx_path, "rb") as f:
            magic, version, code, n, n_doc = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise corrupt(f"bad magic {magic!r}, expected {MAGIC!r} (not a Megatron .idx file)")
        if version != VERSION:
            raise corrupt(f"index version {version}, only version {VERSION} is supported")
        if code not in DTYPE_CODES:
            raise corrupt(f"unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + n * 4 + n * 8 + n_doc * 8
        if idx_size != expected:
            raise corrupt(f"{idx_size} bytes, but its header ({n} sentences, {n_doc} document boundaries) "
                          f"needs {expected} (truncated or overwritten)")
        self._index = np.memmap(idx_path, mode="r", dtype=np.uint8)
        offset = _HEADER.size
        self.sizes = np.frombuffer(self._index, dtype=np.int32, count=n, offset=offset)
        offset += n * 4
        self.pointers = np.frombuffer(self._index, dtype=np.int64, count=n, offset=offset)
        offset += n * 8
        self.doc_idx = np.frombuffer(self._index, dtype=np.int64, count=n_doc, offset=offset)
        """Sentence index where each document starts, then ``len(self)``: document ``d`` is sentences
        ``doc_idx[d]:doc_idx[d+1]`` (Megatron's name)."""
        if n_doc < 1 or self.doc_idx[0] != 0 or self.doc_idx[-1] != n or np.any(np.diff(self.doc_idx) < 0):
            raise corrupt("document boundaries do not run from 0 to the number of sentences in order")
        if np.any(self.sizes < 0) or (n and (self.pointers[0] != 0 or np.any(
                np.diff(self.pointers) != self.sizes[:-1].astype(np.int64) * self.dtype.itemsize))):
            raise corrupt("sentence sizes and pointers disagree")
        total_bytes = int(self.sizes.sum(dtype=np.int64)) * self.dtype.itemsize
        bin_size = bin_path.stat().st_size
        if bin_size != total_bytes:
            raise corrupt(f"{bin_size} bytes, but its index {str(idx_path)!r} describes {total_bytes} "
                          f"(truncated, or the pair comes from different runs)", bin_path)
        # np.memmap refuses empty files; an empty dataset has nothing to map.
        self._data = (np.memmap(bin_path, mode="r", dtype=self.dtype) if total_bytes
                      else np.zeros(0, dtype=self.dtype))

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def __len__(self) -> int:
        """Number of sentences."""
        return len(self.sizes)

    def __getitem__(self, index: int) -> np.ndarray:
        """Token ids of sentence ``index`` (a read-only view of the mapped file)."""
        start = int(self.pointers[index]) // self.dtype.itemsize
        return self._data[start:start + int(self.sizes[index])]

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Part of a sentence: ``length`` ids from ``offset`` (Megatron's ``get``)."""
        ids = self[index]
        return ids[offset:] if length is None else ids[offset:offset + length]

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    def document(self, index: int) -> list[np.ndarray]:
        """The sentences of document ``index``."""
        return [self[i] for i in range(int(self.doc_idx[index]), int(self.doc_idx[index + 1]))]

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))
