"""Text, JSON lines or Hugging Face corpora -> a memory-mapped indexed dataset (Megatron's
``preprocess_data.py``).

With a WordPiece tokenizer (BERT) every sentence is tokenized and written as one item; with a BPE
tokenizer (GPT) every document is one item, its text verbatim, with the end-of-document id appended
when ``append_eod`` (Megatron's ``--append-eod``). Documents end with ``end_document``;
``<prefix>.vocab.json`` records the vocabulary and the largest token id (:mod:`.dataset_vocab`).
Malformed input never crashes: empty files, blank lines, invalid UTF-8, malformed JSON lines and
over-long sentences or documents are handled and counted in the returned :class:`PreprocessStats`. A missing input raises :class:`FileNotFoundError` naming it, and inputs
that hold no text at all raise :class:`ValueError` (nothing is written).

With ``workers > 1`` the main process reads and splits the documents and ``workers`` processes
tokenize batches of them; the batches are written in input order, so the output is the same.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_megatron.data.bpe_tokenizer import BPETokenizer
from lightning_megatron.data.corpus import CorpusStats, Document, read_documents
from lightning_megatron.data.dataset_vocab import write_dataset_vocab
from lightning_megatron.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from lightning_megatron.data.tokenizer import BertTokenizer, load_tokenizer

__all__ = ["PreprocessStats", "preprocess_corpus"]

_BATCH_SENTENCES = 4096  # sentences tokenized per call into the (multi-threaded) tokenizers library
_BATCH_CHARS = 1 << 23  # ... or fewer: whole BPE documents can be large, a batch stays near 8 M characters


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
    text_bytes: int = 0
    """UTF-8 bytes of the sentences tokenized."""
    max_token_id: int = -1
    """Largest token id written."""
    seconds: float = 0.0
    """Wall time of the run."""
    output_prefix: str = ""
    """Where the dataset was written (``<prefix>.bin`` / ``<prefix>.idx`` / ``.vocab.json``)."""


def _batches(documents: Iterator[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    count = chars = 0
    for doc in documents:
        batch.append(doc)
        count += len(doc)
        chars += sum(map(len, doc))
        if count >= _BATCH_SENTENCES or chars >= _BATCH_CHARS:
            yield batch
            batch, count, chars = [], 0, 0
    if batch:
        yield batch


_TokenizedDoc = tuple[list[np.ndarray], int, int, int]
"""(pieces to write, tokens, empty sentences, sentences split)."""
Tokenizer = BertTokenizer | BPETokenizer


def _tokenize(tokenizer: Tokenizer, batch: list[Document], max_sentence: int | None,
              append_eod: bool = False) -> tuple[list[_TokenizedDoc], int]:
    """Token ids of a batch of documents, each sentence cut into pieces of at most ``max_sentence``
    (``None``: never cut), the end-of-document id appended to each document's last piece when
    ``append_eod``."""
    sentences = [s for doc in batch for s in doc]
    text_bytes = sum(len(s.encode("utf-8")) for s in sentences)
    ids = iter(tokenizer.tokenize_batch(sentences))
    dtype = best_dtype(tokenizer.vocab_size)
    out: list[_TokenizedDoc] = []
    for doc in batch:
        pieces: list[np.ndarray] = []
        tokens = empty = split = 0
        for _ in doc:
            sentence = np.asarray(next(ids), dtype=dtype)
            if sentence.size == 0:
                empty += 1
                continue
            if max_sentence is None:
                pieces.append(sentence)
            else:
                split += sentence.size > max_sentence
                pieces.extend(sentence[start:start + max_sentence] for start in range(0, sentence.size, max_sentence))
            tokens += sentence.size
        if append_eod and pieces:  # Megatron's --append-eod: on the document's last item
            pieces[-1] = np.append(pieces[-1], np.asarray(tokenizer.eod, dtype=dtype))
            tokens += 1
        out.append((pieces, tokens, empty, split))
    return out, text_bytes


_worker_state: dict[str, Any] = {}


def _worker_init(tokenizer: Tokenizer, max_sentence: int | None, append_eod: bool) -> None:
    # The tokenizer arrives pickled without its `tokenizers` object and reloads it from its file.
    _worker_state.update(tokenizer=tokenizer, max_sentence=max_sentence, append_eod=append_eod)


def _worker_tokenize(batch: list[Document]) -> tuple[list[_TokenizedDoc], int]:
    return _tokenize(_worker_state["tokenizer"], batch, _worker_state["max_sentence"], _worker_state["append_eod"])


def _tokenized_batches(batches: Iterable[list[Document]], tokenizer: Tokenizer, max_sentence: int | None,
                       workers: int, append_eod: bool) -> Iterator[tuple[list[_TokenizedDoc], int]]:
    """Tokenized batches in input order; with ``workers > 1`` from a process pool, at most
    ``2 * workers`` batches in flight (reading never runs far ahead of writing)."""
    if workers <= 1:
        for batch in batches:
            yield _tokenize(tokenizer, batch, max_sentence, append_eod)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    context = multiprocessing.get_context(method)
    with context.Pool(workers, initializer=_worker_init, initargs=(tokenizer, max_sentence, append_eod)) as pool:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(_worker_tokenize, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _Progress:
    """``MB read, MB/s`` on stderr (tqdm when installed, else a plain line every second)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None
        self.done = 0
        self.start = self.last = time.perf_counter()
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(unit="B", unit_scale=True, unit_divisor=1000, desc="preprocess", file=sys.stderr,
                                dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def update(self, nbytes: int, documents: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix(documents=documents, refresh=False)
            return
        now = time.perf_counter()
        if now - self.last >= 1.0:
            self.last = now
            print(f"preprocess: {self.done / 1e6:.1f} MB, {documents} documents, "
                  f"{self.done / 1e6 / (now - self.start):.2f} MB/s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def preprocess_corpus(inputs: Sequence[Any] | None, output_prefix: str | os.PathLike[str],
                      tokenizer: Tokenizer | str | os.PathLike[str] | None = None, *,
                      json_key: str = "text", max_seq_length: int = 512, workers: int = 1,
                      append_eod: bool = False, add_special_tokens: bool = False,
                      progress: bool = False) -> PreprocessStats:
    """Tokenize documents and write ``<output_prefix>.bin`` / ``.idx`` / ``.vocab.json``.

    Args:
        inputs: ``.txt`` / ``.jsonl`` files (or ``.gz`` ones), directories of them (recursive),
            Hugging Face ``datasets`` objects or ``save_to_disk`` directories; ``None``: the
            built-in corpus.
        output_prefix: path prefix of the output (parent directories are created).
        tokenizer: a :class:`BertTokenizer` or :class:`BPETokenizer`, a path that
            :func:`.load_tokenizer` reads (``vocab.txt``, ``tokenizer.json``, GPT-2 ``vocab.json``, a
            folder), or ``None`` for the packaged BERT vocabulary.
        json_key: field of each JSON line (column of a dataset) holding the document text.
        max_seq_length: the longest sample the data will feed; WordPiece sentences longer than
            ``max_seq_length - 3`` ids (room for ``[CLS]`` and two ``[SEP]``) are split into pieces of
            that size, so every piece fits a sample (BPE documents are never cut: the GPT dataset
            spans documents); longer documents are counted.
        append_eod: end every document with the BPE tokenizer's end-of-document id.
        add_special_tokens: encode each document as ``tokenizer(text)`` does in transformers, with the special
            tokens the BPE ``tokenizer.json``'s post-processor adds (Llama's BOS: megatron-core's
            ``--tokenizer-hf-include-special-tokens``); recorded, so the datamodule tokenizes prompts the same way.
        workers: processes tokenizing in parallel (1: in this process).
        progress: show MB read and MB/s on stderr.

    Returns:
        The counters of what was read and written. The output is written atomically: an
        interrupted run leaves no valid-looking pair (and any previous one untouched or removed).
    """
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1")
    if not isinstance(tokenizer, (BertTokenizer, BPETokenizer)):
        tokenizer = load_tokenizer(tokenizer)
    bpe = isinstance(tokenizer, BPETokenizer)
    if add_special_tokens and not bpe:
        raise ValueError(f"add_special_tokens=True adds a BPE tokenizer's own special tokens (Llama's BOS), but "
                         f"{str(tokenizer.vocab_file)!r} is a WordPiece (BERT) vocabulary, whose [CLS] and [SEP] the "
                         f"BERT samples add; drop --add-special-tokens")
    if add_special_tokens and not tokenizer.add_special_tokens:
        tokenizer = BPETokenizer(tokenizer.vocab_file, tokenizer.merges_file, eod_token=tokenizer.eod_token,
                                 add_special_tokens=True)
    ends_with_eod = bpe and tokenizer.add_special_tokens and tokenizer.added_tokens()[1][-1:] == [tokenizer.eod]
    if append_eod and ends_with_eod:
        raise ValueError(f"the post-processor of {str(tokenizer.vocab_file)!r} already ends every text with "
                         f"{tokenizer.eod_token!r}, the end-of-document token: drop --append-eod (append_eod), or "
                         f"every document would end with it twice")
    if max_seq_length < 8 and not bpe:  # BPE documents are never cut
        raise ValueError(f"max_seq_length={max_seq_length} is too short for BERT samples; use at least 8")
    if append_eod and not bpe:
        raise ValueError(f"append_eod=True needs a BPE tokenizer with an end-of-document token, but "
                         f"{str(tokenizer.vocab_file)!r} is a WordPiece (BERT) vocabulary, which has none; pass a "
                         f"BPE tokenizer.json (--tokenizer) or drop --append-eod")
    start = time.perf_counter()
    stats = PreprocessStats(output_prefix=os.fspath(output_prefix))
    documents = read_documents(inputs, stats, json_key=json_key, split_sentences=not bpe)  # missing files raise here
    max_sentence = None if bpe else max_seq_length - 3
    progress_bar = _Progress(progress)
    try:
        with IndexedDatasetBuilder(Path(output_prefix), dtype=best_dtype(tokenizer.vocab_size)) as builder:
            for tokenized, text_bytes in _tokenized_batches(_batches(documents), tokenizer, max_sentence, workers,
                                                                append_eod):
                stats.text_bytes += text_bytes
                for pieces, doc_tokens, empty, split in tokenized:
                    stats.empty_sentences += empty
                    stats.long_sentences_split += split
                    if not pieces:
                        continue
                    for piece in pieces:
                        builder.add_item(piece)
                    stats.max_token_id = max(stats.max_token_id, max(int(p.max()) for p in pieces))
                    builder.end_document()
                    stats.tokens += doc_tokens
                    stats.written_documents += 1
                    stats.written_sentences += len(pieces)
                    stats.long_documents += doc_tokens > max_seq_length
                    stats.single_sentence_documents += len(pieces) == 1 and not bpe  # BPE: one item by design
                progress_bar.update(text_bytes, stats.written_documents)
            if stats.written_documents == 0:
                raise ValueError(f"no text to preprocess in {_describe(inputs)}: {stats.files} files read, "
                                 f"{stats.empty_files} empty, {stats.bad_json_lines} bad JSON lines, "
                                 f"{stats.empty_documents} empty documents; nothing was written (check the "
                                 f"inputs and json_key={json_key!r})")
    finally:
        progress_bar.close()
    # The record is replaced once the new pair is in place (a failed run leaves the old data and its record);
    # a record of the old data beside the new one, were this process stopped in between, is refused by its counts.
    write_dataset_vocab(output_prefix, tokenizer, max_token_id=stats.max_token_id,
                        append_eod=append_eod or ends_with_eod)
    stats.seconds = time.perf_counter() - start
    return stats


def _describe(inputs: Sequence[Any] | None) -> str:
    if inputs is None:
        return "the built-in corpus"
    names = [os.fspath(i) if isinstance(i, (str, os.PathLike)) else type(i).__name__ for i in inputs]
    return repr(names[:5] + (["..."] if len(names) > 5 else []))
