"""Fine-tuning data for Lightning: the user's labelled text (one text or a text pair, and a label), GLUE-shaped.

:class:`LabelledTextDataModule` reads rows from

- ``.jsonl`` / ``.json`` files (one JSON object per line), ``.csv`` or ``.tsv`` files (a header row),
- a Hugging Face ``datasets`` folder written by ``save_to_disk`` (a ``DatasetDict``: its splits by
  name; a ``Dataset``: the training split), or a ``datasets`` object (``datasets`` is the optional
  ``hf`` extra, imported only then),

takes the text under ``text_key`` (and the second text under ``text_pair_key``), the label under
``label_key``, and encodes each row as BERT does: ``[CLS] a [SEP]`` or ``[CLS] a [SEP] b [SEP]``
(token types 0 then 1), the longer text truncated first, padded to ``max_seq_length``
(the Lightning-free readers and encoder: :mod:`lightning_megatron.data.labelled_text`).

The four GLUE task shapes: SST-2 (one sentence, 2 classes), CoLA (one sentence, 2 classes, Matthews
correlation), MNLI (a pair, 3 classes), STS-B (a pair, a real-valued score: ``task="regression"``,
one output, mean-squared error). Classification labels are class ids ``0..num_classes-1`` or names
listed in ``labels`` (``[negative, positive]``: "positive" is class 1).

Splits: ``train``/``validation``/``test`` files (or a DatasetDict's splits); a missing validation or
test split is carved from the training rows by ``val_fraction`` / ``test_fraction`` (seeded).

:class:`FinetuneDataModule` is the shared part (tokenizer, encoding, data-parallel sharding,
loaders); the built-in docstring task (``models/bert/docstring_task.py``) is one too.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_megatron.data.labelled_text import (
    FILE_SUFFIXES,
    SPLITS,
    EncodedRows,
    Row,
    _load_hf,
    encode_rows,
    file_where,
    read_labelled_rows,
    read_records,
)
from lightning_megatron.data.loader import MegatronDataLoader
from lightning_megatron.data.predict import IndexedSamples, PredictBatchSampler

__all__ = ["FinetuneDataModule", "LabelledTextDataModule"]


class FinetuneDataModule(LightningDataModule):
    """What every fine-tuning datamodule shares: the WordPiece tokenizer of the pretrained model,
    rows encoded by :func:`encode_rows`, and loaders sharded over the data-parallel ranks (each rank
    takes ``global_batch_size / dp`` rows per step; every TP/PP rank of a replica the same ones).

    Subclasses implement :meth:`read_splits` (rows per split) and :attr:`num_classes` (1: regression).
    """

    def __init__(self, *, vocab_file: str | None = None, lowercase: bool | None = None, max_seq_length: int = 128,
                 global_batch_size: int = 32, micro_batch_size: int = 16, seed: int = 1234) -> None:
        super().__init__()
        if global_batch_size % micro_batch_size:
            raise ValueError(f"global_batch_size={global_batch_size} must be a multiple of "
                             f"micro_batch_size={micro_batch_size}")
        if max_seq_length < 4:
            raise ValueError(f"max_seq_length={max_seq_length} must leave room for [CLS] text [SEP] (>= 4)")
        self.vocab_file, self.lowercase = vocab_file, lowercase
        self.max_seq_length = max_seq_length
        self.global_batch_size, self.micro_batch_size, self.seed = global_batch_size, micro_batch_size, seed
        self.datasets: dict[str, EncodedRows] = {}
        self._tokenizer = None

    @property
    def num_classes(self) -> int:
        raise NotImplementedError

    def read_splits(self) -> dict[str, list[Row]]:
        """Rows of ``train`` and ``validation`` (and ``test`` when there is one)."""
        raise NotImplementedError

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from lightning_megatron.data.tokenizer import BertTokenizer

            self._tokenizer = BertTokenizer(self.vocab_file, lowercase=self.lowercase)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Pieces in the vocabulary (the model reads it when its ``vocab_size`` is None)."""
        return self.tokenizer.vocab_size

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        for split, rows in self.read_splits().items():
            if rows:
                self.datasets[split] = encode_rows(self.tokenizer, rows, self.max_seq_length,
                                                   regression=self.num_classes == 1)

    def _dp(self) -> tuple[int, int]:
        """(rank, size) of this process's data-parallel group: the strategy's ``parallel_state`` (the
        MegatronStrategy's), else the world's."""
        state = getattr(self.trainer.strategy, "parallel_state", None) if self.trainer is not None else None
        if state is not None:
            return int(state.dp_rank), int(state.dp_size)
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        return 0, 1

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        dataset = self.datasets.get(split)
        if dataset is None:
            raise ValueError(f"{type(self).__name__} has no {split!r} split: give the file (data.{split}) or a "
                             f"fraction of the training rows (data.val_fraction / data.test_fraction)")
        rank, size = self._dp()
        per_rank = self.global_batch_size // size
        if self.global_batch_size % size:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by the {size} "
                             f"data-parallel ranks; choose a multiple of {size}")
        if not shuffle:
            # Evaluation sees every row once: full global batches (the microbatch schedule needs equal
            # microbatches), the last one padded with sample_index -1, which the module leaves out of
            # its loss and metrics.
            sampler = PredictBatchSampler(total_samples=len(dataset), local_batch_size=per_rank,
                                          data_parallel_rank=rank, data_parallel_size=size)
            return MegatronDataLoader(IndexedSamples(dataset), batch_sampler=sampler)
        if len(dataset) < self.global_batch_size:
            raise ValueError(f"the {split} split has {len(dataset)} rows and global_batch_size="
                             f"{self.global_batch_size}: a training step needs a full global batch; lower "
                             f"data.global_batch_size")
        # Training takes full global batches only: at most global_batch_size - 1 rows of an epoch are
        # left out (a different set each epoch, as the shuffle changes).
        sampler = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=self.seed,
                                     drop_last=True)
        return DataLoader(dataset, batch_size=per_rank, sampler=sampler, drop_last=True)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test" if "test" in self.datasets else "validation", shuffle=False)

    @override
    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}


