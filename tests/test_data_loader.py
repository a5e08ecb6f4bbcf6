"""DataLoader defaults: workers where cores allow, pinned memory on accelerators, datasets that
travel to worker processes by reopening their memory maps (never copying them)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import torch
from data_testing import data_cache_dir, default_corpus_prefix, tokenizer

from lightning_megatron.data import loader as loader_module
from lightning_megatron.data.bert_dataset import BertDataset
from lightning_megatron.data.indexed_dataset import IndexedDataset
from lightning_megatron.data.loader import default_num_workers
from lightning_megatron.datamodules.pretraining import BertDataModule


def test_default_num_workers(monkeypatch):
    for cores, processes, expected in ((2, 1, 0), (2, 2, 0), (3, 1, 0), (4, 1, 3), (8, 1, 4), (96, 8, 4),
                                       (16, 8, 0), (32, 8, 3)):
        monkeypatch.setattr(loader_module.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert default_num_workers(processes) == expected, (cores, processes)


def test_dataset_pickles_without_its_samples_mapping():
    prefix, _ = default_corpus_prefix(128)
    ds = BertDataset(IndexedDataset(prefix), tokenizer(), max_seq_length=128, num_samples=200_000)
    assert isinstance(ds.samples_mapping, np.memmap)
    blob = pickle.dumps(ds)
    assert len(blob) < ds.samples_mapping.nbytes // 4  # the mapping is reopened, not copied
    copy = pickle.loads(blob)
    assert isinstance(copy.samples_mapping, np.memmap)
    for i in (0, 199_999):
        assert all(torch.equal(copy[i][k], ds[i][k]) for k in ds[i])


def _trainer(device):
    state = SimpleNamespace(dp_rank=0, dp_size=1)
    strategy = SimpleNamespace(parallel_state=state, barrier=lambda name=None: None, root_device=device)
    return SimpleNamespace(strategy=strategy, global_step=0, max_steps=-1, local_rank=0, num_devices=1)


def test_workers_give_the_same_batches_and_memory_is_pinned_only_on_accelerators():
    def loader(num_workers, device=torch.device("cpu")):
        dm = BertDataModule(max_seq_length=64, global_batch_size=8, micro_batch_size=4, num_workers=num_workers,
                            cache_dir=str(data_cache_dir()))
        dm.trainer = _trainer(device)
        dm.setup("fit")
        return dm.train_dataloader()

    in_process, workers = loader(0), loader(1)
    assert workers.num_workers == 1 and workers.persistent_workers and not workers.pin_memory
    for a, b, _ in zip(in_process, workers, range(3)):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert loader(0, torch.device("meta")).pin_memory
