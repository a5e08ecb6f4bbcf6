"""Masking statistics of ``BertDataset`` on the built-in corpus: the figures of docs/data.md ("Sample i").

    PYTHONPATH=. .venv/bin/python benchmarks/masking_stats.py [--samples 3000] [--seq 128] [--seed 1234]

Preprocesses the built-in corpus with the packaged BERT vocabulary (into a temporary directory),
builds ``--samples`` samples with whole-word masking and again with token masking, and prints: the
share of candidate tokens (all but ``[CLS]``/``[SEP]``/padding) selected, how the selected tokens are
replaced (``[MASK]`` / unchanged / random), multi-piece words partially masked under each masking,
the share of swapped SOP pairs, the samples of one epoch and the time to build a sample.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from lightning_megatron.data import BertDataset, BertTokenizer, IndexedDataset, preprocess_corpus


def _stack(ds: BertDataset) -> tuple[dict[str, np.ndarray], float]:
    start = time.perf_counter()
    items = [ds[i] for i in range(len(ds))]
    seconds = (time.perf_counter() - start) / len(ds)
    return {k: np.stack([it[k].numpy() for it in items]) for k in items[0]}, seconds


def _partially_masked(batch: dict[str, np.ndarray], original: np.ndarray, candidate: np.ndarray,
                      tok: BertTokenizer) -> tuple[int, int]:
    """(words of several pieces with some but not all pieces selected, words of several pieces)."""
    selected = batch["loss_mask"] == 1
    partial = multi = 0
    for row in range(len(original)):
        positions = np.flatnonzero(candidate[row])
        starts = np.flatnonzero(~tok.continuation[original[row, positions]] | np.r_[True, np.diff(positions) != 1])
        for word in np.split(positions, starts[1:]):
            if len(word) > 1:
                multi += 1
                partial += 0 < selected[row, word].sum() < len(word)
    return partial, multi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    tok = BertTokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "corpus"
        preprocess_corpus(None, prefix, tok, max_seq_length=args.seq)
        indexed = IndexedDataset(prefix)
        common = dict(max_seq_length=args.seq, seed=args.seed, samples_cache_dir=False)
        epoch = len(BertDataset(indexed, tok, num_epochs=1, **common))
        runs = {wwm: _stack(BertDataset(indexed, tok, num_samples=args.samples, whole_word_masking=wwm, **common))
                for wwm in (True, False)}
    batch, seconds = runs[True]
    selected = batch["loss_mask"] == 1
    original = np.where(selected, batch["lm_labels"], batch["tokens"])
    candidate = (batch["attention_mask"] == 1) & (original != tok.cls_id) & (original != tok.sep_id)
    n = selected.sum()
    as_mask = (selected & (batch["tokens"] == tok.mask_id)).sum() / n
    unchanged = (selected & (batch["tokens"] == batch["lm_labels"])).sum() / n
    partial_wwm, multi = _partially_masked(batch, original, candidate, tok)
    token_batch, token_seconds = runs[False]
    token_original = np.where(token_batch["loss_mask"] == 1, token_batch["lm_labels"], token_batch["tokens"])
    token_candidate = ((token_batch["attention_mask"] == 1) & (token_original != tok.cls_id)
                       & (token_original != tok.sep_id))
    partial_token, token_multi = _partially_masked(token_batch, token_original, token_candidate, tok)
    print(f"built-in corpus, {args.samples:,} samples, max_seq_length={args.seq}, seed {args.seed}, "
          f"vocabulary {tok.vocab_size:,} pieces")
    print(f"selected: {n / candidate.sum():.2%} of {candidate.sum():,} candidate tokens ({n:,})")
    print(f"of the selected: [MASK] {as_mask:.1%}, unchanged {unchanged:.1%}, random {1 - as_mask - unchanged:.1%}")
    print(f"words of several pieces partially masked: whole-word masking {partial_wwm} of {multi:,}, "
          f"token masking {partial_token} of {token_multi:,}")
    print(f"SOP pairs swapped: {batch['binary_labels'].mean():.1%}")
    print(f"one epoch: {epoch:,} samples")
    print(f"build time per sample: {seconds * 1e3:.2f} ms (whole words), {token_seconds * 1e3:.2f} ms (tokens)")


if __name__ == "__main__":
    main()
