"""Text corpora as documents of sentences: the built-in default corpus and the user's own files.

A *document* is a list of sentences (``list[str]``); Megatron's BERT samples are built from
consecutive sentences of one document, and sentence-order prediction needs at least two of them.

The built-in corpus is real English text that every CPython installation carries, so it works
offline on any machine: the reference manual topics bundled for ``help()`` (``pydoc_data.topics``)
and the docstrings of a fixed list of standard-library modules, their public classes, functions
and methods. Code examples and grammar blocks (indented paragraphs, ``>>>`` sessions) are dropped.

User files:
- ``.txt``: documents are separated by a blank line; each line holds one or more sentences.
- ``.jsonl`` / ``.json``: one JSON object per line, the document text under ``json_key``.
- the same gzip-compressed (``.txt.gz``, ``.jsonl.gz``); directories, searched recursively for these;
- Hugging Face ``datasets``: a ``Dataset`` object, or a directory written by ``save_to_disk``
  (the ``train`` split of a ``DatasetDict``), the document text under ``json_key``
  (``datasets`` is an optional dependency, imported only then).
Files are read as bytes and decoded line by line as UTF-8; undecodable bytes become U+FFFD and
the line is counted, as are empty files, superfluous blank lines and malformed JSON lines.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import inspect
import json
import os
import re
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CorpusStats",
    "DEFAULT_CORPUS_MODULES",
    "Document",
    "default_corpus_documents",
    "default_corpus_fingerprint",
    "expand_inputs",
    "is_hf_dataset",
    "read_documents",
    "read_utf8_text",
    "split_sentences",
]

Document = list[str]
"""A document: its sentences, in order."""

DEFAULT_CORPUS_VERSION = 1
"""Bumped whenever the way the default corpus is assembled changes (invalidates caches)."""

DEFAULT_CORPUS_MODULES: tuple[str, ...] = tuple("""
abc argparse ast asyncio.events asyncio.futures asyncio.locks asyncio.queues asyncio.tasks base64
bisect calendar cmd codecs collections concurrent.futures configparser contextlib copy csv
dataclasses datetime decimal difflib doctest email.message enum fractions ftplib functools getopt
gettext glob graphlib gzip hashlib heapq hmac html html.parser http.client http.cookiejar
imaplib inspect io ipaddress itertools json json.decoder json.encoder locale logging
logging.handlers lzma mailbox math mimetypes numbers operator optparse pathlib pickle pickletools
pkgutil poplib pprint profile pstats queue quopri random re reprlib sched secrets selectors
shelve shlex shutil smtplib socketserver statistics string stringprep struct tarfile tempfile
textwrap threading timeit tokenize trace traceback types typing unittest.case unittest.mock
urllib.parse urllib.request uuid warnings wave weakref xml.dom.minidom xml.etree.ElementTree
zipfile
""".split())
"""Standard-library modules whose docstrings join the default corpus: importing them has no side
effects (no ``this``/``antigravity``/GUI toolkits) and their text does not depend on the platform."""

JSON_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt", ".text")

# A sentence ends at . ! or ? followed by whitespace and a capital, a digit or an opening quote.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")
_HEADING_RULE = re.compile(r"^[*=\-~^#]{3,}\s*$")


@dataclass(kw_only=True)
class CorpusStats:
    """What reading a corpus met: every irregularity is counted, none is fatal."""

    files: int = 0
    """Input files read."""
    empty_files: int = 0
    """Files with no bytes, or only whitespace."""
    documents: int = 0
    """Documents produced (with at least one sentence)."""
    sentences: int = 0
    """Sentences produced."""
    empty_lines: int = 0
    """Blank lines that separate nothing: in JSON lines files, and repeated/leading/trailing ones in text files."""
    empty_documents: int = 0
    """JSON documents whose text is empty or whitespace (dropped)."""
    non_utf8_lines: int = 0
    """Lines with bytes that are not valid UTF-8, or JSON escapes of lone surrogates (``\\ud800``) no UTF-8
    holds (each replaced with U+FFFD)."""
    bad_json_lines: int = 0
    """JSON lines that do not parse, are not objects, or lack a string under ``json_key`` (dropped)."""

    def as_dict(self) -> dict[str, int | str]:
        """The counters as a plain dict (for printing and logging)."""
        return asdict(self)


def split_sentences(text: str) -> list[str]:
    """Split running text into sentences: whitespace is collapsed, then the text is cut after
    ``.``, ``!`` or ``?`` when the next word starts with a capital letter, a digit or a quote.
    Deterministic and dependency-free; good enough for sentence-order prediction."""
    text = " ".join(text.split())
    if not text:
        return []
    return [s for s in _SENTENCE_END.split(text) if s]


def _paragraphs(lines: Iterable[str]) -> Iterator[list[str]]:
    """Blocks of consecutive non-blank lines."""
    block: list[str] = []
    for line in lines:
        if line.strip():
            block.append(line.rstrip())
        elif block:
            yield block
            block = []
    if block:
        yield block


def _prose_documents(text: str) -> Iterator[Document]:
    """Documents from reStructuredText-like plain text: a heading starts a new document, indented
    blocks (code, grammar) and interactive sessions are dropped, prose is split into sentences."""
    sentences: Document = []
    for block in _paragraphs(inspect.cleandoc(text).splitlines()):
        if len(block) >= 2 and _HEADING_RULE.match(block[-1]):
            if sentences:
                yield sentences
            sentences = []
            block = block[:-2]  # paragraph text glued above the heading, if any
            if not block:
                continue
        session = next((i for i, line in enumerate(block) if line.lstrip().startswith(">>>")), len(block))
        block = block[:session]  # an interactive session (and its output) ends the prose
        if not block or block[0][:1].isspace():
            continue
        sentences.extend(split_sentences(" ".join(block)))
    if sentences:
        yield sentences


def _stdlib_docstrings(module_names: Sequence[str]) -> Iterator[str]:
    """Docstrings of each module, then of its public classes (with their public methods) and
    functions defined there, sorted by name. Modules that fail to import are skipped."""
    for name in module_names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except ImportError:
            continue
        yield module.__doc__ or ""
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if inspect.isfunction(obj):
                yield obj.__doc__ or ""
            elif inspect.isclass(obj):
                yield obj.__doc__ or ""
                for method_name, method in vars(obj).items():
                    if not method_name.startswith("_") and inspect.isfunction(method):
                        yield method.__doc__ or ""


def default_corpus_documents(module_names: Sequence[str] = DEFAULT_CORPUS_MODULES) -> Iterator[Document]:
    """The built-in corpus: ``pydoc_data.topics`` (sorted by topic, one document per section)
    followed by standard-library docstrings (one document per docstring)."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield from _prose_documents(topics[key])
    for doc in _stdlib_docstrings(module_names):
        if doc.strip():
            yield from _prose_documents(doc)


