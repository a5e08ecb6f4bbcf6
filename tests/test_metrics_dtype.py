"""Evaluation metrics keep their running sums in fp32 (or wider) whatever the run's dtype.

Lightning builds the model (``configure_model``) with the default dtype set to the run's 16-bit one, and the
families' metrics were built there: their float states were bf16 / fp16, so a decoder's validation perplexity of a
bf16 run was 1-7% off (1208 against exp(val_loss) = 1255) and of an fp16 run inf (an audit through the CLI), and
changed with the data-parallel size. The reference: the plain fp32 mean of the same updates.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.parallel_state import ParallelState


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eval_metrics_built_under_a_16_bit_default_dtype_sum_in_fp32(dtype):
    from lightning_megatron.models.bert.metrics import finetune_metrics, pretraining_metrics
    from lightning_megatron.models.gpt import GPTConfig
    from lightning_megatron.models.gpt.module import GPTLightningModule

    ps = ParallelState(dims=ParallelDims(dp=1), rank=0, members={})
    gpt = GPTLightningModule(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64,
                                       max_sequence_length=8))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # what Lightning's init context does for a 16-bit run
    try:
        gpt.configure_model()
        collections = {"gpt": gpt.eval_metrics["val"], "bert": pretraining_metrics(64, ps)["val"],
                       "classifier": finetune_metrics(2, ps)["val"]}
    finally:
        torch.set_default_dtype(previous)
    losses = [8.3 + 0.01 * i for i in range(40)]  # 40 microbatches of 512 tokens
    want = math.exp(sum(losses) / len(losses))
    for name, metric in (("gpt", collections["gpt"]["perplexity"]), ("bert", collections["bert"]["perplexity"]),
                         ("classifier", collections["classifier"]["loss"])):
        for loss in losses:
            metric.update(torch.tensor(loss), 512)
        got = float(metric.compute())
        got = got if name != "classifier" else math.exp(got)
        assert got == pytest.approx(want, rel=1e-6), (name, dtype, got, want)


def test_eval_means_keep_a_nan_loss_and_read_nothing_from_the_device():
    """A microbatch's non-finite loss makes the split's perplexity (and a classifier's mean loss) nan, as its
    logged loss is: torchmetrics' default (``nan_strategy="warn"``) dropped it with a warning, and the split's
    perplexity was the other microbatches' (exp(3) here). Its check also read the device at every update (``if
    nans.any()``: a host synchronisation per evaluation microbatch on a GPU); the updates read nothing. The means stay
    weighted by the token counts."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_megatron.models.bert.metrics import finetune_metrics, pretraining_metrics
    from lightning_megatron.models.gpt import GPTConfig
    from lightning_megatron.models.gpt.module import GPTLightningModule

    ps = ParallelState(dims=ParallelDims(dp=1), rank=0, members={})
    gpt = GPTLightningModule(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64,
                                       max_sequence_length=8))
    gpt.configure_model()
    means = {"gpt": gpt.eval_metrics["val"]["perplexity"], "bert": pretraining_metrics(64, ps)["val"]["perplexity"],
             "classifier": finetune_metrics(2, ps)["val"]["loss"]}
    reads = []

    class CountReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
                reads.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    for name, metric in means.items():
        with CountReads():
            metric.update(torch.tensor(float("nan")), torch.tensor(4.0))
            metric.update(torch.tensor(3.0), torch.tensor(4.0))
        assert reads == [], (name, reads)
        assert math.isnan(float(metric.compute())), name
        metric.reset()  # weighted by the counts (torchmetrics' nan_strategy="disable" weighs every update 1)
        metric.update(torch.tensor(2.0), torch.tensor(1.0))
        metric.update(torch.tensor(4.0), torch.tensor(3.0))
        metric.update(torch.tensor(0.0), torch.tensor(0.0))  # no counted tokens: the losses' clamp gives 0
        got = float(metric.compute())
        assert (got if name == "classifier" else math.log(got)) == pytest.approx(3.5, rel=1e-6), (name, got)


def test_a_classifiers_evaluation_updates_read_nothing_from_the_device():
    """torchmetrics' checks of the labels (``torch.unique``, ``.item()``: 12 reads an update for two classes, 6 for
    three) read the device at every evaluation microbatch of a fine-tuned classifier: a host synchronisation each on
    a GPU. The labels are checked when the data is read; the updates read nothing, and compute as before."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_megatron.models.bert.metrics import finetune_metrics, update_stage

    ps = ParallelState(dims=ParallelDims(dp=1), rank=0, members={})
    reads = []

    class CountReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default) or \
                    "unique" in func.overloadpacket.__name__:
                reads.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    for classes in (2, 3):
        metrics = finetune_metrics(classes, ps)
        preds, target = (torch.randint(0, classes, (64,), generator=g) for _ in range(2))
        with CountReads():
            update_stage(metrics, "val", preds, target, loss=torch.rand(64, generator=g))
        assert reads == [], (classes, reads)
        got = {k: float(v) for k, v in metrics["val"].compute().items()}
        assert got["accuracy"] == pytest.approx(float((preds == target).float().mean()), abs=1e-7), got
