"""The vocabulary an indexed dataset was made with, recorded beside it and checked before training.

``preprocess`` writes ``<prefix>.vocab.json`` next to ``<prefix>.bin`` / ``.idx``::

    {"vocab_size": 30522, "vocab_sha256": "...", "max_token_id": 29605, "num_tokens": ..., "num_documents": ...}

``vocab_sha256`` hashes the vocabulary's pieces in id order (one per line, ``\\n``-joined), and a BPE
vocabulary's merge rules after them, so the same vocabulary in another file or with other line endings
has the same hash and the same pieces with other merges do not. A BPE dataset also records
``tokenizer_type``, its ``eod`` id and whether every document ends with it (``append_eod``).
:func:`check_dataset_vocab` compares it with the tokenizer and the model before any step runs: a model
``vocab_size`` at or below the largest token id would give an infinite loss every step, and a dataset
made with another vocabulary would train on the wrong pieces; both are errors naming the two values
and the fix.

:func:`dataset_tokenizer` is THE rule for which tokenizer a data section uses (``vocab_file``, else the
vocabulary the dataset's record names, else the family's packaged one): the datamodules and the
check before launch (:mod:`lightning_megatron.config_checks`) both call it.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from lightning_megatron.atomic_files import unique_tag

__all__ = [
    "DatasetTokenizer",
    "DatasetVocab",
    "TokenizerFamily",
    "check_dataset_vocab",
    "dataset_tokenizer",
    "read_dataset_vocab",
    "recorded_vocabulary",
    "trained_vocabulary",
    "vocab_sha256",
    "vocab_sidecar_path",
    "pieces_sha256",
    "vocabulary_mismatch",
    "vocabulary_record",
    "write_dataset_vocab",
]


class DatasetTokenizer(Protocol):
    """What a tokenizer gives the record (:class:`.BertTokenizer`, :class:`.BPETokenizer`)."""

    tokenizer_type: str
    """``"wordpiece"`` or ``"bpe"``."""
    inv_vocab: list[str]
    """The pieces in id order."""
    merges: tuple[str, ...]
    """BPE merge rules in priority order (empty for WordPiece)."""
    vocab_file: str | os.PathLike[str]
    lowercase: bool

    @property
    def vocab_size(self) -> int: ...


@dataclass(kw_only=True, frozen=True)
class DatasetVocab:
    """What ``<prefix>.vocab.json`` records."""

    vocab_size: int
    """Pieces in the vocabulary the dataset was tokenized with."""
    vocab_sha256: str
    """:func:`vocab_sha256` of that vocabulary."""
    max_token_id: int
    """Largest token id in the dataset (-1 when it holds no tokens)."""
    num_tokens: int
    """Token ids in the dataset."""
    num_documents: int
    """Documents in the dataset."""
    vocab_file: str | None = None
    """Absolute path of the vocabulary (``vocab.txt`` / ``tokenizer.json``) it was tokenized with: the
    datamodule's vocabulary when its ``vocab_file`` is left null (None in records written before)."""
    lowercase: bool | None = None
    """Whether the text was lowercased before WordPiece."""
    tokenizer_type: str | None = None
    """``"wordpiece"`` or ``"bpe"`` (None in records written before: WordPiece)."""
    eod: int | None = None
    """The end-of-document id of a BPE vocabulary."""
    append_eod: bool | None = None
    """Whether every document ends with the end-of-document id (``preprocess --append-eod``, Megatron's flag;
    ``preprocess`` records False for WordPiece data, which it never ends so); None: not known."""
    add_special_tokens: bool | None = None
    """Whether each document was encoded with the special tokens the BPE tokenizer's post-processor adds (``preprocess
    --add-special-tokens``: Llama's BOS); the datamodule's tokenizer encodes prompts the same way."""


def vocab_sidecar_path(prefix: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(prefix)}.vocab.json")


