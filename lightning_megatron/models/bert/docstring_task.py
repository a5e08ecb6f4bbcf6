"""A real labelled task from text every Python ships: which standard-library package a docstring is from.

The docstrings of the modules, classes and functions under ``<stdlib>/<package>/`` (test suites
excluded) are read with :mod:`ast` (nothing is imported or executed), labelled with the package's
index in ``packages``, balanced to ``samples_per_class`` per class and split into train and
validation by a seeded shuffle. No download; deterministic for a given Python installation.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

__all__ = ["DEFAULT_PACKAGES", "stdlib_docstrings", "StdlibDocstringDataModule"]

DEFAULT_PACKAGES = ("asyncio", "email", "unittest", "multiprocessing", "importlib", "xml", "http", "logging")
"""Packages with a few hundred docstrings each in CPython 3.10+."""


def stdlib_docstrings(packages: tuple[str, ...] | list[str] = DEFAULT_PACKAGES, *, min_words: int = 4,
                      stdlib: str | None = None) -> list[tuple[str, int]]:
    """``(docstring, label)`` for every docstring of at least ``min_words`` words under each package."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    out: list[tuple[str, int]] = []
    for label, package in enumerate(packages):
        base = root / package
        if not base.is_dir():
            raise FileNotFoundError(f"standard-library package {package!r} not found under {str(root)!r}")
        for path in sorted(base.rglob("*.py")):
            if any(part in ("test", "tests") for part in path.relative_to(root).parts):
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc.split()) >= min_words:
                        out.append((" ".join(doc.split()), label))
    return out


class _Encoded(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


class StdlibDocstringDataModule(LightningDataModule):
    """Docstring -> standard-library package classification, sharded over data-parallel ranks.

    Args:
        vocab_file: WordPiece vocabulary (the pretrained model's); None: the default vocabulary.
        packages: the classes (``num_classes = len(packages)``).
        samples_per_class: docstrings kept per package (fewer if a package has fewer).
        val_fraction: share of each class held out for validation (and test).
        max_seq_length: tokens per sample ([CLS] text [SEP], truncated, padded).
        global_batch_size / micro_batch_size: as :class:`~lightning_megatron.data.BertDataModule`.
        seed: sampling, split and shuffling seed.
    """

    def __init__(self, vocab_file: str | None = None, *, packages: list[str] | None = None,
                 samples_per_class: int = 300, val_fraction: float = 0.2, max_seq_length: int = 64,
                 global_batch_size: int = 32, micro_batch_size: int = 16, seed: int = 1234) -> None:
        super().__init__()
        if global_batch_size % micro_batch_size:
            raise ValueError(f"global_batch_size={global_batch_size} must be a multiple of "
                             f"micro_batch_size={micro_batch_size}")
        self.save_hyperparameters()
        self.vocab_file = vocab_file
        self.packages = tuple(packages or DEFAULT_PACKAGES)
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.train_dataset: _Encoded | None = None
        self.val_dataset: _Encoded | None = None

    @property
    def num_classes(self) -> int:
        return len(self.packages)

    @property
    def tokenizer(self):
        if getattr(self, "_tokenizer", None) is None:
            from lightning_megatron.data.tokenizer import BertTokenizer, default_vocab_file

            self._tokenizer = BertTokenizer(self.vocab_file or default_vocab_file())
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Pieces in the vocabulary (the model reads it when its ``vocab_size`` is None)."""
        return self.tokenizer.vocab_size

    def _encode(self, texts: list[tuple[str, int]]) -> _Encoded:
        tok = self.tokenizer
        s = self.hparams.max_seq_length
        rows = []
        for text, label in texts:
            ids = [tok.cls] + tok.tokenize(text)[: s - 2] + [tok.sep]
            tokens = torch.full((s,), tok.pad, dtype=torch.long)
            tokens[: len(ids)] = torch.tensor(ids)
            mask = (torch.arange(s) < len(ids)).long()
            rows.append({"tokens": tokens, "attention_mask": mask, "token_types": torch.zeros(s, dtype=torch.long),
                         "labels": torch.tensor(label)})
        return _Encoded(rows)

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        rng = random.Random(self.hparams.seed)
        by_class: dict[int, list[tuple[str, int]]] = {}
        for text, label in stdlib_docstrings(self.packages):
            by_class.setdefault(label, []).append((text, label))
        train, val = [], []
        for label in range(self.num_classes):
            rows = by_class.get(label, [])
            rng.shuffle(rows)
            rows = rows[: self.hparams.samples_per_class]
            n_val = max(1, int(len(rows) * self.hparams.val_fraction))
            val += rows[:n_val]
            train += rows[n_val:]
        rng.shuffle(train)
        self.train_dataset, self.val_dataset = self._encode(train), self._encode(val)

    def _dp(self) -> tuple[int, int]:
        """(rank, size) of this process's data-parallel group: the MegatronStrategy's, else (0, 1)."""
        from lightning_megatron.strategy import MegatronStrategy

        strategy = self.trainer.strategy if self.trainer is not None else None
        if isinstance(strategy, MegatronStrategy) and strategy.parallel_state is not None:
            return strategy.parallel_state.dp_rank, strategy.parallel_state.dp_size
        return 0, 1

    def _loader(self, dataset: _Encoded, shuffle: bool) -> DataLoader:
        rank, size = self._dp()
        sampler = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle,
                                     seed=self.hparams.seed, drop_last=True)
        return DataLoader(dataset, batch_size=self.global_batch_size // size, sampler=sampler, drop_last=True)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)

    @override
    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)

    def state_dict(self) -> dict[str, Any]:
        return {}