def default_corpus_fingerprint(module_names: Sequence[str] = DEFAULT_CORPUS_MODULES) -> str:
    """A short hash of what the default corpus is made of on this interpreter (version of the
    assembly code, Python version, module list): the key of cached preprocessed datasets."""
    key = f"v{DEFAULT_CORPUS_VERSION}|{sys.version}|{','.join(module_names)}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _kind(path: Path) -> str:
    """``"json"`` or ``"text"`` by the suffix before any ``.gz``."""
    name = path.name.lower()
    name = name[:-3] if name.endswith(".gz") else name
    return "json" if name.endswith(JSON_SUFFIXES) else "text"


def _is_corpus_file(path: Path) -> bool:
    name = path.name.lower()
    name = name[:-3] if name.endswith(".gz") else name
    return name.endswith(TEXT_SUFFIXES + JSON_SUFFIXES)


def is_hf_dataset(item: Any) -> bool:
    """A Hugging Face ``datasets`` object, or a directory written by its ``save_to_disk``."""
    if isinstance(item, (str, os.PathLike)):
        path = Path(item)
        return path.is_dir() and ((path / "dataset_dict.json").is_file() or all(
            (path / marker).is_file() for marker in ("state.json", "dataset_info.json")))
    return type(item).__module__.startswith("datasets")