def vocab_sha256(tokenizer: DatasetTokenizer) -> str:
    """sha256 of the vocabulary's pieces in id order, ``\\n``-joined, then (BPE) a blank line and the
    merge rules, ``\\n``-joined (a WordPiece vocabulary hashes as it always did)."""
    text = "\n".join(tokenizer.inv_vocab)
    if tokenizer.merges:
        text += "\n\n#merges\n" + "\n".join(tokenizer.merges)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def vocabulary_record(tokenizer: Any) -> dict[str, Any] | None:
    """What a checkpoint records of the vocabulary its data was tokenized with: ``{"vocab_size", "pieces_sha256",
    "source"}``, the pieces hashed in id order (``\\n``-joined; one tokenizer.json read by our BPE reader and by the
    chat reader hashes the same). None for a tokenizer that does not give its pieces (``inv_vocab``)."""
    pieces = getattr(tokenizer, "inv_vocab", None)
    if not isinstance(pieces, (list, tuple)) or not pieces:
        return None
    source = getattr(tokenizer, "vocab_file", None) or getattr(tokenizer, "path", None)
    return {"vocab_size": len(pieces), "pieces_sha256": pieces_sha256(pieces),
            "source": str(Path(source).resolve()) if source else None}


def pieces_sha256(pieces: Any) -> str:
    """sha256 of a vocabulary's pieces in id order, ``\\n``-joined (what :func:`vocabulary_record` records)."""
    return hashlib.sha256("\n".join(pieces).encode("utf-8")).hexdigest()


def vocabulary_mismatch(saved: Any, tokenizer: Any, checkpoint: str) -> str | None:
    """Why the model of ``checkpoint``, trained on data tokenized as ``saved`` (its :func:`vocabulary_record`)
    must not take data tokenized by ``tokenizer``: the same ids would be other pieces (with the same number of
    pieces nothing else notices). None when they agree, or when either side does not say."""
    current = vocabulary_record(tokenizer)
    if not isinstance(saved, dict) or current is None or saved.get("pieces_sha256") in (None, current["pieces_sha256"]):
        return None

    def named(record: dict[str, Any]) -> str:
        return (f"{record.get('source') or 'a vocabulary'} ({record.get('vocab_size')} pieces, sha256 "
                f"{str(record.get('pieces_sha256'))[:12]})")

    return (f"checkpoint {checkpoint!r} was trained on data tokenized with {named(saved)}; this run's data is "
            f"tokenized with {named(current)}: the same ids would be other pieces. Tokenize the data with the "
            f"checkpoint's vocabulary (the data section's vocab_file, or tokenizer for chats: "
            f"{saved.get('source') or 'the one the checkpoint was trained with'})")


def write_dataset_vocab(prefix: str | os.PathLike[str], tokenizer: DatasetTokenizer, *,
                        max_token_id: int | None = None, append_eod: bool | None = None) -> DatasetVocab:
    """Write ``<prefix>.vocab.json`` for the dataset at ``prefix`` (atomically). ``max_token_id=None``
    scans ``<prefix>.bin`` for it: use this for a dataset made by another tool (Megatron's
    ``preprocess_data.py``) with the vocabulary of ``tokenizer``."""
    from lightning_megatron.data.bpe_tokenizer import BPETokenizer
    from lightning_megatron.data.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    if max_token_id is None:
        max_token_id = _max_token_id(dataset)
    record = DatasetVocab(vocab_size=tokenizer.vocab_size, vocab_sha256=vocab_sha256(tokenizer),
                          max_token_id=int(max_token_id), num_tokens=dataset.num_tokens,
                          num_documents=dataset.num_documents, vocab_file=str(Path(tokenizer.vocab_file).resolve()),
                          lowercase=tokenizer.lowercase, tokenizer_type=tokenizer.tokenizer_type,
                          eod=tokenizer.eod if isinstance(tokenizer, BPETokenizer) else None,
                          append_eod=append_eod,
                          add_special_tokens=bool(getattr(tokenizer, "add_special_tokens", False)))
    path = vocab_sidecar_path(prefix)
    tmp = path.with_name(f"{path.name}.tmp-{unique_tag()}")
    tmp.write_text(json.dumps(asdict(record), indent=1) + "\n")
    os.replace(tmp, path)
    return record


