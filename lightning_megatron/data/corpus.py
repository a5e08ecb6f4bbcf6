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
Files are read as bytes and decoded line by line as UTF-8; undecodable bytes become U+FFFD and
the line is counted, as are empty files, superfluous blank lines and malformed JSON lines.
"""

from __future__ import annotations

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

__all__ = [
    "CorpusStats",
    "DEFAULT_CORPUS_MODULES",
    "Document",
    "default_corpus_documents",
    "default_corpus_fingerprint",
    "expand_inputs",
    "read_documents",
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
    """Lines with bytes that are not valid UTF-8 (decoded with U+FFFD replacement characters)."""
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


def expand_inputs(inputs: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Paths of the input files: files as given, directories expanded to their ``.txt``/``.jsonl``
    files in sorted order. A missing path raises :class:`FileNotFoundError` naming it."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file()
                                and p.suffix.lower() in TEXT_SUFFIXES + JSON_SUFFIXES))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input file {str(path)!r} does not exist")
    return files


def _decoded_lines(path: Path, stats: CorpusStats) -> Iterator[str]:
    """Lines of a file as text; invalid UTF-8 is replaced and counted, an empty file counted."""
    any_text = False
    with open(path, "rb") as f:
        for raw in f:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                line = raw.decode("utf-8", errors="replace")
                stats.non_utf8_lines += 1
            any_text = any_text or bool(line.strip())
            yield line
    if not any_text:
        stats.empty_files += 1


def _text_file_documents(path: Path, stats: CorpusStats) -> Iterator[Document]:
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


def _json_file_documents(path: Path, json_key: str, stats: CorpusStats) -> Iterator[Document]:
    for line in _decoded_lines(path, stats):
        if not line.strip():
            stats.empty_lines += 1
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            stats.bad_json_lines += 1
            continue
        if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
            stats.bad_json_lines += 1
            continue
        sentences = [s for paragraph in record[json_key].split("\n") for s in split_sentences(paragraph)]
        if not sentences:
            stats.empty_documents += 1
            continue
        yield sentences


def read_documents(inputs: Iterable[str | os.PathLike[str]] | None, stats: CorpusStats | None = None,
                   *, json_key: str = "text") -> Iterator[Document]:
    """Documents of the given files (``None``: the built-in default corpus), counting in ``stats``.

    ``.jsonl``/``.json`` files are read as JSON lines, anything else as plain text. Missing files
    raise :class:`FileNotFoundError` before anything is read.
    """
    stats = stats if stats is not None else CorpusStats()
    files = None if inputs is None else expand_inputs(inputs)  # eager: a missing file fails now

    def documents() -> Iterator[Document]:
        if files is None:
            source: Iterable[Document] = default_corpus_documents()
        else:
            source = _file_documents(files, json_key, stats)
        for doc in source:
            stats.documents += 1
            stats.sentences += len(doc)
            yield doc

    return documents()


def _file_documents(files: Sequence[Path], json_key: str, stats: CorpusStats) -> Iterator[Document]:
    for path in files:
        stats.files += 1
        if path.suffix.lower() in JSON_SUFFIXES:
            yield from _json_file_documents(path, json_key, stats)
        else:
            yield from _text_file_documents(path, stats)