def expand_inputs(inputs: Iterable[Any]) -> list[Any]:
    """The inputs to read, in order: files as given, directories expanded recursively to their
    ``.txt``/``.jsonl``/``.json`` files (also ``.gz``) in sorted order, saved Hugging Face datasets and
    ``datasets`` objects as they are. A missing path raises :class:`FileNotFoundError` naming it."""
    items: list[Any] = []
    for item in inputs:
        if not isinstance(item, (str, os.PathLike)):
            if not is_hf_dataset(item):
                raise TypeError(f"input {item!r} is neither a path nor a Hugging Face datasets object")
            items.append(item)
            continue
        path = Path(item)
        if is_hf_dataset(path):
            items.append(path)
        elif path.is_dir():
            items.extend(sorted(p for p in path.rglob("*") if p.is_file() and _is_corpus_file(p)))
        elif path.is_file():
            items.append(path)
        else:
            raise FileNotFoundError(f"input file {str(path)!r} does not exist")
    return items


def read_utf8_text(path: str | os.PathLike[str], where: str | None = None) -> str:
    """The whole text of a file; one that is not UTF-8 is a ValueError naming it (``where``, e.g.
    ``"predict_file '/x/p.txt'"``; default: the path), the line and the byte offset of the first bad byte
    (what ``open().read()`` raises names neither). A leading byte order mark (Excel's, Notepad's) is no
    character of the text: left out, as ``utf-8-sig`` reads it."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        where = where or repr(os.fspath(path))
        raise ValueError(f"{where} is not UTF-8 text: byte {e.start} (line {line}) is "
                         f"{data[e.start:e.start + 1]!r} ({e.reason}); save it as UTF-8 (e.g. iconv -f LATIN1 -t "
                         f"UTF-8)") from None


def text_lines(text: str) -> list[str]:
    """The lines of ``text`` as a file read in text mode ends them: at ``\n``, ``\r\n`` and ``\r`` only
    (``str.splitlines`` also breaks at form feed, NEL and U+2028 / U+2029, which a line of text, or a JSON line
    written with ``ensure_ascii=False``, may hold)."""
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


def _decoded_lines(path: Path, stats: CorpusStats) -> Iterator[str]:
    """Lines of a file (gzip-compressed when it ends in ``.gz``) as text; invalid UTF-8 is replaced
    and counted, an empty file counted; a leading byte order mark left out (:func:`read_utf8_text`)."""
    any_text = False
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        for number, raw in enumerate(f):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                line = raw.decode("utf-8", errors="replace")
                stats.non_utf8_lines += 1
            if number == 0:
                line = line.removeprefix("\ufeff")
            any_text = any_text or bool(line.strip())
            yield line
    if not any_text:
        stats.empty_files += 1


def _text_file_documents(path: Path, stats: CorpusStats, split: bool = True) -> Iterator[Document]:
    if not split:
        yield from _whole_text_file_documents(path, stats)
        return
    sentences: Document = []
    blank_run = 0
    for line in _decoded_lines(path, stats):
        if not line.strip():
            blank_run += 1
            continue
        if blank_run and sentences:
            stats.empty_lines += blank_run - 1
            yield sentences
            sentences = []
        else:
            stats.empty_lines += blank_run  # leading blank lines
        blank_run = 0
        sentences.extend(split_sentences(line))
    stats.empty_lines += blank_run  # trailing blank lines
    if sentences:
        yield sentences


def _whole_text_file_documents(path: Path, stats: CorpusStats) -> Iterator[Document]:
    """Documents of a text file as one item each: the lines between blank lines, verbatim."""
    lines: list[str] = []
    blank_run = 0
    for line in _decoded_lines(path, stats):
        if not line.strip():
            blank_run += 1
            continue
        if blank_run and lines:
            stats.empty_lines += blank_run - 1
            yield ["".join(lines).rstrip("\r\n")]
            lines = []
        else:
            stats.empty_lines += blank_run
        blank_run = 0
        lines.append(line)
    stats.empty_lines += blank_run
    if lines:
        yield ["".join(lines).rstrip("\r\n")]


_SURROGATE = re.compile("[\ud800-\udfff]")


def _record_document(record: Any, json_key: str, stats: CorpusStats, split: bool = True) -> Document | None:
    """The sentences of one JSON / datasets record (``split=False``: its text verbatim, one item), or
    ``None`` (counted) when it has none."""
    if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
        stats.bad_json_lines += 1
        return None
    text = record[json_key]
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a JSON escape of a lone surrogate: no tokenizer takes it
            text = _SURROGATE.sub("\ufffd", text)
            stats.non_utf8_lines += 1
    if not split:
        if not text.strip():
            stats.empty_documents += 1
            return None
        return [text]
    sentences = [s for paragraph in text.split("\n") for s in split_sentences(paragraph)]
    if not sentences:
        stats.empty_documents += 1
        return None
    return sentences


def _json_file_documents(path: Path, json_key: str, stats: CorpusStats, split: bool = True) -> Iterator[Document]:
    for line in _decoded_lines(path, stats):
        if not line.strip():
            stats.empty_lines += 1
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            stats.bad_json_lines += 1
            continue
        if (sentences := _record_document(record, json_key, stats, split)) is not None:
            yield sentences


def _hf_documents(item: Any, json_key: str, stats: CorpusStats, split: bool = True) -> Iterator[Document]:
    """Documents of a Hugging Face dataset (object or ``save_to_disk`` directory)."""
    if isinstance(item, (str, os.PathLike)):
        try:
            import datasets
        except ImportError:
            raise ImportError(f"reading the saved Hugging Face dataset {os.fspath(item)!r} needs the `datasets` "
                              f"package: pip install 'lightning-megatron[hf]'") from None
        item = datasets.load_from_disk(os.fspath(item))
    if isinstance(item, dict):  # a DatasetDict
        splits = sorted(item.keys())
        if "train" not in splits and len(splits) != 1:
            raise ValueError(f"the Hugging Face DatasetDict has splits {splits} and no 'train': pass the split "
                             f"to preprocess, e.g. dataset['{splits[0]}']")
        item = item["train" if "train" in splits else splits[0]]
    if json_key not in item.column_names:
        raise ValueError(f"the Hugging Face dataset has no column json_key={json_key!r}; its columns are "
                         f"{item.column_names}: pass --json-key")
    stats.files += 1
    for batch in item.select_columns([json_key]).iter(batch_size=1000):
        for text in batch[json_key]:
            if (sentences := _record_document({json_key: text}, json_key, stats, split)) is not None:
                yield sentences


def read_documents(inputs: Iterable[Any] | None, stats: CorpusStats | None = None,
                   *, json_key: str = "text", split_sentences: bool = True) -> Iterator[Document]:
    """Documents of the given inputs (``None``: the built-in default corpus), counting in ``stats``.

    ``split_sentences=False`` (GPT data, Megatron's default there) gives every document as one item,
    its text verbatim: a JSON line's text, a text file's lines between blank lines, a built-in
    document's sentences joined by spaces.

    ``.jsonl``/``.json`` files (and ``.gz`` ones) are read as JSON lines, other files as plain
    text, Hugging Face datasets by their ``json_key`` column. Missing files raise
    :class:`FileNotFoundError` before anything is read.
    """
    stats = stats if stats is not None else CorpusStats()
    files = None if inputs is None else expand_inputs(inputs)  # eager: a missing file fails now

    def documents() -> Iterator[Document]:
        if files is None:
            source: Iterable[Document] = default_corpus_documents()
            if not split_sentences:
                source = ([" ".join(doc)] for doc in source)
        else:
            source = _file_documents(files, json_key, stats, split_sentences)
        for doc in source:
            stats.documents += 1
            stats.sentences += len(doc)
            yield doc

    return documents()


def _file_documents(items: Sequence[Any], json_key: str, stats: CorpusStats, split: bool) -> Iterator[Document]:
    for item in items:
        if is_hf_dataset(item):
            yield from _hf_documents(item, json_key, stats, split)
            continue
        stats.files += 1
        if _kind(item) == "json":
            yield from _json_file_documents(item, json_key, stats, split)
        else:
            yield from _text_file_documents(item, stats, split)
