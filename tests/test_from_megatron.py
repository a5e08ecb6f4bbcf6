"""docs/from_megatron.md: every override in its *here* column is an option the CLI parses, and the value given is
the value the configuration holds (read back from ``--print_config``, as a user checks a port of a script).

The page's backticked ``--key value`` segments run as two commands: a decoder's (recipes/gpt_tiny.yaml) and, for
the BERT-only keys, bert_tiny's; a key given in two rows is checked at its last value (``--print_config``
validates nothing else, so rows may disagree, e.g. bf16 and fp16)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from lightning_megatron.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "from_megatron.md"
BERT_KEYS = ("--data.masked_lm_prob", "--data.short_seq_prob", "--data.max_ngrams", "--data.binary_head",
             "--model.config.add_binary_head", "--data.max_seq_length")


def _overrides() -> dict[str, list[tuple[str, str]]]:
    """The ``(--key, value)`` pairs of the tables' *here* cells, by the recipe that takes them."""
    runs: dict[str, list[tuple[str, str]]] = {"gpt": [], "bert": []}
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if not line.startswith("| ") or len(cells) != 3 or cells[1] in ("here", "---"):
            continue
        for segment in re.findall(r"`(--[^`]+)`", cells[1]):
            words = shlex.split(segment)
            assert len(words) % 2 == 0, f"{segment!r}: each option takes one value"
            pairs = list(zip(words[::2], words[1::2]))
            runs["bert" if any(k in BERT_KEYS for k, _ in pairs) else "gpt"] += pairs
    return runs


def _printed(config: dict, key: str):
    node = config
    for part in key[2:].split("."):
        if isinstance(node, list):  # a list of callbacks / loggers: the last one holding the key
            held = [c["init_args"] for c in node if part in (c.get("init_args") or {})]
            node = held[-1][part] if held else KeyError(key)
        elif isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, dict) and part in (node.get("init_args") or {}):
            node = node["init_args"][part]
        else:
            return KeyError(key)
    return node


@pytest.mark.parametrize("recipe", ["gpt", "bert"])
def test_every_megatron_lm_override_on_the_page_is_parsed_with_its_value(recipe, capsys, monkeypatch):
    pairs = _overrides()[recipe]
    assert len(pairs) > (80 if recipe == "gpt" else 5), pairs  # the page's tables were read
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])
    config_file = ROOT / "recipes" / ("gpt_tiny.yaml" if recipe == "gpt" else "bert_tiny.yaml")
    argv = ["fit", "--config", str(config_file), *[w for pair in pairs for w in pair], "--print_config"]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out = capsys.readouterr()
    assert exited.value.code in (0, None), out.err[-3000:]
    config = yaml.safe_load(out.out)
    last = dict(pairs)  # a key given twice: its last value
    wrong = []
    for key, value in last.items():
        got, want = _printed(config, key), yaml.safe_load(value)
        if not (got == want or str(got) == str(want)):
            wrong.append((key, value, got))
    assert not wrong, wrong
