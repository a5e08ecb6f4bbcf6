"""Megatron's GPT dataset against a plain reference: documents joined into one token stream, cut into
``seq_length + 1`` windows, the same numpy permutations; its cache; resume; blends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_megatron.data import gpt_dataset
from lightning_megatron.data.blended import BlendedDataset, blend_num_samples
from lightning_megatron.data.gpt_dataset import GPTDataset, build_gpt_indices
from lightning_megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

EOD = 3


def _write_corpus(prefix, rng: np.random.Generator, num_docs: int, max_len: int = 40) -> list[np.ndarray]:
    """Documents of random ids (each ending with EOD, as ``preprocess --append-eod`` writes them), each
    written as several sentences; returns every document's tokens."""
    docs = []
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as builder:
        for _ in range(num_docs):
            tokens = np.r_[rng.integers(10, 500, int(rng.integers(0, max_len))), EOD].astype(np.uint16)
            cuts = np.sort(rng.integers(0, len(tokens) + 1, int(rng.integers(0, 4))))
            for piece in np.split(tokens, cuts):
                if len(piece):
                    builder.add_item(piece)
            builder.end_document()
            docs.append(tokens.astype(np.int64))
    return docs


def reference_samples(docs, documents, *, seq_length, seed, num_samples=None, num_epochs=None):
    """Plain: epoch ``e`` lists ``documents`` in the order ``default_rng([seed, DOC, e]).permutation``; the
    epochs' tokens are joined; window ``k`` is tokens ``[k*s, k*s + s + 1)``; windows are read in the
    order of one permutation (two when the last epoch is used for less than 80%: Megatron's rule)."""
    documents = np.asarray(documents)
    per_epoch = sum(len(docs[d]) for d in documents)
    if num_samples is not None:
        num_epochs = 1
        while num_epochs * per_epoch < num_samples * seq_length + 1:
            num_epochs += 1
    num_epochs = num_epochs or 1
    stream = []
    for epoch in range(num_epochs):
        order = np.random.default_rng([seed, gpt_dataset._DOCUMENT_SEED, epoch]).permutation(len(documents))
        stream += [docs[d] for d in documents[order]]
    stream = np.concatenate(stream)
    total = (len(stream) - 1) // seq_length
    windows = [stream[k * seq_length:k * seq_length + seq_length + 1] for k in range(total)]
    rng = np.random.default_rng([seed, gpt_dataset._SHUFFLE_SEED])
    order = rng.permutation(total)
    if num_samples is not None and num_epochs > 1:
        sans_final = ((num_epochs - 1) * per_epoch - 1) // seq_length
        if num_samples - sans_final < int(0.8 * ((per_epoch - 1) // seq_length)):
            rng = np.random.default_rng([seed, gpt_dataset._SHUFFLE_SEED])
            order = np.r_[rng.permutation(sans_final), sans_final + rng.permutation(total - sans_final)]
    return [windows[k] for k in order[:num_samples if num_samples is not None else total]]


def _check_stream(dataset, expected, eod_mask_loss=False):
    assert len(dataset) == len(expected)
    for i, window in enumerate(expected):
        sample = dataset[i]
        assert set(sample) == {"tokens", "labels", "loss_mask"}
        assert sample["tokens"].dtype == torch.int64 and sample["labels"].dtype == torch.int64
        assert sample["loss_mask"].dtype == torch.float32
        assert sample["tokens"].tolist() == window[:-1].tolist(), i
        assert sample["labels"].tolist() == window[1:].tolist(), i
        mask = (window[:-1] != EOD) if eod_mask_loss else np.ones(len(window) - 1, bool)
        assert sample["loss_mask"].tolist() == mask.astype(np.float32).tolist(), i


@pytest.mark.parametrize("case", [
    dict(seq_length=16, num_samples=None, num_epochs=None),      # one epoch
    dict(seq_length=16, num_samples=None, num_epochs=3),
    dict(seq_length=7, num_samples=250, num_epochs=None),        # last epoch 2/3 used: shuffled apart
    dict(seq_length=16, num_samples=130, num_epochs=None),       # last epoch nearly whole: one shuffle
    dict(seq_length=64, num_samples=40, num_epochs=None),        # samples longer than most documents
])
def test_sample_stream_equals_the_plain_reference(tmp_path, case):
    rng = np.random.default_rng(5)
    docs = _write_corpus(tmp_path / "ds", rng, 60)
    documents = np.arange(5, 55)
    indexed = IndexedDataset(tmp_path / "ds")
    expected = reference_samples(docs, documents, seed=9, **case)
    dataset = GPTDataset(indexed, documents=documents, seed=9, samples_cache_dir=tmp_path / "cache", **case)
    _check_stream(dataset, expected)
    in_memory = GPTDataset(indexed, documents=documents, seed=9, samples_cache_dir=False, **case)
    assert all(torch.equal(in_memory[i]["tokens"], dataset[i]["tokens"]) for i in range(len(dataset)))


def test_any_subset_of_documents_in_any_order(tmp_path):
    docs = _write_corpus(tmp_path / "ds", np.random.default_rng(6), 60)
    documents = np.random.default_rng(7).choice(60, 30, replace=False)
    expected = reference_samples(docs, documents, seq_length=10, seed=3, num_samples=200)
    _check_stream(GPTDataset(IndexedDataset(tmp_path / "ds"), documents=documents, seq_length=10, seed=3,
                             num_samples=200, samples_cache_dir=False), expected)


def test_eod_mask_loss_drops_positions_whose_input_is_eod(tmp_path):
    docs = _write_corpus(tmp_path / "ds", np.random.default_rng(1), 30, max_len=8)
    dataset = GPTDataset(IndexedDataset(tmp_path / "ds"), seq_length=12, seed=2, num_epochs=2, eod_id=EOD,
                         eod_mask_loss=True, samples_cache_dir=False)
    _check_stream(dataset, reference_samples(docs, np.arange(30), seq_length=12, seed=2, num_epochs=2),
                  eod_mask_loss=True)
    with pytest.raises(ValueError, match="eod_mask_loss=True needs eod_id"):
        GPTDataset(IndexedDataset(tmp_path / "ds"), seq_length=12, eod_mask_loss=True, samples_cache_dir=False)


def test_indices_are_megatrons_layout():
    lengths = np.array([5, 0, 9, 3, 12, 1])
    document_index, sample_index, shuffle_index = build_gpt_indices(lengths, np.arange(6), seq_length=4, seed=0,
                                                                     num_epochs=2)
    assert sorted(document_index.tolist()) == sorted(list(range(6)) * 2)
    assert sample_index.shape == ((2 * 30 - 1) // 4 + 1, 2)
    # Each row is (position in the document index, offset) of token k * seq_length of the stream.
    ends = np.cumsum(lengths[document_index.astype(np.int64)])
    for k, (position, offset) in enumerate(sample_index.astype(np.int64)):
        assert ends[position] - lengths[document_index[position]] + offset == 4 * k
        assert offset < lengths[document_index[position]]
    assert sorted(shuffle_index.tolist()) == list(range(len(sample_index) - 1))


def megatron_build_sample_idx(sizes, document_index, seq_length, num_epochs, tokens_per_epoch):
    """megatron-core's ``helpers.cpp: build_sample_idx`` (drop_last_partial_sequence=True,
    add_extra_token_to_sequence=1), transcribed line by line."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = [(0, 0)]
    document_idx_index, doc_offset = 0, 0
    while len(sample_idx) <= num_samples:
        remaining_seq_length = seq_length + 1
        while remaining_seq_length != 0:
            document_length = sizes[document_index[document_idx_index]] - doc_offset
            remaining_seq_length -= document_length
            if remaining_seq_length <= 0:
                doc_offset += remaining_seq_length + document_length - 1
                remaining_seq_length = 0
            else:
                if document_idx_index == len(document_index) - 1:
                    assert len(sample_idx) == num_samples
                    doc_offset = sizes[document_index[document_idx_index]] - 1
                    break
                document_idx_index += 1
                doc_offset = 0
        sample_idx.append((document_idx_index, doc_offset))
    return np.array(sample_idx)


@pytest.mark.parametrize("seq_length", [1, 3, 8, 50])
def test_sample_index_equals_megatrons_helper_on_the_same_document_index(seq_length):
    lengths = np.random.default_rng(seq_length).integers(0, 12, 40)
    lengths[[3, 4, 17]] = 0  # empty documents, two in a row
    documents = np.arange(2, 38)
    document_index, sample_index, _ = build_gpt_indices(lengths, documents, seq_length=seq_length, seed=1,
                                                        num_epochs=3)
    expected = megatron_build_sample_idx(lengths, document_index.astype(np.int64), seq_length, 3,
                                         int(lengths[documents].sum()))
    assert np.array_equal(sample_index.astype(np.int64), expected)


@pytest.mark.parametrize("epochs", [1, 2])
def test_samples_filling_whole_epochs_need_one_more_epoch_for_the_last_label(tmp_path, epochs):
    """At the boundary N x s = k x T (T tokens per epoch): N samples of s inputs need N x s + 1 tokens (the
    last sample's last label), one more than k epochs hold, so k + 1 epochs; one sample fewer fits in k."""
    from lightning_megatron.data.gpt_dataset import plan_gpt_indices

    seq_length, per_epoch = 8, 120  # 10 documents of 12 tokens
    with IndexedDatasetBuilder(tmp_path / "ds", dtype=np.uint16) as builder:
        docs = []
        for tokens in np.random.default_rng(epochs).integers(10, 500, (10, 12)):
            builder.add_item(tokens.astype(np.uint16))
            builder.end_document()
            docs.append(tokens.astype(np.int64))
    num_samples = epochs * per_epoch // seq_length
    assert num_samples * seq_length == epochs * per_epoch
    plan = plan_gpt_indices(per_epoch, seq_length=seq_length, num_samples=num_samples)
    assert plan.num_epochs == epochs + 1 and plan.total_samples >= num_samples, plan
    assert plan_gpt_indices(per_epoch, seq_length=seq_length, num_samples=num_samples - 1).num_epochs == epochs
    dataset = GPTDataset(IndexedDataset(tmp_path / "ds"), seq_length=seq_length, seed=2, num_samples=num_samples,
                         samples_cache_dir=False)
    _check_stream(dataset, reference_samples(docs, np.arange(10), seq_length=seq_length, seed=2,
                                             num_samples=num_samples))


def test_too_little_text_is_refused():
    with pytest.raises(ValueError, match="hold 8 tokens, fewer than seq_length \\+ 1 = 17"):
        build_gpt_indices(np.array([3, 5]), np.arange(2), seq_length=16, seed=0)
    with pytest.raises(ValueError, match="seq_length=0"):
        build_gpt_indices(np.array([3, 5]), np.arange(2), seq_length=0, seed=0)


def test_cache_is_reused_and_invalidated_by_every_input(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    _write_corpus(tmp_path / "ds", rng, 50)
    indexed = IndexedDataset(tmp_path / "ds")
    kwargs = dict(documents=np.arange(40), seq_length=8, seed=4, num_samples=300)
    first = GPTDataset(indexed, **kwargs)   # next to the data
    files = sorted(p.name for p in tmp_path.glob("ds.gpt-*.npy"))
    assert len(files) == 3 and all(isinstance(a, np.memmap) for a in first.indices)
    built = []
    real = gpt_dataset._write_indices
    monkeypatch.setattr(gpt_dataset, "_write_indices", lambda *a, **k: built.append(1) or real(*a, **k))
    again = GPTDataset(indexed, **kwargs)
    assert built == [] and [a.filename for a in again.indices] == [a.filename for a in first.indices]
    for change in (dict(documents=np.arange(39)), dict(seq_length=9), dict(seed=5), dict(num_samples=301),
                   dict(num_samples=None, num_epochs=2)):
        GPTDataset(indexed, **{**kwargs, **change})
    assert len(built) == 5
    # Other document lengths (the same number of documents) are another index.
    _write_corpus(tmp_path / "ds", np.random.default_rng(4), 50)
    GPTDataset(IndexedDataset(tmp_path / "ds"), **kwargs)
    assert len(built) == 6 and len(list(tmp_path.glob("ds.gpt-*.npy"))) == 3 * 7
    assert not list(tmp_path.glob("*.tmp-*"))


def test_worker_copies_reopen_the_maps(tmp_path):
    _write_corpus(tmp_path / "ds", np.random.default_rng(0), 20)
    dataset = GPTDataset(IndexedDataset(tmp_path / "ds"), seq_length=8, num_epochs=2)
    state = dataset.__getstate__()
    assert all(not isinstance(v, np.ndarray) or v.size < 100 for v in state.values())
    copy = GPTDataset.__new__(GPTDataset)  # what a worker process does with the state it receives
    copy.__setstate__(state)
    assert all(torch.equal(copy[i]["tokens"], dataset[i]["tokens"]) for i in range(len(dataset)))


def test_resume_from_consumed_samples_gives_the_same_next_batch(tmp_path):
    from lightning_megatron.data.samplers import MegatronPretrainingSampler

    _write_corpus(tmp_path / "ds", np.random.default_rng(8), 80)
    dataset = GPTDataset(IndexedDataset(tmp_path / "ds"), seq_length=8, num_samples=96)

    def batches(consumed):
        sampler = MegatronPretrainingSampler(total_samples=len(dataset), consumed_samples=consumed,
                                             micro_batch_size=4, data_parallel_rank=0, data_parallel_size=1,
                                             num_microbatches=2)
        return [torch.stack([dataset[i]["tokens"] for i in batch]) for batch in sampler]

    full = batches(0)
    assert torch.equal(batches(40)[0], full[5]) and len(batches(40)) == len(full) - 5


def test_blend_of_two_gpt_datasets(tmp_path):
    docs = [_write_corpus(tmp_path / name, np.random.default_rng(i), 40) for i, name in enumerate(("a", "b"))]
    weights, size = [0.25, 0.75], 120
    counts = blend_num_samples(weights, size)
    parts = [GPTDataset(IndexedDataset(tmp_path / name), seq_length=8, seed=1, num_samples=count,
                        samples_cache_dir=False) for name, count in zip(("a", "b"), counts)]
    blend = BlendedDataset(parts, weights, size)
    expected = [reference_samples(d, np.arange(40), seq_length=8, seed=1, num_samples=count)
                for d, count in zip(docs, counts)]
    seen = [0, 0]
    for i in range(size):
        which = int(blend.index["dataset"][i])
        assert blend[i]["tokens"].tolist() == expected[which][seen[which]][:-1].tolist()
        seen[which] += 1
    assert abs(seen[0] - 0.25 * size) <= 1


def _megatron_ltor(tokens: np.ndarray, eod: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron-LM's ``get_ltor_masks_and_position_ids`` with ``reset_position_ids`` and
    ``reset_attention_mask`` for one sample, written as its loop: (may-attend [s, s], position ids [s])."""
    s = len(tokens)
    may_attend, position_ids, previous = np.tril(np.ones((s, s), bool)), np.arange(s), 0
    for i in np.flatnonzero(tokens == eod):
        may_attend[i + 1:, :i + 1] = False
        position_ids[i + 1:] -= i + 1 - previous
        previous = i + 1
    return may_attend, position_ids


def test_packed_samples_carry_megatrons_positions_and_document_mask(tmp_path):
    """``reset_position_ids`` / ``reset_attention_mask``: the positions and, with the causal triangle, the
    document mask of every sample equal Megatron-LM's; off, the sample is as before."""
    from lightning_megatron.transformer.attention import document_attention_mask

    _write_corpus(tmp_path / "ds", np.random.default_rng(4), 40, max_len=10)
    kw = dict(seq_length=24, seed=2, num_epochs=2, eod_id=EOD, samples_cache_dir=False)
    packed = GPTDataset(IndexedDataset(tmp_path / "ds"), reset_position_ids=True, reset_attention_mask=True, **kw)
    plain = GPTDataset(IndexedDataset(tmp_path / "ds"), **kw)
    documents_seen = 0
    for i in range(len(packed)):
        sample = packed[i]
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids", "document_ids"}
        assert set(plain[i]) == {"tokens", "labels", "loss_mask"} and torch.equal(plain[i]["tokens"], sample["tokens"])
        may_attend, position_ids = _megatron_ltor(sample["tokens"].numpy(), EOD)
        assert sample["position_ids"].tolist() == position_ids.tolist(), i
        hidden = document_attention_mask(sample["document_ids"][None])[0, 0].numpy()
        assert ((~hidden) & np.tril(np.ones((24, 24), bool)) == may_attend).all(), i
        documents_seen += int(sample["document_ids"][-1]) + 1
    assert documents_seen > 2 * len(packed)  # most samples pack several documents
    only_positions = GPTDataset(IndexedDataset(tmp_path / "ds"), reset_position_ids=True, **kw)
    assert set(only_positions[0]) == {"tokens", "labels", "loss_mask", "position_ids"}
    with pytest.raises(ValueError, match="reset_attention_mask=True needs eod_id"):
        GPTDataset(IndexedDataset(tmp_path / "ds"), seq_length=12, reset_attention_mask=True, samples_cache_dir=False)
