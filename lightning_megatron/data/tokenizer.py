"""WordPiece tokenizer for BERT: a ``vocab.txt`` loaded through the ``tokenizers`` library.

:class:`BertTokenizer` is a thin wrapper in the shape of Megatron's ``_BertWordPieceTokenizer``:
ids of the special tokens, ``tokenize(text) -> ids``, and which ids continue a word (``##`` pieces)
so that whole-word masking can keep a word's pieces together.

The default vocabulary is the real uncased BERT vocabulary (30522 pieces, Apache-2.0) shipped inside
this package as data (``data/vocab/bert-base-uncased-vocab.txt``, :func:`packaged_vocab_file`).
:func:`train_wordpiece_tokenizer` trains your own.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BertTokenizer",
    "SPECIAL_TOKENS",
    "default_cache_dir",
    "default_vocab_file",
    "packaged_vocab_file",
    "file_lock",
    "load_tokenizer",
    "train_wordpiece_tokenizer",
]

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
DEFAULT_TRAINED_VOCAB_SIZE = 8192


def default_cache_dir() -> Path:
    """``$LIGHTNING_MEGATRON_CACHE`` if set, else ``~/.cache/lightning_megatron``."""
    env = os.environ.get("LIGHTNING_MEGATRON_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lightning_megatron"


_said_unlocked: list[bool] = []
"""Whether :func:`file_lock` said that this file system takes no locks (once a process)."""


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str], timeout_s: float = 1800.0) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed): processes of one node building
    the same cached artefact take turns, and the later ones find it built. Waits at most ``timeout_s``
    (the strategy's default collective timeout), then raises ``TimeoutError`` naming the lock: a holder
    that is stopped or hung never blocks a rank for ever. On a file system without ``flock`` (Lustre mounted
    ``noflock``, NFS without its lock daemon: ENOSYS, ENOLCK) it goes on unlocked, as the builds may: each cached
    file is named by its content's key and published once, atomically (two builders write the same bytes)."""
    import fcntl

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    locked = False
    try:
        deadline, pause = time.monotonic() + timeout_s, 0.05
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"waited {timeout_s:.0f} s for the lock {str(path)!r}: another process building the same "
                        f"cached file holds it (a build still running, or a stopped job sharing the cache folder; "
                        f"`fuser {path}` names it on this host; a lock taken on another host of a network file "
                        f"system is released when its holder ends)") from None
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
            except OSError as e:  # no locks on this file system: build unlocked, said once
                if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                if not _said_unlocked:
                    _said_unlocked.append(True)
                    warnings.warn(f"{str(path)!r}: this file system takes no locks ({e.strerror}): cached files are "
                                  f"built without one (two processes may build the same file; neither reads a "
                                  f"partial one)", stacklevel=3)
                break
        yield
    finally:
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class BertTokenizer:
    """WordPiece tokenizer from a BERT ``vocab.txt`` (one piece per line, id = line number), a Hugging
    Face ``tokenizer.json`` (a WordPiece model), or a folder holding either (``tokenizer.json`` first).

    Args:
        vocab_file: that file or folder; ``None`` means :func:`default_vocab_file`.
        lowercase: lowercase and strip accents before WordPiece (uncased vocabularies). ``None``: as
            the vocabulary says: ``do_lower_case`` of a ``tokenizer_config.json`` beside it, else the
            normalizer of a ``tokenizer.json``, else whether the vocabulary has no upper-case piece
            (a cased vocabulary, such as bert-base-cased's, is never lowercased behind your back).
    """

    tokenizer_type = "wordpiece"
    merges: tuple[str, ...] = ()  # WordPiece has no merge rules (what the dataset sidecar hashes with the pieces)

    def __init__(self, vocab_file: str | os.PathLike[str] | None = None, *, lowercase: bool | None = None) -> None:
        self.vocab_file = _vocabulary_path(Path(vocab_file) if vocab_file is not None else default_vocab_file())
        _require_utf8(self.vocab_file)
        self._lowercase_arg = lowercase
        self._tokenizer, self.lowercase = _load_wordpiece(self.vocab_file, lowercase)
        vocab = self._tokenizer.get_vocab()
        self.inv_vocab: list[str] = [""] * len(vocab)
        for token, index in vocab.items():
            self.inv_vocab[index] = token
        missing = [t for t in SPECIAL_TOKENS if t not in vocab]
        if missing:
            raise ValueError(f"vocab_file {str(self.vocab_file)!r} lacks the special tokens {missing}; "
                             f"a BERT vocabulary needs all of {list(SPECIAL_TOKENS)}: add them, or train one with "
                             f"`lightning-megatron train-tokenizer --type wordpiece` (it writes them first)")
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (vocab[t] for t in SPECIAL_TOKENS)
        self.continuation = np.array([t.startswith("##") for t in self.inv_vocab], dtype=bool)
        """``continuation[id]`` is true for ``##`` pieces, which continue the previous word."""
        special = np.array([t.startswith("[") and t.endswith("]") for t in self.inv_vocab], dtype=bool)
        self.random_token_ids = np.flatnonzero(~special).astype(np.int64)
        """Ids that MLM's "random token" replacement draws from: every piece but ``[...]`` ones."""

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_tokenizer"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tokenizer, _ = _load_wordpiece(self.vocab_file, self._lowercase_arg)

    @property
    def vocab_size(self) -> int:
        """Number of pieces in the vocabulary (before any padding for tensor parallelism)."""
        return len(self.inv_vocab)

    # Megatron's names for the special ids.
    @property
    def cls(self) -> int:
        return self.cls_id

    @property
    def sep(self) -> int:
        return self.sep_id

    @property
    def pad(self) -> int:
        return self.pad_id

    @property
    def mask(self) -> int:
        return self.mask_id

    @property
    def eod(self) -> int:
        """End-of-document id for GPT data made with a WordPiece vocabulary (which has none): ``[SEP]``."""
        return self.sep_id

    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text``'s WordPiece pieces, without special tokens."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`tokenize` of many texts at once (the library parallelises this)."""
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def is_word_start(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Boolean array: which ids begin a word (are not ``##`` continuation pieces)."""
        return ~self.continuation[np.asarray(ids, dtype=np.int64)]

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.inv_vocab[i] for i in ids]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens kept, ``##`` pieces joined to their word)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(path: str | os.PathLike[str] | None) -> Any:
    """The tokenizer a vocabulary file or folder holds: :class:`.BPETokenizer` for a BPE
    ``tokenizer.json`` or GPT-2 ``vocab.json`` (+ ``merges.txt``), :class:`BertTokenizer` for a
    WordPiece ``vocab.txt`` / ``tokenizer.json`` (``None``: the packaged BERT vocabulary)."""
    import json

    from lightning_megatron.data.bpe_tokenizer import BPETokenizer

    if path is None:
        return BertTokenizer()
    file = Path(path)
    if file.is_dir():
        names = ("tokenizer.json", "vocab.json", "vocab.txt")
        file = next((file / n for n in names if (file / n).is_file()), file)
        if file.is_dir():
            raise FileNotFoundError(f"tokenizer folder {str(path)!r} holds none of {list(names)}")
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer {str(path)!r} does not exist")
    if file.suffix == ".json":
        try:
            spec = json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError) as error:
            raise ValueError(f"tokenizer {str(file)!r} is not valid JSON ({error})") from None
        model = spec.get("model") if isinstance(spec, dict) else None
        if model is None or (isinstance(model, dict) and model.get("type") == "BPE"):
            return BPETokenizer(file)  # a GPT-2 vocab.json (no "model") or a BPE tokenizer.json
    return BertTokenizer(file)


