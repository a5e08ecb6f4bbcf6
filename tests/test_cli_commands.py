"""The small commands of ``lightning-megatron`` through its entry point (``lightning_megatron.cli.main``,
what the console script calls): train-tokenizer, plot, and the checks of the data before launch."""

from __future__ import annotations

import json

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
