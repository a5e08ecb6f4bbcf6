"""Text or JSON lines corpora -> a memory-mapped indexed dataset (Megatron's ``preprocess_data.py``).

Every sentence is tokenized with WordPiece and written as one item, documents end with
``end_document``. Nothing in the input makes this crash: empty files, blank lines, invalid UTF-8,
malformed JSON lines and over-long sentences or documents are handled and counted in the returned
:class:`PreprocessStats`; only a missing input file raises (:class:`FileNotFoundError` naming it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_megatron.data.corpus import CorpusStats, Document, read_documents
from lightning_megatron.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from lightning_megatron.data.tokenizer import BertTokenizer

__all__ = ["PreprocessStats", "preprocess_corpus"]

_BATCH_SENTENCES = 4096  # sentences tokenized per call into the (multi-threaded) tokenizers library


@dataclass(kw_only=True)
class PreprocessStats(CorpusStats):
    """Counters of one preprocessing run (the reading counters of :class:`CorpusStats`, plus these)."""

    tokens: int = 0
    """Token ids written."""
    empty_sentences: int = 0
    """Sentences that tokenized to nothing (e.g. only control characters); dropped."""
    long_sentences_split: int = 0
    """Sentences longer than ``max_seq_length - 3`` ids, split into pieces that fit one sample."""
    long_documents: int = 0
    """Documents with more than ``max_seq_length`` ids (kept: the dataset spreads them over samples)."""
    single_sentence_documents: int = 0
    """Documents with one sentence: kept, but sentence-order / next-sentence samples cannot use them."""
    written_documents: int = 0
    """Documents in the output."""
    written_sentences: int = 0
    """Sentences (items) in the output."""
    output_prefix: str = ""
    """Where the dataset was written (``<prefix>.bin`` / ``<prefix>.idx``)."""


def _batches(documents: Iterator[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    count = 0
    for doc in documents:
        batch.append(doc)
        count += len(doc)
        if count >= _BATCH_SENTENCES:
            yield batch
            batch, count = [], 0
    if batch:
        yield batch


def preprocess_corpus(inputs: Sequence[str | os.PathLike[str]] | None, output_prefix: str | os.PathLike[str],
                      tokenizer: BertTokenizer | str | os.PathLike[str] | None = None, *,
                      json_key: str = "text", max_seq_length: int = 512) -> PreprocessStats:
    """Tokenize documents and write ``<output_prefix>.bin`` / ``.idx``.

    Args:
        inputs: ``.txt`` / ``.jsonl`` files or directories of them; ``None``: the built-in corpus.
        output_prefix: path prefix of the output pair (parent directories are created).
        tokenizer: a :class:`BertTokenizer`, a ``vocab.txt`` path, or ``None`` for the default vocabulary.
        json_key: field of each JSON line holding the document text.
        max_seq_length: the longest sample the data will feed; sentences longer than
            ``max_seq_length - 3`` ids (room for ``[CLS]`` and two ``[SEP]``) are split into pieces of
            that size, so every piece fits a sample; longer documents are counted.

    Returns:
        The counters of what was read and written. The output is written atomically: an
        interrupted run leaves no valid-looking pair (and any previous one untouched or removed).
    """
    if max_seq_length < 8:
        raise ValueError(f"max_seq_length={max_seq_length} is too short for BERT samples; use at least 8")
    if not isinstance(tokenizer, BertTokenizer):
        tokenizer = BertTokenizer(tokenizer)
    stats = PreprocessStats(output_prefix=os.fspath(output_prefix))
    documents = read_documents(inputs, stats, json_key=json_key)  # missing files raise here
    max_sentence = max_seq_length - 3
    with IndexedDatasetBuilder(Path(output_prefix), dtype=best_dtype(tokenizer.vocab_size)) as builder:
        for batch in _batches(documents):
            ids = iter(tokenizer.tokenize_batch([s for doc in batch for s in doc]))
            for doc in batch:
                doc_tokens = 0
                doc_sentences = 0
                for _ in doc:
                    sentence = np.asarray(next(ids), dtype=np.int64)
                    if sentence.size == 0:
                        stats.empty_sentences += 1
                        continue
                    if sentence.size > max_sentence:
                        stats.long_sentences_split += 1
                    for start in range(0, sentence.size, max_sentence):
                        builder.add_item(sentence[start:start + max_sentence])
                        doc_sentences += 1
                    doc_tokens += sentence.size
                if doc_sentences == 0:
                    continue
                builder.end_document()
                stats.tokens += doc_tokens
                stats.written_documents += 1
                stats.written_sentences += doc_sentences
                stats.long_documents += doc_tokens > max_seq_length
                stats.single_sentence_documents += doc_sentences == 1
    return stats