def _max_token_id(dataset) -> int:
    """The largest id in an :class:`IndexedDataset`'s ``.bin`` (-1 when empty), read in chunks."""
    data = dataset._data
    largest = -1
    for start in range(0, len(data), 1 << 26):  # in chunks: never the whole file in memory
        largest = max(largest, int(np.max(data[start:start + (1 << 26)])))
    return largest


_RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "vocab_size": (int,), "vocab_sha256": (str,), "max_token_id": (int,), "num_tokens": (int,),
    "num_documents": (int,), "vocab_file": (str, type(None)), "lowercase": (bool, type(None)),
    "tokenizer_type": (str, type(None)), "eod": (int, type(None)), "append_eod": (bool, type(None)),
    "add_special_tokens": (bool, type(None))}
"""The JSON types of a :class:`DatasetVocab`'s fields (an integer field takes no bool)."""


def _record_type_problems(record: DatasetVocab) -> list[str]:
    out = []
    for name, types in _RECORD_TYPES.items():
        value = getattr(record, name)
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            out.append(f"{name}={value!r} is not {' or '.join(t.__name__ for t in types)}")
    if record.tokenizer_type not in (None, "wordpiece", "bpe"):
        out.append(f"tokenizer_type={record.tokenizer_type!r} is not 'wordpiece' or 'bpe'")
    return out


def read_dataset_vocab(prefix: str | os.PathLike[str]) -> DatasetVocab | None:
    """The record of ``<prefix>.vocab.json``, or ``None`` when the file does not exist."""
    path = vocab_sidecar_path(prefix)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        optional = ("vocab_file", "lowercase", "tokenizer_type", "eod", "append_eod",  # absent in older records
                    "add_special_tokens")
        record = DatasetVocab(**{k: raw[k] if k not in optional else raw.get(k)
                                 for k in DatasetVocab.__dataclass_fields__})
        wrong = _record_type_problems(record)  # a hand-edited record ("append_eod": "no" passed as true)
        if wrong:
            raise TypeError("; ".join(wrong))
        return record
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise ValueError(f"{str(path)!r} is not a valid dataset vocabulary record ({error}); rewrite it with "
                         f"lightning_megatron.data.write_dataset_vocab(prefix, tokenizer)") from None


TokenizerFamily = Literal["wordpiece", "bpe"]
"""A datamodule's packaged default: ``"wordpiece"`` (BERT's uncased ``vocab.txt``; the tokenizer is always
WordPiece, whose special tokens BERT samples need) or ``"bpe"`` (the byte-level BPE whose ``<|endoftext|>``
ends GPT documents; a given vocabulary loads as what it holds, BPE or WordPiece)."""


def recorded_vocabulary(prefix: str | os.PathLike[str]) -> tuple[str | None, bool | None]:
    """(vocabulary file, lowercase) that dataset ``prefix``'s ``.vocab.json`` names: what it was tokenized with;
    ``(None, None)`` without a record or a named file (a family's packaged vocabulary). A named vocabulary that does
    not exist here is an error naming it."""
    record = read_dataset_vocab(prefix)
    if record is None or record.vocab_file is None:
        return None, None
    if not Path(record.vocab_file).is_file():
        raise FileNotFoundError(f"dataset {os.fspath(prefix)!r} was tokenized with {record.vocab_file!r} (its "
                                f"{vocab_sidecar_path(prefix).name} says), which does not exist here: pass "
                                f"that vocabulary as data.vocab_file")
    return record.vocab_file, record.lowercase


def trained_vocabulary(data: dict[str, Any]) -> tuple[str | None, bool | None]:
    """(vocabulary file, lowercase) a run's data section tokenized with, from its saved hyper-parameters
    (``vocab_file``, ``data_prefix``, ``lowercase``), by :func:`dataset_tokenizer`'s rule: its ``vocab_file``; else
    the vocabulary its first dataset's ``.vocab.json`` names; ``(None, None)``: the family's packaged one. A
    ``data_prefix`` not found here is an error (its record decides), as is a named vocabulary that is not."""
    from lightning_megatron.data.blended import split_blends

    if data.get("vocab_file") is not None:
        return os.fspath(data["vocab_file"]), data.get("lowercase")
    prefix = data.get("data_prefix")
    if prefix is None:
        return None, None
    if not isinstance(prefix, (str, os.PathLike)):  # a blend, or one per split: the training data's first
        prefix = split_blends(prefix)[0][1][0]
    if not Path(f"{os.fspath(prefix)}.idx").is_file():
        raise FileNotFoundError(f"the run trained on data_prefix {os.fspath(prefix)!r}, which is not here (relative "
                                f"paths start at {os.getcwd()!r}): its .vocab.json names the vocabulary the run used; "
                                f"run this where the run ran, or name that vocabulary")
    return recorded_vocabulary(prefix)


