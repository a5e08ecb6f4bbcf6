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

``predict`` reads texts only, and only what it predicts: ``predict_file`` (``.txt``, one text per line, or
``.jsonl``/``.json``/``.csv``/``.tsv`` with the text columns), else the split ``test`` evaluates (the test
split, else the validation one; labels there are not read). The training file is read only when that
split is held out from it (``test_fraction`` / ``val_fraction``).

:class:`FinetuneDataModule` is the shared part (tokenizer, encoding, data-parallel sharding,
loaders); the built-in docstring task (``models/bert/docstring_task.py``) is one too.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_megatron.data.labelled_text import (
    FILE_SUFFIXES,
    PREDICT_SUFFIXES,
    SPLITS,
    EncodedRows,
    Row,
    _load_hf,
    encode_rows,
    file_where,
    predict_split,
    read_labelled_rows,
    read_predict_file,
    read_records,
    regression_problem,
)
from lightning_megatron.data.loader import MegatronDataLoader
from lightning_megatron.data.predict import IndexedSamples, PredictBatchSampler
from lightning_megatron.data.sft_samples import EpochShuffledBatchSampler

__all__ = ["FinetuneDataModule", "LabelledTextDataModule"]


class FinetuneDataModule(LightningDataModule):
    """What every fine-tuning datamodule shares: the WordPiece tokenizer of the pretrained model,
    rows encoded by :func:`encode_rows`, and loaders sharded over the data-parallel ranks (each rank
    takes ``global_batch_size / dp`` rows per step; every TP/PP rank of a replica the same ones).

    Subclasses implement :meth:`read_splits` (rows per split) and :attr:`num_classes` (1: regression);
    :meth:`read_predict_rows` (default: the texts of the split ``test`` evaluates) and :attr:`label_names`
    (default: none, the classes are their ids) are what ``predict`` reads and writes. ``predict_rows``: the
    rows predicted, in the order of their ``sample_index`` (set up for ``predict``).
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
        self.predict_rows: list[Row] | None = None
        self.predict_dataset: EncodedRows | None = None
        self._tokenizer = None
        self._restored = (0, 0)
        """(consumed_samples, global_step) at the last checkpoint restored."""

    @property
    def num_classes(self) -> int:
        raise NotImplementedError

    def read_splits(self) -> dict[str, list[Row]]:
        """Rows of ``train`` and ``validation`` (and ``test`` when there is one)."""
        raise NotImplementedError

    labels_argument = "labels"
    """The argument that names the classes in class-id order (what a refusal of another order asks for)."""

    @property
    def label_names(self) -> list[str] | None:
        """The class names in class-id order (``predict`` writes them as ``label``; the checkpoint records them);
        None: the ids."""
        return None

    def read_predict_rows(self) -> list[Row]:
        """The rows ``predict`` reads, label None: here the split ``test`` evaluates (the test split, else
        the validation split)."""
        splits = self.read_splits()
        split = "test" if "test" in splits else "validation"
        return [(text, pair, None) for text, pair, _ in splits[split]]

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
        if stage == "predict":  # the rows to predict only: the splits (the training file) are not read
            if self.predict_dataset is None:
                self.predict_rows = self.read_predict_rows()
                self.predict_dataset = encode_rows(self.tokenizer, self.predict_rows, self.max_seq_length)
            return
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

    def _per_rank(self) -> tuple[int, int, int]:
        """(rank, size, rows per step on this rank) of the data-parallel group."""
        rank, size = self._dp()
        if self.global_batch_size % size:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by the {size} "
                             f"data-parallel ranks; choose a multiple of {size}")
        return rank, size, self.global_batch_size // size

    def _every_row_once(self, dataset: EncodedRows) -> DataLoader:
        """Evaluation and prediction see every row once: full global batches (the microbatch schedule needs
        equal microbatches), this rank's contiguous slice of each, the last one padded with sample_index -1,
        which the module leaves out of its loss and metrics and the PredictionWriter drops."""
        rank, size, per_rank = self._per_rank()
        sampler = PredictBatchSampler(total_samples=len(dataset), local_batch_size=per_rank,
                                      data_parallel_rank=rank, data_parallel_size=size)
        return MegatronDataLoader(IndexedSamples(dataset), batch_sampler=sampler)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        dataset = self.datasets.get(split)
        if dataset is None:
            raise ValueError(f"{type(self).__name__} has no {split!r} split: give the file (data.{split}) or a "
                             f"fraction of the training rows (data.val_fraction / data.test_fraction)")
        if not shuffle:
            return self._every_row_once(dataset)
        rank, size, per_rank = self._per_rank()
        if len(dataset) < self.global_batch_size:
            raise ValueError(f"the {split} split has {len(dataset)} rows and global_batch_size="
                             f"{self.global_batch_size}: a training step needs a full global batch; lower "
                             f"data.global_batch_size")
        # The stream of epochs, each a permutation of the rows drawn from seed + epoch, in full global batches (an
        # epoch's remainder carries over), from the samples consumed: a resumed run reads on where it stopped, at any
        # DP size (the decoders' SFTDataModule's sampler). torch's DistributedSampler, with no state, started the
        # epoch again on resume.
        sampler = EpochShuffledBatchSampler(num_samples=len(dataset), local_batch_size=per_rank,
                                            data_parallel_rank=rank, data_parallel_size=size, seed=self.seed,
                                            consumed_samples=lambda: self.consumed_samples)
        return MegatronDataLoader(dataset, batch_sampler=sampler)

    @property
    def consumed_samples(self) -> int:
        """Training samples consumed so far: the count restored from a checkpoint plus ``global_batch_size`` per
        optimizer step taken since."""
        base_samples, base_step = self._restored
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return base_samples
        return base_samples + (int(trainer.global_step) - base_step) * self.global_batch_size

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
        if self.predict_dataset is None:
            self.setup("predict")
        return self._every_row_once(self.predict_dataset)

    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = getattr(self, "trainer", None)
        step = int(trainer.global_step) if trainer is not None else self._restored[1]
        return {"consumed_samples": self.consumed_samples, "global_step": step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "consumed_samples" in state_dict:  # a checkpoint written before this state was kept has none
            self._restored = (int(state_dict["consumed_samples"]), int(state_dict.get("global_step", 0)))


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
        predict_file: what ``predict`` reads instead of the test split: a ``.txt`` file (one text per
            line) or a ``.jsonl``/``.json``/``.csv``/``.tsv`` file with the text columns (labels not
            read). With it, ``train`` may be None (a model that is only used to predict).
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
                 val_fraction: float = 0.0, test_fraction: float = 0.0, predict_file: str | None = None,
                 vocab_file: str | None = None, lowercase: bool | None = None, max_seq_length: int = 128,
                 global_batch_size: int = 32, micro_batch_size: int = 16, seed: int = 1234) -> None:
        super().__init__(vocab_file=vocab_file, lowercase=lowercase, max_seq_length=max_seq_length,
                         global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, seed=seed)
        if task not in ("classification", "regression"):
            raise ValueError(f"task={task!r} must be 'classification' or 'regression'")
        if (dataset is not None and train is not None) or (dataset is None and train is None and predict_file is None):
            raise ValueError("give the training data either as files (data.train, data.validation, data.test) or "
                             "as a Hugging Face datasets folder/object (data.dataset), one of the two (only to "
                             "predict: data.predict_file alone)")
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
            if problem := regression_problem(labels, num_classes):
                raise ValueError(problem)
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
        if predict_file is not None and Path(predict_file).suffix.lower() not in PREDICT_SUFFIXES:
            raise ValueError(f"data.predict_file={predict_file!r}: use a .txt file (one text per line), or .jsonl, "
                             f".json (one object per line), .csv or .tsv with the text columns")
        unknown = set(split_names or {}) - set(SPLITS)
        if unknown:
            raise ValueError(f"data.split_names has {sorted(unknown)}: its keys are {list(SPLITS)}")
        self.files = {"train": train, "validation": validation, "test": test}
        self.predict_file = predict_file
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

    @property
    @override
    def label_names(self) -> list[str] | None:
        return None if self.labels is None else list(self.labels)

    def _records(self, splits: tuple[str, ...] = SPLITS) -> dict[str, tuple[Any, str]]:
        """(records, how errors name them) of each of ``splits`` the data has (files read only for these)."""
        if self.dataset is None:
            return {s: (read_records(Path(f), file_where(s, f)), file_where(s, f)) for s in splits
                    if (f := self.files[s])}
        loaded = _load_hf(self.dataset)
        where = repr(os.fspath(self.dataset)) if isinstance(self.dataset, (str, os.PathLike)) else "the dataset"
        if not hasattr(loaded, "keys"):  # one Dataset: the training rows
            return {"train": (loaded, where)} if "train" in splits else {}
        available = list(loaded.keys())
        out = {}
        for split in splits:
            name = self.split_names[split]
            if name in available:
                out[split] = (loaded[name], f"{where}[{name!r}]")
            elif split == "train" or name != split:
                raise ValueError(f"the DatasetDict {where} has the splits {available}, not {name!r}: set "
                                 f"data.split_names.{split}")
        return out

    @override
    def read_predict_rows(self) -> list[Row]:
        """``predict_file``'s rows, else the texts of the test split (else the validation split), labels
        not read; the training file only when that split is held out from it."""
        keys = dict(text_key=self.keys["text_key"], text_pair_key=self.keys["text_pair_key"])
        if self.predict_file is not None:
            return read_predict_file(self.predict_file, **keys)
        fractions = {"validation": self.val_fraction, "test": self.test_fraction}
        if self.dataset is None:
            found = dict(self.files)
        else:  # the splits the DatasetDict has (a training-only Dataset: none)
            loaded = _load_hf(self.dataset)
            names = set(loaded.keys()) if hasattr(loaded, "keys") else set()
            found = {s: self.split_names[s] in names for s in SPLITS}
        split = predict_split(found, fractions)
        if split is None:
            source = "data.test (the test split; labels optional)" if self.dataset is None else \
                "a dataset with a test or validation split (or data.test_fraction)"
            raise ValueError(f"predict has no rows to read: give data.predict_file (the texts to predict) or {source}")
        if fractions[split] and not found.get(split):  # held out from the training rows
            return [(text, pair, None) for text, pair, _ in self.read_splits()[split]]
        [(records, where)] = self._records((split,)).values()
        return read_labelled_rows(records, where, **keys, label_key=None, regression=False, labels=None)

    @override
    def read_splits(self) -> dict[str, list[Row]]:
        regression = self.task == "regression"
        found = {s: read_labelled_rows(records, where, **self.keys, regression=regression, labels=self.labels,
                                       num_classes=None if regression else self.num_classes)
                 for s, (records, where) in self._records().items()}
        if "train" not in found:
            raise ValueError("no training split: give data.train (a file) or data.dataset (data.predict_file "
                             "alone serves predict only)")
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
