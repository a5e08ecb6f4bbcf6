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

from typing_extensions import override

from lightning_megatron.data.labelled_text import Row
from lightning_megatron.datamodules.finetune import FinetuneDataModule

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


class StdlibDocstringDataModule(FinetuneDataModule):
    """Docstring -> standard-library package classification, sharded over data-parallel ranks.

    Args:
        vocab_file: WordPiece vocabulary (the pretrained model's); None: the default vocabulary.
        packages: the classes (``num_classes = len(packages)``).
        samples_per_class: docstrings kept per package (fewer if a package has fewer).
        val_fraction: share of each class held out for validation (and test).
        max_seq_length: tokens per sample ([CLS] text [SEP], truncated, padded).
        global_batch_size / micro_batch_size: as :class:`~lightning_megatron.datamodules.pretraining.BertDataModule`.
        seed: sampling, split and shuffling seed.
        lowercase: as :class:`~lightning_megatron.datamodules.finetune.LabelledTextDataModule`.
    """

    def __init__(self, vocab_file: str | None = None, *, packages: list[str] | None = None,
                 samples_per_class: int = 300, val_fraction: float = 0.2, max_seq_length: int = 64,
                 global_batch_size: int = 32, micro_batch_size: int = 16, seed: int = 1234,
                 lowercase: bool | None = None) -> None:
        super().__init__(vocab_file=vocab_file, lowercase=lowercase, max_seq_length=max_seq_length,
                         global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, seed=seed)
        self.save_hyperparameters()
        self.packages = tuple(packages or DEFAULT_PACKAGES)

    labels_argument = "packages"

    @property
    def num_classes(self) -> int:
        return len(self.packages)

    @property
    @override
    def label_names(self) -> list[str]:
        return list(self.packages)

    @override
    def read_splits(self) -> dict[str, list[Row]]:
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
            val += [(text, None, label) for text, label in rows[:n_val]]
            train += [(text, None, label) for text, label in rows[n_val:]]
        rng.shuffle(train)
        return {"train": train, "validation": val}
