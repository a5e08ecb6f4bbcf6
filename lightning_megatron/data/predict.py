"""What ``lightning-megatron predict`` reads: the test split, or a user's raw text / JSONL file, in full
global batches whatever the dataset size.

Every rank of a step must see a batch of ``micro_batch_size * num_microbatches`` samples (the microbatch
schedule and the pipeline shapes depend on it), so :class:`PredictBatchSampler` pads the last global
batch with the index ``-1``; :class:`IndexedSamples` turns it into a copy of sample 0 whose
``sample_index`` is ``-1``, which :class:`~lightning_megatron.callbacks.PredictionWriter` drops.

Decoders generate from prompts (:class:`PromptDataset`: the tokens of each text, unpadded). A batch of
them stacks as one tensor at one length only, so :class:`LengthGroupedBatchSampler` groups the prompts
by token count and fills full global batches from one group at a time, padded with ``-1 - j``: a copy
of the group's sample ``j`` (the same length), marked ``sample_index = -1``; such batches need no
padding inside a row (generation itself also takes left-padded batches of mixed lengths:
:func:`lightning_megatron.generation.generate`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_megatron.data.corpus import read_utf8_text, text_lines
from lightning_megatron.data.tokenizer import BertTokenizer

__all__ = ["TextPredictionDataset", "PromptDataset", "IndexedSamples", "PredictBatchSampler",
           "LengthGroupedBatchSampler", "SAMPLE_INDEX", "read_text_lines", "read_texts"]

SAMPLE_INDEX = "sample_index"
"""Batch key: the sample's index in the predict dataset (its place among the input file's texts), -1 for padding."""


class TextPredictionDataset(Dataset):
    """One sample per text: ``[CLS] text [SEP]`` padded to ``max_seq_length``; ``[MASK]`` in the text is
    the mask token. ``path``: a ``.jsonl`` file (the ``json_key`` field of each line) or any other
    text file (one text per non-empty line). ``cut_warning``: what to say when texts are longer than
    ``max_seq_length`` (their ends are cut), ``None`` when none is; the datamodule says it once, on rank 0."""

    def __init__(self, path: str | os.PathLike[str], tokenizer: BertTokenizer, max_seq_length: int,
                 json_key: str = "text") -> None:
        texts, self.lines = read_text_lines(path, json_key)
        self.texts, self.tokenizer, self.max_seq_length = texts, tokenizer, max_seq_length
        self.ids = tokenizer.tokenize_batch(texts)
        long = sum(len(ids) > max_seq_length - 2 for ids in self.ids)
        self.cut_warning = (f"{long} of the {len(texts)} texts of {str(path)!r} are longer than max_seq_length="
                            f"{max_seq_length} tokens with [CLS] and [SEP]: their ends are cut") if long else None

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


def read_texts(path: str | os.PathLike[str], json_key: str = "text") -> list[str]:
    """The texts of a ``predict_file`` (:func:`read_text_lines`)."""
    return read_text_lines(path, json_key)[0]


def read_text_lines(path: str | os.PathLike[str], json_key: str = "text") -> tuple[list[str], list[int]]:
    """``(texts, lines)``: the texts of a ``predict_file``, a ``.jsonl`` file (the ``json_key`` field of each
    line) or any other text file (one text per line), blank lines skipped, and the line of the file each
    comes from (1-based: what a prediction record's ``line`` says). Errors name the file (and the line, or
    the byte that is not UTF-8)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"predict_file {str(path)!r} does not exist")
    numbered = [(number, line) for number, line in
                enumerate(text_lines(read_utf8_text(path, f"predict_file {str(path)!r}")), 1) if line.strip()]
    if path.suffix == ".jsonl":
        texts = []
        for number, line in numbered:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"predict_file {str(path)!r} line {number} is not JSON ({error}): a .jsonl file "
                                 f"holds one JSON object per line") from None
            if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                raise ValueError(f"{str(path)!r} line {number}: no string field {json_key!r} (set "
                                 f"--data.predict_json_key to the field holding the text)")
            texts.append(record[json_key])
    else:
        texts = [line for _, line in numbered]
    if not texts:
        raise ValueError(f"predict_file {str(path)!r} holds no text")
    return texts, [number for number, _ in numbered]


class PromptDataset(Dataset):
    """One prompt per text of ``path`` (:func:`read_texts`): ``{"tokens": [n] int64}``, the text's tokens
    as ``tokenizer.tokenize`` gives them (no end-of-document token, no padding). A prompt of more than
    ``max_length`` tokens is refused (``None``: no limit)."""

    def __init__(self, path: str | os.PathLike[str], tokenizer: Any, json_key: str = "text",
                 max_length: int | None = None) -> None:
        self.texts, self.lines = read_text_lines(path, json_key)
        self.ids = [list(tokenizer.tokenize(text)) for text in self.texts]
        for number, text, ids in zip(self.lines, self.texts, self.ids):
            if not ids:
                raise ValueError(f"predict_file {str(path)!r} line {number}: the prompt ({text!r}) has no "
                                 f"tokens: give every prompt some text")
            if max_length is not None and len(ids) > max_length:
                raise ValueError(f"predict_file {str(path)!r} line {number}: the prompt has {len(ids)} tokens, more "
                                 f"than {max_length} (the data's seq_length): shorten it or raise --data.seq_length")

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.ids]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"tokens": torch.tensor(self.ids[index], dtype=torch.int64)}


class IndexedSamples(Dataset):
    """``dataset[i]`` plus ``sample_index = i``; a negative index ``-1 - j`` (padding) gives sample ``j``
    marked ``-1`` (``-1``: sample 0)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            return {**self.dataset[-1 - index], SAMPLE_INDEX: torch.tensor(-1, dtype=torch.int64)}
        return {**self.dataset[index], SAMPLE_INDEX: torch.tensor(index, dtype=torch.int64)}


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


class LengthGroupedBatchSampler:
    """Full global batches of prompts of one length: the samples grouped by ``lengths`` (shortest group
    first, each in index order), each group cut into global batches of ``G = local_batch_size *
    data_parallel_size`` and its last one padded with ``-1 - first`` (a copy of the group's first sample);
    this rank yields its contiguous ``local_batch_size`` slice of each."""

    def __init__(self, lengths: list[int], *, local_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int) -> None:
        if not lengths or local_batch_size < 1:
            raise ValueError(f"{len(lengths)} samples and local_batch_size={local_batch_size} must be positive")
        self.local_batch_size, self.rank = local_batch_size, data_parallel_rank
        self.global_batch_size = local_batch_size * data_parallel_size
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            groups.setdefault(n, []).append(i)
        self.batches = []
        for n in sorted(groups):
            group = groups[n]
            for start in range(0, len(group), self.global_batch_size):
                chunk = group[start:start + self.global_batch_size]
                self.batches.append(chunk + [-1 - group[0]] * (self.global_batch_size - len(chunk)))

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        first = self.rank * self.local_batch_size
        for batch in self.batches:
            yield batch[first:first + self.local_batch_size]
