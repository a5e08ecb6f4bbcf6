"""The vectorised samples mapping against the original loop, its rules with short targets, and its cache."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
from samples_reference import reference_samples_mapping

from lightning_megatron.data import samples_index
from lightning_megatron.data.samples_index import build_samples_mapping, cached_samples_mapping


def _corpus(rng: np.random.Generator, num_docs: int, max_sentences: int = 12, max_size: int = 40):
    """Random documents (some empty, some one sentence) of random sentences (some empty, some longer
    than a sample)."""
    lengths = rng.integers(0, max_sentences, num_docs)
    doc_idx = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    sizes = rng.integers(0, max_size, int(doc_idx[-1])).astype(np.int32)
    return sizes, doc_idx


def _random_case(seed: int):
    rng = np.random.default_rng(seed)
    sizes, doc_idx = _corpus(rng, int(rng.integers(1, 60)), max_sentences=int(rng.integers(2, 30)))
    num_docs = len(doc_idx) - 1
    kind = seed % 4
    if kind == 0:
        documents = np.arange(num_docs)
    elif kind == 1:  # a contiguous split, as the datamodule uses
        a = int(rng.integers(0, num_docs))
        documents = np.arange(a, int(rng.integers(a + 1, num_docs + 1)))
    elif kind == 2:  # any subset, in any order, with repeats
        documents = rng.choice(num_docs, size=int(rng.integers(1, num_docs + 1)))
    else:
        documents = np.sort(rng.choice(num_docs, size=int(rng.integers(1, num_docs + 1)), replace=False))
    kwargs = dict(max_num_tokens=int(rng.integers(2, 90)), seed=seed, min_num_sentences=int(rng.integers(1, 4)))
    if seed % 2:
        kwargs["num_samples"] = int(rng.integers(1, 400))
    else:
        kwargs["num_epochs"] = int(rng.integers(1, 4))
    return sizes, doc_idx, documents, kwargs


@pytest.mark.parametrize("walk_rounds", [samples_index.WALK_ROUNDS, 0, 1])
def test_same_rows_in_the_same_order_as_the_loop_without_short_targets(walk_rounds):
    checked = 0
    for seed in range(150):
        sizes, doc_idx, documents, kwargs = _random_case(seed)
        try:
            expected = reference_samples_mapping(sizes, doc_idx, documents, short_seq_prob=0.0, **kwargs)
        except ValueError as error:
            with pytest.raises(ValueError, match="no document has"):
                build_samples_mapping(sizes, doc_idx, documents, short_seq_prob=0.0, walk_rounds=walk_rounds,
                                      **kwargs)
            assert "no document has" in str(error)
            continue
        got = build_samples_mapping(sizes, doc_idx, documents, short_seq_prob=0.0, walk_rounds=walk_rounds,
                                    **kwargs)
        assert got.dtype == np.int64 and np.array_equal(got, expected), (seed, kwargs)
        checked += 1
    assert checked > 100


def test_edge_cases_match_the_loop():
    one_sentence_docs = (np.array([5, 6, 7], np.int32), np.array([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="no document has 2 or more sentences"):
        build_samples_mapping(*one_sentence_docs, [0, 1, 2], max_num_tokens=10, seed=0)
    assert build_samples_mapping(*one_sentence_docs, [0, 1, 2], max_num_tokens=10, seed=0, short_seq_prob=0.0,
                                 min_num_sentences=1).tolist() == \
        reference_samples_mapping(*one_sentence_docs, [0, 1, 2], max_num_tokens=10, seed=0, short_seq_prob=0.0,
                                  min_num_sentences=1).tolist()
    # Sentences longer than a sample, empty documents, one long document of 5000 sentences.
    sizes = np.r_[np.full(10, 500), np.random.default_rng(0).integers(1, 30, 5000)].astype(np.int32)
    doc_idx = np.array([0, 0, 10, 10, 5010])
    for kwargs in (dict(num_epochs=2), dict(num_samples=1234)):
        expected = reference_samples_mapping(sizes, doc_idx, range(4), max_num_tokens=60, seed=1,
                                             short_seq_prob=0.0, **kwargs)
        assert np.array_equal(build_samples_mapping(sizes, doc_idx, range(4), max_num_tokens=60, seed=1,
                                                    short_seq_prob=0.0, **kwargs), expected)
    with pytest.raises(ValueError, match="num_samples=0"):
        build_samples_mapping(sizes, doc_idx, range(4), max_num_tokens=60, seed=1, num_samples=0)


def _check_rules(mapping, sizes, doc_idx, documents, max_num_tokens, min_num, one_epoch):
    doc_of = np.searchsorted(doc_idx, mapping[:, 0], side="right") - 1
    assert (mapping[:, 1] - mapping[:, 0] >= min_num).all()
    assert (mapping[:, 1] <= doc_idx[doc_of + 1]).all(), "a span leaves its document"
    assert np.isin(doc_of, documents).all()
    assert ((mapping[:, 2] >= 2) & (mapping[:, 2] <= max_num_tokens)).all()
    if one_epoch:
        order = np.argsort(mapping[:, 0])
        rows, docs = mapping[order], doc_of[order]
        for d in np.unique(docs):
            spans = rows[docs == d]
            assert spans[0, 0] == doc_idx[d], "a document's spans start at its first sentence"
            assert (spans[1:, 0] == spans[:-1, 1]).all(), "spans of one document are disjoint and in order"
            # Every span but the last closed at the first sentence where it had the target and room remained.
            cum = np.r_[0, np.cumsum(sizes[doc_idx[d]:doc_idx[d + 1]])]
            for start, end, target in spans[:-1] - [doc_idx[d], doc_idx[d], 0]:
                assert cum[end] - cum[start] >= target and end - start >= min_num
                assert end - 1 - start < min_num or cum[end - 1] - cum[start] < target


@pytest.mark.parametrize("short_seq_prob", [0.1, 0.5, 1.0])
def test_short_targets_obey_the_rules(short_seq_prob):
    rng = np.random.default_rng(7)
    sizes, doc_idx = _corpus(rng, 3000, max_sentences=60, max_size=30)
    documents = np.arange(200, 2900)
    for min_num in (1, 2):
        kwargs = dict(max_num_tokens=100, seed=11, short_seq_prob=short_seq_prob, min_num_sentences=min_num)
        one_epoch = build_samples_mapping(sizes, doc_idx, documents, **kwargs)
        _check_rules(one_epoch, sizes, doc_idx, documents, 100, min_num, one_epoch=True)
        # The short-target share: P(short) * P(a short draw is below the maximum) = p * 98/99.
        share = np.mean(one_epoch[:, 2] < 100)
        expected = short_seq_prob * 98 / 99
        assert abs(share - expected) < 4 * np.sqrt(expected * (1 - expected) / len(one_epoch)) + 1e-9
        many = build_samples_mapping(sizes, doc_idx, documents, num_samples=5 * len(one_epoch), **kwargs)
        _check_rules(many, sizes, doc_idx, documents, 100, min_num, one_epoch=False)
        assert np.array_equal(many[:len(one_epoch)], one_epoch), "a longer mapping starts with the shorter"
        # Deterministic per seed, whichever way the spans are computed (walk or pointer doubling).
        for walk_rounds in (0, 3):
            assert np.array_equal(build_samples_mapping(sizes, doc_idx, documents, walk_rounds=walk_rounds,
                                                        **kwargs), one_epoch)
        other = build_samples_mapping(sizes, doc_idx, documents, **{**kwargs, "seed": 12})
        assert not np.array_equal(other, one_epoch)


# --- cache ----------------------------------------------------------------------------------------

def _cache_case():
    sizes, doc_idx = _corpus(np.random.default_rng(3), 400, max_sentences=20)
    return sizes, doc_idx, dict(max_num_tokens=50, seed=5, num_samples=3000, short_seq_prob=0.1)


def test_cache_is_memory_mapped_reused_and_invalidated(tmp_path, monkeypatch):
    sizes, doc_idx, kwargs = _cache_case()
    docs = np.arange(300)
    mapping = cached_samples_mapping(sizes, doc_idx, docs, cache_dir=tmp_path, name="ds", **kwargs)
    assert isinstance(mapping, np.memmap) and not mapping.flags.writeable and mapping.dtype == np.uint32
    assert np.array_equal(mapping, build_samples_mapping(sizes, doc_idx, docs, **kwargs))
    (path,) = tmp_path.glob("ds.samples-*.npy")

    def no_build(*args, **kw):
        raise AssertionError("rebuilt a cached mapping")

    monkeypatch.setattr(samples_index, "_write_mapping", no_build)
    again = cached_samples_mapping(sizes, doc_idx, docs, cache_dir=tmp_path, name="ds", **kwargs)
    assert again.filename == mapping.filename
    monkeypatch.undo()
    changed_sizes = sizes.copy()
    changed_sizes[17] += 1
    variants = [(sizes, doc_idx, np.arange(299), kwargs), (changed_sizes, doc_idx, docs, kwargs)]
    variants += [(sizes, doc_idx, docs, {**kwargs, key: value}) for key, value in
                 (("seed", 6), ("num_samples", 2999), ("short_seq_prob", 0.2), ("max_num_tokens", 51))]
    variants.append((sizes, doc_idx, docs, {**kwargs, "min_num_sentences": 1}))
    paths = {path}
    for s, d, docs_, kw in variants:
        other = cached_samples_mapping(s, d, docs_, cache_dir=tmp_path, name="ds", **kw)
        assert np.array_equal(other, build_samples_mapping(s, d, docs_, **kw))
        paths.add(other.filename)
    assert len(paths) == len(variants) + 1
    assert not list(tmp_path.glob("*.tmp-*"))


def _build_in_child(args):
    cache_dir, log = args
    real = samples_index._write_mapping

    def logged(*a, **kw):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(*a, **kw)

    samples_index._write_mapping = logged
    sizes, doc_idx, kwargs = _cache_case()
    mapping = cached_samples_mapping(sizes, doc_idx, np.arange(400), cache_dir=cache_dir, name="ds", **kwargs)
    return mapping.filename, int(np.asarray(mapping[:, 0], dtype=np.int64).sum())


def test_one_process_builds_the_others_wait_and_map_it(tmp_path):
    log = tmp_path / "builds.log"
    with multiprocessing.get_context("fork").Pool(3) as pool:
        results = pool.map(_build_in_child, [(tmp_path / "cache", log)] * 3)
    assert len(set(results)) == 1
    assert len(log.read_text().split()) == 1


def test_unwritable_data_directory_falls_back_to_the_cache(tmp_path):
    sizes, doc_idx, kwargs = _cache_case()
    (tmp_path / "a_file").write_text("")
    unwritable = tmp_path / "a_file" / "data"  # cannot be created, even by root
    mapping = cached_samples_mapping(sizes, doc_idx, np.arange(400), cache_dir=unwritable,
                                     fallback_cache_dir=tmp_path / "fallback", **kwargs)
    assert str(mapping.filename).startswith(str(tmp_path / "fallback"))


def test_a_held_build_lock_is_waited_for_a_bounded_time_and_temporaries_never_collide(tmp_path):
    """The cache's build lock waited for ever (a stopped job sharing the cache folder held a rank there); a
    temporary file's tag was the process id alone, which containers on two nodes share (the second build opened the
    first's temporary file and truncated it)."""
    import time

    from lightning_megatron.atomic_files import unique_tag
    from lightning_megatron.data.tokenizer import file_lock

    lock = tmp_path / "cache.lock"
    with file_lock(lock):  # held through another open file: another process's, to flock
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"waited 0 s for the lock .*cache.lock.*fuser"):
            with file_lock(lock, timeout_s=0.3):
                pass
        assert 0.3 <= time.monotonic() - start < 5
    with file_lock(lock, timeout_s=0.3):  # released: taken at once
        pass
    tags = {unique_tag() for _ in range(100)}
    assert len(tags) == 100 and all(t.startswith(f"{os.getpid()}-") for t in tags)