def _require_utf8(path: Path) -> None:
    """A vocabulary file the ``tokenizers`` library would reject without naming it ("stream did not
    contain valid UTF-8"): the error names the file and the first bad byte."""
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ValueError(f"vocab_file {str(path)!r} is not UTF-8 text (line {line}, byte {e.start}: {e.reason}); a "
                         f"WordPiece vocab.txt holds one UTF-8 piece per line: convert it (e.g. iconv -f LATIN1 "
                         f"-t UTF-8) or pass the vocabulary the model was trained with") from None


def _vocabulary_path(path: Path) -> Path:
    """``vocab.txt`` / ``tokenizer.json`` as given, or the one in a folder (``tokenizer.json`` first)."""
    if path.is_dir():
        for name in ("tokenizer.json", "vocab.txt"):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"vocab_file {str(path)!r} is a folder without tokenizer.json or vocab.txt")
    if not path.is_file():
        raise FileNotFoundError(f"vocab_file {str(path)!r} does not exist")
    return path


def _config_lowercase(path: Path) -> bool | None:
    """``do_lower_case`` of a ``tokenizer_config.json`` beside the vocabulary, if it says."""
    import json

    config = path.parent / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("do_lower_case")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, bool) else None


def _load_wordpiece(path: Path, lowercase: bool | None) -> tuple[Any, bool]:
    """The ``tokenizers`` tokenizer of ``path`` and whether it lowercases (see :class:`BertTokenizer`)."""
    import json

    from tokenizers import Tokenizer, normalizers
    from tokenizers.implementations import BertWordPieceTokenizer

    if lowercase is None:
        lowercase = _config_lowercase(path)
    if path.suffix == ".json":
        tokenizer = Tokenizer.from_file(str(path))
        tokenizer.no_padding()  # ours pads and truncates itself
        tokenizer.no_truncation()
        if type(tokenizer.model).__name__ != "WordPiece":
            raise ValueError(f"{str(path)!r} holds a {type(tokenizer.model).__name__} tokenizer; BERT needs WordPiece")
        if lowercase is None:
            spec = json.dumps(json.loads(path.read_text(encoding="utf-8")).get("normalizer"))
            lowercase = '"lowercase": true' in spec or '"type": "Lowercase"' in spec
        else:  # an explicit choice replaces the file's normalizer
            tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        return tokenizer, lowercase
    if lowercase is None:
        with path.open(encoding="utf-8") as fh:
            # A cased vocabulary (bert-base-cased: ~5,000 pieces) has pieces with capitals, in any script (a cased
            # Cyrillic one has no A-Z); an uncased one none (bert-base-uncased's ℝ has no lower case: not a capital)
            lowercase = not any(c != c.lower() for line in fh if not line.startswith("[") for c in line)
    return BertWordPieceTokenizer(str(path), lowercase=lowercase), lowercase


