"""The output layer's weight gradient deferred to the pipeline flush (``defer_embedding_wgrad_compute``):
the same input, bias and weight gradients as autograd's ``F.linear``, bit for bit, and refused where
there is no flush. Bitwise equality of whole PP / PP x VP runs with and without it, fp32 and bf16, is in
tests/test_optimizer_grad_norm.py. Also the CPU tuning's ``weight_grads_per_step``: one GEMM per weight
over the step's microbatches, bitwise the gradient of one microbatch of all the tokens (whole runs
against one process: tests/test_optimizer_grad_norm.py)."""

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
    x = torch.randn(*shape, generator=gen, device="cpu").to(device, dtype)
    weight = torch.randn(1000, 96, generator=gen, device="cpu").to(device, dtype)
    b = torch.randn(1000, generator=gen, device="cpu").to(device, dtype) if bias else None
    grad_out = torch.randn(*shape[:-1], 1000, generator=gen, device="cpu").to(device, dtype)

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
    xs = [torch.randn(20, 64, generator=gen, device="cpu").bfloat16() for _ in range(3)]
    gs = [torch.randn(20, 500, generator=gen, device="cpu").bfloat16() for _ in range(3)]

    def main_grad(defer: bool) -> torch.Tensor:
        weight = torch.nn.Parameter(torch.randn(500, 64, generator=torch.Generator().manual_seed(2), device="cpu").bfloat16())
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


def test_per_step_drain_is_one_microbatch_of_all_tokens():
    # The CPU tuning's weight_grads_per_step: two bf16 layers sharing one deferral, three microbatches.
    # Each weight's main_grad must be bitwise the gradient one F.linear over all the step's tokens gives
    # (the reference: plain autograd on the concatenated batch), reach the buffer once (its count says
    # final: the overlapped reduction's bucket is ready), and stay within bf16 rounding of the
    # per-microbatch path.
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(20, 64, generator=gen, device="cpu").bfloat16() for _ in range(3)]
    gs = [torch.randn(20, 48, generator=gen, device="cpu").bfloat16() for _ in range(3)]
    w0 = torch.randn(48, 64, generator=gen, device="cpu").bfloat16()
    w1 = torch.randn(48, 48, generator=gen, device="cpu").bfloat16()

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        a, b = w0.clone().requires_grad_(), w1.clone().requires_grad_()
        F.linear(F.linear(torch.cat(xs), a), b).backward(torch.cat(gs))
        return a.grad.float(), b.grad.float()

    def main_grads(per_step: bool) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w1.clone())
        buffer = GradBuffer([a, b], overlap_grad_reduce=True)
        deferral = DeferredWeightGrad(per_step=per_step)
        buffer.start(3)
        deferral.open()
        for x, g in zip(xs, gs):
            deferral.linear(deferral.linear(x, a, None), b, None).backward(g)
        assert a.grad is None and b.grad is None and deferral.pending == 6
        assert deferral.drain(buffer.add_grad) == 6 and deferral.drained == 6
        assert [bucket.ready for bucket in buffer.buckets] == [2]  # both counted final
        buffer.finish_grad_sync()
        out = a.main_grad.clone(), b.main_grad.clone()
        buffer.remove()
        return out

    per_step, per_microbatch = main_grads(True), main_grads(False)
    for got, want, other in zip(per_step, reference(), per_microbatch):
        assert torch.equal(got, want)
        assert not torch.equal(got, other)  # other bits: why the piece is never a default
        assert (got - other).abs().max() <= 2 ** -7 * got.abs().max()  # bf16 roundings apart


def test_cpu_tuning_defers_every_linear_layer_of_a_stage():
    from lightning_megatron.cpu import CPUTuning
    from types import SimpleNamespace

    from lightning_megatron.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        WeightGradPolicy,
    )

    chunks = [torch.nn.Sequential(ColumnParallelLinear(8, 16), RowParallelLinear(16, 8)) for _ in range(2)]
    state = SimpleNamespace(pp_size=2)  # a pipeline stage's (configure_grads reads only the size)
    policy = WeightGradPolicy()
    changed = CPUTuning(weight_grads_per_step=True).configure_grads(policy, chunks, state, torch.device("cpu"))
    assert changed == {"embedding_grad_rows": 0, "weight_grads_per_step": 4}
    deferrals = policy.deferrals
    assert len(deferrals) == 2 and all(d.per_step for d in deferrals)  # one per chunk
    assert CPUTuning().configure_grads(WeightGradPolicy(), chunks[:1], state,
                                       torch.device("cpu"))["weight_grads_per_step"] == 0
    # One stage: an output layer whose weight is the same chunk's word embedding keeps autograd's sum
    # of the two gradients; an output layer with its own weight is deferred.
    tied = torch.nn.ModuleList([VocabParallelEmbedding(16, 8), ColumnParallelLinear(8, 16, skip_weight_param_allocation=True),
                                ColumnParallelLinear(8, 8), RowParallelLinear(8, 8)])
    policy = WeightGradPolicy()
    changed = CPUTuning(weight_grads_per_step=True).configure_grads(policy, [tied], SimpleNamespace(pp_size=1),
                                                                    torch.device("cpu"))
    assert changed == {"embedding_grad_rows": 0, "weight_grads_per_step": 2}
    assert policy.deferral(tied[1]) is None and policy.deferral(tied[2]) is policy.deferral(tied[3]) is not None


