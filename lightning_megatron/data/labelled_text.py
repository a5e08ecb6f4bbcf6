"""Labelled text, read and encoded without Lightning: one text or a text pair, and a label, GLUE-shaped.

Rows come from

- ``.jsonl`` / ``.json`` files (one JSON object per line), ``.csv`` or ``.tsv`` files (a header row),
- a Hugging Face ``datasets`` folder written by ``save_to_disk`` or a ``datasets`` object
  (``datasets`` is the optional ``hf`` extra, imported only then);

:func:`read_labelled_rows` takes the text under ``text_key`` (and the second text under ``text_pair_key``)
and the label under ``label_key``, refusing (the file, the row and the value named) a file without rows, a
column that is not there (listing the columns there are) and a label that is no class; the
``lightning-megatron`` command runs the same on a section's files before it launches any process
(:func:`labelled_files_problems`). Rows are counted from 1 (a CSV file's header is not a row).
The rows to predict carry no label (``label_key=None``): a split's file read for its texts only, or a
``predict_file`` (:func:`read_predict_file`: also ``.txt``, one text per line).
:func:`encode_rows` encodes each row as BERT does: ``[CLS] a [SEP]`` or
``[CLS] a [SEP] b [SEP]`` (token types 0 then 1), the longer text truncated first, padded to
``max_seq_length``.

The Lightning side, the splits and the loaders: :class:`~lightning_megatron.datamodules.finetune.LabelledTextDataModule`
and its base :class:`~lightning_megatron.datamodules.finetune.FinetuneDataModule`.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.data.corpus import read_utf8_text, text_lines

__all__ = ["EncodedRows", "MissingColumnError", "Row", "encode_rows", "file_where", "labelled_files_problems",
           "predict_input_problems", "predict_split", "read_labelled_rows", "read_predict_file", "read_records"]

Row = tuple[str, str | None, float | int | None]
"""(text, second text or None, label): a class id, a real value for regression, or None (a row to predict)."""

SPLITS = ("train", "validation", "test")
FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv")
PREDICT_SUFFIXES = (".txt", *FILE_SUFFIXES)
"""What ``predict_file`` takes: one text per line (``.txt``), or the labelled files' formats (labels unread)."""


class EncodedRows(torch.utils.data.Dataset):
    """Encoded rows held as stacked tensors (int32 tokens): ``tokens``, ``attention_mask``,
    ``token_types`` [n, s] and ``labels`` [n] (int64 class ids or float32 values; None, and no
    ``labels`` in a sample: rows to predict)."""

    def __init__(self, tokens: torch.Tensor, token_types: torch.Tensor, lengths: torch.Tensor,
                 labels: torch.Tensor | None) -> None:
        self.tokens, self.token_types, self.lengths, self.labels = tokens, token_types, lengths, labels

    def __len__(self) -> int:
        return self.tokens.size(0)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = self.tokens.size(1)
        sample = {"tokens": self.tokens[i].long(), "attention_mask": (torch.arange(s) < self.lengths[i]).long(),
                  "token_types": self.token_types[i].long()}
        return sample if self.labels is None else {**sample, "labels": self.labels[i]}


def _truncate_pair(la: int, lb: int, budget: int) -> tuple[int, int]:
    """Lengths kept of a pair, ``longest_first`` as the ``tokenizers`` library cuts them: the shorter
    text stays whole when it fits in half, otherwise both get half (the second one the odd token)."""
    if la + lb <= budget:
        return la, lb
    n1, n2 = (lb, la) if la > lb else (la, lb)  # n1: the shorter
    n2 = n1 if n1 > budget else max(n1, budget - n1)
    if n1 + n2 > budget:
        n1 = budget // 2
        n2 = n1 + budget % 2
    if la > lb:
        n1, n2 = n2, n1
    return min(la, n1), min(lb, n2)