def train_wordpiece_tokenizer(files: Sequence[str | os.PathLike[str]] | None, vocab_size: int,
                              output_dir: str | os.PathLike[str], *, lowercase: bool = True,
                              min_frequency: int = 2, json_key: str = "text") -> Path:
    """Train a WordPiece vocabulary on ``files`` (``.txt``/``.jsonl`` as :mod:`.corpus` reads
    them; ``None``: the built-in corpus) and write ``output_dir/vocab.txt`` atomically.

    Returns the path of ``vocab.txt``. The special tokens of :data:`SPECIAL_TOKENS` come first.
    Inputs that hold no text (say, JSON lines without ``json_key``) raise :class:`ValueError` and
    write nothing.
    """
    from tokenizers import BertWordPieceTokenizer

    from lightning_megatron.data.corpus import CorpusStats, read_documents

    if vocab_size < len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size={vocab_size} is too small; use at least a few hundred pieces")
    stats = CorpusStats()
    documents = read_documents(files, stats, json_key=json_key)  # missing files fail here
    tokenizer = BertWordPieceTokenizer(lowercase=lowercase)
    tokenizer.train_from_iterator((s for doc in documents for s in doc), vocab_size=vocab_size,
                                  min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
                                  show_progress=False)
    if stats.documents == 0:
        names = "the built-in corpus" if files is None else [os.fspath(f) for f in files][:5]
        raise ValueError(f"no text to train a vocabulary on in {names}: {stats.files} files read, "
                         f"{stats.empty_files} empty, {stats.bad_json_lines} JSON lines without a string under "
                         f"json_key={json_key!r}, {stats.empty_documents} empty documents; nothing was written "
                         f"(pass --json-key with the field that holds the text)")
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output) as tmp:
        (written,) = tokenizer.save_model(tmp)
        # what the vocabulary is for, as Hugging Face's folders say it: read back by BertTokenizer (and by
        # transformers), so the choice made here is never a guess from the pieces
        config = Path(tmp) / "tokenizer_config.json"
        config.write_text(json.dumps({"do_lower_case": lowercase, "tokenizer_class": "BertTokenizer"}, indent=1) + "\n",
                          encoding="utf-8")
        os.replace(config, output / "tokenizer_config.json")
        os.replace(written, output / "vocab.txt")
    return output / "vocab.txt"


PACKAGED_VOCAB = "bert-base-uncased-vocab.txt"
"""The real uncased BERT WordPiece vocabulary (30,522 pieces, Apache-2.0; see ``data/vocab/NOTICE``),
shipped in the package as data."""


def packaged_vocab_file() -> Path:
    """Path of the packaged BERT ``vocab.txt`` (``lightning_megatron/data/vocab/``)."""
    from importlib.resources import files

    resource = files("lightning_megatron.data") / "vocab" / PACKAGED_VOCAB
    path = Path(str(resource))
    if not path.is_file():
        raise FileNotFoundError(f"the packaged vocabulary {str(path)!r} is missing: the lightning-megatron "
                                f"installation is incomplete; reinstall it, or pass vocab_file=...")
    return path


def default_vocab_file(cache_dir: str | os.PathLike[str] | None = None, *, prefer_packaged: bool = True) -> Path:
    """The default vocabulary: the packaged real BERT ``vocab.txt`` (:func:`packaged_vocab_file`);
    with ``prefer_packaged=False``, an 8192-piece WordPiece vocabulary trained on the built-in
    corpus instead, cached under ``cache_dir`` (default :func:`default_cache_dir`) and built once
    per node."""
    if prefer_packaged:
        return packaged_vocab_file()
    from lightning_megatron.data.corpus import default_corpus_fingerprint

    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    directory = directory / f"wordpiece-{DEFAULT_TRAINED_VOCAB_SIZE}-{default_corpus_fingerprint()}"
    vocab = directory / "vocab.txt"
    with file_lock(directory.with_suffix(".lock")):
        if not vocab.is_file():
            train_wordpiece_tokenizer(None, DEFAULT_TRAINED_VOCAB_SIZE, directory)
    return vocab
