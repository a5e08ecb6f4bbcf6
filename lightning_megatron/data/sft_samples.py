"""Encoded chats (:data:`~lightning_megatron.data.chat.Example`: ids and their loss mask) as training samples,
without Lightning: truncation, packing, the datasets and the training sample order.

A sample holds ``seq_length`` input tokens: an example of ``n <= seq_length + 1`` tokens gives
``tokens = ids[:-1]``, ``labels = ids[1:]``, ``loss_mask = mask[1:]``. :func:`fit_examples` cuts or drops
longer examples; :func:`first_fit` packs whole examples into samples (:class:`SFTSamples`), and
:class:`EpochShuffledBatchSampler` orders the training samples: a new seeded shuffle every epoch, the
position in that stream given by the consumed-samples count (exact resume).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_megatron.data.chat import Example

__all__ = ["EncodeStats", "EpochShuffledBatchSampler", "PromptSamples", "SFTSamples", "first_fit", "fit_examples",
           "group_examples"]


# ------------------------------------------------------------------ lengths and packing


@dataclass
class EncodeStats:
    """What :func:`fit_examples` did to the examples of a split."""

    examples: int = 0
    """Examples kept."""
    truncated: int = 0
    """Kept, cut to ``seq_length + 1`` tokens (some targets left)."""
    dropped: int = 0
    """Left out: longer than ``seq_length + 1`` tokens and no target left after the cut (or ``overlong="drop"``)."""
    tokens: int = 0
    targets: int = 0
    """Tokens with loss of the kept examples."""
    dropped_where: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.examples} examples ({self.truncated} truncated), {self.dropped} dropped, {self.tokens} "
                f"tokens of which {self.targets} targets")

    def overlong_line(self, seq_length: int, overlong: Literal["truncate", "drop", "error"]) -> str | None:
        """What :func:`fit_examples` did to the examples longer than ``seq_length + 1`` tokens, or None (none was)."""
        if not self.truncated and not self.dropped:
            return None
        total, fit = self.examples + self.dropped, f"seq_length + 1 = {seq_length + 1} tokens"
        first = f" (first: {', '.join(self.dropped_where[:3])})"
        if overlong == "drop":
            return f"{self.dropped} of {total} examples left out, longer than {fit}{first}"
        line = f"{self.truncated} of {total} examples cut to {fit}"
        return line + (f"; {self.dropped} left out, no target left after the cut{first}" if self.dropped else "")


def fit_examples(examples: Sequence[Example], wheres: Sequence[str], seq_length: int,
                 overlong: Literal["truncate", "drop", "error"]) -> tuple[list[Example], EncodeStats]:
    """The examples that fit a sample of ``seq_length`` inputs (``seq_length + 1`` tokens). Longer ones:
    ``truncate`` keeps their first ``seq_length + 1`` tokens, dropping those left without a target;
    ``drop`` leaves them out; ``error`` refuses the first, naming it. An example without a target at all
    (``mask[1:]`` all false) is refused."""
    kept, stats = [], EncodeStats()
    for (ids, mask), where in zip(examples, wheres):
        if not mask[1:].any():
            raise ValueError(f"{where}: no assistant token to learn (the template rendered none of the assistant's "
                             f"text after the first token)")
        if len(ids) > seq_length + 1:
            if overlong == "error":
                raise ValueError(f"{where} has {len(ids)} tokens, more than seq_length + 1 = {seq_length + 1}: raise "
                                 f"seq_length or choose overlong='truncate' / 'drop'")
            ids, mask = ids[: seq_length + 1], mask[: seq_length + 1]
            if overlong == "drop" or not mask[1:].any():
                stats.dropped += 1
                stats.dropped_where.append(where)
                continue
            stats.truncated += 1
        kept.append((ids, mask))
        stats.examples += 1
        stats.tokens += len(ids)
        stats.targets += int(mask[1:].sum())
    return kept, stats


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Greedy first fit: each item in order goes to the first bin with room (a new one when none has);
    a max-tree over the bins' room finds it in O(log n). Returns the item indices of each bin."""
    if any(not 0 < n <= capacity for n in lengths):
        raise ValueError(f"every length must be in [1, {capacity}]")
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    room = [capacity] * (2 * size)  # room[size + b]: room left in bin b (unopened: capacity); node: max of its two
    bins: list[list[int]] = []
    for item, n in enumerate(lengths):
        node = 1
        while node < size:  # descend to the leftmost leaf with room >= n
            node = 2 * node if room[2 * node] >= n else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(item)
        room[node] -= n
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