def encode_rows(tokenizer: Any, rows: Sequence[Row], max_seq_length: int, *, regression: bool = False) -> EncodedRows:
    """``[CLS] a [SEP] (b [SEP])`` of every row, truncated longest-first (as transformers'
    ``truncation=True``) and padded to ``max_seq_length``. Rows without labels (None: to predict)
    give no ``labels``."""
    n, s = len(rows), max_seq_length
    tokens = torch.full((n, s), tokenizer.pad, dtype=torch.int32)
    types = torch.zeros((n, s), dtype=torch.int32)
    lengths = torch.zeros(n, dtype=torch.int32)
    firsts = tokenizer.tokenize_batch([r[0] for r in rows])
    pairs = [i for i, r in enumerate(rows) if r[1] is not None]
    seconds = dict(zip(pairs, tokenizer.tokenize_batch([rows[i][1] for i in pairs]))) if pairs else {}
    for i in range(n):
        a, b = firsts[i], seconds.get(i)
        if b is None:
            ids = [tokenizer.cls, *a[: s - 2], tokenizer.sep]
            n_a = len(ids)
        else:
            la, lb = _truncate_pair(len(a), len(b), s - 3)
            ids = [tokenizer.cls, *a[:la], tokenizer.sep, *b[:lb], tokenizer.sep]
            n_a = la + 2
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        types[i, n_a: len(ids)] = 1
        lengths[i] = len(ids)
    labelled = [r[2] is not None for r in rows]
    if any(labelled) and not all(labelled):
        raise ValueError(f"encode_rows: {labelled.count(False)} of the {n} rows have no label: label all or none")
    labels = torch.tensor([r[2] for r in rows], dtype=torch.float32 if regression else torch.long) \
        if all(labelled) and rows else None
    return EncodedRows(tokens, types, lengths, labels)


def _load_hf(source: Any) -> Any:
    if not isinstance(source, (str, os.PathLike)):
        return source
    try:
        import datasets
    except ImportError:
        raise ImportError(f"reading the saved Hugging Face dataset {os.fspath(source)!r} needs the `datasets` "
                          f"package: pip install 'lightning-megatron[hf]' (or give JSONL/CSV files)") from None
    return datasets.load_from_disk(os.fspath(source))


class MissingColumnError(ValueError):
    """A row lacks the column ``text_key`` / ``text_pair_key`` / ``label_key`` names."""


def file_where(split: str, path: str | os.PathLike[str]) -> str:
    """How errors name the file of a split: ``data.train '/path/train.jsonl'``."""
    return f"data.{split} {os.fspath(path)!r}"


def read_records(path: Path, where: str | None = None) -> list[dict[str, Any]]:
    """The records of a ``.jsonl`` / ``.json`` (one JSON object per line) or ``.csv`` / ``.tsv`` file (a
    header row); ``where`` names it in errors (default: the path)."""
    where = where or repr(str(path))
    if not path.is_file():
        raise FileNotFoundError(f"labelled data file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise ValueError(f"labelled data file {str(path)!r}: use .jsonl, .json (one object per line), .csv or .tsv, "
                         f"or a Hugging Face datasets folder (dataset=...)")
    text = read_utf8_text(path, where)
    if suffix in (".csv", ".tsv"):
        return list(csv.DictReader(io.StringIO(text, newline=""), delimiter="\t" if suffix == ".tsv" else ",",
                                   quoting=csv.QUOTE_MINIMAL))
    records = []
    for line_no, line in enumerate(text_lines(text), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} line {line_no} is not JSON ({error}): a .jsonl file holds one JSON object "
                             f"per line") from None
    return records