def dataset_tokenizer(vocab_file: str | os.PathLike[str] | None, prefix: str | os.PathLike[str] | None, *,
                      default: TokenizerFamily) -> Any:
    """The tokenizer of a data section: ``vocab_file`` when given; else the vocabulary the record
    ``<prefix>.vocab.json`` names (lowercased as it records: the one ``preprocess`` used); else the packaged
    one of ``default`` (:data:`TokenizerFamily`). ``prefix``: the data's (first) dataset prefix, ``None``
    for the built-in corpus. A record naming a vocabulary that does not exist here is an error naming it."""
    from lightning_megatron.data.bpe_tokenizer import BPETokenizer
    from lightning_megatron.data.tokenizer import BertTokenizer, load_tokenizer

    if default not in ("wordpiece", "bpe"):
        raise ValueError(f"default={default!r} must be 'wordpiece' or 'bpe'")
    lowercase, given = None, vocab_file
    if vocab_file is None and prefix is not None:
        vocab_file, lowercase = recorded_vocabulary(prefix)
    if default == "wordpiece":
        return BertTokenizer(vocab_file, lowercase=lowercase)
    if vocab_file is None:
        return BPETokenizer()
    tokenizer = load_tokenizer(vocab_file)
    if isinstance(tokenizer, BertTokenizer) and lowercase is not None:
        tokenizer = BertTokenizer(vocab_file, lowercase=lowercase)
    record = read_dataset_vocab(prefix) if prefix is not None else None
    if isinstance(tokenizer, BPETokenizer) and record is not None and record.add_special_tokens:
        if given is not None and not any(tokenizer.added_tokens()):  # not the tokenizer that wrote the data
            raise ValueError(f"dataset {os.fspath(prefix)!r} was preprocessed with --add-special-tokens by "
                             f"{record.vocab_file!r}, but data vocab_file={os.fspath(given)!r} adds no special "
                             f"tokens to a text; leave data.vocab_file unset (the tokenizer the data records) or "
                             f"preprocess the data with the one you name")
        # prompts encoded as the documents were (Llama's BOS first)
        tokenizer = BPETokenizer(tokenizer.vocab_file, tokenizer.merges_file, eod_token=tokenizer.eod_token,
                                 add_special_tokens=True)
    return tokenizer