def test_a_file_system_without_locks_builds_unlocked(tmp_path, monkeypatch):
    """Lustre mounted ``noflock`` or NFS without its lock daemon answers ``flock`` with ENOSYS / ENOLCK: every
    cache build (the corpus, the samples and blend indices) failed on every node with a bare errno. It goes on
    unlocked (the cached files are named by their content and published by an atomic rename)."""
    import errno
    import fcntl
    import warnings

    from lightning_megatron.data.tokenizer import file_lock

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr("lightning_megatron.data.tokenizer._said_unlocked", [])
    ran = []
    with pytest.warns(UserWarning, match="this file system takes no locks .No locks available.: cached files are "
                                         "built without one"):
        with file_lock(tmp_path / "cache.lock", timeout_s=0.3):
            ran.append(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once a process
        with file_lock(tmp_path / "cache.lock", timeout_s=0.3):
            ran.append(True)
    assert ran == [True, True]

    def failing(fd, operation):  # another error is not a file system without locks
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fcntl, "flock", failing)
    with pytest.raises(OSError, match="Input/output error"):
        with file_lock(tmp_path / "cache.lock", timeout_s=0.3):
            pass


def test_a_second_builder_never_replaces_a_published_cache_file(tmp_path, monkeypatch):
    """Two builders of one cache file (nodes whose locks do not see each other's: NFS with node-local locks, a
    file system without locks) each renamed their copy into place; the second rename replaced the file the first
    node had memory-mapped, whose pages an NFS client then reads as ESTALE. The first copy published stays: the
    second builder's identical bytes are dropped, and neither leaves a temporary file."""
    import errno

    from lightning_megatron.data.samples_index import NpyStreamWriter

    path = tmp_path / "index.npy"
    rows = np.arange(12, dtype=np.int64).reshape(4, 3)
    with NpyStreamWriter(path, np.int64) as first:
        first.write(rows)
    inode = path.stat().st_ino
    mapped = np.load(path, mmap_mode="r", allow_pickle=False)
    with NpyStreamWriter(path, np.int64) as second:
        second.write(rows)
    assert path.stat().st_ino == inode  # still the file the first reader mapped
    assert np.array_equal(mapped, rows) and np.array_equal(np.load(path, allow_pickle=False), rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.npy"]

    def no_links(src, dst):  # a file system without hard links (some FUSE and object-store mounts) renames
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    fresh = tmp_path / "fresh.npy"
    with NpyStreamWriter(fresh, np.int64) as writer:
        writer.write(rows)
    assert np.array_equal(np.load(fresh, allow_pickle=False), rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.npy", "index.npy"]
