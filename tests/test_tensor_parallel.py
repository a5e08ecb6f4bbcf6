"""Tensor-parallel mappings and layers equal one process (fp32, 1e-6), at TP=2 and TP=4 on gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import run_distributed
from lightning_megatron.parallel_state import group_size, initialize_model_parallel, process_group
from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_reduce_sequence_parallel_grads,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    pad_vocab_size,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from lightning_megatron.cpu.shared_memory import enable_shared_memory_collectives

TOL = dict(atol=1e-6, rtol=1e-6)


def _gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(parts, t.contiguous(), group=process_group(group))
    return torch.cat(parts, dim=dim)


def _mappings_worker(tp: int, shm: bool = False) -> None:
    ps = initialize_model_parallel(ParallelDims(tp=tp))
    if shm:  # the same checks with the TP group's collectives in shared memory (the opt-in CPU tuning)
        comm = enable_shared_memory_collectives(ps.tp_group, slot_bytes=64)
        assert comm is not None
        ps.set_communicator("tp", comm)
    g, r = ps.group("tp"), ps.tp_rank
    world_sum = sum(range(tp))

    # copy_to: identity forward; backward all-reduces: grad ones*rank -> ones*sum(ranks)
    x = torch.ones(3, 4, requires_grad=True)
    y = copy_to_tensor_model_parallel_region(x, g)
    assert torch.equal(y, x)
    y.backward(torch.ones(3, 4) * r)
    assert torch.equal(x.grad, torch.full((3, 4), float(world_sum)))

    # reduce_from: forward all-reduce; backward identity
    x = (torch.ones(3, 4) * r).requires_grad_()
    y = reduce_from_tensor_model_parallel_region(x, g)
    assert torch.equal(y, torch.full((3, 4), float(world_sum)))
    assert torch.equal(x, torch.ones(3, 4) * r), "reduce must not modify its input"
    y.backward(torch.full((3, 4), 2.0))
    assert torch.equal(x.grad, torch.full((3, 4), 2.0))

    # scatter (last dim): keep own chunk; backward gathers
    full = torch.arange(2 * 3 * 4 * tp, dtype=torch.float32).reshape(2, 3, 4 * tp).requires_grad_()
    y = scatter_to_tensor_model_parallel_region(full, g)
    assert torch.equal(y, full.detach()[..., 4 * r:4 * (r + 1)])
    y.backward(torch.full_like(y, float(r + 1)))
    expected = torch.cat([torch.full((2, 3, 4), float(i + 1)) for i in range(tp)], dim=-1)
    assert torch.equal(full.grad, expected)

    # gather (last dim): forward all-gather; backward keeps own chunk
    local = (torch.ones(2, 3) * r).requires_grad_()
    y = gather_from_tensor_model_parallel_region(local, g)
    assert torch.equal(y, torch.cat([torch.ones(2, 3) * i for i in range(tp)], dim=-1))
    grad = torch.arange(2 * 3 * tp, dtype=torch.float32).reshape(2, 3 * tp)
    y.backward(grad)
    assert torch.equal(local.grad, grad[:, 3 * r:3 * (r + 1)])

    # sequence parallel: scatter dim 0 / backward all-gather
    seq = torch.arange(4 * tp * 2, dtype=torch.float32).reshape(4 * tp, 2).requires_grad_()
    y = scatter_to_sequence_parallel_region(seq, g)
    assert torch.equal(y, seq.detach()[4 * r:4 * (r + 1)])
    y.backward(torch.full_like(y, float(r)))
    assert torch.equal(seq.grad, torch.cat([torch.full((4, 2), float(i)) for i in range(tp)]))

    # gather dim 0 / backward reduce-scatter
    local = (torch.ones(2, 3) * r).requires_grad_()
    y = gather_from_sequence_parallel_region(local, g)
    assert torch.equal(y, torch.cat([torch.ones(2, 3) * i for i in range(tp)]))
    y.backward(torch.ones(2 * tp, 3) * (r + 1))  # every rank: partial grad for the whole sequence
    assert torch.equal(local.grad, torch.full((2, 3), float(sum(i + 1 for i in range(tp)))))

    # reduce-scatter dim 0 / backward all-gather
    x = (torch.arange(2 * tp, dtype=torch.float32).unsqueeze(-1).repeat(1, 3) * (r + 1)).requires_grad_()
    y = reduce_scatter_to_sequence_parallel_region(x, g)
    coeff = sum(i + 1 for i in range(tp))
    assert torch.equal(y, torch.arange(2 * r, 2 * r + 2, dtype=torch.float32).unsqueeze(-1).repeat(1, 3) * coeff)
    y.backward(torch.full_like(y, float(r)))
    assert torch.equal(x.grad, torch.cat([torch.full((2, 3), float(i)) for i in range(tp)]))


def _check_linear_pair(ref, par, x_full, x_local, dy_full, dy_local, out_full_fn, group, w_dim):
    y_ref, _ = ref(x_full)
    y_ref.backward(dy_full)
    y_par, _ = par(x_local)
    y_par.backward(dy_local)
    torch.testing.assert_close(out_full_fn(y_par), y_ref, **TOL)
    return y_ref, y_par


def _check_sequence_parallel_column_keeps_its_part(fc1, fc2, x_part, dy_part, ref1, group, tp: int) -> None:
    """Under SP the column-parallel layer keeps its part of the sequence for the backward, not the all-gathered
    input (megatron-core's way: the backward gathers it again for the weight gradient), and its weight gradient
    deferred by a :class:`DeferredWeightGrad` is drained as the one process computes it."""
    from lightning_megatron.tensor_parallel.deferred_wgrad import DeferredWeightGrad

    params = {p.untyped_storage().data_ptr() for p in fc1.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t.numel())
        return t

    x = x_part.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fc1(x)
    assert saved == [x.numel()], (saved, x.numel())
    deferral = DeferredWeightGrad()
    fc1.weight_grad_deferral = deferral
    fc1.weight.grad = None
    deferral.open()
    try:
        fc2(F.gelu(fc1(x)[0]))[0].backward(dy_part)
        assert fc1.weight.grad is None and deferral.pending == 1
        drained = {}
        deferral.drain(lambda weight, grad, microbatches=1: drained.setdefault(id(weight), grad))
    finally:
        fc1.weight_grad_deferral = None
    torch.testing.assert_close(_gather(drained[id(fc1.weight)], group, 0), ref1.weight.grad, **TOL)


def _layers_worker(tp: int, shm: bool = False) -> None:
    ps = initialize_model_parallel(ParallelDims(tp=tp))
    if shm:
        comm = enable_shared_memory_collectives(ps.tp_group)
        assert comm is not None
        ps.set_communicator("tp", comm)
    g, r = ps.group("tp"), ps.tp_rank
    s, b, h, ffn = 8, 2, 8, 16

    def seeded(fn, seed):
        torch.manual_seed(seed)
        return fn()

    x_data = seeded(lambda: torch.randn(s, b, h), 1)
    dy_ffn = seeded(lambda: torch.randn(s, b, ffn), 2)
    dy_h = seeded(lambda: torch.randn(s, b, h), 3)

    # ColumnParallelLinear, gather_output off and on
    for gather_output in (False, True):
        ref = seeded(lambda: ColumnParallelLinear(h, ffn, bias=True), 10)
        with torch.no_grad():
            ref.bias.normal_()  # non-trivial bias
        par = seeded(lambda: ColumnParallelLinear(h, ffn, bias=True, gather_output=gather_output, tp_group=g), 10)
        with torch.no_grad():
            par.bias.copy_(ref.bias.chunk(tp)[r])
        assert par.weight.shape == (ffn // tp, h)
        torch.testing.assert_close(par.weight, ref.weight.chunk(tp, 0)[r], atol=0, rtol=0)
        xr, xp = x_data.clone().requires_grad_(), x_data.clone().requires_grad_()
        y_ref, _ = ref(xr)
        y_ref.backward(dy_ffn)
        y_par, _ = par(xp)
        y_par.backward(dy_ffn if gather_output else dy_ffn.chunk(tp, -1)[r])
        full = y_par if gather_output else _gather(y_par, g, -1)
        torch.testing.assert_close(full, y_ref, **TOL)
        torch.testing.assert_close(xp.grad, xr.grad, **TOL)
        torch.testing.assert_close(_gather(par.weight.grad, g, 0), ref.weight.grad, **TOL)
        torch.testing.assert_close(_gather(par.bias.grad, g, 0), ref.bias.grad, **TOL)

    # RowParallelLinear, input_is_parallel off and on
    x_ffn = seeded(lambda: torch.randn(s, b, ffn), 4)
    for input_is_parallel in (False, True):
        ref = seeded(lambda: RowParallelLinear(ffn, h), 20)
        with torch.no_grad():
            ref.bias.normal_()
        par = seeded(lambda: RowParallelLinear(ffn, h, input_is_parallel=input_is_parallel, tp_group=g), 20)
        with torch.no_grad():
            par.bias.copy_(ref.bias)
        assert par.weight.shape == (h, ffn // tp)
        xr = x_ffn.clone().requires_grad_()
        xp = (x_ffn.chunk(tp, -1)[r] if input_is_parallel else x_ffn).clone().requires_grad_()
        y_ref, _ = ref(xr)
        y_ref.backward(dy_h)
        y_par, _ = par(xp)
        y_par.backward(dy_h)
        torch.testing.assert_close(y_par, y_ref, **TOL)
        expected_dx = xr.grad.chunk(tp, -1)[r] if input_is_parallel else xr.grad
        torch.testing.assert_close(xp.grad, expected_dx, **TOL)
        torch.testing.assert_close(_gather(par.weight.grad, g, 1), ref.weight.grad, **TOL)
        torch.testing.assert_close(par.bias.grad, ref.bias.grad, **TOL)

    # Column -> GeLU -> Row MLP, plain and sequence parallel
    for sp in (False, True):
        def mlp(group, seq_par):
            fc1 = ColumnParallelLinear(h, ffn, tp_group=group, sequence_parallel=seq_par)
            fc2 = RowParallelLinear(ffn, h, tp_group=group, input_is_parallel=True, sequence_parallel=seq_par)
            return fc1, fc2
        ref1, ref2 = seeded(lambda: mlp(None, False), 30)
        par1, par2 = seeded(lambda: mlp(g, sp), 30)
        xr = x_data.clone().requires_grad_()
        x_in = (x_data.chunk(tp, 0)[r] if sp else x_data).clone().requires_grad_()
        y_ref = ref2(F.gelu(ref1(xr)[0]))[0]
        y_ref.backward(dy_h)
        y_par = par2(F.gelu(par1(x_in)[0]))[0]
        y_par.backward(dy_h.chunk(tp, 0)[r] if sp else dy_h)
        if sp:
            all_reduce_sequence_parallel_grads([par2.bias], g)
            torch.testing.assert_close(_gather(y_par, g, 0), y_ref, **TOL)
            torch.testing.assert_close(x_in.grad, xr.grad.chunk(tp, 0)[r], **TOL)
        else:
            torch.testing.assert_close(y_par, y_ref, **TOL)
            torch.testing.assert_close(x_in.grad, xr.grad, **TOL)
        torch.testing.assert_close(_gather(par1.weight.grad, g, 0), ref1.weight.grad, **TOL)
        torch.testing.assert_close(_gather(par1.bias.grad, g, 0), ref1.bias.grad, **TOL)
        torch.testing.assert_close(_gather(par2.weight.grad, g, 1), ref2.weight.grad, **TOL)
        torch.testing.assert_close(par2.bias.grad, ref2.bias.grad, **TOL)
        if sp:
            _check_sequence_parallel_column_keeps_its_part(par1, par2, x_in, dy_h.chunk(tp, 0)[r], ref1, g, tp)

    # VocabParallelEmbedding with a padded vocab
    vocab = pad_vocab_size(50, tp, make_vocab_size_divisible_by=4)
    ref = seeded(lambda: VocabParallelEmbedding(vocab, h), 40)
    par = seeded(lambda: VocabParallelEmbedding(vocab, h, tp_group=g), 40)
    ids = seeded(lambda: torch.randint(0, 50, (b, s)), 5)
    y_ref, y_par = ref(ids), par(ids)
    dy = seeded(lambda: torch.randn(b, s, h), 6)
    y_ref.backward(dy)
    y_par.backward(dy)
    torch.testing.assert_close(y_par, y_ref, **TOL)
    torch.testing.assert_close(_gather(par.weight.grad, g, 0), ref.weight.grad, **TOL)


@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
@pytest.mark.parametrize("tp", [2, 4], ids=lambda t: f"tp{t}")
def test_mappings_forward_and_backward(tp, shm):
    run_distributed(_mappings_worker, tp, tp, shm, timeout=120)


@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
@pytest.mark.parametrize("tp", [2, 4], ids=lambda t: f"tp{t}")
def test_layers_equal_one_process(tp, shm):
    run_distributed(_layers_worker, tp, tp, shm, timeout=120)


def test_mappings_are_identity_without_group():
    x = torch.randn(3, 4, requires_grad=True)
    for fn in (copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
               scatter_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region,
               scatter_to_sequence_parallel_region, gather_from_sequence_parallel_region,
               reduce_scatter_to_sequence_parallel_region):
        assert fn(x, None) is x


def _bad_output_size_worker() -> str:
    ps = initialize_model_parallel(ParallelDims(tp=2))
    try:
        ColumnParallelLinear(8, 7, tp_group=ps.tp_group)
    except ValueError as e:
        msg_col = str(e)
    else:
        raise AssertionError("ColumnParallelLinear accepted output_size=7 at TP=2")
    with pytest.raises(ValueError, match="input_size=5 is not divisible by tensor_model_parallel_size=2"):
        RowParallelLinear(5, 8, tp_group=ps.tp_group)
    return msg_col


def test_bad_layer_sizes_raise_with_numbers():
    msgs = run_distributed(_bad_output_size_worker, 2, timeout=60)
    assert "output_size=7 is not divisible by tensor_model_parallel_size=2" in msgs[0]


