"""Megatron's GPT dataset: documents joined into one token stream, cut into ``seq_length + 1``-token samples.

Every document of the indexed dataset already ends with the end-of-document token (``preprocess
--append-eod``); a document is the concatenation of its items (one item per document in Megatron's
GPT files, several sentences in ours: the same tokens either way). Three indices, megatron-core's
``GPTDataset`` layout, built with numpy and cached next to the data:

- *document index* (``[E * D]``): the ``D`` documents of the split repeated for ``E`` epochs, each
  epoch in its own order ``default_rng([seed, 0x6D0C, e]).permutation(D)`` (megatron-core shuffles
  all epochs together; per epoch, every epoch holds each document once and the index streams epoch
  by epoch, so its memory is one chunk, and a longer run keeps the epochs of a shorter one).
- *sample index* (``[N + 1, 2]``): row ``k`` is ``(position in the document index, offset)`` of token
  ``k * seq_length`` of the stream; sample ``k`` is tokens ``[k s, k s + s + 1)``: inputs and labels
  shifted by one, consecutive samples sharing one token (Megatron's ``add_extra_token_to_sequence``).
  ``N = (E * T - 1) // s`` for ``T`` tokens per epoch: the last partial sample is dropped.
- *shuffle index* (``[N]``): the order samples are read in, ``default_rng([seed, 0x5FF1])``'s
  permutation of ``range(N)``; Megatron's rule: when the last epoch is needed for less than 80% of
  its samples, the samples of the earlier epochs and those of the last one are shuffled apart (two
  permutations from the same generator), so the run reads every earlier epoch whole first.

``E`` is the fewest epochs whose tokens give ``num_samples`` samples (``num_epochs`` when no number
of samples is asked for, default 1); the dataset's length is ``num_samples`` (else ``N``).

:func:`cached_gpt_indices` stores the three as ``<name>.gpt-<key>.{document,sample,shuffle}.npy``
(:func:`~lightning_megatron.data.samples_index.cached_npy_files`: built once under a file lock,
streamed chunk by chunk into temporary files published in place, memory-mapped by every process),
the key a sha256 of the token count of every document, the split's documents, ``seq_length``,
``seed``, the number of samples or epochs and the algorithm version.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_megatron.data.indexed_dataset import IndexedDataset
from lightning_megatron.data.packing import document_ids, document_positions
from lightning_megatron.data.samples_index import NpyStreamWriter, cached_npy_files, content_key

__all__ = ["GPTDataset", "GPTIndexPlan", "build_gpt_indices", "cached_gpt_indices", "check_documents_end_with_eod",
           "document_lengths", "plan_gpt_indices"]

GPT_INDEX_VERSION = 2
"""Bumped whenever the indices an input gives change (invalidates every cached index)."""

_DOCUMENT_SEED = 0x6D0C
_SHUFFLE_SEED = 0x5FF1
_CHUNK = 1 << 21  # document-index entries per streamed chunk (whole epochs; about 100 MB of temporaries)
_SEPARATE_FINAL_EPOCH = 0.80


def document_lengths(indexed: IndexedDataset) -> np.ndarray:
    """Tokens of every document (int64 ``[D]``): the sum of its items' sizes."""
    ends = np.zeros(len(indexed.sizes) + 1, dtype=np.int64)
    np.cumsum(indexed.sizes, dtype=np.int64, out=ends[1:])
    return np.diff(ends[np.asarray(indexed.doc_idx)])


def check_documents_end_with_eod(indexed: IndexedDataset, eod_id: int, *, checked: int = 10_000,
                                 wordpiece: bool = False) -> None:
    """Refuse a dataset whose documents do not end with ``eod_id`` (made without ``--append-eod``, or
    with another tokenizer): its documents would run into each other unseparated. Looks at up to
    ``checked`` documents spread evenly over the dataset (empty ones skipped). ``wordpiece``: the tokenizer is
    WordPiece (``eod`` its ``[SEP]``), whose data ``preprocess`` never ends so: the fix is a BPE tokenizer."""
    lengths = document_lengths(indexed)
    ends = np.cumsum(lengths)
    nonempty = np.flatnonzero(lengths)
    if not len(nonempty):
        return
    picked = nonempty[np.unique(np.linspace(0, len(nonempty) - 1, min(checked, len(nonempty))).astype(np.int64))]
    last = np.asarray(indexed._data[ends[picked] - 1])
    bad = np.flatnonzero(last != eod_id)
    if len(bad):
        doc = int(picked[bad[0]])
        raise ValueError(f"dataset {str(indexed.prefix)!r}: document {doc} does not end with the end-of-document id "
                         f"{eod_id} (its last token is {int(last[bad[0]])}; {len(bad)} of {len(picked)} documents "
                         f"checked): GPT samples join documents, which must be separated; " + (
                             "preprocess the text with a byte-level BPE tokenizer (`lightning-megatron preprocess "
                             "... --tokenizer tokenizer.json --append-eod`; `preprocess` ends no WordPiece document "
                             "with an end-of-document id)" if wordpiece else
                             "preprocess it again with the tokenizer's EOD (`lightning-megatron preprocess ... "
                             "--append-eod`, preprocess_corpus(..., append_eod=True))"))


