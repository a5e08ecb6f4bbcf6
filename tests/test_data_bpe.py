"""Byte-level BPE tokenizer (lightning_megatron/data/bpe_tokenizer.py) against transformers'
GPT2TokenizerFast on the same vocab + merges, its refusals, and BPE preprocessing with EOD."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from lightning_megatron.data import (
    BertTokenizer,
    BPETokenizer,
    IndexedDataset,
    check_dataset_vocab,
    default_corpus_documents,
    packaged_bpe_tokenizer_file,
    preprocess_corpus,
    read_dataset_vocab,
)
from lightning_megatron.data.bpe_tokenizer import EOD_TOKEN

TRICKY = ["  two leading spaces", "tabs\tand\nnew\n\nlines ", "Ünïcödé façade — naïve café 東京 🤖👍🏽",
          "it's we'll I'M 1234567 3.14e-10", "ends with spaces   ", "", " ", "a<|endoftext|>b"]


def _texts(n: int | None = None) -> list[str]:
    """The built-in corpus (its first ``n`` documents) as GPT data reads it, then the edge cases."""
    docs = [" ".join(d) for d in itertools.islice(default_corpus_documents(), n)]
    return docs + TRICKY


def test_bpe_equals_gpt2_tokenizer_fast_on_vocab_and_merges(tmp_path):
    from tokenizers import Tokenizer
    from transformers import GPT2TokenizerFast, PreTrainedTokenizerFast

    packaged = packaged_bpe_tokenizer_file()
    assert packaged.parent.parent.name == "data" and packaged.stat().st_size < 1_000_000  # package data, small
    Tokenizer.from_file(str(packaged)).model.save(str(tmp_path))  # GPT-2's files: vocab.json + merges.txt
    assert {p.name for p in tmp_path.iterdir()} == {"vocab.json", "merges.txt"}
    reference = GPT2TokenizerFast.from_pretrained(str(tmp_path))  # a local folder: vocab.json + merges.txt
    from_files = BPETokenizer(tmp_path / "vocab.json")  # merges.txt beside it
    from_json = BPETokenizer(packaged)
    from_folder = BPETokenizer(tmp_path)
    saved = BPETokenizer(from_files.save(tmp_path / "saved"))  # GPT-2 files -> tokenizer.json
    texts = _texts()
    expected = reference(texts)["input_ids"]
    assert len(texts) > 2400 and sum(map(len, expected)) > 150_000
    exported = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "saved" / "tokenizer.json"))
    assert exported(texts)["input_ids"] == expected  # what a Hugging Face export of ours gives
    for tok in (from_files, from_json, from_folder, saved):
        assert tok.tokenize_batch(texts) == expected
        assert [tok.tokenize(t) for t in TRICKY] == expected[-len(TRICKY):]
        assert tok.vocab_size == len(reference) == 8192
        assert tok.eod == reference.eos_token_id == reference.convert_tokens_to_ids(EOD_TOKEN)
        assert tok.inv_vocab == from_json.inv_vocab and tok.merges == from_json.merges
    assert from_json.tokenize("a<|endoftext|>b")[1] == from_json.eod  # a special token, as GPT2TokenizerFast
    for text in texts:  # byte-level: lossless
        assert from_json.detokenize(from_json.tokenize(text)) == text
    assert from_json.detokenize(expected[0]) == reference.decode(expected[0])
    import pickle  # what a spawned preprocess worker receives: the files' paths, reloaded there

    assert pickle.loads(pickle.dumps(from_files)).tokenize_batch(texts[-len(TRICKY):]) == expected[-len(TRICKY):]


def test_bpe_refuses_vocabularies_it_cannot_use(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    no_eod = Tokenizer(models.BPE())
    no_eod.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    no_eod.train_from_iterator(_texts(50), trainer=trainers.BpeTrainer(vocab_size=400, show_progress=False))
    no_eod.save(str(tmp_path / "no_eod.json"))
    with pytest.raises(ValueError, match=r"no end-of-document token '<\|endoftext\|>'.*train-tokenizer --type bpe"):
        BPETokenizer(tmp_path / "no_eod.json")
    no_eod.model.save(str(tmp_path))
    with pytest.raises(ValueError, match="no end-of-document token"):
        BPETokenizer(tmp_path / "vocab.json")
    (tmp_path / "merges.txt").unlink()
    with pytest.raises(FileNotFoundError, match="needs its merges.txt"):
        BPETokenizer(tmp_path / "vocab.json")
    wordpiece = BertTokenizer()._tokenizer
    wordpiece.save(str(tmp_path / "wordpiece.json"))
    with pytest.raises(ValueError, match="holds a WordPiece tokenizer; GPT data needs a BPE one"):
        BPETokenizer(tmp_path / "wordpiece.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        BPETokenizer(tmp_path / "missing.json")


def test_bpe_reads_whole_documents_verbatim(tmp_path):
    """BPE data keeps each document's text as written (GPT): text files by blank lines, lines joined with
    their newlines; the built-in corpus one item per document."""
    tok = BPETokenizer()
    (tmp_path / "a.txt").write_text("\n\nFirst doc, line one.\n  Line two, indented.\n\n\nSecond doc.\n\n")
    preprocess_corpus([tmp_path / "a.txt"], tmp_path / "txt", tok, append_eod=True)
    ds = IndexedDataset(tmp_path / "txt")
    assert [tok.detokenize(ds[i].tolist()) for i in range(len(ds))] == [
        "First doc, line one.\n  Line two, indented.<|endoftext|>", "Second doc.<|endoftext|>"]
    stats = preprocess_corpus(None, tmp_path / "builtin", tok)
    ds = IndexedDataset(tmp_path / "builtin")
    assert len(ds) == ds.num_documents == stats.written_documents == stats.documents > 2000
    assert stats.single_sentence_documents == stats.long_sentences_split == 0


def test_preprocess_bpe_one_item_per_document_with_eod_and_vocab_sidecar(tmp_path):
    tok = BPETokenizer()
    texts = ["First document.\nIts second line keeps its newline.", "  Second: leading spaces kept.", "",
             "Third " * 400]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    stats = preprocess_corpus([jsonl], tmp_path / "gpt", tok, append_eod=True, max_seq_length=64)
    ds = IndexedDataset(tmp_path / "gpt")
    kept = [t for t in texts if t.strip()]
    assert ds.num_documents == len(ds) == stats.written_documents == len(kept)  # one item per document, unsplit
    for i, text in enumerate(kept):
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod], i
    record = read_dataset_vocab(tmp_path / "gpt")
    assert (record.tokenizer_type, record.eod, record.append_eod) == ("bpe", tok.eod, True)
    assert record.vocab_file == str(packaged_bpe_tokenizer_file().resolve()) and record.vocab_size == 8192
    assert check_dataset_vocab(tmp_path / "gpt", tok, model_vocab_size=tok.vocab_size) == record
    # Another vocabulary: the same pieces with one merge dropped tokenizes differently; refused
    spec = json.loads(packaged_bpe_tokenizer_file().read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    (tmp_path / "other.json").write_text(json.dumps(spec))
    other = BPETokenizer(tmp_path / "other.json")
    assert other.inv_vocab == tok.inv_vocab
    with pytest.raises(ValueError, match="tokenized with another vocabulary"):
        check_dataset_vocab(tmp_path / "gpt", other)
    with pytest.raises(ValueError, match="tokenized with another vocabulary"):
        check_dataset_vocab(tmp_path / "gpt", BertTokenizer())
    # The pre-launch check of `lightning-megatron fit` takes the datamodule's tokenizer the same way: a BPE
    # data.vocab_file, or (null) the vocabulary the record names
    from lightning_megatron.data_checks import data_files_problems
    from lightning_megatron.datamodules.pretraining import BertDataModule
    from lightning_megatron.datamodules.gpt import GPTDataModule

    gpt = str(tmp_path / "gpt")
    for vocab_file in (str(packaged_bpe_tokenizer_file()), None):
        assert data_files_problems({"vocab_file": vocab_file, "data_prefix": gpt}, {"vocab_size": 8192},
                                   data_class=GPTDataModule) == []
    (problem,) = data_files_problems({"vocab_file": str(tmp_path / "other.json"), "data_prefix": gpt}, {},
                                     data_class=GPTDataModule)
    assert "tokenized with another vocabulary" in problem, problem
    (problem,) = data_files_problems({"vocab_file": None, "data_prefix": gpt}, {},
                                     data_class=BertDataModule)  # BERT needs WordPiece: refused as it would
    assert "holds a BPE tokenizer; BERT needs WordPiece" in problem, problem
    # Without --append-eod: the same ids without the EOD, recorded as such
    preprocess_corpus([jsonl], tmp_path / "plain", tok, max_seq_length=64)
    assert IndexedDataset(tmp_path / "plain")[0].tolist() == tok.tokenize(kept[0])
    assert read_dataset_vocab(tmp_path / "plain").append_eod is False
    assert np.asarray(IndexedDataset(tmp_path / "plain").sizes).sum() + len(kept) == ds.num_tokens
    # BERT data has no end-of-document token to append
    with pytest.raises(ValueError, match="append_eod.*WordPiece"):
        preprocess_corpus([jsonl], tmp_path / "bert", BertTokenizer(), append_eod=True)


def test_tokenizing_batches_are_bounded_in_characters_as_well_as_sentences():
    """BPE documents are whole texts: a batch of 4,096 of them could hold gigabytes, so a batch also
    closes at _BATCH_CHARS characters (a document larger than that is a batch of its own)."""
    from lightning_megatron.data.preprocess import _BATCH_CHARS, _BATCH_SENTENCES, _batches

    big = ["x" * (_BATCH_CHARS // 2)]
    assert [len(b) for b in _batches(iter([big] * 5))] == [2, 2, 1]
    assert [len(b) for b in _batches(iter([["x" * (2 * _BATCH_CHARS)], ["y"]]))] == [1, 1]
    assert [len(b) for b in _batches(iter([["a", "b"]] * _BATCH_SENTENCES))] == [_BATCH_SENTENCES // 2] * 2


def test_a_folder_whose_end_of_text_is_its_eos_token_makes_gpt_data(tmp_path):
    """A decoder's folder without ``<|endoftext|>`` (Llama 2 and Mistral end documents with ``</s>``, Llama 3 with
    ``<|end_of_text|>``) was refused for GPT data, the fix naming an eod_token= no command takes. Its
    ``tokenizer_config.json``'s ``eos_token`` is the end of document, as Megatron-LM's Hugging Face tokenizer takes
    ``eos_token_id``: ids as transformers' tokenizer gives them, every document ended by it, the datamodule's check
    of the data passing with the tokenizer it builds from the data's record."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(_texts(50), trainer=trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                                    special_tokens=["<unk>", "<s>", "</s>"]))
    folder = tmp_path / "llama_like"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>", "special": True},
                                                              "bos_token": "<s>"}))
    ours, theirs = BPETokenizer(folder), transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), eos_token="</s>")
    assert ours.eod_token == "</s>" and ours.eod == theirs.eos_token_id == 2
    texts = [t for t in _texts(5) if t.strip()]
    assert [ours.tokenize(t) for t in texts] == [theirs(t, add_special_tokens=False)["input_ids"] for t in texts]
    (tmp_path / "docs.txt").write_text("\n\n".join(t.replace("\n\n", "\n") for t in texts) + "\n")
    preprocess_corpus([tmp_path / "docs.txt"], tmp_path / "data", BPETokenizer(folder), append_eod=True,
                      progress=False)
    ds = IndexedDataset(str(tmp_path / "data"))
    assert all(int(ds[i][-1]) == 2 for i in range(len(ds)))
    from lightning_megatron.data.dataset_vocab import dataset_tokenizer

    check_dataset_vocab(str(tmp_path / "data"), dataset_tokenizer(None, str(tmp_path / "data"), default="bpe"), 400,
                        needs_eod=True)
    assert BPETokenizer(folder, eod_token="<s>").eod == 1  # an explicit choice wins
    assert BPETokenizer().eod_token == EOD_TOKEN  # the packaged BPE: unchanged