def check_dataset_vocab(prefix: str | os.PathLike[str], tokenizer: DatasetTokenizer | None = None,
                        model_vocab_size: int | None = None, *, needs_eod: bool = False) -> DatasetVocab | None:
    """Refuse a dataset that would train silently wrong; returns its record (``None``, with a
    warning, when the dataset has no ``.vocab.json``).

    Raises :class:`ValueError` when the record's document and token counts are not the dataset's (it belongs to
    other data), when the dataset is empty, when it was made with another vocabulary
    than ``tokenizer``'s, or when ``model_vocab_size`` (the model's real, unpadded vocabulary) is not
    larger than its largest token id; with ``needs_eod`` (GPT data: samples join documents), when the record says
    its documents do not end with an end-of-document id. Each message names both values and the fix.
    """
    record = read_dataset_vocab(prefix)
    if record is None:
        # Made before the sidecar existed (or by another tool): the largest id is computed here, once.
        from lightning_megatron.data.indexed_dataset import IndexedDataset

        largest = _max_token_id(IndexedDataset(prefix))
        limits = {name: v for name, v in (("the tokenizer's vocab_size", tokenizer and tokenizer.vocab_size),
                                          ("the model's vocab_size", model_vocab_size)) if v is not None}
        rebuild = (f"rebuild it with `lightning-megatron preprocess --input YOUR_TEXT --output-prefix "
                   f"{os.fspath(prefix)} --vocab-file VOCAB` (or, if VOCAB is the vocabulary it was made with, "
                   f"record it: lightning_megatron.data.write_dataset_vocab({os.fspath(prefix)!r}, tokenizer))")
        for name, limit in limits.items():
            if largest >= limit:
                raise ValueError(f"dataset {os.fspath(prefix)!r} (no {vocab_sidecar_path(prefix).name}) holds token id "
                                 f"{largest}, not below {name}={limit}: it was made with another vocabulary or "
                                 f"is corrupt; {rebuild}")
        warnings.warn(f"dataset {os.fspath(prefix)!r} has no {vocab_sidecar_path(prefix).name}: its largest token "
                      f"id {largest} fits the vocabulary, but whether it was made with this vocabulary cannot be "
                      f"checked; {rebuild}", stacklevel=2)
        return None
    from lightning_megatron.data.indexed_dataset import dataset_counts

    counts = dataset_counts(prefix)
    if counts is not None and counts != (record.num_documents, record.num_tokens):
        raise ValueError(f"{str(vocab_sidecar_path(prefix))!r} describes {record.num_documents} documents and "
                         f"{record.num_tokens} tokens, but the dataset holds {counts[0]} documents and {counts[1]} "
                         f"tokens: the record belongs to other data (the prefix rewritten by another tool, or a "
                         f"preprocess stopped between its files); preprocess it again, or record the vocabulary it "
                         f"was made with: lightning_megatron.data.write_dataset_vocab({os.fspath(prefix)!r}, "
                         f"tokenizer)")
    if record.num_tokens == 0 or record.num_documents == 0:
        raise ValueError(f"dataset {os.fspath(prefix)!r} is empty ({record.num_documents} documents, "
                         f"{record.num_tokens} tokens): preprocess it again from inputs that hold text")
    if tokenizer is not None and record.vocab_sha256 != vocab_sha256(tokenizer):
        raise ValueError(f"dataset {os.fspath(prefix)!r} was tokenized with another vocabulary (vocab_size="
                         f"{record.vocab_size}, sha256 {record.vocab_sha256[:12]}) than the tokenizer's "
                         f"{str(tokenizer.vocab_file)!r} (vocab_size={tokenizer.vocab_size}, sha256 "
                         f"{vocab_sha256(tokenizer)[:12]}); pass the vocab_file the dataset was preprocessed "
                         f"with, or preprocess it again with this one")
    if needs_eod and record.append_eod is False:
        bpe = record.tokenizer_type == "bpe"
        fix = (f"preprocess it again with --append-eod: `lightning-megatron preprocess --input TEXT --output-prefix "
               f"{os.fspath(prefix)} --tokenizer {record.vocab_file or 'TOKENIZER'} --append-eod`" if bpe else
               "preprocess the text with a byte-level BPE tokenizer: `lightning-megatron preprocess --input TEXT "
               "--output-prefix PREFIX --tokenizer tokenizer.json --append-eod` (`lightning-megatron "
               "train-tokenizer --type bpe` makes one; without --tokenizer, the packaged BPE)")
        made = "preprocessed without --append-eod" if bpe else (
            "tokenized with a WordPiece (BERT) vocabulary, and `preprocess` ends no WordPiece document with an "
            "end-of-document id")
        raise ValueError(f"dataset {os.fspath(prefix)!r} was {made}: GPT samples join documents, which an "
                         f"end-of-document id must separate; {fix}")
    if model_vocab_size is not None and model_vocab_size <= record.max_token_id:
        raise ValueError(f"the model's vocab_size={model_vocab_size} is not larger than the largest token id "
                         f"{record.max_token_id} in dataset {os.fspath(prefix)!r} (its vocabulary has "
                         f"{record.vocab_size} pieces): the loss would be infinite; set model vocab_size to "
                         f"{record.vocab_size} (or leave it null to take the tokenizer's)")
    return record