@dataclass(frozen=True, kw_only=True)
class GPTIndexPlan:
    """The numbers the indices follow from (see the module docstring)."""

    tokens_per_epoch: int
    num_epochs: int
    total_samples: int
    """``N``: samples of ``num_epochs`` epochs (rows of the sample index minus one)."""
    separate_at: int | None
    """Samples of the epochs before the last when the last is shuffled apart, else None."""
    num_samples: int
    """The dataset's length."""


def plan_gpt_indices(tokens_per_epoch: int, *, seq_length: int, num_samples: int | None = None,
                     num_epochs: int | None = None) -> GPTIndexPlan:
    """Epochs and sample counts of megatron-core's ``_get_num_epochs`` and its separate-final-epoch rule."""
    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length} must be positive")
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be positive (or None for whole epochs)")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs={num_epochs} must be positive (or None)")
    if tokens_per_epoch < seq_length + 1:
        raise ValueError(f"the documents hold {tokens_per_epoch} tokens, fewer than seq_length + 1 = "
                         f"{seq_length + 1}: no sample fits; use more text or a shorter seq_length")
    separate_at = None
    if num_samples is None:
        num_epochs = num_epochs or 1
    else:
        num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
        if num_epochs > 1:
            separate_at = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
            per_epoch = (tokens_per_epoch - 1) // seq_length
            if num_samples - separate_at >= int(_SEPARATE_FINAL_EPOCH * per_epoch):
                separate_at = None
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    return GPTIndexPlan(tokens_per_epoch=tokens_per_epoch, num_epochs=num_epochs, total_samples=total,
                        separate_at=separate_at, num_samples=num_samples if num_samples is not None else total)


def _dtypes(lengths: np.ndarray, num_documents: int, plan: GPTIndexPlan) -> tuple[np.dtype, np.dtype, np.dtype]:
    """(document, sample, shuffle) index dtypes: uint32 where every value fits, else int64."""
    u32 = np.iinfo(np.uint32).max - 1
    longest = int(lengths.max()) if len(lengths) else 0
    return tuple(np.dtype(np.uint32 if fits else np.int64) for fits in (
        len(lengths) < u32, num_documents * plan.num_epochs < u32 and longest < u32, plan.total_samples < u32))


def _permutation(seed: int, epoch: int, n: int, dtype: np.dtype) -> np.ndarray:
    """``default_rng([seed, 0x6D0C, epoch]).permutation(n)`` (the same draws) in ``dtype``."""
    order = np.arange(n, dtype=dtype)
    np.random.default_rng([seed, _DOCUMENT_SEED, epoch]).shuffle(order)
    return order