class SFTSamples(Dataset):
    """Samples of ``seq_length`` tokens, each from a group of examples (one, or several packed):
    ``tokens``, ``labels`` int64 and ``loss_mask`` float32 [s], right-padded (``pad_id``, no loss); packed
    ones also ``position_ids`` (restarting at 0 per example) and ``document_ids`` (the example's place in
    the sample; the padding one more), so that attention stays within an example. A negative index
    ``-1 - j`` gives sample ``j`` without any loss (evaluation's padding to full global batches)."""

    def __init__(self, examples: Sequence[Example], groups: Sequence[Sequence[int]], *, seq_length: int,
                 pad_id: int, packed: bool) -> None:
        self.examples, self.groups = list(examples), [list(g) for g in groups]
        self.seq_length, self.pad_id, self.packed = seq_length, pad_id, packed

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        group = self.groups[index if index >= 0 else -1 - index]
        s = self.seq_length
        tokens = np.full(s, self.pad_id, dtype=np.int64)
        labels = np.full(s, self.pad_id, dtype=np.int64)
        loss_mask = np.zeros(s, dtype=np.float32)
        positions, documents = np.zeros(s, dtype=np.int64), np.full(s, len(group), dtype=np.int64)
        at = 0
        for doc, i in enumerate(group):
            ids, mask = self.examples[i]
            n = len(ids) - 1
            tokens[at:at + n], labels[at:at + n], loss_mask[at:at + n] = ids[:-1], ids[1:], mask[1:]
            positions[at:at + n], documents[at:at + n] = np.arange(n), doc
            at += n
        positions[at:] = np.arange(s - at)
        if index < 0:
            loss_mask[:] = 0.0
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
        if self.packed:
            sample |= {"position_ids": positions, "document_ids": documents}
        return {k: torch.from_numpy(v) for k, v in sample.items()}


def group_examples(examples: Sequence[Example], seq_length: int, pack: bool) -> list[list[int]]:
    """One example per sample, or (``pack``) :func:`first_fit` of their ``n - 1`` input tokens."""
    if not pack:
        return [[i] for i in range(len(examples))]
    return first_fit([len(ids) - 1 for ids, _ in examples], seq_length)


class PromptSamples(Dataset):
    """Prompts to continue: ``{"tokens": [n] int64}`` each (unpadded), their ``texts``, ``lengths`` and ``lines``
    (of the file each comes from, 1-based)."""

    def __init__(self, texts: list[str], ids: list[list[int]], lines: list[int]) -> None:
        self.texts, self.ids, self.lines = texts, ids, lines

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> list[int]:
        return [len(i) for i in self.ids]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"tokens": torch.from_numpy(np.asarray(self.ids[index], dtype=np.int64))}


# ------------------------------------------------------------------ the training order


class EpochShuffledBatchSampler:
    """Training batches from a stream of sample indices: epoch ``e`` is a permutation of the ``N`` samples
    drawn from ``seed + e``, the epochs one after another. Global batch ``k`` is the stream's positions
    ``[k G, (k + 1) G)`` (``G = local_batch_size * data_parallel_size``, whatever the DP size: a resumed run
    may change it) and DP rank ``r`` takes its contiguous ``local_batch_size`` of them.

    Each ``iter()`` starts at the position ``consumed_samples()`` gives then (the datamodule's count:
    restored from the checkpoint plus a global batch per optimizer step since) and yields ``len()`` =
    ``N // G`` batches, one epoch's worth (Lightning stops a resumed epoch after the batches it lacks).
    """

    def __init__(self, *, num_samples: int, local_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, seed: int, consumed_samples: Callable[[], int]) -> None:
        self.num_samples, self.local_batch_size, self.seed = num_samples, local_batch_size, seed
        self.rank, self.global_batch_size = data_parallel_rank, local_batch_size * data_parallel_size
        if num_samples < self.global_batch_size:
            raise ValueError(f"the training split has {num_samples} samples, fewer than one global batch "
                             f"({self.global_batch_size}): lower global_batch_size, or give more data")
        self.consumed_samples = consumed_samples
        self._epoch: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.num_samples // self.global_batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, np.random.default_rng(self.seed + epoch).permutation(self.num_samples))
        return self._epoch[1]

    def indices(self, start: int, count: int) -> list[int]:
        """The sample indices at stream positions ``[start, start + count)``."""
        out: list[int] = []
        while count > 0:
            epoch, at = divmod(start, self.num_samples)
            take = min(count, self.num_samples - at)
            out += self._order(epoch)[at:at + take].tolist()
            start, count = start + take, count - take
        return out

    def __iter__(self) -> Iterator[list[int]]:
        position = self.consumed_samples()
        for _ in range(len(self)):
            yield self.indices(position + self.rank * self.local_batch_size, self.local_batch_size)
            position += self.global_batch_size
