"""Shared pieces of the Trainer-level parity tests: a deterministic BERT batch source, a tiny model
config, a Trainer factory for spawned ranks, gathering of sharded parameters to full size, and the
comparison of final parameters with a reference's (:func:`assert_final_params_close`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from dist_utils import accelerator
from lightning_megatron.tensor_parallel.param_facts import param_facts

VOCAB = 1000
SEQ = 16
MASKED_PER_SAMPLE = 3  # constant: the mean over microbatch means equals the token mean for any grouping

TINY_CONFIG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=VOCAB,
                   max_sequence_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=128)
"""The tiny BERT's BertConfig fields."""
TINY_OPTIONS = dict(lr=1e-3, weight_decay=0.01)
"""The tiny BERT's other BertLightningModule arguments."""
TINY_MODEL = dict(config=TINY_CONFIG, **TINY_OPTIONS)
"""``BertLightningModule(**TINY_MODEL)`` (the config as a mapping of its fields, as a recipe gives it)."""


class SyntheticBertDataset(Dataset):
    """Deterministic BERT samples from (seed, index): padding, 3 masked tokens, a binary label."""

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        self.num_samples, self.seed = num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        with torch.device("cpu"):  # samples are made on the host, as a DataLoader's are (any test device)
            return self._sample(index)

    def _sample(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + index)
        length = int(torch.randint(SEQ // 2, SEQ + 1, (1,), generator=g))
        tokens = torch.randint(5, VOCAB, (SEQ,), generator=g)
        attention_mask = (torch.arange(SEQ) < length).long()
        tokens = tokens * attention_mask
        token_types = (torch.arange(SEQ) >= length // 2).long() * attention_mask
        positions = torch.randperm(length - 1, generator=g)[:MASKED_PER_SAMPLE] + 1
        lm_labels = torch.full((SEQ,), -100)
        lm_labels[positions] = tokens[positions]
        tokens[positions] = 3  # [MASK]
        loss_mask = torch.zeros(SEQ)
        loss_mask[positions] = 1.0
        return {"tokens": tokens, "token_types": token_types, "attention_mask": attention_mask,
                "lm_labels": lm_labels, "loss_mask": loss_mask,
                "binary_labels": torch.randint(0, 2, (), generator=g)}


def dataloader(per_rank_batch: int, dp_size: int, dp_rank: int, num_samples: int = 512,
               num_workers: int = 0) -> DataLoader:
    """Per-DP-rank batches of a global batch of ``per_rank_batch * dp_size`` samples, in order."""
    ds = SyntheticBertDataset(num_samples)
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    return DataLoader(ds, batch_size=per_rank_batch, sampler=sampler, drop_last=True, num_workers=num_workers,
                      persistent_workers=num_workers > 0)


class LossRecorder:
    """A Lightning callback recording the logged training loss of every step."""

    def __new__(cls, *args: Any, **kwargs: Any):  # built lazily so importing this module skips Lightning
        from lightning.pytorch import Callback

        class _Recorder(Callback):
            def __init__(self) -> None:
                self.losses: list[float] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                self.losses.append(float(outputs["loss"]))

        return _Recorder()


def error_of(fn: Any) -> str:
    """``"<ExceptionType>: <message>"`` of what ``fn()`` raises, ``"no error"`` when it returns (a rank's outcome,
    returned to the test as a string)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def make_trainer(strategy: Any, world_size: int, max_steps: int, callbacks: list | None = None, **kwargs: Any):
    from lightning.pytorch import Trainer

    defaults = dict(accelerator=accelerator(), devices=world_size, strategy=strategy, max_steps=max_steps, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False)
    defaults.update(kwargs)
    return Trainer(callbacks=callbacks or [], **defaults)


def local_shards(module: Any) -> dict[str, tuple[torch.Tensor, int | None]]:
    """name -> (tensor, partition dim if TP-sharded) of this rank, under global names."""
    ps = module.parallel_state
    out = {}
    for name, p in module.sharded_named_parameters():
        facts = param_facts(p)
        if facts.shared_embedding and not ps.is_pipeline_first_stage():
            continue
        dim = facts.partition_dim % p.dim() if facts.tensor_model_parallel else None
        out[name] = (p.detach().clone(), dim)
    return out


def full_params(per_rank: list[dict[str, Any]], tp: int, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Combine the ranks' shards (DP rank 0 of every stage) into full, unpadded tensors."""
    merged: dict[str, list[tuple[int, torch.Tensor, int | None]]] = {}
    for r in per_rank:
        if r["dp_rank"] != 0:
            continue
        for name, (t, dim) in r["shards"].items():
            merged.setdefault(name, []).append((r["tp_rank"], t, dim))
    full = {}
    for name, parts in merged.items():
        parts.sort(key=lambda x: x[0])
        dim = parts[0][2]
        t = torch.cat([p[1] for p in parts], dim=dim) if dim is not None and len(parts) > 1 else parts[0][1]
        if "word_embeddings" in name or name.startswith("output_layer"):
            t = t.narrow(0, 0, vocab)
        full[name] = t
    return full


def consumed_samples_loader(trainer: Any, global_batch: int, micro: int, dp_size: int, dp_rank: int,
                            num_samples: int = 512, consumed: int | None = None, seed: int = 0):
    """A loader that starts at ``trainer.global_step * global_batch`` (Megatron's resume rule)."""
    from lightning_megatron.data.loader import MegatronDataLoader
    from lightning_megatron.data.samplers import MegatronPretrainingSampler

    per_rank = global_batch // dp_size
    sampler = MegatronPretrainingSampler(
        total_samples=num_samples, consumed_samples=consumed if consumed is not None else trainer.global_step * global_batch,
        micro_batch_size=micro, data_parallel_rank=dp_rank, data_parallel_size=dp_size,
        num_microbatches=per_rank // micro)
    return MegatronDataLoader(SyntheticBertDataset(num_samples, seed), batch_sampler=sampler)


def synthetic_datamodule(global_batch: int, micro: int, dp_size: int, dp_rank: int, val_samples: int = 64):
    """A LightningDataModule over SyntheticBertDataset whose train loader resumes by consumed samples."""
    from lightning.pytorch import LightningDataModule

    class _DM(LightningDataModule):
        micro_batch_size = micro
        global_batch_size = global_batch

        def train_dataloader(self):
            return consumed_samples_loader(self.trainer, global_batch, micro, dp_size, dp_rank)

        def val_dataloader(self):
            return consumed_samples_loader(self.trainer, global_batch, micro, dp_size, dp_rank,
                                           num_samples=val_samples, consumed=0, seed=1)

    return _DM()


def assert_final_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                              init: dict[str, torch.Tensor], rtol: float | None = None) -> None:
    """Final parameters ``got`` against the reference's ``want``, both trained from ``init``: every
    tensor within ``rtol`` (default ``check.Tolerances().param_rtol``) of the reference's update, the
    one rule of every final-parameter comparison (``lightning_megatron.check.parity.update_error``,
    which ``lightning-megatron check`` applies too; why not element by element: its docstring)."""
    from lightning_megatron.check.parity import Tolerances, update_error

    tol = Tolerances()
    rtol = tol.param_rtol if rtol is None else rtol
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    errs = update_error(got, want, init, tol.param_floor)
    bad = {name: f"{e:.2e}" for name, e in errs.items() if not e <= rtol}
    assert not bad, f"final parameters differ from the reference by more than {rtol:g} of its update (rms): {bad}"
