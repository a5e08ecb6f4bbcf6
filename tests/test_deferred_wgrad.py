"""The output layer's weight gradient deferred to the pipeline flush (``defer_embedding_wgrad_compute``):
the same input, bias and weight gradients as autograd's ``F.linear``, bit for bit, and refused where
there is no flush. Bitwise equality of whole PP / PP x VP runs with and without it, fp32 and bf16, is in
tests/test_optimizer_grad_norm.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_utils import test_device
from lightning_megatron.grads import GradBuffer
from lightning_megatron.tensor_parallel import DeferredWeightGrad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(38, 1, 96), (16, 2, 96), (24, 96)])
@pytest.mark.parametrize("bias", [True, False])
def test_deferred_linear_gives_autograds_gradients_bitwise(dtype, shape, bias):
    gen, device = torch.Generator().manual_seed(0), test_device()  # the GPU check runs it on CUDA
    x = torch.randn(*shape, generator=gen).to(device, dtype)
    weight = torch.randn(1000, 96, generator=gen).to(device, dtype)
    b = torch.randn(1000, generator=gen).to(device, dtype) if bias else None
    grad_out = torch.randn(*shape[:-1], 1000, generator=gen).to(device, dtype)

    def grads(deferral):
        xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
        bi = b.clone().requires_grad_() if bias else None
        out = deferral.linear(xi, wi, bi) if deferral is not None else F.linear(xi, wi, bi)
        # as in GPT's head: the output gradient reaches the layer through a transposed copy
        out.transpose(0, -2).contiguous().backward(grad_out.transpose(0, -2).contiguous())
        if deferral is not None:
            assert wi.grad is None and deferral.pending == 1
            assert deferral.drain(lambda p, g: setattr(p, "grad", g)) == 1
            assert not wi.grad.requires_grad and wi.grad.grad_fn is None  # no graph (the input required grad)
        return xi.grad, wi.grad, (bi.grad if bias else None)

    deferral = DeferredWeightGrad()
    deferral.open()
    for got, want in zip(grads(deferral), grads(None)):
        assert (got is None and want is None) or torch.equal(got, want)
    # Closed (evaluation, a backward outside the training step): plain F.linear.
    x_ = x.clone().requires_grad_()
    w_ = weight.clone().requires_grad_()
    deferral.linear(x_, w_, b).sum().backward()
    assert w_.grad is not None and deferral.pending == 0


def test_drained_grads_reach_main_grad_as_the_hook_would():
    # Three bf16 microbatches: fp32 main_grad sums, in microbatch order, equal to autograd's path.
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(20, 64, generator=gen).bfloat16() for _ in range(3)]
    gs = [torch.randn(20, 500, generator=gen).bfloat16() for _ in range(3)]

    def main_grad(defer: bool) -> torch.Tensor:
        weight = torch.nn.Parameter(torch.randn(500, 64, generator=torch.Generator().manual_seed(2)).bfloat16())
        buffer = GradBuffer([weight])
        deferral = DeferredWeightGrad()
        buffer.start(3)
        if defer:
            deferral.open()
        for x, g in zip(xs, gs):
            deferral.linear(x.requires_grad_(), weight, None).backward(g)
        if defer:
            assert deferral.drain(buffer.add_grad) == 3
        buffer.finish_grad_sync()
        assert not buffer.data.requires_grad
        out = weight.main_grad.clone()
        buffer.remove()
        return out

    deferred = main_grad(True)
    assert torch.equal(deferred, main_grad(False))
    assert not deferred.requires_grad


def test_refused_without_pipeline_parallelism():
    from lightning_megatron.models.bert.module import BertLightningModule
    from megatron_testing import TINY_MODEL

    module = BertLightningModule(**{**TINY_MODEL, "defer_embedding_wgrad_compute": True})
    with pytest.raises(ValueError, match=r"defer_embedding_wgrad_compute=True needs pipeline parallelism "
                                         r"\(pipeline_model_parallel_size >= 2\).*Set it to False"):
        module.configure_model()
