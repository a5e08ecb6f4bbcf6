"""Evaluation metrics of any model family: torchmetrics synchronised over the data-parallel group only.

Every validation/test microbatch updates the metrics of its stage on the last pipeline stage; at the
end of the epoch :func:`log_epoch_metrics` computes them (torchmetrics gathers the states over the
``process_group`` given by :func:`sync_args`: the data-parallel group, so the TP ranks of a replica,
which hold the same predictions, are not counted twice), broadcasts the values along the pipeline and
logs them on every rank. The result is the metric of the whole split, equal at every TP x PP x DP layout.

The families' own collections: ``models/bert/metrics.py`` (masked LM, fine-tuning), GPT's perplexity
(``models/gpt/module.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import MeanMetric, Metric, MetricCollection

from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.tensor_parallel.mappings import all_reduce

__all__ = ["EVAL_STAGES", "Mean", "Perplexity", "eval_stage", "float32_states", "log_epoch_metrics", "on_device",
           "sync_args"]

EVAL_STAGES = ("val", "test")


def sync_args(ps: ParallelState) -> dict[str, Any]:
    """torchmetrics arguments: state gathered over the data-parallel group (no gather for one replica)."""
    # No gather at all for one replica; otherwise over the data-parallel group only.
    return {"process_group": ps.dp_group, "sync_on_compute": ps.dp_size > 1}


@contextlib.contextmanager
def float32_states() -> Iterator[None]:
    """Build metrics inside: their float states fp32 whatever the default dtype. Lightning builds the model
    (``configure_model``, where the families build their metrics) with the default dtype set to a 16-bit run's,
    and running sums in bf16 / fp16 gave a perplexity 1-7% off, or inf."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class Mean(MeanMetric):
    """A weighted mean whose non-finite values stay in it: torchmetrics' default (``nan_strategy="warn"``) dropped
    a nan microbatch loss with a warning, so a split's perplexity was the other microbatches' while its logged loss
    was nan, and its check read the device at every update (a host synchronisation per evaluation microbatch on a
    GPU); its ``nan_strategy="disable"`` drops the weights instead (torchmetrics 1.9). A microbatch without counted
    tokens adds 0 with weight 0 (the losses' ``clamp``)."""

    def update(self, value: torch.Tensor | float, weight: torch.Tensor | float | None = None) -> None:
        value = torch.as_tensor(value, dtype=self.dtype, device=self.device)
        weight = torch.ones_like(value) if weight is None else torch.as_tensor(weight, dtype=self.dtype,
                                                                                 device=self.device)
        self.mean_value += (value * weight.broadcast_to(value.shape)).sum()
        self.weight += weight.broadcast_to(value.shape).sum()


class Perplexity(Mean):
    """exp of the weighted mean of per-token cross entropies (update with the mean and the token count)."""

    def compute(self) -> torch.Tensor:
        return torch.exp(super().compute())


def log_epoch_metrics(module: Any, metrics: MetricCollection, stage: str, ps: ParallelState,
                      last_stage: bool) -> dict[str, torch.Tensor]:
    """Compute (last pipeline stage), broadcast along the pipeline, log ``{stage}_{name}`` on every
    rank, reset. Every rank calls this at the end of the stage's epoch."""
    names = sorted(metrics.keys())
    device = module.device
    # The values, then whether any microbatch updated them: a module whose forward_step does not (a
    # subclass) logs nothing, rather than torchmetrics' "compute before update" warning and zeros.
    values = torch.zeros(len(names) + 1, device=device)
    updated = last_stage and any(m.update_count for m in metrics.values())
    if last_stage and ps.dp_size > 1:
        # A replica whose rows were all padding updated nothing, yet computing syncs over the
        # data-parallel group: every replica computes when any did (one flag, once an epoch).
        flag = torch.tensor([float(updated)], device=device)
        all_reduce(flag, ps.group("dp"), dist.ReduceOp.MAX)
        updated = bool(flag.item())
    if updated:
        computed = metrics.compute()
        values[:-1] = torch.stack([computed[n].detach().float().reshape(()) for n in names]).to(device)
        values[-1] = 1.0
    if ps.pp_size > 1:
        dist.broadcast(values, src=ps.pp_ranks[-1], group=ps.pp_group)
    metrics.reset()
    out = dict(zip(names, values[:-1].unbind(0))) if values[-1] > 0 else {}
    for name, value in out.items():
        # Every rank holds the same value: max over the world keeps it exact (and Lightning quiet).
        module.log(f"{stage}_{name}", value, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max",
                   batch_size=1)
    return out


def eval_stage(module: Any) -> str | None:
    """``val`` (sanity check included) or ``test`` while the module's Trainer evaluates, else None."""
    trainer = module._trainer
    if trainer is None:
        return None
    return "test" if trainer.testing else "val" if trainer.validating or trainer.sanity_checking else None


def on_device(collection: MetricCollection, device: torch.device) -> MetricCollection:
    """``collection`` with its states on ``device`` (moved once)."""
    first: Metric = next(iter(collection.values()))
    if first.device != device:
        collection.to(device)
    return collection
