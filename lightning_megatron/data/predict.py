"""What ``lightning-megatron predict`` reads: the test split, or a user's raw text / JSONL file, in full
global batches whatever the dataset size.

Every rank of a step must see a batch of ``micro_batch_size * num_microbatches`` samples (the microbatch
schedule and the pipeline shapes depend on it), so :class:`PredictBatchSampler` pads the last global
batch with the index ``-1``; :class:`IndexedSamples` turns it into a copy of sample 0 whose
``sample_index`` is ``-1``, which :class:`~lightning_megatron.callbacks.PredictionWriter` drops.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_megatron.data.tokenizer import BertTokenizer

__all__ = ["TextPredictionDataset", "IndexedSamples", "PredictBatchSampler", "SAMPLE_INDEX"]

SAMPLE_INDEX = "sample_index"
"""Batch key: the sample's index in the predict dataset (line of the input file), -1 for padding."""


class TextPredictionDataset(Dataset):
    """One sample per text: ``[CLS] text [SEP]`` padded to ``max_seq_length``; ``[MASK]`` in the text is
    the mask token. ``path``: a ``.jsonl`` file (the ``json_key`` field of each line) or any other
    text file (one text per non-empty line)."""

    def __init__(self, path: str | os.PathLike[str], tokenizer: BertTokenizer, max_seq_length: int,
                 json_key: str = "text") -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"predict_file {str(path)!r} does not exist")
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if path.suffix == ".jsonl":
            texts = []
            for number, line in enumerate(lines, 1):
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                    raise ValueError(f"{str(path)!r} line {number}: no string field {json_key!r} (set "
                                     f"--data.predict_json_key to the field holding the text)")
                texts.append(record[json_key])
        else:
            texts = lines
        if not texts:
            raise ValueError(f"predict_file {str(path)!r} holds no text")
        self.texts, self.tokenizer, self.max_seq_length = texts, tokenizer, max_seq_length
        self.ids = tokenizer.tokenize_batch(texts)
        long = sum(len(ids) > max_seq_length - 2 for ids in self.ids)
        if long:
            warnings.warn(f"{long} of the {len(texts)} texts of {str(path)!r} are longer than max_seq_length="
                          f"{max_seq_length} tokens with [CLS] and [SEP]: their ends are cut", UserWarning, stacklevel=2)

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        t = self.tokenizer
        ids = [t.cls_id, *self.ids[index][: self.max_seq_length - 2], t.sep_id]
        tokens = torch.full((self.max_seq_length,), t.pad_id, dtype=torch.int64)
        tokens[: len(ids)] = torch.tensor(ids)
        mask = torch.zeros(self.max_seq_length, dtype=torch.int64)
        mask[: len(ids)] = 1
        return {"tokens": tokens, "token_types": torch.zeros_like(tokens), "attention_mask": mask}


class IndexedSamples(Dataset):
    """``dataset[i]`` plus ``sample_index = i``; index ``-1`` (padding) gives sample 0 marked ``-1``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.dataset[max(index, 0)], SAMPLE_INDEX: torch.tensor(index, dtype=torch.int64)}


class PredictBatchSampler:
    """Global batch ``k`` is indices ``k*G .. (k+1)*G - 1`` (``G = local_batch_size * data_parallel_size``),
    this rank yields its contiguous ``local_batch_size`` slice; the last global batch is padded with -1."""

    def __init__(self, *, total_samples: int, local_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int) -> None:
        if total_samples < 1 or local_batch_size < 1:
            raise ValueError(f"total_samples={total_samples} and local_batch_size={local_batch_size} must be positive")
        self.total_samples, self.local_batch_size = total_samples, local_batch_size
        self.rank, self.global_batch_size = data_parallel_rank, local_batch_size * data_parallel_size

    def __len__(self) -> int:
        return -(-self.total_samples // self.global_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for start in range(0, self.total_samples, self.global_batch_size):
            first = start + self.rank * self.local_batch_size
            yield [i if i < self.total_samples else -1 for i in range(first, first + self.local_batch_size)]
