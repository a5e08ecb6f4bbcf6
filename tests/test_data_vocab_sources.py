"""Where the tokenizer's vocabulary comes from: cased vocabularies are not lowercased, a Hugging Face
``tokenizer.json`` (or a folder) works, ``do_lower_case`` of ``tokenizer_config.json`` is read, and
pretraining data records its vocabulary in ``<prefix>.vocab.json``, which the datamodule uses when
``vocab_file`` is left null."""

from __future__ import annotations

import pytest

from lightning_megatron.data.tokenizer import BertTokenizer


def test_cased_vocabulary_tokenizer_json_and_config(tmp_path):
    """A cased vocabulary is not lowercased (before: "Paris" became [UNK] or "paris"); a tokenizer.json
    and a tokenizer_config.json's do_lower_case are read; ids equal transformers' tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import BertWordPieceTokenizer

    pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Paris", "paris", "is", "in", "France", "france",
              "The", "the", "city", "##s", ".", ","]
    (tmp_path / "cased").mkdir()
    vocab = tmp_path / "cased" / "vocab.txt"
    vocab.write_text("\n".join(pieces) + "\n")
    text = "The city Paris is in France."
    cased = BertTokenizer(vocab)
    assert cased.lowercase is False
    expected = transformers.BertTokenizerFast(str(vocab), do_lower_case=False)(text, add_special_tokens=False)
    assert cased.tokenize(text) == expected["input_ids"] == [11, 13, 5, 7, 8, 9, 15]
    assert BertTokenizer(vocab, lowercase=True).tokenize(text) == [12, 13, 6, 7, 8, 10, 15]  # explicit wins
    # A Hugging Face tokenizer.json (WordPiece), read with its own normalizer; the folder finds it.
    BertWordPieceTokenizer(str(vocab), lowercase=False).save(str(tmp_path / "cased" / "tokenizer.json"))
    from_json = BertTokenizer(tmp_path / "cased")
    assert from_json.vocab_file.name == "tokenizer.json" and from_json.lowercase is False
    assert from_json.tokenize(text) == cased.tokenize(text) and from_json.vocab_size == len(pieces)
    # the memory estimate before launch reads the vocabulary as the datamodule does (the folder was opened as a
    # file: an IsADirectoryError traceback from fit; a tokenizer.json's lines were counted as pieces)
    from lightning_megatron.models.bert.module import BertLightningModule

    for source in (tmp_path / "cased", tmp_path / "cased" / "tokenizer.json", vocab):
        shape = BertLightningModule.estimate_shape({}, {"vocab_file": str(source)}, micro_batch_size=2,
                                                   global_batch_size=4)
        assert shape.vocab_size == len(pieces), source
    # do_lower_case of tokenizer_config.json beside the vocabulary decides when no option is given.
    (tmp_path / "cased" / "tokenizer_config.json").write_text('{"do_lower_case": true}')
    assert BertTokenizer(vocab).lowercase is True
    assert BertTokenizer().lowercase is True  # the packaged uncased vocabulary


TEXT = """Paris is the capital of France. The Seine flows through Paris.