def _index_chunks(lengths: np.ndarray, documents: np.ndarray, *, seq_length: int, seed: int,
                  plan: GPTIndexPlan) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(document index, sample index)`` chunk by chunk, each chunk whole epochs. Vectorised: sample
    starts are the multiples of ``seq_length``; ``c_j = ceil(end_j / s)`` samples start before the end
    of the ``j``-th document, so the document holding sample ``k``'s start is ``#{j : c_j <= k}`` (a
    ``bincount`` and a ``cumsum``)."""
    epoch_tokens, per_chunk = lengths[documents], max(1, _CHUNK // max(1, len(documents)))
    small = np.dtype(np.int32 if len(lengths) < 2**31 - 1 else np.int64)
    contiguous = bool(len(documents)) and bool(np.all(np.diff(documents) == 1))  # a split: ids = first + order
    token_base = position_base = next_sample = 0
    for first in range(0, plan.num_epochs, per_chunk):
        epochs = range(first, min(plan.num_epochs, first + per_chunk))
        order = np.concatenate([_permutation(seed, e, len(documents), small) for e in epochs])
        tokens = epoch_tokens[order]
        ends = np.cumsum(tokens)
        ends += token_base
        before_end = (ends + (seq_length - 1)) // seq_length  # samples starting before each document's end
        np.minimum(before_end, plan.total_samples + 1, out=before_end)  # the last row starts at N * s
        count = int(before_end[-1]) - next_sample
        where = np.cumsum(np.bincount(before_end[:-1] - next_sample, minlength=count + 1)[:count])
        starts = np.arange(next_sample, next_sample + count, dtype=np.int64) * seq_length
        offsets = starts - (ends[where] - tokens[where])
        rows = np.empty((count, 2), dtype=np.int64)
        np.add(where, position_base, out=rows[:, 0])
        rows[:, 1] = offsets
        if next_sample == 0:
            rows[0] = 0  # Megatron's first row is (0, 0) even when the first document is empty
        yield (order + small.type(documents[0]) if contiguous else documents[order]), rows
        token_base, position_base, next_sample = int(ends[-1]), position_base + len(order), int(before_end[-1])


def _shuffle_index(plan: GPTIndexPlan, seed: int, dtype: np.dtype) -> np.ndarray:
    """The read order: one permutation of ``range(N)``, or two (before / from ``separate_at``)."""
    rng = np.random.default_rng([seed, _SHUFFLE_SEED])
    index = np.arange(plan.total_samples, dtype=dtype)
    cut = plan.separate_at if plan.separate_at is not None else plan.total_samples
    rng.shuffle(index[:cut])  # in place, in the array's own dtype: uint32 takes half of permutation()'s int64
    rng.shuffle(index[cut:])
    return index


def _prepare(lengths: np.ndarray, documents: Sequence[int] | np.ndarray | None, seq_length: int,
             num_samples: int | None, num_epochs: int | None) -> tuple[np.ndarray, np.ndarray, GPTIndexPlan]:
    lengths = np.asarray(lengths, dtype=np.int64)
    documents = np.arange(len(lengths)) if documents is None else np.asarray(documents, dtype=np.int64).reshape(-1)
    if len(documents) and (documents.min() < 0 or documents.max() >= len(lengths)):
        raise ValueError(f"documents must be in [0, {len(lengths)}); got {documents.min()}..{documents.max()}")
    tokens = int(lengths[documents].sum())
    return lengths, documents, plan_gpt_indices(tokens, seq_length=seq_length, num_samples=num_samples,
                                                num_epochs=num_epochs)


def build_gpt_indices(lengths: np.ndarray, documents: Sequence[int] | np.ndarray | None = None, *,
                      seq_length: int, seed: int, num_samples: int | None = None,
                      num_epochs: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(document_index, sample_index, shuffle_index)`` in memory for documents of ``lengths`` tokens
    (:func:`document_lengths`); :func:`cached_gpt_indices` is the on-disk, memory-mapped version."""
    lengths, documents, plan = _prepare(lengths, documents, seq_length, num_samples, num_epochs)
    doc_dtype, sample_dtype, shuffle_dtype = _dtypes(lengths, len(documents), plan)
    chunks = list(_index_chunks(lengths, documents, seq_length=seq_length, seed=seed, plan=plan))
    return (np.concatenate([c[0] for c in chunks]).astype(doc_dtype),
            np.concatenate([c[1] for c in chunks]).astype(sample_dtype), _shuffle_index(plan, seed, shuffle_dtype))


def _write_indices(paths: list[Path], lengths: np.ndarray, documents: np.ndarray, *, seq_length: int, seed: int,
                   plan: GPTIndexPlan) -> None:
    """Stream the three indices into ``paths`` (document, sample, shuffle), each published in place when
    complete; the shuffle index, the one permutation held whole, last."""
    doc_dtype, sample_dtype, shuffle_dtype = _dtypes(lengths, len(documents), plan)
    with NpyStreamWriter(paths[0], doc_dtype) as doc_writer, NpyStreamWriter(paths[1], sample_dtype) as writer:
        for doc_chunk, sample_chunk in _index_chunks(lengths, documents, seq_length=seq_length, seed=seed, plan=plan):
            doc_writer.write(doc_chunk)
            writer.write(sample_chunk)
    shuffle = _shuffle_index(plan, seed, shuffle_dtype)
    with NpyStreamWriter(paths[2], shuffle_dtype) as writer:
        for start in range(0, len(shuffle), 1 << 24):
            writer.write(shuffle[start:start + (1 << 24)])


