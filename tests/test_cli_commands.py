"""The small commands of ``lightning-megatron`` through its entry point (``lightning_megatron.cli.main``,
what the console script calls): train-tokenizer, plot, and the checks of the data before launch."""

from __future__ import annotations

import json
import sys

import pytest

from lightning_megatron.cli import main


def _jsonl(path, key: str, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
    return str(path)


TEXTS = [f"Document number {i} talks about tokenizers. It has a second sentence about {w}."
         for i, w in enumerate(["apples", "pears", "plums", "cherries", "grapes", "lemons"] * 5)]


def test_train_tokenizer_json_key_and_empty_input(tmp_path, capsys):
    body = _jsonl(tmp_path / "body.jsonl", "body", TEXTS)
    main(["train-tokenizer", "--input", body, "--json-key", "body", "--vocab-size", "200",
          "--output-dir", str(tmp_path / "tok")])
    vocab = (tmp_path / "tok" / "vocab.txt").read_text().split("\n")
    assert {"tokenizers", "apples", "[MASK]"} <= set(vocab) and len(vocab) > 50, vocab[:20]
    # Text under another key than --json-key: no text at all, refused, nothing written
    with pytest.raises(SystemExit) as e:
        main(["train-tokenizer", "--input", body, "--vocab-size", "200", "--output-dir", str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no text to train a vocabulary on" in err and "json_key='text'" in err, err
    assert "--json-key" in err and not (tmp_path / "empty" / "vocab.txt").exists()


def test_fit_refuses_missing_or_foreign_data_before_launch(tmp_path, monkeypatch):
    """A data_prefix without its .bin/.idx, one given with its extension, or a dataset tokenized with
    another vocabulary than data.vocab_file: `fit` exits before building the Trainer, listing each."""
    from pathlib import Path

    from lightning_megatron.data.preprocess import preprocess_corpus
    from lightning_megatron.data.tokenizer import BertTokenizer, train_wordpiece_tokenizer

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])  # as the console script, with argv passed in
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(TEXTS))
    own_vocab = train_wordpiece_tokenizer([text], 200, tmp_path / "tok")
    preprocess_corpus([text], tmp_path / "own", BertTokenizer(own_vocab), max_seq_length=64, progress=False)
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny.yaml")
    blend = f"[0.4, {tmp_path / 'nope'}, 0.3, {tmp_path / 'own.bin'}, 0.3, {tmp_path / 'own'}]"
    with pytest.raises(SystemExit) as e:  # the packaged vocabulary (vocab_file null) is not the dataset's
        main(["fit", "--config", recipe, "--trainer.devices", "1", "--trainer.strategy.tensor_model_parallel_size",
              "1", "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path / "run"),
              "--data.data_prefix", blend])
    message = str(e.value.code)
    assert "found before launching any process" in message, message
    assert f"{tmp_path / 'nope'}.bin" in message and "lightning-megatron preprocess" in message, message
    assert f"the prefix is the path without .bin: data_prefix={str(tmp_path / 'own')!r}" in message, message
    assert "was tokenized with another vocabulary" in message and "vocab_size=30522" in message, message
