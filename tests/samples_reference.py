"""The original sentence-by-sentence samples mapping loop, kept as the reference the vectorised
:func:`lightning_megatron.data.samples_index.build_samples_mapping` is tested against."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["reference_samples_mapping"]


def _target_length(rng: np.random.Generator, max_num_tokens: int, short_seq_prob: float) -> int:
    if short_seq_prob > 0 and rng.random() < short_seq_prob:
        return int(rng.integers(2, max_num_tokens + 1))
    return max_num_tokens


def reference_samples_mapping(sizes: np.ndarray, doc_idx: np.ndarray, documents: Sequence[int] | np.ndarray, *,
                          max_num_tokens: int, seed: int, num_samples: int | None = None,
                          num_epochs: int | None = None, short_seq_prob: float = 0.1,
                          min_num_sentences: int = 2) -> np.ndarray:
    """The samples mapping: int64 rows ``[start_sentence, end_sentence, target_length]``.

    ``num_samples`` rows (epochs are repeated as needed, the last one cut), else ``num_epochs``
    full epochs (default 1). Documents with fewer than ``min_num_sentences`` sentences are skipped
    (2 for the binary head: A and B must be non-empty).
    """
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be positive (or None for whole epochs)")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs={num_epochs} must be positive (or None)")
    if num_samples is None and num_epochs is None:
        num_epochs = 1
    rng = np.random.default_rng([seed, 0x5A3])
    epochs: list[np.ndarray] = []
    total = 0
    while (num_epochs is None or len(epochs) < num_epochs) and (num_samples is None or total < num_samples):
        rows: list[tuple[int, int, int]] = []
        for doc in documents:
            first, last = int(doc_idx[doc]), int(doc_idx[doc + 1])
            if last - first < min_num_sentences:
                continue
            start, seq_len, target = first, 0, _target_length(rng, max_num_tokens, short_seq_prob)
            for sentence in range(first, last):
                seq_len += int(sizes[sentence])
                num_sentences, remaining = sentence + 1 - start, last - sentence - 1
                # Close the span when it is long enough and what remains can still form a span.
                if (seq_len >= target and remaining > 1 and num_sentences >= min_num_sentences) or remaining == 0:
                    if num_sentences >= min_num_sentences:
                        rows.append((start, sentence + 1, target))
                    start, seq_len, target = sentence + 1, 0, _target_length(rng, max_num_tokens, short_seq_prob)
        if not rows:
            raise ValueError(f"no document has {min_num_sentences} or more sentences, so no sample can be built; "
                             f"use more text, or binary_head=None to allow one-sentence documents")
        epoch = np.asarray(rows, dtype=np.int64)
        epochs.append(epoch[rng.permutation(len(epoch))])
        total += len(epoch)
    mapping = np.concatenate(epochs)
    return mapping[:num_samples] if num_samples is not None else mapping