Berlin is the capital of Germany. The Spree flows through Berlin.
"""


def test_dataset_records_its_vocabulary_and_the_datamodule_uses_it(tmp_path):
    from lightning_megatron.cli import main
    from lightning_megatron.data import check_dataset_vocab, read_dataset_vocab, train_wordpiece_tokenizer
    from lightning_megatron.datamodules.pretraining import BertDataModule
    from lightning_megatron.data.indexed_dataset import IndexedDataset

    (tmp_path / "corpus.txt").write_text(TEXT * 20)
    vocab = train_wordpiece_tokenizer([tmp_path / "corpus.txt"], 120, tmp_path / "tok", lowercase=False)
    main(["preprocess", "--input", str(tmp_path / "corpus.txt"), "--output-prefix", str(tmp_path / "data"),
          "--vocab-file", str(vocab), "--no-progress"])
    record = read_dataset_vocab(tmp_path / "data")
    assert record.vocab_file == str(vocab.resolve()) and record.lowercase is False
    dm = BertDataModule(str(tmp_path / "data"), global_batch_size=2, micro_batch_size=1, max_seq_length=32)
    tok = dm.tokenizer  # before: the packaged uncased vocabulary, and a "tokenized with another vocabulary" error
    assert tok.vocab_file == vocab.resolve() and tok.lowercase is False
    check_dataset_vocab(tmp_path / "data", tok, tok.vocab_size)
    ids = {int(i) for doc in IndexedDataset(tmp_path / "data") for i in doc}
    assert tok.tokenize("Paris")[0] in ids and tok.tokenize("Paris") != tok.tokenize("paris")
    # A hand-edited record whose values are of other types ("append_eod": "no" read as true passed the check that
    # GPT documents end with EOD): refused, naming each field.
    import json

    from lightning_megatron.data.dataset_vocab import vocab_sidecar_path

    sidecar = vocab_sidecar_path(tmp_path / "data")
    good = sidecar.read_text()
    sidecar.write_text(json.dumps({**json.loads(good), "append_eod": "no", "eod": 10**30 * 1.0, "vocab_size": [1]}))
    with pytest.raises(ValueError, match=r"vocab_size=\[1\] is not int; .*eod=1e\+30 is not int or NoneType; "
                                         r"append_eod='no' is not bool"):
        read_dataset_vocab(tmp_path / "data")
    sidecar.write_text(good)
    # The recorded vocabulary gone: an error that names it and the setting to give.
    vocab.rename(tmp_path / "elsewhere.txt")
    with pytest.raises(FileNotFoundError, match=r"was tokenized with .*vocab.txt.*pass that vocabulary as "
                                                r"data.vocab_file"):
        BertDataModule(str(tmp_path / "data")).tokenizer


def test_a_record_of_other_data_is_refused_and_a_failed_preprocess_keeps_the_record(tmp_path):
    """A re-run of ``preprocess`` that failed (no text, an interrupt) deleted the prefix's ``.vocab.json`` and
    kept its ``.bin`` / ``.idx``: the datamodule then took the packaged vocabulary and trained on ids that meant
    other pieces, with a warning only. The record stays until new data replaces it. A record beside data it does
    not describe (another tool rewrote the prefix) was trusted: refused by its document and token counts."""
    import shutil

    from lightning_megatron.cli import main
    from lightning_megatron.data import check_dataset_vocab, read_dataset_vocab, train_wordpiece_tokenizer
    (tmp_path / "corpus.txt").write_text(TEXT * 20)
    (tmp_path / "short.txt").write_text(TEXT)
    (tmp_path / "blank.txt").write_text("\n\n")
    vocab = train_wordpiece_tokenizer([tmp_path / "corpus.txt"], 120, tmp_path / "tok", lowercase=False)
    for name, text in (("data", "corpus.txt"), ("short", "short.txt")):
        main(["preprocess", "--input", str(tmp_path / text), "--output-prefix", str(tmp_path / name),
              "--vocab-file", str(vocab), "--no-progress"])
    record = read_dataset_vocab(tmp_path / "data")
    with pytest.raises(SystemExit):
        main(["preprocess", "--input", str(tmp_path / "blank.txt"), "--output-prefix", str(tmp_path / "data"),
              "--vocab-file", str(vocab), "--no-progress"])
    assert read_dataset_vocab(tmp_path / "data") == record
    tok = BertTokenizer(vocab, lowercase=False)
    check_dataset_vocab(tmp_path / "data", tok, tok.vocab_size)
    shutil.copy(tmp_path / "short.vocab.json", tmp_path / "data.vocab.json")  # same vocabulary, other data
    with pytest.raises(ValueError, match=r"data.vocab.json' describes 2 documents and 26 tokens, but the dataset "
                                         r"holds 21 documents and 520 tokens: the record belongs to other data"):
        check_dataset_vocab(tmp_path / "data", tok, tok.vocab_size)


def test_a_cased_vocabulary_in_any_script_is_kept_cased(tmp_path):
    """``train-tokenizer --cased`` on Cyrillic text wrote a vocabulary the loader took for uncased (it looked for
    A-Z only): "Москва Пётр" trained as "москва петр", case and ё lost without a word. The trained vocabulary says
    it is cased (``tokenizer_config.json``, as Hugging Face's), and any script's capitals mark a vocabulary cased;
    the packaged uncased vocabulary (whose ℝ has no lower case) stays uncased. transformers' ids are the reference."""
    import transformers

    from lightning_megatron.data.tokenizer import packaged_vocab_file, train_wordpiece_tokenizer

    text = "Москва Привет Пётр Ёлка большой Город"
    corpus = tmp_path / "ru.txt"
    corpus.write_text("\n\n".join(f"{text} номер {i}.\nЕщё одна строка {i}." for i in range(60)) + "\n",
                      encoding="utf-8")
    vocab = train_wordpiece_tokenizer([corpus], 300, tmp_path / "tok", lowercase=False)
    for folder_config in (True, False):  # as trained (with its config), and the vocabulary alone
        if not folder_config:
            (tmp_path / "tok" / "tokenizer_config.json").unlink()
        ours = BertTokenizer(vocab)
        theirs = transformers.BertTokenizer(str(vocab), do_lower_case=False)
        assert ours.lowercase is False
        assert ours.tokenize(text) == theirs(text, add_special_tokens=False)["input_ids"]
        assert "Москва" in ours.convert_ids_to_tokens(ours.tokenize(text))
    assert BertTokenizer(packaged_vocab_file()).lowercase is True
    uncased = train_wordpiece_tokenizer([corpus], 300, tmp_path / "lower")
    assert BertTokenizer(uncased).lowercase is True and "Москва" not in uncased.read_text(encoding="utf-8")
