"""BERT's evaluation metrics from torchmetrics, synchronised over the data-parallel group only (the
model-agnostic machinery, :func:`log_epoch_metrics` and :class:`Perplexity`, is :mod:`lightning_megatron.metrics`).

- fine-tuning, classification: ``accuracy``, ``f1`` (binary: of class 1; multiclass: macro),
  ``matthews_corrcoef`` (as scikit-learn computes it: :func:`matthews_corrcoef_of`) and ``loss`` (mean cross
  entropy per row); regression (one output):
  ``pearson``, ``spearman``, ``mse`` and ``loss`` (the same mean squared error as the training loss);
- pretraining: ``mlm_accuracy`` (masked tokens predicted right) and ``perplexity`` (exp of the
  mean masked-LM cross entropy per masked token).
"""

from __future__ import annotations

import warnings

import torch
from torchmetrics import MetricCollection
from torchmetrics.classification import (
    BinaryAccuracy,
    BinaryF1Score,
    BinaryMatthewsCorrCoef,
    MulticlassAccuracy,
    MulticlassF1Score,
    MulticlassMatthewsCorrCoef,
)
from torchmetrics.regression import MeanSquaredError, PearsonCorrCoef, SpearmanCorrCoef

from lightning_megatron.metrics import (EVAL_STAGES, Mean, Perplexity, eval_stage, float32_states, log_epoch_metrics,
                                        on_device)
from lightning_megatron.metrics import sync_args as _sync_args
from lightning_megatron.parallel_state import ParallelState

__all__ = ["EVAL_STAGES", "Perplexity", "finetune_metrics", "log_epoch_metrics", "eval_stage", "on_device", "pretraining_metrics",
           "update_stage"]


def matthews_corrcoef_of(confmat: torch.Tensor) -> torch.Tensor:
    """Matthews' correlation of a confusion matrix (``[classes, classes]``) as scikit-learn computes it, GLUE's
    scorer: the covariances of targets and predictions, 0 where it is undefined (one class among the targets or the
    predictions; torchmetrics gives -1 for all wrong and 1 for all right there)."""
    c = confmat.double()
    targets, preds, correct, n = c.sum(dim=1), c.sum(dim=0), torch.trace(c), c.sum()
    cov_tp = correct * n - (targets * preds).sum()
    denominator = (n * n - (preds * preds).sum()) * (n * n - (targets * targets).sum())
    out = cov_tp / denominator.sqrt() if denominator > 0 else torch.zeros((), dtype=torch.float64)
    return out.float()


class _SklearnMatthews:
    """torchmetrics' Matthews correlation (its confusion matrix, its synchronisation) computed as
    :func:`matthews_corrcoef_of`."""

    def compute(self) -> torch.Tensor:
        return matthews_corrcoef_of(self.confmat)


class BinaryMatthews(_SklearnMatthews, BinaryMatthewsCorrCoef):
    """:class:`~torchmetrics.classification.BinaryMatthewsCorrCoef` as scikit-learn computes it."""


class MulticlassMatthews(_SklearnMatthews, MulticlassMatthewsCorrCoef):
    """:class:`~torchmetrics.classification.MulticlassMatthewsCorrCoef` as scikit-learn computes it."""


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
                                     "mse": MeanSquaredError(**kw), "loss": Mean(**kw)}
                                    ).set_dtype(torch.float64)
        # validate_args=False: torchmetrics' checks of the labels (torch.unique, .item()) read the device at every
        # update, a host synchronisation per evaluation microbatch on a GPU; a label outside the classes fails the
        # loss's cross entropy first (and LabelledTextDataModule refuses it when reading), the predictions an argmax
        cls = dict(kw, validate_args=False)
        if num_classes == 2:
            return MetricCollection({"accuracy": BinaryAccuracy(**cls), "f1": BinaryF1Score(**cls),
                                     "matthews_corrcoef": BinaryMatthews(**cls), "loss": Mean(**kw)})
        return MetricCollection({
            "accuracy": MulticlassAccuracy(num_classes, average="micro", **cls),
            "f1": MulticlassF1Score(num_classes, average="macro", **cls),
            "matthews_corrcoef": MulticlassMatthews(num_classes, **cls), "loss": Mean(**kw)})

    with float32_states():
        return {stage: collection() for stage in EVAL_STAGES}


def pretraining_metrics(vocab_size: int, ps: ParallelState) -> dict[str, MetricCollection]:
    """``{stage: MetricCollection(mlm_accuracy, perplexity)}`` for val and test (see :func:`finetune_metrics`)."""
    kw = _sync_args(ps)
    with float32_states():
        return {stage: MetricCollection({
            "mlm_accuracy": MulticlassAccuracy(vocab_size, average="micro", ignore_index=-100, validate_args=False,
                                               **kw),
            "perplexity": Perplexity(**kw)}) for stage in EVAL_STAGES}


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