def test_add_special_tokens_puts_the_tokenizers_bos_where_transformers_and_megatron_do(tmp_path):
    """A Llama-style ``tokenizer.json`` whose post-processor starts every text with ``<s>``: ``tokenize`` leaves it
    out by default (megatron-core's Hugging Face tokenizer without ``--tokenizer-hf-include-special-tokens``), and
    ``preprocess --add-special-tokens`` gives the ids of ``tokenizer(text)`` in transformers (what Megatron-LM's
    ``tokenize`` gave): every document starts with BOS, ends with EOD, the record says so, and the datamodule's
    tokenizer read from the record tokenizes prompts the same way. A tokenizer that adds nothing, WordPiece, or a
    template that already ends with EOD beside --append-eod are refused by name."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    from lightning_megatron.cli import main
    from lightning_megatron.data.dataset_vocab import dataset_tokenizer
    from lightning_megatron.data.predict import PromptDataset

    def folder(name: str, single: str) -> Path:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.train_from_iterator(_texts(50), trainer=trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                                        special_tokens=["<unk>", "<s>", "</s>"]))
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 1), ("</s>", 2)])
        (tmp_path / name).mkdir()
        tok.save(str(tmp_path / name / "tokenizer.json"))
        (tmp_path / name / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
        return tmp_path / name

    llama = folder("llama_like", "<s> $A")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(llama / "tokenizer.json"))
    texts = [t for t in _texts(5) if t.strip()]
    assert [BPETokenizer(llama).tokenize(t) for t in texts] == [theirs(t, add_special_tokens=False)["input_ids"]
                                                                for t in texts]
    with_bos = BPETokenizer(llama, add_special_tokens=True)
    assert [with_bos.tokenize(t) for t in texts] == [theirs(t)["input_ids"] for t in texts]
    assert with_bos.tokenize_batch(texts) == [theirs(t)["input_ids"] for t in texts]
    assert all(ids[0] == 1 for ids in with_bos.tokenize_batch(texts))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    main(["preprocess", "--input", str(tmp_path / "docs.jsonl"), "--output-prefix", str(tmp_path / "data"),
          "--tokenizer", str(llama), "--add-special-tokens", "--append-eod", "--no-progress"])
    ds = IndexedDataset(str(tmp_path / "data"))
    assert [ds[i].tolist() for i in range(len(ds))] == [theirs(t)["input_ids"] + [2] for t in texts]
    assert read_dataset_vocab(str(tmp_path / "data")).add_special_tokens is True
    recorded = dataset_tokenizer(None, str(tmp_path / "data"), default="bpe")
    assert recorded.add_special_tokens is True
    assert dataset_tokenizer(str(llama), str(tmp_path / "data"), default="bpe").add_special_tokens is True
    (tmp_path / "prompts.txt").write_text(texts[0].splitlines()[0] + "\n")
    assert PromptDataset(tmp_path / "prompts.txt", recorded).ids[0][0] == 1  # the prompts as the data was made
    preprocess_corpus([tmp_path / "docs.jsonl"], tmp_path / "plain", BPETokenizer(llama), append_eod=True)
    assert read_dataset_vocab(str(tmp_path / "plain")).add_special_tokens is False
    assert dataset_tokenizer(None, str(tmp_path / "plain"), default="bpe").add_special_tokens is False
    with pytest.raises(ValueError, match=r"adds no special tokens.*drop --add-special-tokens"):
        BPETokenizer(add_special_tokens=True)  # the packaged BPE (GPT-2's scheme): no BOS to add
    with pytest.raises(ValueError, match=r"add_special_tokens.*WordPiece"):
        preprocess_corpus([tmp_path / "docs.jsonl"], tmp_path / "bert", BertTokenizer(), add_special_tokens=True)
    ends = folder("ends_with_eos", "<s> $A </s>")
    with pytest.raises(ValueError, match=r"already ends every text with '</s>'.*drop --append-eod"):
        preprocess_corpus([tmp_path / "docs.jsonl"], tmp_path / "twice", str(ends), append_eod=True,
                          add_special_tokens=True)
    preprocess_corpus([tmp_path / "docs.jsonl"], tmp_path / "once", str(ends), add_special_tokens=True)
    assert IndexedDataset(str(tmp_path / "once"))[0].tolist() == [1] + theirs(texts[0], add_special_tokens=False)[
        "input_ids"] + [2]
    assert read_dataset_vocab(str(tmp_path / "once")).append_eod is True  # its documents end with EOD: GPT data
