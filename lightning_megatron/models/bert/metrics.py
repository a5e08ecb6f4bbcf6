"""Evaluation metrics from torchmetrics, synchronised over the data-parallel group only.

Every validation/test microbatch updates the metrics of its stage on the last pipeline stage; at the
end of the epoch :func:`log_epoch_metrics` computes them (torchmetrics gathers the states over the
``process_group`` given here: the data-parallel group, so the TP ranks of a replica, which hold the
same predictions, are not counted twice), broadcasts the values along the pipeline and logs them on
every rank. The result is the metric of the whole split, equal at every TP x PP x DP layout.

- fine-tuning, classification: ``accuracy``, ``f1`` (binary: of class 1; multiclass: macro),
  ``matthews_corrcoef`` and ``loss`` (mean cross entropy per row); regression (one output):
  ``pearson``, ``spearman``, ``mse`` and ``loss`` (the same mean squared error as the training loss);
- pretraining: ``mlm_accuracy`` (masked tokens predicted right) and ``perplexity`` (exp of the
  mean masked-LM cross entropy per masked token).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import MeanMetric, Metric, MetricCollection
from torchmetrics.classification import (
    BinaryAccuracy,
    BinaryF1Score,
    BinaryMatthewsCorrCoef,
    MulticlassAccuracy,
    MulticlassF1Score,
    MulticlassMatthewsCorrCoef,
)
from torchmetrics.regression import MeanSquaredError, PearsonCorrCoef, SpearmanCorrCoef

from lightning_megatron.parallel_state import ParallelState, process_group
from lightning_megatron.tensor_parallel.mappings import all_reduce

__all__ = ["EVAL_STAGES", "Perplexity", "finetune_metrics", "log_epoch_metrics", "eval_stage", "on_device", "pretraining_metrics",
           "update_stage"]

EVAL_STAGES = ("val", "test")


def _sync_args(ps: ParallelState) -> dict[str, Any]:
    # No gather at all for one replica; otherwise over the data-parallel group only.
    return {"process_group": process_group(ps.dp_group), "sync_on_compute": ps.dp_size > 1}


class Perplexity(MeanMetric):
    """exp of the weighted mean of per-token cross entropies (update with the mean and the token count)."""

    def compute(self) -> torch.Tensor:
        return torch.exp(super().compute())


def finetune_metrics(num_classes: int, ps: ParallelState) -> dict[str, MetricCollection]:
    """``{stage: MetricCollection}`` for val and test; ``num_classes == 1`` is regression.

    A plain dict, not submodules: the metrics stay out of the model's state dict and summary, and
    out of Lightning's ``module.to(dtype)`` (which would cast float64 metric states to float32);
    :func:`update_stage` moves them to the predictions' device."""
    kw = _sync_args(ps)

    def collection() -> MetricCollection:
        if num_classes == 1:
            with warnings.catch_warnings():  # "will save all targets and predictions": that is how ranks work
                warnings.filterwarnings("ignore", message=".*will save all targets and predictions")
                spearman = SpearmanCorrCoef(**kw)
            # Moments merged over ranks in float64: the same correlation at every layout to ~1e-12
            # (float32 moments drift by ~1e-5 for a near-zero correlation).
            return MetricCollection({"pearson": PearsonCorrCoef(**kw), "spearman": spearman,
                                     "mse": MeanSquaredError(**kw), "loss": MeanMetric(**kw)}
                                    ).set_dtype(torch.float64)
        if num_classes == 2:
            return MetricCollection({"accuracy": BinaryAccuracy(**kw), "f1": BinaryF1Score(**kw),
                                     "matthews_corrcoef": BinaryMatthewsCorrCoef(**kw), "loss": MeanMetric(**kw)})
        return MetricCollection({
            "accuracy": MulticlassAccuracy(num_classes, average="micro", **kw),
            "f1": MulticlassF1Score(num_classes, average="macro", **kw),
            "matthews_corrcoef": MulticlassMatthewsCorrCoef(num_classes, **kw), "loss": MeanMetric(**kw)})

    return {stage: collection() for stage in EVAL_STAGES}


def pretraining_metrics(vocab_size: int, ps: ParallelState) -> dict[str, MetricCollection]:
    """``{stage: MetricCollection(mlm_accuracy, perplexity)}`` for val and test (see :func:`finetune_metrics`)."""
    kw = _sync_args(ps)
    return {stage: MetricCollection({
        "mlm_accuracy": MulticlassAccuracy(vocab_size, average="micro", ignore_index=-100, validate_args=False,
                                           **kw),
        "perplexity": Perplexity(**kw)}) for stage in EVAL_STAGES}


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
        all_reduce(flag, ps.dp_group, dist.ReduceOp.MAX)
        updated = bool(flag.item())
    if updated:
        computed = metrics.compute()
        values[:-1] = torch.stack([computed[n].detach().float().reshape(()) for n in names]).to(device)
        values[-1] = 1.0
    if ps.pp_size > 1:
        dist.broadcast(values, src=ps.pp_ranks[-1], group=ps.pp_group.process_group)
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


def update_stage(metrics: dict[str, MetricCollection] | None, stage: str | None, preds: torch.Tensor,
                 target: torch.Tensor, loss: torch.Tensor | None = None) -> None:
    """Update the metrics of ``stage`` (None: not evaluating) with a microbatch's outputs; a ``loss``
    metric (fine-tuning's, the mean over the split's rows) takes the per-row ``loss``."""
    if metrics is None or stage not in EVAL_STAGES:
        return
    if preds.numel() == 0:  # a microbatch of padding only (the last global batch of a split)
        return
    collection = on_device(metrics[stage], preds.device)
    if "loss" not in collection:
        collection.update(preds, target)
        return
    if loss is None:
        raise ValueError("update_stage: this stage's metrics include 'loss': pass the per-row loss")
    for name, metric in collection.items(keep_base=True):
        if name == "loss":
            metric.update(loss)
        else:
            metric.update(preds, target)