def test_refused_without_pipeline_parallelism():
    from lightning_megatron.models.bert import BertConfig
    from lightning_megatron.models.bert.module import BertLightningModule
    from megatron_testing import TINY_CONFIG, TINY_OPTIONS

    module = BertLightningModule(BertConfig(**TINY_CONFIG, defer_embedding_wgrad_compute=True), **TINY_OPTIONS)
    with pytest.raises(ValueError, match=r"defer_embedding_wgrad_compute=True needs pipeline parallelism "
                                         r"\(pipeline_model_parallel_size >= 2\).*Set it to False"):
        module.configure_model()


def test_backward_input_then_backward_weight_per_microbatch():
    """The primitives a zero-bubble schedule calls: inside the policy's step, ``backward_input`` of each
    microbatch leaves the deferred layers' weight gradients stashed (the input and bias gradients are
    there); ``backward_weight(k)`` adds microbatch k's, in the order asked for. In microbatch order the
    fp32 main_grad is bitwise autograd's; the layers consult the policy only while its step runs, and a
    layer it does not defer (and the row-routed embedding) takes autograd's own path."""
    from lightning_megatron.cpu.embedding_grad import RowSparseEmbeddingGrad
    from lightning_megatron.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        WeightGradPolicy,
    )

    torch.manual_seed(0)
    ids = [torch.randint(0, 32, (6, 2)) for _ in range(3)]

    def run(policy_kind: str | None) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], WeightGradPolicy]:
        torch.manual_seed(1)
        model = torch.nn.ModuleList([VocabParallelEmbedding(32, 8), ColumnParallelLinear(8, 16),
                                     RowParallelLinear(16, 8)]).bfloat16()
        embedding, column, row = model
        buffer, policy = GradBuffer(list(model.parameters())), WeightGradPolicy()
        if policy_kind is not None:
            policy.defer([column])
            policy.route_embedding_grad(embedding, RowSparseEmbeddingGrad())
        buffer.start(len(ids))
        input_grads = []
        with policy.step(buffer.add_grad, buffer.add_grad_rows):
            for k, batch in enumerate(ids):
                hidden = embedding(batch).detach().requires_grad_()  # the chunk's input, as a pipeline receives
                out = row(column(embedding(batch) + hidden)[0])[0]
                policy.backward_input(out.float().square().mean(), None, microbatch=k)
                input_grads.append(hidden.grad)
                if policy_kind is not None:
                    assert column.weight.grad is None and column.weight.main_grad is not None
                    assert policy.deferral(column).pending == k + 1 and policy.deferral(row) is None
            if policy_kind == "reversed":  # out of order: other fp32 sums
                assert [policy.backward_weight(k) for k in (2, 0, 1)] == [1, 1, 1]
            elif policy_kind == "in_order":
                assert [policy.backward_weight(k) for k in range(3)] == [1, 1, 1]
            assert policy.backward_weight() == 0
        buffer.finish_grad_sync()
        grads = {name: p.main_grad.clone() for name, p in model.named_parameters()}
        buffer.remove()
        # Outside the step the policy is not consulted: autograd's weight gradient.
        column(torch.randn(2, 8).bfloat16())[0].sum().backward()
        assert column.weight.grad is not None and all(d.pending == 0 for d in policy.deferrals)
        return grads, input_grads, policy

    plain, plain_inputs, _ = run(None)
    deferred, deferred_inputs, policy = run("in_order")
    assert policy.drained == 3 and len(policy.embedding_rows) == 1
    assert plain.keys() == deferred.keys() and all(torch.equal(plain[k], deferred[k]) for k in plain)
    assert all(torch.equal(a, b) for a, b in zip(plain_inputs, deferred_inputs))
    shuffled, _, _ = run("reversed")
    assert torch.equal(shuffled["2.weight"], plain["2.weight"])  # not deferred
    torch.testing.assert_close(shuffled["1.weight"], plain["1.weight"], rtol=0, atol=1e-6)


