"""Shared, cached fixtures for the tests/test_data_*.py files: the tokenizer and the built-in corpus
preprocessed once per pytest process (plain functions, cached, so every test module reuses them)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

__all__ = ["data_cache_dir", "default_corpus_prefix", "tokenizer"]


@functools.cache
def data_cache_dir() -> Path:
    """A temporary cache directory for this test process (removed at exit)."""
    path = Path(tempfile.mkdtemp(prefix="lm-data-tests-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def tokenizer():
    """The default tokenizer (the packaged real BERT vocabulary when installed)."""
    from lightning_megatron.data.tokenizer import BertTokenizer

    return BertTokenizer()


@functools.cache
def default_corpus_prefix(max_seq_length: int = 128) -> tuple[Path, object]:
    """The built-in corpus preprocessed with :func:`tokenizer`: ``(prefix, stats)``."""
    from lightning_megatron.data.preprocess import preprocess_corpus

    prefix = data_cache_dir() / f"default-s{max_seq_length}" / "corpus"
    stats = preprocess_corpus(None, prefix, tokenizer(), max_seq_length=max_seq_length)
    return prefix, stats