def read_labelled_rows(records: Any, where: str, *, text_key: str, text_pair_key: str | None, label_key: str | None,
                       regression: bool, labels: Sequence[str] | None, num_classes: int | None = None) -> list[Row]:
    """(text, pair, label) of each record (dicts, or a ``datasets.Dataset``). Refused, naming ``where``, the
    row and the value: no rows at all, a key that is not a column (listing the row's keys), a label that is
    not a class (a name outside ``labels``, an id outside ``0..num_classes-1``), a text that is no string.
    ``label_key=None``: the texts only (rows to predict; a label column, if any, is not read), label None."""
    names = {str(name): i for i, name in enumerate(labels)} if labels else None
    rows: list[Row] = []
    for i, rec in enumerate(records, 1):
        if not isinstance(rec, Mapping):
            raise ValueError(f"{where} row {i} is a {type(rec).__name__}, not an object with the text and the label")
        options = (("text_key", text_key), ("text_pair_key", text_pair_key), ("label_key", label_key))
        missing = [(option, key) for option, key in options if key is not None and key not in rec]
        if missing:
            raise MissingColumnError(f"{where} row {i} has no column {' or '.join(repr(k) for _, k in missing)}: its columns "
                             f"are {sorted(rec)}; set {' / '.join(f'--data.{o}' for o, _ in missing)} to the one that "
                             f"holds the {'label' if missing[0][0] == 'label_key' else 'text'}")
        raw = rec[label_key] if label_key is not None else None
        hint = ("a number (task='regression': the value to predict)" if regression else
                f"one of data.labels={list(labels)}" if names is not None else
                "a class id (or list the label names in data.labels)")
        try:
            if label_key is None:
                label: float | int | None = None
            elif isinstance(raw, bool):  # JSON true / false: neither a score nor a class id (int(True) is 1)
                raise ValueError
            elif regression:
                label = float(raw)
                if not math.isfinite(label):  # JSON NaN / Infinity, "nan": a loss and metrics of nan
                    hint = "a finite number (task='regression': the value to predict)"
                    raise ValueError
            elif names is not None and str(raw) in names:
                label = names[str(raw)]
            else:
                if isinstance(raw, float) and not raw.is_integer():  # int() would truncate a score to a class
                    raise ValueError
                label = int(raw)
                if names is not None and not 0 <= label < len(names):
                    raise ValueError
        except (TypeError, ValueError):
            if names is None and not regression and isinstance(raw, (bool, float)):
                hint = "a class id (a whole number; scores to predict: data.task regression)"
            raise ValueError(f"{where} row {i}: label {raw!r} is not {hint}"
                             + ("" if raw not in (-1, "-1") else " (GLUE's test splits are unlabelled: -1)")) from None
        if names is None and not regression and num_classes is not None and label is not None and \
                not 0 <= label < num_classes:
            raise ValueError(f"{where} row {i}: label {raw!r} is outside the classes 0..{num_classes - 1} "
                             f"(data.num_classes={num_classes}); set data.num_classes (or data.labels) to the "
                             f"task's classes")
        text = rec[text_key]
        pair = rec[text_pair_key] if text_pair_key is not None else None
        if not isinstance(text, str) or (text_pair_key is not None and not isinstance(pair, str)):
            raise ValueError(f"{where} row {i}: the text under {text_key!r}"
                             f"{'' if text_pair_key is None else f' / {text_pair_key!r}'} is not a string")
        rows.append((text, pair, label))
    if not rows:
        raise ValueError(f"{where} is empty: it holds no rows (a .jsonl file: one JSON object per line; .csv / "
                         f".tsv: a header, then one row per example)")
    return rows


def read_predict_file(path: str | os.PathLike[str], *, text_key: str, text_pair_key: str | None) -> list[Row]:
    """The rows of a ``predict_file`` (label None): a ``.txt`` file holds one text per non-empty line (one
    text per row: not for text pairs); ``.jsonl`` / ``.json`` / ``.csv`` / ``.tsv`` files the texts under
    ``text_key`` (and ``text_pair_key``), as :func:`read_labelled_rows` reads them, a label column ignored.
    Errors name the option (``data.predict_file``), the file and the row."""
    path = Path(path)
    where = file_where("predict_file", path)
    if not path.is_file():
        raise FileNotFoundError(f"{where} does not exist (relative paths start at {os.getcwd()!r}): give "
                                f"--data.predict_file the file of the texts to predict")
    suffix = path.suffix.lower()
    if suffix not in PREDICT_SUFFIXES:
        raise ValueError(f"{where}: use a .txt file (one text per line), or .jsonl, .json (one object per line), "
                         f".csv or .tsv with the text column {text_key!r} (--data.text_key)")
    if suffix != ".txt":
        return read_labelled_rows(read_records(path, where), where, text_key=text_key, text_pair_key=text_pair_key,
                                  label_key=None, regression=False, labels=None)
    if text_pair_key is not None:
        raise ValueError(f"{where}: a .txt file holds one text per line, and this data has text pairs "
                         f"(data.text_pair_key={text_pair_key!r}): give a .jsonl or .csv file with the columns "
                         f"{text_key!r} and {text_pair_key!r}")
    texts = [line for line in text_lines(read_utf8_text(path, where)) if line.strip()]
    if not texts:
        raise ValueError(f"{where} holds no text (one text per line)")
    return [(text, None, None) for text in texts]


def predict_split(files: Mapping[str, Any], fractions: Mapping[str, float]) -> str | None:
    """The split ``predict`` (without a ``predict_file``) reads, as ``test`` evaluates: ``test`` when the
    data has one (its file, or ``fractions["test"]`` of the training rows held out), else ``validation``;
    None when neither has a source. ``files``: split -> file or None (a ``datasets`` DatasetDict: the
    splits it has, each mapped to its name)."""
    for split in ("test", "validation"):
        if files.get(split) or fractions.get(split):
            return split
    return None


