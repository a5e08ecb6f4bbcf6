"""Corpus reading, tokenizer, preprocessing and the indexed dataset: round trips, malformed input, corruption."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from data_testing import default_corpus_prefix, tokenizer

from lightning_megatron.data import indexed_dataset as indexed_module
from lightning_megatron.data.corpus import CorpusStats, default_corpus_documents, read_documents, split_sentences
from lightning_megatron.data.indexed_dataset import (
    CorruptIndexedDatasetError,
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
)
from lightning_megatron.data.preprocess import preprocess_corpus
from lightning_megatron.data.tokenizer import BertTokenizer, default_vocab_file, train_wordpiece_tokenizer

# --- corpus ---------------------------------------------------------------------------------------


def test_split_sentences():
    assert split_sentences("  One sentence.  Two, with e.g. a comma!\nThree?  4 is a digit.") == [
        "One sentence.", "Two, with e.g. a comma!", "Three?", "4 is a digit."]
    assert split_sentences("   \n ") == []


def test_default_corpus_is_real_deterministic_text():
    docs = list(default_corpus_documents())
    assert docs == list(default_corpus_documents())
    sentences = [s for d in docs for s in d]
    assert len(docs) > 1000 and len(sentences) > 5000
    text = " ".join(sentences)
    assert len(text) > 500_000
    assert "The \"for\" statement is used to iterate over the elements of a sequence" in text
    assert ">>>" not in text  # interactive sessions are dropped
    multi = [d for d in docs if len(d) >= 2]
    assert len(multi) > 1000  # enough documents for sentence-order prediction


def test_default_corpus_preprocessed_reads_back_exact_token_ids():
    prefix, stats = default_corpus_prefix()
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and ds.num_documents == stats.written_documents == stats.documents
    assert ds.num_tokens == stats.tokens and len(ds) == stats.written_sentences
    tok = tokenizer()
    for d, doc in enumerate(default_corpus_documents()):
        expected = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in tok.tokenize_batch(doc)])
        got = np.concatenate(ds.document(d)).astype(np.int64)
        assert np.array_equal(got, expected), f"document {d} differs"
    assert max(ds.sizes) <= 128 - 3  # long sentences were split to fit a sample


# --- tokenizer ------------------------------------------------------------------------------------


def test_default_tokenizer_is_real_bert_vocab():
    tok = tokenizer()
    assert tok.vocab_size == 30522
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 100, 101, 102, 103)
    ids = tok.tokenize("Tokenization of unbelievably long words")
    pieces = tok.convert_ids_to_tokens(ids)
    assert any(p.startswith("##") for p in pieces)
    assert list(tok.is_word_start(ids)) == [not p.startswith("##") for p in pieces]
    assert tok.detokenize(ids) == "tokenization of unbelievably long words"
    assert tok.mask_id not in set(tok.random_token_ids.tolist())


def test_train_wordpiece_tokenizer(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("Lightning trains models. Megatron splits layers.\n\nTensor parallel layers split it.\n" * 50)
    vocab = train_wordpiece_tokenizer([corpus], 200, tmp_path / "tok")
    assert vocab == tmp_path / "tok" / "vocab.txt"
    tok = BertTokenizer(vocab)
    assert tok.vocab_size <= 200
    assert tok.convert_ids_to_tokens(range(5)) == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert tok.unk_id not in tok.tokenize("Megatron splits tensor parallel layers")
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        train_wordpiece_tokenizer([tmp_path / "nope.txt"], 200, tmp_path / "tok2")


def test_default_vocab_falls_back_to_trained_and_cached(tmp_path):
    vocab = default_vocab_file(tmp_path, prefer_packaged=False)
    assert vocab.is_relative_to(tmp_path) and BertTokenizer(vocab).vocab_size > 4000
    mtime = vocab.stat().st_mtime_ns
    assert default_vocab_file(tmp_path, prefer_packaged=False) == vocab and vocab.stat().st_mtime_ns == mtime


# --- malformed input ------------------------------------------------------------------------------


def test_malformed_input_is_counted_never_fatal(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_bytes(b"\n  \n\n")
    (tmp_path / "docs.txt").write_bytes(
        b"\n\nFirst sentence here. Second one!\nThird line.\n\n\n\nNew doc one. New doc two.\n\n")
    (tmp_path / "latin1.txt").write_bytes(b"Caf\xe9 au lait. Fine line.\nAll good here.\n")
    long_doc = " ".join(["word"] * 300)  # no sentence end: one 300-token sentence
    (tmp_path / "data.jsonl").write_text("\n".join([
        json.dumps({"text": "A json doc. It has two sentences."}),
        "this is not json",
        json.dumps(["a", "list"]),
        json.dumps({"other": "no text key"}),
        "",
        json.dumps({"text": "   "}),
        json.dumps({"text": long_doc + ". Short tail sentence."}),
        '{"text": "truncated json',
        '{"text": "A lone surrogate \\ud800 escaped. It stopped the whole run."}',  # no UTF-8 holds it
    ]) + "\n")
    inputs = [tmp_path / n for n in ("empty.txt", "blank.txt", "docs.txt", "latin1.txt", "data.jsonl")]
    stats = preprocess_corpus(inputs, tmp_path / "out" / "ds", tokenizer(), max_seq_length=128)
    assert (stats.files, stats.empty_files) == (5, 2)
    assert stats.empty_lines == 3 + 2 + (2 + 1) + 1  # blank.txt, leading, extra separators + trailing, jsonl
    assert stats.non_utf8_lines == 2  # latin1.txt's byte and the escaped surrogate (replaced by U+FFFD)
    assert (stats.bad_json_lines, stats.empty_documents) == (4, 1)
    assert stats.long_sentences_split == 1 and stats.long_documents == 1
    assert stats.documents == stats.written_documents == 6  # docs.txt 2, latin1 1, jsonl 3
    ds = IndexedDataset(tmp_path / "out" / "ds")
    assert ds.num_documents == 6
    tok = tokenizer()
    assert [list(s) for s in ds.document(0)] == [tok.tokenize(s) for s in
                                                 ("First sentence here.", "Second one!", "Third line.")]
    assert len(ds.document(2)) == 3  # the undecodable byte did not break the line
    long_sentence = tok.tokenize(long_doc + ".")
    assert [len(s) for s in ds.document(4)][:3] == [125, 125, len(long_sentence) - 250]
    assert [list(s) for s in ds.document(5)] == [tok.tokenize(s) for s in ("A lone surrogate \ufffd escaped.",
                                                                          "It stopped the whole run.")]


def test_missing_input_file_is_a_clear_error(tmp_path):
    (tmp_path / "ok.txt").write_text("Hello there. General Kenobi.\n")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        preprocess_corpus([tmp_path / "ok.txt", tmp_path / "missing.jsonl"], tmp_path / "ds", tokenizer())
    assert not list(tmp_path.glob("ds*"))


# --- indexed dataset ------------------------------------------------------------------------------


def _write(prefix, documents, dtype=np.uint16):
    with IndexedDatasetBuilder(prefix, dtype=dtype) as builder:
        for doc in documents:
            for sentence in doc:
                builder.add_item(sentence)
            builder.end_document()


DOCS = [[[5, 6, 7], [8]], [[9, 10]], [[11], [12, 13], [14, 15, 16]]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_indexed_dataset_round_trip(tmp_path, dtype):
    _write(tmp_path / "ds", DOCS, dtype)
    ds = IndexedDataset(tmp_path / "ds")
    assert ds.dtype == dtype and len(ds) == 6 and ds.num_documents == 3
    assert [[list(s) for s in ds.document(d)] for d in range(3)] == DOCS
    assert list(ds.doc_idx) == [0, 2, 3, 6] and list(ds.get(5, 1, 1)) == [15]
    import pickle
    assert list(pickle.loads(pickle.dumps(ds))[5]) == [14, 15, 16]
    assert best_dtype(30522) == np.uint16 and best_dtype(70000) == np.int32
    with pytest.raises(ValueError, match="dtype=uint16"):
        _write(tmp_path / "big", [[[70000]]])


def test_corrupt_or_truncated_files_give_clear_errors(tmp_path):
    prefix = tmp_path / "ds"
    _write(prefix, DOCS)
    idx, bin_ = tmp_path / "ds.idx", tmp_path / "ds.bin"
    good_idx, good_bin = idx.read_bytes(), bin_.read_bytes()

    idx.write_bytes(good_idx[:-5])
    with pytest.raises(CorruptIndexedDatasetError, match=r"ds\.idx.*truncated"):
        IndexedDataset(prefix)
    idx.write_bytes(good_idx[:10])
    with pytest.raises(CorruptIndexedDatasetError, match=r"ds\.idx.*header"):
        IndexedDataset(prefix)
    idx.write_bytes(b"GARBAGE!!" + good_idx[9:])
    with pytest.raises(CorruptIndexedDatasetError, match=r"ds\.idx.*magic"):
        IndexedDataset(prefix)
    idx.write_bytes(good_idx)
    bin_.write_bytes(good_bin[:-2])
    with pytest.raises(CorruptIndexedDatasetError, match=r"ds\.bin.*truncated"):
        IndexedDataset(prefix)
    bin_.unlink()
    with pytest.raises(FileNotFoundError, match=r"ds\.bin"):
        IndexedDataset(prefix)


def test_writes_are_atomic(tmp_path, monkeypatch):
    prefix = tmp_path / "ds"
    _write(prefix, DOCS)
    # A failure while writing: the previous dataset stays intact, no temporary files remain.
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(prefix, dtype=np.uint16) as builder:
            builder.add_item([1, 2, 3])
            raise RuntimeError("interrupted")
    assert [[list(s) for s in IndexedDataset(prefix).document(d)] for d in range(3)] == DOCS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx"]

    # Interrupted between the two renames: the new .bin is in place but no .idx, so the pair is
    # plainly incomplete instead of an old index over new data.
    real_replace = os.replace
    calls = []

    def replace_then_die(src, dst):
        calls.append(dst)
        if str(dst).endswith(".idx"):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(indexed_module.os, "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        _write(prefix, [[[1, 2, 3, 4]]])
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match=r"ds\.idx"):
        IndexedDataset(prefix)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_read_documents_counts(tmp_path):
    (tmp_path / "a.txt").write_text("One. Two.\n\nThree.\n")
    stats = CorpusStats()
    assert list(read_documents([tmp_path], stats)) == [["One.", "Two."], ["Three."]]
    assert (stats.files, stats.documents, stats.sentences) == (1, 2, 3)


def test_a_byte_order_mark_is_not_text(tmp_path):
    """A UTF-8 byte order mark (what Excel and Notepad write first) is no character of the text, as Python's
    ``utf-8-sig`` reads it: a corpus's first document, a CSV's first column name, a chat file's first record and a
    predict file's first prompt read as without it (the CSV's column was 'row 1 has no column', the chat file's
    first line 'not JSON', the JSONL corpus's first document dropped as bad JSON, a text's first token the mark)."""
    from lightning_megatron.data.chat import read_chat_records
    from lightning_megatron.data.labelled_text import read_records
    from lightning_megatron.data.predict import read_text_lines

    bom = "\ufeff"
    chat = json.dumps({"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hey."}]})
    texts = {"a.txt": "One. Two.\n\nThree.\n", "b.jsonl": '{"text": "Four."}\n{"text": "Five."}\n',
             "rows.csv": "sentence,label\nfine,1\n", "chat.jsonl": chat + "\n", "prompts.txt": "The function\n"}
    for folder, mark in (("plain", ""), ("marked", bom)):
        (tmp_path / folder).mkdir()
        for name, text in texts.items():
            (tmp_path / folder / name).write_text(mark + text, encoding="utf-8")
    read = {}
    for folder in ("plain", "marked"):
        d, stats = tmp_path / folder, CorpusStats()
        read[folder] = (list(read_documents([d / "a.txt", d / "b.jsonl"], stats)), stats.bad_json_lines,
                        read_records(d / "rows.csv"), [r.messages for r in read_chat_records(d / "chat.jsonl", "x")],
                        read_text_lines(d / "prompts.txt"))
    assert read["marked"] == read["plain"]
    assert read["plain"][0] == [["One.", "Two."], ["Three."], ["Four."], ["Five."]] and read["plain"][1] == 0