def _policy_step(layer, buffer: GradBuffer, policy, losses: list, after=None) -> torch.Tensor:
    """One training step through ``policy`` into ``buffer``: each microbatch's ``losses[k]()`` backward as the schedule
    runs it (``after()`` following each), then the deferred weight gradients; ``layer``'s ``main_grad``."""
    buffer.start(len(losses))
    with policy.step(buffer.add_grad, buffer.add_grad_rows):
        for k, loss in enumerate(losses):
            policy.backward_input(loss(), None, microbatch=k)
            if after is not None:
                after()
        policy.backward_weight()
    buffer.finish_grad_sync()
    grad = layer.weight.main_grad.clone()
    buffer.remove()
    return grad


def test_a_deferral_limit_keeps_at_most_that_many_microbatches_waiting_with_the_same_bits():
    """``wgrad_deferral_limit`` (megatron-core's name): at most ``limit`` microbatches' output gradients and inputs
    wait; when one more would, the oldest is computed then, in its turn, so the fp32 ``main_grad`` is autograd's
    bits at every limit (megatron-core computes the later microbatches' at once instead: another order). 5
    microbatches, limits 0 (all wait), 1, 2 and 5."""
    from lightning_megatron.tensor_parallel import ColumnParallelLinear, WeightGradPolicy

    torch.manual_seed(0)
    xs = [torch.randn(6, 8).bfloat16() for _ in range(5)]

    def run(limit: int | None) -> tuple[torch.Tensor, list[int]]:
        torch.manual_seed(1)
        layer = ColumnParallelLinear(8, 16).bfloat16()
        buffer, policy = GradBuffer(list(layer.parameters())), WeightGradPolicy()
        if limit is not None:
            policy.defer([layer], limit=limit)
        waiting: list[int] = []
        grad = _policy_step(layer, buffer, policy, [lambda x=x: layer(x)[0].float().square().mean() for x in xs],
                            after=lambda: waiting.append(policy.deferral(layer).pending if limit is not None else 0))
        return grad, waiting

    plain, _ = run(None)
    for limit, most in ((0, [1, 2, 3, 4, 5]), (1, [1, 1, 1, 1, 1]), (2, [1, 2, 2, 2, 2]), (5, [1, 2, 3, 4, 5])):
        grad, waiting = run(limit)
        assert waiting == most and torch.equal(grad, plain), (limit, waiting)
    with pytest.raises(ValueError, match="limit=-1 must be >= 0"):
        WeightGradPolicy().defer([ColumnParallelLinear(8, 16)], limit=-1)
    from lightning_megatron.transformer.config import TransformerConfig

    with pytest.raises(ValueError, match="wgrad_deferral_limit=2 bounds the deferral of defer_embedding_wgrad_compute"):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, wgrad_deferral_limit=2)



@pytest.mark.parametrize("limit, per_step", [(0, False), (1, False), (0, True)])
def test_a_deferred_layer_run_twice_in_a_microbatch_reaches_its_bucket_once_per_microbatch(limit, per_step):
    """A layer whose weight gradient is deferred, run twice in each microbatch (a head or block reused in one
    forward): autograd sums the two uses' gradients before the gradient buffer's hook sees them, once per
    microbatch. The drain must hand the buffer the same: one sum per microbatch, so that the count that says a
    bucket is final (its overlapped DP reduction starts then) is reached only after the last one, and
    ``main_grad`` is autograd's bits. It had been two gradients per microbatch: the bucket was declared final
    after half of them and its reduction would have started while the other half were still to be added. The CPU
    tuning's one GEMM a step (``per_step``) hands the buffer one gradient of the step's microbatches: final at once,
    within fp32 rounding of autograd's sum."""
    from lightning_megatron.tensor_parallel import ColumnParallelLinear, WeightGradPolicy

    torch.manual_seed(0)
    xs = [torch.randn(6, 16) for _ in range(4)]

    def run(defer: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(1)
        layer = ColumnParallelLinear(16, 16, bias=False)
        buffer, policy = GradBuffer([layer.weight], overlap_grad_reduce=True), WeightGradPolicy()
        if defer:
            policy.defer([layer], limit=limit, per_step=per_step)
        at_launch: list[torch.Tensor] = []
        launch = buffer._launch
        buffer._launch = lambda bucket: (at_launch.append(layer.weight.main_grad.clone()), launch(bucket))
        grad = _policy_step(layer, buffer, policy,
                            [lambda x=x: layer(layer(x)[0].tanh())[0].square().mean() for x in xs])
        assert policy.drained == (len(xs) if defer else 0)  # one gradient a microbatch, of the two uses
        return grad, at_launch

    plain, plain_launch = run(False)
    assert len(plain_launch) == 1 and torch.equal(plain_launch[0], plain)  # launched once, when final
    deferred, launched = run(True)
    assert len(launched) == 1 and torch.equal(launched[0], deferred), "the bucket was launched before it was final"
    if per_step:
        torch.testing.assert_close(deferred, plain, rtol=1e-5, atol=1e-7)
    else:
        assert torch.equal(deferred, plain)
