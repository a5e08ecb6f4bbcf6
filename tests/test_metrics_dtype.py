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