def cached_gpt_indices(lengths: np.ndarray, documents: Sequence[int] | np.ndarray | None = None, *,
                       seq_length: int, seed: int, num_samples: int | None = None, num_epochs: int | None = None,
                       cache_dir: str | os.PathLike[str], name: str = "gpt",
                       fallback_cache_dir: str | os.PathLike[str] | None = None) -> tuple[np.memmap, ...]:
    """:func:`build_gpt_indices`, built once into ``<cache_dir>/<name>.gpt-<key>.*.npy`` and memory-mapped."""
    lengths, documents, plan = _prepare(lengths, documents, seq_length, num_samples, num_epochs)
    key = content_key(f"gpt-v{GPT_INDEX_VERSION}|{seq_length}|{seed}|{num_samples}|{plan.num_epochs}|",
                      (lengths, documents))[:24]
    names = [f"{name}.gpt-{key}.{kind}.npy" for kind in ("document", "sample", "shuffle")]

    def build(paths: list[Path]) -> None:
        _write_indices(paths, lengths, documents, seq_length=seq_length, seed=seed, plan=plan)

    indices = cached_npy_files(cache_dir, names, build, fallback_cache_dir=fallback_cache_dir)
    expected = [(len(documents) * plan.num_epochs,), (plan.total_samples + 1, 2), (plan.total_samples,)]
    if [a.shape for a in indices] != expected:
        raise ValueError(f"cached GPT indices {[str(a.filename) for a in indices]} have shapes "
                         f"{[a.shape for a in indices]}, expected {expected}; delete them to rebuild")
    return tuple(indices)


