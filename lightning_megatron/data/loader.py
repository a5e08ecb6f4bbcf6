"""The loader of the pretraining and fine-tuning datamodules, and how many workers it gets.

:class:`MegatronDataLoader` is a plain ``DataLoader`` whose position is its batch sampler's
``consumed_samples`` (:mod:`~lightning_megatron.data.samplers`); :func:`default_num_workers` is the
worker count when a datamodule's ``num_workers`` is None. Neither imports Lightning.
"""

from __future__ import annotations

import os
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["MegatronDataLoader", "default_num_workers"]


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
    (and does not warn that the loader is not resumable); they carry nothing themselves."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
