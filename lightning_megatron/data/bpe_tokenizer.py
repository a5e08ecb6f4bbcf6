"""Byte-level BPE tokenizer for decoder models (GPT-2's scheme) through the ``tokenizers`` library.

:class:`BPETokenizer` loads a Hugging Face ``tokenizer.json`` (a BPE model), GPT-2's ``vocab.json`` +
``merges.txt``, or a folder holding either, and exposes the interface the GPT data pipeline uses:
``vocab_size``, ``eod`` (the end-of-document id, ``<|endoftext|>``), ``tokenize(text) -> ids`` and
``detokenize(ids) -> text``. On GPT-2's files it gives exactly the ids of transformers'
``GPT2TokenizerFast`` (tested). Only local files are read; nothing is downloaded or executed.

:func:`train_bpe_tokenizer` trains one (on the built-in corpus or your files) and writes its
``tokenizer.json`` atomically; :func:`packaged_bpe_tokenizer_file` is the 8,192-piece one shipped
with the package, trained on the built-in corpus (what the GPT recipes use by default).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_megatron.atomic_files import unique_tag

__all__ = [
    "BPETokenizer",
    "EOD_TOKEN",
    "PACKAGED_BPE_TOKENIZER",
    "packaged_bpe_tokenizer_file",
    "train_bpe_tokenizer",
]

EOD_TOKEN = "<|endoftext|>"
"""GPT-2's end-of-document token: Megatron's ``eod``, appended to every document by ``--append-eod``."""

PACKAGED_BPE_TOKENIZER = "gpt-bpe-8192.json"
"""A byte-level BPE ``tokenizer.json`` of 8,192 pieces trained on the built-in corpus, shipped as data."""


def _config_eos_token(vocab_file: Path) -> str | None:
    """The ``eos_token`` of a ``tokenizer_config.json`` beside ``vocab_file`` (a string, or transformers' added-token
    record with its ``content``); None when there is none."""
    config = vocab_file.parent / "tokenizer_config.json"
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) and eos else None


class BPETokenizer:
    """Byte-level BPE tokenizer from a ``tokenizer.json``, GPT-2 ``vocab.json`` + ``merges.txt``, or a
    folder holding either (``tokenizer.json`` first).

    Args:
        vocab_file: that file or folder; ``None``: :func:`packaged_bpe_tokenizer_file`.
        merges_file: GPT-2's ``merges.txt`` when ``vocab_file`` is a ``vocab.json`` (default: the
            ``merges.txt`` beside it).
        eod_token: the end-of-document token; the vocabulary must hold it (a ``ValueError`` names
            the fix otherwise). None: ``<|endoftext|>`` where the vocabulary has it, else the ``eos_token`` of a
            ``tokenizer_config.json`` beside it (Megatron-LM's Hugging Face tokenizer takes ``eos_token_id`` as
            its end of document: Llama 3's ``<|end_of_text|>``, Llama 2's and Mistral's ``</s>``).
        add_special_tokens: encode as ``tokenizer(text)`` does in transformers, with the special tokens the
            ``tokenizer.json``'s post-processor adds (Llama's BOS; megatron-core's
            ``--tokenizer-hf-include-special-tokens``, what Megatron-LM's older ``tokenize`` did). A tokenizer that
            adds none is refused (GPT-2's scheme has no BOS).

    Text is encoded without special tokens added by default (megatron-core's Hugging Face tokenizer); a literal
    ``<|endoftext|>`` inside the text becomes the EOD id, as with ``GPT2TokenizerFast``.
    """

    tokenizer_type = "bpe"
    lowercase = False  # byte-level BPE never normalises the text (recorded in the dataset's sidecar)

    def __init__(self, vocab_file: str | os.PathLike[str] | None = None,
                 merges_file: str | os.PathLike[str] | None = None, *, eod_token: str | None = None,
                 add_special_tokens: bool = False) -> None:
        path = Path(vocab_file) if vocab_file is not None else packaged_bpe_tokenizer_file()
        self.vocab_file, self.merges_file = _bpe_files(path, Path(merges_file) if merges_file is not None else None)
        self._tokenizer = _load_bpe(self.vocab_file, self.merges_file)
        spec = json.loads(self._tokenizer.to_str())
        self.merges: tuple[str, ...] = tuple(" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"])
        """The merge rules in priority order (``"a b"``): with the pieces, what identifies the vocabulary."""
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.inv_vocab: list[str] = [""] * len(vocab)
        for token, index in vocab.items():
            if index >= len(vocab):
                raise ValueError(f"{str(self.vocab_file)!r}: token {token!r} has id {index} but the vocabulary has "
                                 f"{len(vocab)} pieces; the ids must be 0..{len(vocab) - 1} without gaps")
            self.inv_vocab[index] = token
        if eod_token is None:
            eos = _config_eos_token(self.vocab_file)
            eod_token = EOD_TOKEN if EOD_TOKEN in vocab or eos is None else eos
        self.eod_token = eod_token
        if eod_token not in vocab:
            raise ValueError(f"{str(self.vocab_file)!r} has no end-of-document token {eod_token!r}: GPT data appends "
                             f"it to every document; train the tokenizer with it (`lightning-megatron train-tokenizer "
                             f"--type bpe` does), add it as a special token (tokenizer.add_special_tokens"
                             f"([{eod_token!r}]) and save), name the vocabulary's own as eos_token in a "
                             f"tokenizer_config.json beside it (as Hugging Face folders do), or pass eod_token=")
        self.eod_id = vocab[eod_token]
        self.add_special_tokens = bool(add_special_tokens)
        if self.add_special_tokens and not self.added_tokens()[0] and not self.added_tokens()[1]:
            raise ValueError(f"{str(self.vocab_file)!r} adds no special tokens to a text (its post-processor adds "
                             f"none: GPT-2's scheme has no BOS): drop --add-special-tokens (add_special_tokens=True)")

    def added_tokens(self) -> tuple[list[int], list[int]]:
        """(ids the post-processor puts before a text, ids it puts after): what ``add_special_tokens`` adds."""
        plain = self._tokenizer.encode("a", add_special_tokens=False).ids
        full = self._tokenizer.encode("a", add_special_tokens=True).ids
        start = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
        return full[:start], full[start + len(plain):]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_tokenizer"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"add_special_tokens": False, **state})
        self._tokenizer = _load_bpe(self.vocab_file, self.merges_file)

    @property
    def vocab_size(self) -> int:
        """Number of pieces, special tokens included (before any padding for tensor parallelism)."""
        return len(self.inv_vocab)

    @property
    def eod(self) -> int:
        """Id of the end-of-document token (Megatron's name)."""
        return self.eod_id

    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text`` (special tokens added only with ``add_special_tokens``)."""
        return self._tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`tokenize` of many texts at once (the library parallelises this)."""
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=self.add_special_tokens)]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens kept): byte-level BPE gives back the exact text."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.inv_vocab[i] for i in ids]

    def save(self, output_dir: str | os.PathLike[str]) -> Path:
        """Write this tokenizer as ``output_dir/tokenizer.json`` (atomically; what a Hugging Face export
        ships: ``PreTrainedTokenizerFast(tokenizer_file=...)`` gives the same ids). Returns its path."""
        return _save_atomic(self._tokenizer, Path(output_dir))


def _bpe_files(path: Path, merges: Path | None) -> tuple[Path, Path | None]:
    """(``tokenizer.json`` or ``vocab.json``, ``merges.txt`` or None) of a file or folder."""
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        elif (path / "vocab.json").is_file():
            path = path / "vocab.json"
        else:
            raise FileNotFoundError(f"{str(path)!r} is a folder without tokenizer.json or vocab.json + merges.txt")
    if not path.is_file():
        raise FileNotFoundError(f"BPE vocabulary {str(path)!r} does not exist")
    if not _is_gpt2_vocab(path):
        if merges is not None:
            raise ValueError(f"merges_file={str(merges)!r} goes with a GPT-2 vocab.json, but {str(path)!r} is a "
                             f"tokenizer.json, which holds its merges: leave merges_file out")
        return path, None
    merges = merges if merges is not None else path.with_name("merges.txt")
    if not merges.is_file():
        raise FileNotFoundError(f"GPT-2 vocabulary {str(path)!r} needs its merges.txt: {str(merges)!r} does not exist; "
                                f"put it beside vocab.json or pass merges_file=")
    return path, merges


def _is_gpt2_vocab(path: Path) -> bool:
    """A GPT-2 ``vocab.json`` is a flat ``{piece: id}`` object; a ``tokenizer.json`` has a ``model``."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{str(path)!r} is not a JSON tokenizer.json / vocab.json ({error})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{str(path)!r} is neither a tokenizer.json nor a GPT-2 vocab.json (not a JSON object)")
    return "model" not in spec


def _load_bpe(path: Path, merges: Path | None) -> Any:
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json``, or GPT-2's pipeline around vocab + merges
    (the one ``GPT2TokenizerFast`` builds: byte-level pre-tokenizer without a prefix space, byte-level
    decoder, ``<|endoftext|>`` a special token)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if merges is None:
        tokenizer = Tokenizer.from_file(str(path))
        if type(tokenizer.model).__name__ != "BPE":
            raise ValueError(f"{str(path)!r} holds a {type(tokenizer.model).__name__} tokenizer; GPT data needs a BPE "
                             f"one (train one with `lightning-megatron train-tokenizer --type bpe`)")
    else:
        tokenizer = Tokenizer(models.BPE.from_file(str(path), str(merges)))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        if EOD_TOKEN in tokenizer.get_vocab():
            tokenizer.add_special_tokens([AddedToken(EOD_TOKEN, special=True)])
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def train_bpe_tokenizer(files: Sequence[Any] | None, vocab_size: int, output_dir: str | os.PathLike[str], *,
                        min_frequency: int = 2, json_key: str = "text") -> Path:
    """Train a byte-level BPE (GPT-2's pre-tokenizer, all 256 bytes in the alphabet, ``<|endoftext|>``
    id 0) on ``files`` (what :func:`.corpus.read_documents` reads; ``None``: the built-in corpus), one
    whole document at a time, and write ``output_dir/tokenizer.json`` atomically. Returns its path.

    Inputs that hold no text raise :class:`ValueError` and write nothing.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from lightning_megatron.data.corpus import CorpusStats, read_documents

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 2:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE: its {len(alphabet)} byte "
                         f"pieces and {EOD_TOKEN} come first; use at least a few thousand")
    stats = CorpusStats()
    documents = read_documents(files, stats, json_key=json_key, split_sentences=False)  # missing files fail here
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator((text for doc in documents for text in doc), trainer=trainer)
    if stats.documents == 0:
        names = "the built-in corpus" if files is None else [os.fspath(f) for f in files][:5]
        raise ValueError(f"no text to train a BPE tokenizer on in {names}: {stats.files} files read, "
                         f"{stats.empty_files} empty, {stats.bad_json_lines} JSON lines without a string under "
                         f"json_key={json_key!r}, {stats.empty_documents} empty documents; nothing was written "
                         f"(pass --json-key with the field that holds the text)")
    return _save_atomic(tokenizer, Path(output_dir))


def _save_atomic(tokenizer: Any, output: Path) -> Path:
    """``tokenizer.save`` to a temporary file in ``output``, renamed to ``tokenizer.json``."""
    output.mkdir(parents=True, exist_ok=True)
    tmp = output / f".tokenizer.json.tmp-{unique_tag()}"
    try:
        tokenizer.save(str(tmp))
        os.replace(tmp, output / "tokenizer.json")
    finally:
        tmp.unlink(missing_ok=True)
    return output / "tokenizer.json"


def packaged_bpe_tokenizer_file() -> Path:
    """Path of the packaged byte-level BPE ``tokenizer.json`` (``lightning_megatron/data/vocab/``)."""
    from importlib.resources import files

    path = Path(str(files("lightning_megatron.data") / "vocab" / PACKAGED_BPE_TOKENIZER))
    if not path.is_file():
        raise FileNotFoundError(f"the packaged BPE tokenizer {str(path)!r} is missing: the lightning-megatron "
                                f"installation is incomplete; reinstall it, or pass a tokenizer.json")
    return path
