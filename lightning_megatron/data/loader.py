"""The loader of the pretraining and fine-tuning datamodules, and how many workers it gets.

:class:`MegatronDataLoader` is a plain ``DataLoader`` whose position is its batch sampler's
``consumed_samples`` (:mod:`~lightning_megatron.data.samplers`); :func:`default_num_workers` is the
worker count when a datamodule's ``num_workers`` is None; :func:`trainer_loader` builds the loader a datamodule
hands its trainer, and :func:`count_the_resumed_pass` makes a resumed fit's count of its epoch the sampler's. None
imports Lightning.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import DataLoader

__all__ = ["MegatronDataLoader", "count_the_resumed_pass", "default_num_workers", "epoch_steps",
           "trainer_loader"]


def default_num_workers(processes_per_node: int = 1) -> int:
    """DataLoader workers per training process: ``min(4, cores per process - 1)`` when a process has
    4 cores or more, else 0 (on 2-3 cores a worker only competes with the training process)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    share = cores // max(1, processes_per_node)
    return min(4, share - 1) if share >= 4 else 0


class MegatronDataLoader(DataLoader):
    """A DataLoader whose position is its batch sampler's ``consumed_samples``, which the datamodule
    sets from its own checkpointed state when it builds the loader. ``state_dict`` /
    ``load_state_dict`` exist so that Lightning knows a mid-epoch resume continues where it stopped
    (and does not warn that the loader is not resumable); they carry nothing themselves.

    It draws its iterators' base seed (the workers' seeds) from a generator of its own (``generator``), not
    torch's global one, which dropout on a CPU draws from: an evaluation or a resume (each a new iterator)
    does not move the training's dropout stream. The datasets draw no random numbers of their own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("generator") is None:
            kwargs["generator"] = torch.Generator()
        super().__init__(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def trainer_loader(dataset: Any, batch_sampler: Any, trainer: Any, num_workers: int | None) -> MegatronDataLoader:
    """The datamodules' loader of ``dataset`` in ``batch_sampler``'s order for ``trainer`` (None: none attached):
    ``num_workers`` workers (None: :func:`default_num_workers` for the trainer's processes on this node), kept
    alive between epochs, and pinned memory when the strategy's device is not the CPU."""
    devices = int(getattr(trainer, "num_devices", 1) or 1) if trainer is not None else 1
    workers = num_workers if num_workers is not None else default_num_workers(devices)
    root = getattr(getattr(trainer, "strategy", None), "root_device", None) if trainer is not None else None
    pin = root is not None and getattr(root, "type", "cpu") != "cpu"
    return MegatronDataLoader(dataset, batch_sampler=batch_sampler, num_workers=workers,
                              persistent_workers=workers > 0, pin_memory=pin)


def count_the_resumed_pass(trainer: Any, sampler: Any) -> Any:
    """A resumed fit: Lightning's count of the interrupted epoch's batches made the sampler's ``steps_taken_in_pass``.
    Lightning restores the count in the checkpoint's run's global batches and ends the epoch when it reaches
    ``len(sampler)``: resumed with a larger global batch (6 steps of 4 samples restored, 10 steps of 8 a pass), it
    ended the pass 2 steps early and read the next from its start, some samples twice and the pass's last ones not
    at all, unsaid; with a smaller one its count ended the epoch late. Every counter of the epoch's batch progress
    moves by the same amount, so Lightning's own restart arithmetic (a checkpoint saved at a batch's end or after
    it) stays as it was. A sampler that cannot say (None) leaves Lightning's count. Returns ``sampler``."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    taken = sampler.steps_taken_in_pass
    if loop is not None and getattr(trainer.fit_loop, "restarting", False) and taken is not None:
        current = loop.batch_progress.current
        shift = taken - current.ready
        current.ready, current.started = current.ready + shift, current.started + shift
        current.processed, current.completed = current.processed + shift, current.completed + shift
    return sampler


def epoch_steps(trainer: Any, steps: int) -> int | None:
    """The training steps of an epoch of ``steps`` global batches under ``trainer``'s ``limit_train_batches`` (an
    int caps them, a fraction scales them down, as Lightning reads it); None without a trainer."""
    limit = getattr(trainer, "limit_train_batches", None) if trainer is not None else None
    if limit is None:
        return None
    return min(steps, limit) if isinstance(limit, int) else int(steps * float(limit))