class LabelledTextDataModule(FinetuneDataModule):
    """Your labelled text for sequence classification or regression (see the module docstring).

    Args:
        train, validation, test: ``.jsonl``/``.json``/``.csv``/``.tsv`` files of the splits.
        dataset: instead of files, a Hugging Face ``datasets`` folder (``save_to_disk``) or object; a
            DatasetDict's splits are taken by the names in ``split_names``.
        split_names: the DatasetDict's split of each of train/validation/test (MNLI:
            ``{validation: validation_matched}``).
        text_key, text_pair_key, label_key: the columns (``text_pair_key`` None: one text per row).
        task: ``classification`` (cross entropy over ``num_classes``) or ``regression`` (one
            output, mean-squared error; STS-B).
        labels: the class names in class-id order, when the label column holds names.
        num_classes: classes when the labels are ids (None: ``len(labels)``; 1 for regression).
        val_fraction, test_fraction: share of the training rows held out for a missing
            validation / test split (seeded shuffle).
        vocab_file: the pretrained model's vocabulary (``vocab.txt`` or a ``tokenizer.json``);
            None: the packaged BERT vocabulary.
        lowercase: lowercase before WordPiece; None: as the vocabulary says (see
            :class:`~lightning_megatron.data.tokenizer.BertTokenizer`).
        max_seq_length, global_batch_size, micro_batch_size, seed: as the other datamodules.
    """

    def __init__(self, train: str | None = None, validation: str | None = None, test: str | None = None, *,
                 dataset: Any = None, split_names: dict[str, str] | None = None, text_key: str = "sentence",
                 text_pair_key: str | None = None, label_key: str = "label",
                 task: Literal["classification", "regression"] = "classification",
                 labels: list[str] | None = None, num_classes: int | None = None,
                 val_fraction: float = 0.0, test_fraction: float = 0.0, vocab_file: str | None = None,
                 lowercase: bool | None = None, max_seq_length: int = 128, global_batch_size: int = 32,
                 micro_batch_size: int = 16, seed: int = 1234) -> None:
        super().__init__(vocab_file=vocab_file, lowercase=lowercase, max_seq_length=max_seq_length,
                         global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, seed=seed)
        if task not in ("classification", "regression"):
            raise ValueError(f"task={task!r} must be 'classification' or 'regression'")
        if (dataset is None) == (train is None):
            raise ValueError("give the training data either as files (data.train, data.validation, data.test) or "
                             "as a Hugging Face datasets folder/object (data.dataset), one of the two")
        if dataset is not None and (validation or test):
            raise ValueError("data.dataset brings its own splits: leave data.validation / data.test unset "
                             "(or choose the splits with data.split_names)")
        for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value} must be in [0, 1)")
        if val_fraction + test_fraction >= 1.0:
            raise ValueError(f"val_fraction + test_fraction = {val_fraction + test_fraction} leaves no training rows")
        if validation and val_fraction:
            raise ValueError(f"data.validation={validation!r} and data.val_fraction={val_fraction}: "
                             f"use one of the two")
        if test and test_fraction:
            raise ValueError(f"data.test={test!r} and data.test_fraction={test_fraction}: use one of the two")
        if task == "regression":
            if labels or num_classes not in (None, 1):
                raise ValueError(f"task='regression' predicts one value: drop data.labels={labels} / "
                                 f"data.num_classes={num_classes}")
        elif labels is not None and num_classes is not None and num_classes != len(labels):
            raise ValueError(f"data.num_classes={num_classes} but data.labels names {len(labels)} classes {labels}")
        elif labels is None and num_classes is None:
            raise ValueError("task='classification' needs the classes: data.labels (their names, in class-id "
                             "order) or data.num_classes (when the labels are ids 0..num_classes-1)")
        elif (num_classes if labels is None else len(labels)) < 2:
            raise ValueError(f"classification needs at least 2 classes (data.num_classes={num_classes}, "
                             f"data.labels={labels}); one output is task='regression'")
        for split, path in (("train", train), ("validation", validation), ("test", test)):
            if path is not None and Path(path).suffix.lower() not in FILE_SUFFIXES:
                raise ValueError(f"data.{split}={path!r}: use .jsonl, .json (one object per line), .csv or .tsv "
                                 f"files, or a Hugging Face datasets folder (data.dataset)")
        unknown = set(split_names or {}) - set(SPLITS)
        if unknown:
            raise ValueError(f"data.split_names has {sorted(unknown)}: its keys are {list(SPLITS)}")
        self.files = {"train": train, "validation": validation, "test": test}
        self.dataset = dataset
        self.split_names = {s: s for s in SPLITS} | dict(split_names or {})
        self.keys = dict(text_key=text_key, text_pair_key=text_pair_key, label_key=label_key)
        self.task, self.labels, self._num_classes = task, labels, num_classes
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        # The model's num_classes is the one recorded (the CLI links it from this datamodule's property):
        # Lightning refuses two different values under one name.
        self.save_hyperparameters(ignore=["num_classes"] + (
            [] if isinstance(dataset, (str, os.PathLike, type(None))) else ["dataset"]))

    @property
    def num_classes(self) -> int:
        """Outputs of the classifier: 1 for regression (the CLI passes this to the model)."""
        if self.task == "regression":
            return 1
        return len(self.labels) if self.labels is not None else int(self._num_classes)

    def _records(self) -> dict[str, tuple[Any, str]]:
        if self.dataset is None:
            return {s: (read_records(Path(f), file_where(s, f)), file_where(s, f)) for s, f in self.files.items() if f}
        loaded = _load_hf(self.dataset)
        where = repr(os.fspath(self.dataset)) if isinstance(self.dataset, (str, os.PathLike)) else "the dataset"
        if not hasattr(loaded, "keys"):  # one Dataset: the training rows
            return {"train": (loaded, where)}
        available = list(loaded.keys())
        out = {}
        for split, name in self.split_names.items():
            if name in available:
                out[split] = (loaded[name], f"{where}[{name!r}]")
            elif split == "train" or name != split:
                raise ValueError(f"the DatasetDict {where} has the splits {available}, not {name!r}: set "
                                 f"data.split_names.{split}")
        return out

    @override
    def read_splits(self) -> dict[str, list[Row]]:
        regression = self.task == "regression"
        found = {s: read_labelled_rows(records, where, **self.keys, regression=regression, labels=self.labels,
                                       num_classes=None if regression else self.num_classes)
                 for s, (records, where) in self._records().items()}
        train = found["train"]
        carve = [(s, f) for s, f in (("validation", self.val_fraction), ("test", self.test_fraction)) if f]
        if carve:
            order = list(range(len(train)))
            random.Random(self.seed).shuffle(order)
            start = 0
            for split, fraction in carve:
                n = max(1, int(len(train) * fraction))
                found[split] = [train[i] for i in order[start: start + n]]
                start += n
            held = set(order[:start])
            found["train"] = [r for i, r in enumerate(train) if i not in held]
        if "validation" not in found:
            raise ValueError("no validation split: give data.validation (a file), a DatasetDict with one, or "
                             "data.val_fraction (a share of the training rows)")
        return found