class GPTDataset(Dataset):
    """Samples of ``seq_length + 1`` consecutive tokens of the documents' stream (see the module docstring).

    ``dataset[i]`` is a dict of ``tokens`` (int64 ``[s]``), ``labels`` (``tokens`` shifted by one, int64
    ``[s]``) and ``loss_mask`` (float32 ``[s]``: 1, or 0 where the input token is EOD with
    ``eod_mask_loss``, Megatron's ``--eod-mask-loss``: no loss on predicting across a document end); with
    ``reset_position_ids`` also ``position_ids`` (int64 ``[s]``, restarting after every EOD), with
    ``reset_attention_mask`` also ``document_ids`` (int64 ``[s]``: the model attends only within a
    document; :mod:`lightning_megatron.data.packing`).

    Args:
        indexed_dataset: the tokenized corpus, every document ending with EOD.
        documents: indices of the documents this dataset draws from (a train/valid/test split).
        seq_length: tokens per sample (the model's sequence length).
        seed: seed of the document orders and of the shuffle.
        num_samples: length of the dataset (epochs of the documents repeat as needed); or
        num_epochs: whole epochs (default: one epoch).
        eod_id: the end-of-document token (needed by ``eod_mask_loss``).
        eod_mask_loss: loss mask 0 at positions whose input token is ``eod_id``.
        reset_position_ids: positions restart at 0 after every EOD (Megatron's ``--reset-position-ids``).
        reset_attention_mask: no attention across an EOD (Megatron's ``--reset-attention-mask``): the
            sample's documents are seen as if each were run alone.
        vocab_size: the tokenizer's vocabulary: a sample holding an id outside ``[0, vocab_size)`` is an
            error naming the dataset, the document and the id (the vocab-parallel embedding would zero
            it and the loss mask it: a corrupt ``.bin`` would train silently); ``None``: not checked.
        samples_cache_dir: where the indices are cached; ``None``: next to the dataset (or the default
            cache directory when that is not writable); ``False``: built in memory.
    """

    def __init__(self, indexed_dataset: IndexedDataset, *, documents: Sequence[int] | np.ndarray | None = None,
                 seq_length: int = 1024, seed: int = 1234, num_samples: int | None = None,
                 num_epochs: int | None = None, eod_id: int | None = None, eod_mask_loss: bool = False,
                 samples_cache_dir: str | os.PathLike[str] | None | bool = None,
                 vocab_size: int | None = None, reset_position_ids: bool = False,
                 reset_attention_mask: bool = False) -> None:
        for name, on in (("eod_mask_loss", eod_mask_loss), ("reset_position_ids", reset_position_ids),
                         ("reset_attention_mask", reset_attention_mask)):
            if on and eod_id is None:
                raise ValueError(f"{name}=True needs eod_id (the tokenizer's end-of-document id)")
        self.reset_position_ids, self.reset_attention_mask = reset_position_ids, reset_attention_mask
        self.indexed_dataset = indexed_dataset
        self.seq_length, self.seed = seq_length, seed
        self.eod_id, self.eod_mask_loss = eod_id, eod_mask_loss
        self.vocab_size = vocab_size
        lengths = document_lengths(indexed_dataset)
        self._doc_start = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self._doc_start[1:])
        self.documents = np.arange(len(lengths)) if documents is None else np.asarray(documents)
        kwargs: dict[str, Any] = dict(seq_length=seq_length, seed=seed, num_samples=num_samples, num_epochs=num_epochs)
        if samples_cache_dir is False:
            self.indices: tuple[np.ndarray, ...] = build_gpt_indices(lengths, self.documents, **kwargs)
        else:
            prefix = Path(indexed_dataset.prefix)
            self.indices = cached_gpt_indices(
                lengths, self.documents, name=prefix.name,
                cache_dir=prefix.parent if samples_cache_dir in (None, True) else Path(samples_cache_dir), **kwargs)
        self.plan = _prepare(lengths, self.documents, seq_length, num_samples, num_epochs)[2]
        self._length = self.plan.num_samples

    @property
    def order_key(self) -> list[int | None]:
        """What the order of the samples follows from besides the data and the seed: the epochs, and where the last
        is shuffled apart (megatron-core's shuffle permutes all the epochs' samples together, so another count
        reorders every sample). Datasets of one key read their common first samples in the same order."""
        return [self.plan.num_epochs, self.plan.separate_at]

    @property
    def document_index(self) -> np.ndarray:
        return self.indices[0]

    @property
    def sample_index(self) -> np.ndarray:
        return self.indices[1]

    @property
    def shuffle_index(self) -> np.ndarray:
        return self.indices[2]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # reopen the maps, never copy them, in worker processes
        state["indices"] = tuple(Path(a.filename) if isinstance(a, np.memmap) and a.filename else a
                                 for a in self.indices)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["indices"] = tuple(np.load(a, mmap_mode="r", allow_pickle=False) if isinstance(a, Path) else a
                                 for a in state["indices"])
        self.__dict__.update(state)

    def __len__(self) -> int:
        return self._length

    def tokens(self, index: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``index`` (int64)."""
        document_index, sample_index, shuffle_index = self.indices
        k = int(shuffle_index[index])
        (first, offset), (last, end) = (tuple(int(v) for v in row) for row in sample_index[k:k + 2])
        data = self.indexed_dataset._data
        parts, docs = [], []
        for position in range(first, last + 1):  # the few documents this sample spans
            doc = int(document_index[position])
            begin = self._doc_start[doc] + (offset if position == first else 0)
            stop = self._doc_start[doc] + end + 1 if position == last else self._doc_start[doc + 1]
            parts.append(data[begin:stop])
            docs.append(doc)
        ids = np.concatenate(parts).astype(np.int64)
        if self.vocab_size is not None and len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < self.vocab_size:
            self._refuse(parts, docs)  # vectorised per sample: the ids read anyway, nothing else
        return ids

    def _refuse(self, parts: list[np.ndarray], docs: list[int]) -> None:
        """The error for a sample holding an id outside the vocabulary: the dataset, document and id."""
        for part, doc in zip(parts, docs):
            bad = np.flatnonzero((part.astype(np.int64) < 0) | (part.astype(np.int64) >= self.vocab_size))
            if len(bad):
                prefix = self.indexed_dataset.prefix
                raise ValueError(
                    f"dataset {str(prefix)!r}: document {doc} holds token id {int(part[bad[0]])}, outside the "
                    f"tokenizer's vocabulary of {self.vocab_size} pieces: the .bin is corrupt or was made with another "
                    f"vocabulary; preprocess it again (lightning-megatron preprocess --input ... --output-prefix "
                    f"{prefix} --tokenizer TOKENIZER --append-eod)")

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        text = self.tokens(index)
        tokens, labels = text[:-1], text[1:]
        loss_mask = np.ones(len(tokens), dtype=np.float32)
        if self.eod_mask_loss:
            loss_mask[tokens == self.eod_id] = 0.0
        sample = {"tokens": torch.from_numpy(tokens.copy()), "labels": torch.from_numpy(labels.copy()),
                  "loss_mask": torch.from_numpy(loss_mask)}
        if self.reset_position_ids or self.reset_attention_mask:
            documents = document_ids(tokens, self.eod_id)
            if self.reset_position_ids:
                sample["position_ids"] = torch.from_numpy(document_positions(documents))
            if self.reset_attention_mask:
                sample["document_ids"] = torch.from_numpy(documents)
        return sample
