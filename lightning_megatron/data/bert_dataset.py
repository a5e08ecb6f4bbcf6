"""BERT pretraining samples, Megatron's way: ``[CLS] A [SEP] B [SEP]`` with MLM masking and a binary label.

Samples are spans of consecutive sentences of one document, listed once up front in a *samples
mapping* (``[start_sentence, end_sentence, target_length]`` rows, Megatron's ``build_mapping``):
each epoch walks every document, cutting it into spans of about ``target_length`` tokens (with
probability ``short_seq_prob`` a shorter random target, so the model also sees short inputs); the
rows of each epoch are shuffled and epochs are appended until the requested number of samples.
The mapping is built vectorised and cached on disk, memory-mapped by every process
(:mod:`lightning_megatron.data.samples_index`).

Everything random in sample ``i`` comes from a generator seeded with ``(seed, i)``, so a sample is
the same whichever worker, data-parallel rank or resumed run builds it.

Sample ``i`` (:meth:`BertDataset.__getitem__`):
1. split the span's sentences at a random point into A and B (at least one sentence each);
   sentence-order prediction (``binary_head="sop"``, Megatron's default): swap A and B with
   probability 0.5, label 1 = swapped; next-sentence prediction (``"nsp"``): with probability 0.5
   replace B by sentences of another document, label 1 = random B; ``None``: all sentences are A.
2. truncate the longer of A and B, one token at a time from a random end, to ``target_length``;
3. MLM (:func:`create_masked_lm_predictions`): select ``masked_lm_prob`` of the non-special tokens,
   in units of whole words and n-grams; each selected token becomes ``[MASK]`` (80%), a random
   token (10%) or stays (10%).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_megatron.data.indexed_dataset import IndexedDataset
from lightning_megatron.data.samples_index import build_samples_mapping, cached_samples_mapping
from lightning_megatron.data.tokenizer import BertTokenizer

__all__ = [
    "BertDataset",
    "build_samples_mapping",
    "create_masked_lm_predictions",
    "get_train_valid_test_split_",
    "truncate_seq_pair",
]

IGNORE_INDEX = -100
"""``lm_labels`` value at positions without an MLM target (``torch.nn.CrossEntropyLoss``'s default)."""


def split_weights(splits_string: str) -> list[float]:
    """The three weights (train, valid, test) of ``splits_string`` such as ``"949,50,1"`` (missing ones 0)."""
    try:
        splits = [float(s) for s in splits_string.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"splits={splits_string!r} is not a list of numbers like '949,50,1'") from None
    if len(splits) > 3:
        raise ValueError(f"splits={splits_string!r} has {len(splits)} weights; give at most three, "
                         f"train,valid,test, like '949,50,1'")
    splits = (splits + [0.0, 0.0, 0.0])[:3]
    total = sum(splits)
    if total <= 0 or any(s < 0 for s in splits):
        raise ValueError(f"splits={splits_string!r} needs non-negative weights with a positive sum, like '949,50,1'")
    return splits


def get_train_valid_test_split_(splits_string: str, size: int) -> list[int]:
    """Megatron's split of ``size`` documents by weights such as ``"949,50,1"``: returns the four
    boundaries ``[0, end_train, end_valid, size]`` (missing weights count as 0)."""
    splits = split_weights(splits_string)
    total = sum(splits)
    index = [0]
    for split in splits:
        index.append(index[-1] + int(round(split / total * float(size))))
    diff = index[-1] - size
    return [index[0]] + [i - diff for i in index[1:]]


def truncate_seq_pair(tokens_a: np.ndarray, tokens_b: np.ndarray, max_num_tokens: int,
                      rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, bool]:
    """Megatron's truncation: while too long, drop one token of the longer segment (B on ties),
    from its front or back with equal probability. Returns ``(a, b, truncated)``."""
    len_a, len_b = len(tokens_a), len(tokens_b)
    cut = {"a": [0, 0], "b": [0, 0]}  # tokens dropped at [front, back]
    truncated = len_a + len_b > max_num_tokens
    while len_a + len_b > max_num_tokens:
        if len_a > len_b:
            len_a -= 1
            side = cut["a"]
        else:
            len_b -= 1
            side = cut["b"]
        side[0 if rng.random() < 0.5 else 1] += 1
    a = tokens_a[cut["a"][0]:len(tokens_a) - cut["a"][1]]
    b = tokens_b[cut["b"][0]:len(tokens_b) - cut["b"][1]]
    return a, b, truncated


def create_masked_lm_predictions(tokens: np.ndarray, *, candidate: np.ndarray, word_start: np.ndarray,
                                 masked_lm_prob: float, mask_id: int, random_token_ids: np.ndarray,
                                 rng: np.random.Generator, max_ngrams: int = 1, geometric_dist: bool = False,
                                 favor_longer_ngram: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's BERT masking. Returns ``(masked_tokens, positions, labels)``.

    Candidates (``candidate[i]``: not a special token) are grouped into words: a group starts at every
    ``word_start`` token, so whole-word masking is ``word_start = not a ## piece`` and plain token
    masking is ``word_start = True``. ``num_to_predict = max(1, round(masked_lm_prob * candidates))``.
    Groups are visited in random order; at each, an n-gram length ``n <= max_ngrams`` is drawn
    (``P(n) ~ 1/n``, reversed with ``favor_longer_ngram``, or geometric(0.2) clipped) and the n words
    from there are selected unless that overshoots ``num_to_predict`` (then shorter n-grams are
    tried) or overlaps a selected token. Each selected token: ``[MASK]`` with probability 0.8,
    unchanged 0.1, a uniform draw from ``random_token_ids`` 0.1.
    """
    positions = np.flatnonzero(candidate)
    output = tokens.copy()
    if positions.size == 0:
        return output, positions, tokens[positions]
    starts = np.flatnonzero(word_start[positions] | np.r_[True, np.diff(positions) != 1])
    words = np.split(positions, starts[1:])
    num_to_predict = max(1, int(round(positions.size * masked_lm_prob)))
    ngrams = np.arange(1, max_ngrams + 1)
    pvals = 1.0 / ngrams
    pvals = (pvals[::-1] if favor_longer_ngram else pvals) / pvals.sum()
    covered = np.zeros(len(tokens), dtype=bool)
    selected: list[np.ndarray] = []
    num_selected = 0
    for first in rng.permutation(len(words)):
        if num_selected >= num_to_predict:
            break
        available = min(max_ngrams, len(words) - first)
        if available == 1:
            n = 1
        elif geometric_dist:
            n = min(int(rng.geometric(0.2)), available)
        else:
            n = int(rng.choice(ngrams[:available], p=pvals[:available] / pvals[:available].sum()))
        index_set = np.concatenate(words[first:first + n])
        while num_selected + index_set.size > num_to_predict and n > 1:
            n -= 1
            index_set = np.concatenate(words[first:first + n])
        if num_selected + index_set.size > num_to_predict or covered[index_set].any():
            continue
        covered[index_set] = True
        selected.append(index_set)
        num_selected += index_set.size
    masked = np.sort(np.concatenate(selected)) if selected else np.zeros(0, dtype=np.int64)
    draw = rng.random(masked.size)
    to_mask = draw < 0.8
    to_random = draw >= 0.9
    output[masked[to_mask]] = mask_id
    output[masked[to_random]] = random_token_ids[rng.integers(0, len(random_token_ids), int(to_random.sum()))]
    return output, masked, tokens[masked]


class BertDataset(Dataset):
    """BERT pretraining samples over a range of documents of an :class:`IndexedDataset`.

    Args:
        indexed_dataset: the tokenized corpus.
        tokenizer: gives the special ids, ``##`` pieces and the random-token pool.
        documents: indices of the documents this dataset draws from (a train/valid/test split).
        max_seq_length: length of every sample, padded; ``[CLS] A [SEP] B [SEP]`` fits in it.
        seed: with the sample index, determines everything random in a sample.
        num_samples: length of the dataset (epochs of the documents repeat as needed); or
        num_epochs: whole epochs (default: one epoch).
        masked_lm_prob: fraction of non-special tokens selected for MLM.
        short_seq_prob: probability of a shorter random target length for a sample.
        binary_head: ``"sop"`` sentence-order prediction, ``"nsp"`` next-sentence prediction, or ``None``.
        whole_word_masking: mask all pieces of a word together.
        max_ngrams: longest n-gram (in words) masked as one unit; 1 = single words.
        geometric_dist: draw n-gram lengths from geometric(0.2) (SpanBERT) instead of ``P(n) ~ 1/n``.
        favor_longer_ngram: reverse ``P(n) ~ 1/n`` to favour long n-grams.
        samples_cache_dir: where the samples mapping is cached (a memory-mapped ``.npy``, built by
            one process); ``None``: next to the dataset (``<prefix>.samples-<key>.npy``), or the
            default cache directory when that is not writable; ``False``: build it in memory.
    """

    def __init__(self, indexed_dataset: IndexedDataset, tokenizer: BertTokenizer, *,
                 documents: Sequence[int] | np.ndarray | None = None, max_seq_length: int = 128, seed: int = 1234,
                 num_samples: int | None = None, num_epochs: int | None = None, masked_lm_prob: float = 0.15,
                 short_seq_prob: float = 0.1, binary_head: str | None = "sop", whole_word_masking: bool = True,
                 max_ngrams: int = 1, geometric_dist: bool = False, favor_longer_ngram: bool = False,
                 samples_cache_dir: str | os.PathLike[str] | None | bool = None) -> None:
        if binary_head not in ("sop", "nsp", None):
            raise ValueError(f"binary_head={binary_head!r} must be 'sop', 'nsp' or None")
        if max_seq_length < 8:
            raise ValueError(f"max_seq_length={max_seq_length} is too short; use at least 8")
        if not 0.0 < masked_lm_prob < 1.0:
            raise ValueError(f"masked_lm_prob={masked_lm_prob} must be in (0, 1), e.g. 0.15")
        if not 0.0 <= short_seq_prob <= 1.0:
            raise ValueError(f"short_seq_prob={short_seq_prob} must be in [0, 1], e.g. 0.1")
        if max_ngrams < 1:
            raise ValueError(f"max_ngrams={max_ngrams} must be at least 1 (1 = single words)")
        if tokenizer.vocab_size > np.iinfo(indexed_dataset.dtype).max + 1 and indexed_dataset.dtype.kind == "u":
            raise ValueError(f"the tokenizer's vocab_size={tokenizer.vocab_size} does not fit the dataset's "
                             f"dtype={indexed_dataset.dtype.name}; was it built with another vocabulary?")
        self.indexed_dataset = indexed_dataset
        self.documents = np.arange(indexed_dataset.num_documents) if documents is None else np.asarray(documents)
        self.max_seq_length = max_seq_length
        self.seed = seed
        self.masked_lm_prob = masked_lm_prob
        self.binary_head = binary_head
        self.whole_word_masking = whole_word_masking
        self.max_ngrams = max_ngrams
        self.geometric_dist = geometric_dist
        self.favor_longer_ngram = favor_longer_ngram
        self.cls_id, self.sep_id = tokenizer.cls_id, tokenizer.sep_id
        self.pad_id, self.mask_id = tokenizer.pad_id, tokenizer.mask_id
        self.continuation = tokenizer.continuation
        self.random_token_ids = tokenizer.random_token_ids
        self.vocab_size = tokenizer.vocab_size
        mapping_kwargs: dict[str, Any] = dict(
            max_num_tokens=max_seq_length - 3, seed=seed, num_samples=num_samples, num_epochs=num_epochs,
            short_seq_prob=short_seq_prob, min_num_sentences=1 if binary_head is None else 2)
        if samples_cache_dir is False:
            self.samples_mapping: np.ndarray = build_samples_mapping(
                indexed_dataset.sizes, indexed_dataset.doc_idx, self.documents, **mapping_kwargs)
        else:
            prefix = Path(indexed_dataset.prefix)
            self.samples_mapping = cached_samples_mapping(
                indexed_dataset.sizes, indexed_dataset.doc_idx, self.documents, name=prefix.name,
                cache_dir=prefix.parent if samples_cache_dir in (None, True) else Path(samples_cache_dir),
                **mapping_kwargs)
        # Documents that can give NSP's random B: any other document of this split.
        sizes = np.diff(indexed_dataset.doc_idx)[self.documents] if len(self.documents) else np.zeros(0)
        self._nsp_documents = self.documents[sizes > 0]
        if binary_head == "nsp" and len(self._nsp_documents) < 2:
            raise ValueError("binary_head='nsp' needs at least two documents to draw a random B from")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        mapping = state["samples_mapping"]
        if isinstance(mapping, np.memmap) and mapping.filename:  # reopen, never copy, in worker processes
            state["samples_mapping"] = Path(mapping.filename)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["samples_mapping"], Path):
            state["samples_mapping"] = np.load(state["samples_mapping"], mmap_mode="r", allow_pickle=False)
        self.__dict__.update(state)

    def __len__(self) -> int:
        return len(self.samples_mapping)

    def _random_b(self, rng: np.random.Generator, own_doc: int, length: int) -> np.ndarray:
        """NSP's random B: sentences of another document, from a random sentence, up to ``length``."""
        doc = own_doc
        while doc == own_doc:
            doc = int(self._nsp_documents[rng.integers(len(self._nsp_documents))])
        first, last = int(self.indexed_dataset.doc_idx[doc]), int(self.indexed_dataset.doc_idx[doc + 1])
        pieces, total = [], 0
        start = int(rng.integers(first, last))
        for sentence in range(start, last):
            pieces.append(self.indexed_dataset[sentence])
            total += len(pieces[-1])
            if total >= length:
                break
        return self._checked(np.concatenate(pieces).astype(np.int64), start, start + len(pieces))

    def _checked(self, ids: np.ndarray, start: int, end: int) -> np.ndarray:
        """``ids`` (sentences ``[start, end)``) if every id is in the vocabulary; else an error naming the
        dataset, the document and the id (a corrupt ``.bin``, or one made with another vocabulary)."""
        if len(ids) == 0 or (int(ids.max()) < self.vocab_size and int(ids.min()) >= 0):  # vectorised, per sample
            return ids
        position = int(np.flatnonzero((ids < 0) | (ids >= self.vocab_size))[0])
        ends = np.cumsum(self.indexed_dataset.sizes[start:end])
        sentence = start + int(np.searchsorted(ends, position, side="right"))
        doc = int(np.searchsorted(self.indexed_dataset.doc_idx, sentence, side="right")) - 1
        raise ValueError(
            f"dataset {str(self.indexed_dataset.prefix)!r}: document {doc} (sentence {sentence}) holds token id "
            f"{int(ids[position])}, outside the tokenizer's vocabulary of {self.vocab_size} pieces: the .bin is "
            f"corrupt or was made with another vocabulary; preprocess it again (lightning-megatron preprocess "
            f"--input ... --output-prefix {self.indexed_dataset.prefix} --vocab-file VOCAB)")

    def _segments(self, rng: np.random.Generator, start: int, end: int,
                  target: int) -> tuple[np.ndarray, np.ndarray, int]:
        """A, B and the binary label of the span ``[start, end)`` (step 1 of the module docstring)."""
        sentences = [np.asarray(self.indexed_dataset[i], dtype=np.int64) for i in range(start, end)]
        self._checked(np.concatenate(sentences), start, end)
        if self.binary_head is None:
            return np.concatenate(sentences), np.zeros(0, dtype=np.int64), 0
        a_end = int(rng.integers(1, len(sentences))) if len(sentences) > 2 else 1
        tokens_a, tokens_b = np.concatenate(sentences[:a_end]), np.concatenate(sentences[a_end:])
        label = int(rng.random() < 0.5)
        if label and self.binary_head == "sop":
            tokens_a, tokens_b = tokens_b, tokens_a
        elif label:
            own_doc = int(np.searchsorted(self.indexed_dataset.doc_idx, start, side="right")) - 1
            tokens_b = self._random_b(rng, own_doc, max(1, target - len(tokens_a)))
        return tokens_a, tokens_b, label

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, end, target = (int(v) for v in self.samples_mapping[index])
        rng = np.random.default_rng([self.seed, int(index)])
        tokens_a, tokens_b, label = self._segments(rng, start, end, target)
        tokens_a, tokens_b, _ = truncate_seq_pair(tokens_a, tokens_b, target, rng)
        parts = [[self.cls_id], tokens_a, [self.sep_id]] + ([tokens_b, [self.sep_id]] if len(tokens_b) else [])
        tokens = np.concatenate(parts).astype(np.int64)
        token_types = np.zeros(len(tokens), dtype=np.int64)
        token_types[len(tokens_a) + 2:] = 1
        candidate = (tokens != self.cls_id) & (tokens != self.sep_id)
        word_start = ~self.continuation[tokens] if self.whole_word_masking else np.ones(len(tokens), dtype=bool)
        masked, positions, labels = create_masked_lm_predictions(
            tokens, candidate=candidate, word_start=word_start, masked_lm_prob=self.masked_lm_prob,
            mask_id=self.mask_id, random_token_ids=self.random_token_ids, rng=rng, max_ngrams=self.max_ngrams,
            geometric_dist=self.geometric_dist, favor_longer_ngram=self.favor_longer_ngram)
        n, s = len(tokens), self.max_seq_length
        out_tokens = np.full(s, self.pad_id, dtype=np.int64)
        out_tokens[:n] = masked
        out_types = np.zeros(s, dtype=np.int64)
        out_types[:n] = token_types
        attention_mask = np.zeros(s, dtype=np.int64)
        attention_mask[:n] = 1
        lm_labels = np.full(s, IGNORE_INDEX, dtype=np.int64)
        lm_labels[positions] = labels
        loss_mask = np.zeros(s, dtype=np.float32)
        loss_mask[positions] = 1.0
        return {
            "tokens": torch.from_numpy(out_tokens),
            "token_types": torch.from_numpy(out_types),
            "attention_mask": torch.from_numpy(attention_mask),
            "lm_labels": torch.from_numpy(lm_labels),
            "loss_mask": torch.from_numpy(loss_mask),
            "binary_labels": torch.tensor(label, dtype=torch.int64),
        }
