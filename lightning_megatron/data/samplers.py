"""Batch samplers by consumed samples (Megatron's ``MegatronPretrainingSampler`` family).

One *global batch* is ``micro_batch_size * num_microbatches * data_parallel_size`` consecutive
sample indices. Each data-parallel rank takes its contiguous slice of ``micro_batch_size *
num_microbatches`` of them: every tensor- and pipeline-parallel rank of one DP replica gets the same
indices, the DP ranks together cover the global batch exactly once, and the strategy cuts the
local batch into ``num_microbatches`` micro-batches.

Iteration starts after ``consumed_samples``, so a run resumed with the number of samples consumed
so far (``global_step * global_batch_size`` when the batch size never changed) continues with the
next unseen sample, in the pass (epoch) that count falls in.

``len()`` is the number of steps in a whole pass (epoch), counting the ones consumed before a resume, and
:attr:`steps_taken_in_pass` those of the pass a resumed ``iter()`` skips, in this sampler's global batches.
Lightning counts the batches of an interrupted epoch itself, in the checkpoint's run's batches, and ends
the resumed epoch when its count reaches ``len()``: the datamodule sets that count to
:attr:`steps_taken_in_pass` (``PretrainingDataModule.train_dataloader``), so that a resume with another
global batch ends the epoch where the sampler's pass ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

__all__ = ["MegatronPretrainingRandomSampler", "MegatronPretrainingSampler", "evaluation_coverage"]


class _ConsumedSamplesSampler:
    def __init__(self, *, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, num_microbatches: int = 1) -> None:
        for name, value in (("total_samples", total_samples), ("micro_batch_size", micro_batch_size),
                            ("data_parallel_size", data_parallel_size), ("num_microbatches", num_microbatches)):
            if value < 1:
                raise ValueError(f"{name}={value} must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} must be in [0, data_parallel_size="
                             f"{data_parallel_size})")
        self.total_samples = total_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.num_microbatches = num_microbatches
        self.local_batch_size = micro_batch_size * num_microbatches
        """Samples this DP rank gets per step (all its micro-batches)."""
        self.global_batch_size = self.local_batch_size * data_parallel_size
        """Samples of one optimizer step over all DP ranks."""
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples} must be non-negative")
        self.consumed_samples = consumed_samples


class MegatronPretrainingSampler(_ConsumedSamplesSampler):
    """Sequential: global batch ``k`` is indices ``k*G .. (k+1)*G - 1`` and this rank yields its slice
    ``[k*G + r*L, k*G + (r+1)*L)`` (``G`` global, ``L`` local batch size). The first ``iter()``
    starts at ``consumed_samples``; later ones (the next epochs, or every evaluation) make a full
    pass from 0. An incomplete last global batch is dropped unless ``drop_last=False``, in which case
    it is split as evenly as possible over the DP ranks (for evaluation)."""

    def __init__(self, *, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, num_microbatches: int = 1,
                 drop_last: bool = True, pass_steps: int | None = None) -> None:
        super().__init__(total_samples=total_samples, consumed_samples=consumed_samples,
                         micro_batch_size=micro_batch_size, data_parallel_rank=data_parallel_rank,
                         data_parallel_size=data_parallel_size, num_microbatches=num_microbatches)
        self.drop_last = drop_last
        self.pass_steps = len(self) if pass_steps is None else max(1, min(len(self), pass_steps))
        """The steps of a pass: ``len()``, or fewer where the trainer reads fewer an epoch (``limit_train_batches``)."""
        # Where the first pass starts: ``consumed_samples`` in the pass it falls in (a pass reads whole global
        # batches); where the rest of that pass holds no whole global batch (a resume with a larger one), the next.
        first = consumed_samples % (self.pass_steps * self.global_batch_size) if self.pass_steps else 0
        self._resume_from = first if self._pass_end - first >= self.global_batch_size else 0

    @property
    def _pass_end(self) -> int:
        return self.total_samples if self.pass_steps == len(self) else self.pass_steps * self.global_batch_size

    def __len__(self) -> int:
        full, rest = divmod(self.total_samples, self.global_batch_size)
        return full + (0 if self.drop_last or rest == 0 else 1)

    @property
    def steps_taken_in_pass(self) -> int:
        """The steps of the pass that the next ``iter()`` does not make (consumed before a resume), in this sampler's
        global batches: :attr:`pass_steps` less the batches it yields to the pass's end."""
        left, batch = self._pass_end - self._resume_from, self.global_batch_size
        return self.pass_steps - (left // batch if self.drop_last else -(-left // batch))

    def __iter__(self) -> Iterator[list[int]]:
        first, self._resume_from = self._resume_from, 0
        start_local = self.data_parallel_rank * self.local_batch_size
        for start in range(first, self.total_samples, self.global_batch_size):
            end = start + self.global_batch_size
            if end <= self.total_samples:
                yield list(range(start + start_local, start + start_local + self.local_batch_size))
            elif not self.drop_last:
                tail = torch.arange(start, self.total_samples).tensor_split(self.data_parallel_size)
                yield tail[self.data_parallel_rank].tolist()


class MegatronPretrainingRandomSampler(_ConsumedSamplesSampler):
    """Shuffled per epoch, seeded: each epoch covers ``total_samples`` rounded down to whole global batches
    (``E`` samples), cut into ``buckets`` buckets of ``E / buckets``; one permutation drawn from ``seed + epoch``
    orders every bucket, and global batch ``j`` of the epoch takes the next ``G / buckets`` samples of each bucket in
    bucket order. DP rank ``r`` reads its contiguous slice of it, as from the sequential sampler. With ``buckets`` =
    the DP size (the default) rank ``r`` walks bucket ``r`` alone: Megatron's ``MegatronPretrainingRandomSampler``.
    A run keeps its first DP size as ``buckets`` (the datamodule records it): resumed at another DP size, it reads
    the global batches it would have read (:attr:`order_key`). Iteration resumes mid-epoch from ``consumed_samples``
    and advances it, so the next ``iter()`` continues with the next epoch. ``run_consumed_samples``: the run's own
    count (the datamodule's: the optimizer steps taken), read at each ``iter()`` instead. DataLoader workers and
    Lightning's fetcher draw batches ahead of the steps, so where an epoch stops before the sampler's end
    (``limit_train_batches``) the count advanced by drawing ran ahead: the next epoch skipped the batches drawn and
    never trained on (as many as were prefetched), and a resumed run, counting steps, read them."""

    def __init__(self, *, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, num_microbatches: int = 1, seed: int = 1234,
                 buckets: int | None = None, run_consumed_samples: Callable[[], int] | None = None,
                 pass_steps: int | None = None) -> None:
        super().__init__(total_samples=total_samples, consumed_samples=consumed_samples,
                         micro_batch_size=micro_batch_size, data_parallel_rank=data_parallel_rank,
                         data_parallel_size=data_parallel_size, num_microbatches=num_microbatches)
        if consumed_samples % self.global_batch_size:
            raise ValueError(f"consumed_samples={consumed_samples} must be a multiple of the global batch size "
                             f"{self.global_batch_size} = micro_batch_size {micro_batch_size} * num_microbatches "
                             f"{num_microbatches} * data_parallel_size {data_parallel_size}")
        self.buckets = data_parallel_size if buckets is None else buckets
        if self.buckets < 1 or self.global_batch_size % self.buckets:
            raise ValueError(f"buckets={self.buckets} must divide the global batch size {self.global_batch_size} (the "
                             f"run's first data-parallel size does, with the same global batch)")
        self.seed = seed
        self.run_consumed_samples = run_consumed_samples
        self.epoch_samples = total_samples - total_samples % self.global_batch_size
        if self.epoch_samples == 0:
            raise ValueError(f"total_samples={total_samples} is less than one global batch "
                             f"({self.global_batch_size}); use more samples or a smaller batch")
        self.pass_steps = len(self) if pass_steps is None else max(1, min(len(self), pass_steps))
        """The trainer's steps an epoch: ``len()``, or fewer (``limit_train_batches``)."""

    @property
    def order_key(self) -> tuple[int, int, int]:
        """``(seed, samples per epoch, buckets)``: what the order of the samples depends on (not the DP size)."""
        return (self.seed, self.epoch_samples, self.buckets)

    def __len__(self) -> int:
        return self.epoch_samples // self.global_batch_size

    @property
    def steps_taken_in_pass(self) -> int | None:
        """The steps of the epoch that the next ``iter()`` does not make (consumed before it); None where the trainer
        reads fewer steps an epoch (``pass_steps``, from ``limit_train_batches``): its epochs are then runs of
        ``pass_steps`` steps along the sampler's, and its own count of them is the one to keep."""
        if self.pass_steps < len(self):
            return None
        return self.consumed_samples % self.epoch_samples // self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        if self.run_consumed_samples is not None:
            self.consumed_samples = self.run_consumed_samples()
        epoch, done = divmod(self.consumed_samples, self.epoch_samples)
        bucket_size = self.epoch_samples // self.buckets
        per_bucket = self.global_batch_size // self.buckets  # what one global batch takes of each bucket
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(bucket_size, generator=generator)
        mine = torch.arange(self.data_parallel_rank * self.local_batch_size,
                            (self.data_parallel_rank + 1) * self.local_batch_size)  # positions in a global batch
        bucket, within = mine // per_bucket, mine % per_bucket
        for step in range(done // self.global_batch_size, len(self)):
            self.consumed_samples += self.global_batch_size
            yield (order[step * per_bucket + within] + bucket * bucket_size).tolist()


def evaluation_coverage(split: str, samples: int, global_batch: int, limit: int | float | None, *,
                        padded: bool, step: int = 1) -> tuple[str, bool] | None:
    """What an evaluation of ``split`` (``samples`` samples, in global batches of ``global_batch``) scores under
    Lightning's ``limit_val_batches`` / ``limit_test_batches`` = ``limit``, as ``(message, whether it is a
    warning)``; None when it scores the whole split. ``padded``: the last global batch is completed with samples
    without loss (every sample scored), else only whole global batches are read (Megatron-LM's evaluation) and
    the samples past the last are not; ``step``: a global batch must be a multiple of it (micro batch x DP), for
    the one suggested. A limit below the batches is said as information, the samples left unread as a warning."""
    whole, tail = divmod(samples, global_batch)
    batches = whole + (1 if padded and tail else 0)
    scored = batches if limit is None else min(batches, int(limit * batches) if isinstance(limit, float)
                                               else int(limit))
    if 0 < scored < batches:  # (0: no evaluation)
        read = min(samples, scored * global_batch)
        return (f"the {split} split: limit_{'val' if split != 'test' else 'test'}_batches={limit} scores {scored} of "
                f"its {batches} global batches of {global_batch} ({read} of {samples} samples)"), False
    asked_all = limit is None or (limit >= 1.0 if isinstance(limit, float) else limit > batches)
    if padded or not tail or not whole or not asked_all:
        return None
    fits = [g for g in range(global_batch, 1, -1) if g % step == 0 and samples % g == 0]
    return (f"the {split} split's {samples} samples are read in whole global batches of {global_batch}, as "
            f"Megatron-LM's evaluation reads them: {whole * global_batch} are scored and the last {tail} are not; a "
            f"global batch that divides {samples} scores them all"
            + (f" (--data.global_batch_size {fits[0]})" if fits else "")), True