def regression_problem(labels: Any, num_classes: Any) -> str | None:
    """``task='regression'`` with class names or several classes (the datamodule's rule, before launch too)."""
    if labels or num_classes not in (None, 1):
        return f"task='regression' predicts one value: drop data.labels={labels} / data.num_classes={num_classes}"
    return None


def labelled_files_problems(args: Mapping[str, Any], *, predicting: bool = False) -> list[str]:
    """Before launch: the problems of the split files a LabelledTextDataModule section names (``args``: its
    arguments, every one given), one line each. A ``dataset`` folder is read at set-up. ``predicting``: only
    what ``predict`` reads (:func:`predict_input_problems`)."""
    if predicting:
        return predict_input_problems(args)
    if args.get("dataset") is not None:
        return []
    regression = args.get("task") == "regression"
    labels = args.get("labels")
    if regression and (problem := regression_problem(labels, args.get("num_classes"))):
        return [problem]  # the rows' labels would be read against names a regression has none of
    num_classes = None if regression or labels else args.get("num_classes")
    problems = []
    for split in SPLITS:
        path = args.get(split)
        if path is None or Path(path).suffix.lower() not in FILE_SUFFIXES:
            continue  # the constructor refuses a suffix
        where = file_where(split, path)
        try:
            rows = read_labelled_rows(read_records(Path(path), where), where, text_key=args["text_key"],
                                      text_pair_key=args.get("text_pair_key"), label_key=args["label_key"],
                                      regression=regression, labels=labels,
                                      num_classes=num_classes if isinstance(num_classes, int) else None)
        except (ValueError, OSError) as error:
            problems.append(str(error))
            if isinstance(error, MissingColumnError):
                break  # the same keys name every split's columns: said once
            continue
        classes = {label for _, _, label in rows}
        if split == "train" and not regression and len(classes) == 1:
            [only] = classes
            named = f"{labels[only]!r} (class {only})" if labels else f"class {only}"
            problems.append(f"{where} holds one class only, {named}, in its {len(rows)} rows: a classifier trained "
                            f"on it predicts that class alone; check the file and --data.label_key "
                            f"({args['label_key']!r})")
    return problems


def predict_input_problems(args: Mapping[str, Any]) -> list[str]:
    """Before ``predict`` launches: its input (``args``: a LabelledTextDataModule section's arguments) can be
    read: the ``predict_file``'s texts, else the texts of the split :func:`predict_split` names (its file;
    a split held out from the training rows: the training file, labelled); the training file is read for
    nothing else. A ``dataset`` folder is read at set-up."""
    keys = dict(text_key=args["text_key"], text_pair_key=args.get("text_pair_key"))
    if args.get("predict_file") is not None:
        try:
            read_predict_file(args["predict_file"], **keys)
        except (ValueError, OSError) as error:
            return [str(error)]
        return []
    if args.get("dataset") is not None:
        return []
    split = predict_split({s: args.get(s) for s in SPLITS},
                          {"validation": args.get("val_fraction") or 0.0, "test": args.get("test_fraction") or 0.0})
    if split is None:
        return ["predict has no rows to read: give --data.predict_file FILE (the texts to predict: .txt, one per "
                "line, or .jsonl / .csv) or --data.test FILE (the test split; labels optional)"]
    path = args.get(split)
    if not path:  # held out from the training rows
        train = args.get("train")
        if train and not Path(train).is_file():
            fraction = "test_fraction" if split == "test" else "val_fraction"
            return [f"{file_where('train', train)} does not exist (relative paths start at {os.getcwd()!r}): predict "
                    f"reads the {split} split, held out from the training rows (data.{fraction}); give the "
                    f"training file, --data.{split} a file, or --data.predict_file the texts to predict"]
        return labelled_files_problems({**args, "validation": None, "test": None})
    if Path(path).suffix.lower() not in FILE_SUFFIXES:
        return []  # the constructor refuses a suffix
    where = file_where(split, path)
    if not Path(path).is_file():
        return [f"{where} does not exist (relative paths start at {os.getcwd()!r}): predict reads the texts of the "
                f"{split} split; give --data.{split} the file, or --data.predict_file the texts to predict"]
    try:
        read_labelled_rows(read_records(Path(path), where), where, **keys, label_key=None, regression=False,
                           labels=None)
    except (ValueError, OSError) as error:
        return [str(error)]
    return []
