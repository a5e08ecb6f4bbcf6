"""BertDataset on the real built-in corpus: masking statistics, whole words, n-grams, SOP/NSP labels, determinism."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from data_testing import default_corpus_prefix, tokenizer

from lightning_megatron.data.bert_dataset import (
    BertDataset,
    build_samples_mapping,
    create_masked_lm_predictions,
    get_train_valid_test_split_,
)
from lightning_megatron.data.indexed_dataset import IndexedDataset

SEQ = 128


def _dataset(**kwargs) -> BertDataset:
    prefix, _ = default_corpus_prefix(SEQ)
    kwargs.setdefault("num_samples", 3000)
    return BertDataset(IndexedDataset(prefix), tokenizer(), max_seq_length=SEQ, **kwargs)


@functools.cache
def _batch(**kwargs) -> dict[str, torch.Tensor]:
    """All samples of a dataset, stacked."""
    ds = _dataset(**kwargs)
    items = [ds[i] for i in range(len(ds))]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def _originals(batch):
    """Token ids before masking."""
    return torch.where(batch["lm_labels"] != -100, batch["lm_labels"], batch["tokens"])


def _candidates(batch):
    tok = tokenizer()
    orig = _originals(batch)
    return (batch["attention_mask"] == 1) & (orig != tok.cls_id) & (orig != tok.sep_id)


@pytest.mark.parametrize("whole_word_masking", [True, False], ids=["wwm", "token"])
def test_masking_statistics(whole_word_masking):
    batch = _batch(whole_word_masking=whole_word_masking)
    tok = tokenizer()
    selected = batch["loss_mask"] == 1
    assert torch.equal(selected, batch["lm_labels"] != -100)
    assert not (selected & ~_candidates(batch)).any()  # never [CLS], [SEP] or padding
    fraction = selected.sum().item() / _candidates(batch).sum().item()
    assert abs(fraction - 0.15) < 0.01, fraction
    n = selected.sum().item()
    as_mask = (selected & (batch["tokens"] == tok.mask_id)).sum().item() / n
    unchanged = (selected & (batch["tokens"] == batch["lm_labels"])).sum().item() / n
    assert abs(as_mask - 0.8) < 0.02 and abs(unchanged - 0.1) < 0.02 and abs(1 - as_mask - unchanged - 0.1) < 0.02
    print(f"\nselected {fraction:.4f} of {_candidates(batch).sum().item()} candidates; "
          f"[MASK] {as_mask:.4f} unchanged {unchanged:.4f} random {1 - as_mask - unchanged:.4f}")


def _split_words(batch):
    """Per sample, positions of each word (a piece not starting with ## and the ## pieces after it)."""
    tok = tokenizer()
    orig, cand = _originals(batch).numpy(), _candidates(batch).numpy()
    for row in range(len(orig)):
        positions = np.flatnonzero(cand[row])
        starts = np.flatnonzero(~tok.continuation[orig[row, positions]] | np.r_[True, np.diff(positions) != 1])
        yield row, np.split(positions, starts[1:])


def _words_partially_masked(batch) -> tuple[int, int]:
    mask = batch["loss_mask"].numpy() == 1
    partial = multi = 0
    for row, words in _split_words(batch):
        for word in words:
            if len(word) > 1:
                multi += 1
                partial += 0 < mask[row, word].sum() < len(word)
    return partial, multi


def test_whole_words_are_masked_together():
    partial, multi = _words_partially_masked(_batch(whole_word_masking=True))
    assert multi > 10_000 and partial == 0
    partial_token, _ = _words_partially_masked(_batch(whole_word_masking=False))
    assert partial_token > 100  # the check bites: token-level masking splits words


def test_ngram_masking_masks_longer_spans_at_same_rate():
    def mean_run(batch):
        runs = []
        for row in batch["loss_mask"].numpy():
            padded = np.r_[0, row, 0]
            edges = np.flatnonzero(np.diff(padded))
            runs.extend(edges[1::2] - edges[::2])
        return np.mean(runs)

    ngram = _batch(max_ngrams=3, num_samples=1500)
    single = _batch(num_samples=1500)
    fraction = ngram["loss_mask"].sum().item() / _candidates(ngram).sum().item()
    assert abs(fraction - 0.15) < 0.01
    assert mean_run(ngram) > 1.25 * mean_run(single)
    geometric = _batch(max_ngrams=5, geometric_dist=True, num_samples=1500)
    assert mean_run(geometric) > 1.25 * mean_run(single)


def test_sample_format():
    batch = _batch()
    tok = tokenizer()
    assert {k: (v.dtype, tuple(v.shape[1:])) for k, v in batch.items()} == {
        "tokens": (torch.int64, (SEQ,)), "token_types": (torch.int64, (SEQ,)),
        "attention_mask": (torch.int64, (SEQ,)), "lm_labels": (torch.int64, (SEQ,)),
        "loss_mask": (torch.float32, (SEQ,)), "binary_labels": (torch.int64, ())}
    orig = _originals(batch)
    length = batch["attention_mask"].sum(1)
    assert (orig[:, 0] == tok.cls_id).all() and (length <= SEQ).all()
    for row in range(0, len(orig), 97):
        n = int(length[row])
        assert (batch["attention_mask"][row, :n] == 1).all() and (batch["attention_mask"][row, n:] == 0).all()
        assert (batch["tokens"][row, n:] == tok.pad_id).all() and (batch["token_types"][row, n:] == 0).all()
        seps = torch.nonzero(orig[row, :n] == tok.sep_id).flatten().tolist()
        assert seps[-1] == n - 1 and len(seps) == 2  # [CLS] A [SEP] B [SEP]
        types = batch["token_types"][row, :n]
        assert (types[:seps[0] + 1] == 0).all() and (types[seps[0] + 1:] == 1).all()
    # A real share of the samples fills the sequence; short_seq_prob leaves some short ones.
    assert (length == SEQ).float().mean() > 0.2 and (length < 40).float().mean() > 0.02


def _segments(originals, batch, row):
    tok = tokenizer()
    n = int(batch["attention_mask"][row].sum())
    orig = originals[row, :n]
    first_sep = int(np.flatnonzero(orig == tok.sep_id)[0])
    return orig[1:first_sep], orig[first_sep + 1:n - 1]


@pytest.mark.parametrize("binary_head", ["sop", "nsp"])
def test_binary_labels(binary_head):
    ds = _dataset(binary_head=binary_head)
    batch = _batch(binary_head=binary_head)
    labels = batch["binary_labels"]
    assert abs(labels.float().mean().item() - 0.5) < 0.03
    checked = {0: 0, 1: 0}
    same_b = 0
    originals = _originals(batch).numpy()
    for row in range(len(labels)):
        start, end, _ = ds.samples_mapping[row]
        span = np.concatenate([ds.indexed_dataset[i] for i in range(start, end)]).astype(np.int64)
        a, b = _segments(originals, batch, row)
        label = int(labels[row])
        if binary_head == "nsp" and label == 1:
            if np.array_equal(a, span[:len(a)]):  # A untruncated: B must not be what follows it
                checked[label] += 1
                same_b += np.array_equal(b, span[len(a):len(a) + len(b)])
            continue
        if len(a) + len(b) != len(span):
            continue  # truncated: the order check needs the whole span
        checked[label] += 1
        if label == 0:
            assert np.array_equal(np.r_[a, b], span)  # A then B, in document order
        else:
            assert np.array_equal(np.r_[b, a], span)  # sentence order swapped
    assert min(checked.values()) > 300
    assert same_b < 0.05 * checked[1]  # docstrings repeat a few sentences ("See also:"), so not 0


def test_deterministic_per_seed_and_index():
    a, b = _dataset(num_samples=50), _dataset(num_samples=50)
    other = _dataset(num_samples=50, seed=7)
    for i in (0, 13, 49):
        assert all(torch.equal(a[i][k], b[i][k]) for k in a[i])
        assert all(torch.equal(a[i][k], a[i][k]) for k in a[i])
    assert not all(torch.equal(a[i]["tokens"], other[i]["tokens"]) for i in range(10))


def test_no_binary_head_uses_one_segment():
    batch = _batch(binary_head=None, num_samples=300)
    assert (batch["binary_labels"] == 0).all() and (batch["token_types"] == 0).all()
    assert ((_originals(batch) == tokenizer().sep_id).sum(1) == 1).all()


def test_samples_mapping_prefix_property_and_epochs():
    prefix, _ = default_corpus_prefix(SEQ)
    ds = IndexedDataset(prefix)
    kwargs = dict(max_num_tokens=SEQ - 3, seed=3, documents=np.arange(ds.num_documents))
    one_epoch = build_samples_mapping(ds.sizes, ds.doc_idx, **kwargs)
    long = build_samples_mapping(ds.sizes, ds.doc_idx, num_samples=2 * len(one_epoch) + 5, **kwargs)
    short = build_samples_mapping(ds.sizes, ds.doc_idx, num_samples=100, **kwargs)
    assert np.array_equal(long[:len(one_epoch)], one_epoch) and np.array_equal(short, one_epoch[:100])
    # Each epoch covers every sentence of every multi-sentence document exactly once.
    covered = np.zeros(len(ds), dtype=int)
    for start, end, target in one_epoch:
        covered[start:end] += 1
        assert 2 <= target <= SEQ - 3 and end - start >= 2
    multi = np.zeros(len(ds), dtype=bool)
    for d in range(ds.num_documents):
        if ds.doc_idx[d + 1] - ds.doc_idx[d] >= 2:
            multi[ds.doc_idx[d]:ds.doc_idx[d + 1]] = True
    assert (covered[multi] == 1).all() and (covered[~multi] == 0).all()


def test_masking_on_a_table():
    tokens = np.array([101, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 102])
    candidate = np.r_[False, [True] * 10, False]
    out, positions, labels = create_masked_lm_predictions(
        tokens, candidate=candidate, word_start=np.ones(12, dtype=bool), masked_lm_prob=0.2, mask_id=103,
        random_token_ids=np.array([999]), rng=np.random.default_rng(0))
    assert len(positions) == 2 and np.array_equal(labels, tokens[positions])
    assert set(out[positions].tolist()) <= {103, 999} | set(labels.tolist())
    assert np.array_equal(np.delete(out, positions), np.delete(tokens, positions))


@pytest.mark.parametrize(("splits", "size", "expected"), [
    ("949,50,1", 1000, [0, 949, 999, 1000]),
    ("949,50,1", 2426, [0, 2303, 2424, 2426]),
    ("80,20", 10, [0, 8, 10, 10]),
    ("1/1/1", 10, [0, 4, 7, 10]),
])
def test_train_valid_test_split(splits, size, expected):
    assert get_train_valid_test_split_(splits, size) == expected


def test_invalid_arguments_name_the_field():
    with pytest.raises(ValueError, match="binary_head='mlm'"):
        _dataset(binary_head="mlm")
    with pytest.raises(ValueError, match="splits='a,b'"):
        get_train_valid_test_split_("a,b", 10)
    with pytest.raises(ValueError, match="masked_lm_prob=1.5"):
        _dataset(masked_lm_prob=1.5)
