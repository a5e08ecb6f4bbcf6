"""The fp32 grad buffer (lightning_megatron.grads): microbatches summed in fp32, DP mean, one fp32 copy,
overlapped bucket reductions bitwise equal to reductions after backward, hooks scoped."""

from __future__ import annotations

import torch
from torch import nn

from dist_utils import run_distributed
from lightning_megatron.tensor_parallel.param_facts import mark_replicated
from lightning_megatron.parallel_dims import ParallelDims

MICROBATCHES = 3


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    # A bf16 layer that gets no gradient, a bf16 layer and an fp32 layer. "unused" comes first in
    # model order, so last in buffer order: it does not hold back the buckets before it.
    model = nn.ModuleDict({"unused": nn.Linear(4, 4, dtype=dtype), "a": nn.Linear(16, 32, dtype=dtype),
                           "b": nn.Linear(32, 4)})
    mark_replicated(model.parameters())  # plain layers: replicated (what the strategy declares at set-up)
    return model


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model["b"](torch.tanh(model["a"](x)).float()).square().mean()


def _worker() -> dict[str, object]:
    import torch.distributed as dist

    from lightning_megatron.grads import GradBuffer, buffer_order, finalize_model_grads
    from lightning_megatron.parallel_state import initialize_model_parallel
    from lightning_megatron.cpu.shared_memory import enable_shared_memory_collectives

    ps = initialize_model_parallel(ParallelDims(tp=1, pp=1))
    rank = dist.get_rank()
    inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * rank + i)).bfloat16()
              for i in range(MICROBATCHES)]

    # Reference: each microbatch's grad on its own (bf16 for bf16 params), summed in fp32, DP mean.
    model = _model(torch.bfloat16)
    expected = {}
    for x in inputs:
        model.zero_grad(set_to_none=True)
        _loss(model, x).backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                expected[name] = expected.get(name, 0) + p.grad.double()
    for name in expected:
        dist.all_reduce(expected[name])
        expected[name] /= dist.get_world_size()

    out: dict[str, object] = {"runs": {}}
    for shm in (False, True):
        if shm:
            comm = enable_shared_memory_collectives(ps.dp_group)
            assert comm is not None
            ps.set_communicator("dp", comm)
        for overlap in (False, True):
            model = _model(torch.bfloat16)
            # 600-byte buckets: a.weight, a.bias + b.*, unused.* end up in different buckets
            buffer = GradBuffer(buffer_order([model]), bucket_bytes=600, pad_to=2, dp_group=ps.group("dp"),
                                overlap_grad_reduce=overlap)
            run: dict[str, object] = {"ptrs": [], "freed": True, "launched_in_backward": []}
            for _step in range(2):
                buffer.start(MICROBATCHES)
                for x in inputs:
                    _loss(model, x).backward()
                    # The hook frees every grad as soon as it is added into the fp32 buffer.
                    run["freed"] = run["freed"] and all(p.grad is None for p in model.parameters())
                run["launched_in_backward"].append(buffer._next_launch)
                finalize_model_grads(buffer, ps)
                run["ptrs"].append({n: p.main_grad.data_ptr() for n, p in model.named_parameters()})
                run["grads"] = {n: p.main_grad.clone() for n, p in model.named_parameters()}
                run["errors"] = {n: (p.main_grad.double() - expected[n]).abs().max().item()
                                 for n, p in model.named_parameters() if n in expected}
                run["unused_zero"] = all(torch.equal(p.main_grad, torch.zeros_like(p.main_grad))
                                         for n, p in model.named_parameters() if n.startswith("unused"))
            # One fp32 copy: every main grad is a view of the buffer, which is 4 bytes per parameter
            # plus less than the DP size of padding per bucket.
            numel = sum(p.numel() for p in model.parameters())
            run["bytes"] = (buffer.memory_bytes(), 4 * numel, len(buffer.buckets))
            run["all_views"] = all(buffer.holds(p.main_grad) and p.main_grad.dtype == torch.float32
                                   for p in model.parameters())
            buffer.set_param_grads()  # for a plain torch optimizer: fp32 .grad IS main_grad
            run["fp32_grad_is_view"] = all(buffer.holds(p.grad) for p in model.parameters()
                                           if p.dtype == torch.float32)
            # Outside start() / finalize the hooks stay out of the way.
            model.zero_grad(set_to_none=True)
            _loss(model, inputs[0]).backward()
            run["grad_outside"] = model["a"].weight.grad is not None and model["a"].weight.grad.dtype == torch.bfloat16
            buffer.remove()
            run["removed"] = not any(hasattr(p, "main_grad") for p in model.parameters())
            out["runs"][(shm, overlap)] = run
        if shm:
            ps.set_communicator("dp", None)
    # A parameter used in two separately recomputed layers: each recomputation runs its own backward pass, so its
    # gradient reaches the buffer twice in a microbatch, and with the overlapped reduction the second would come
    # after its bucket's reduction had started (lost to the other rank): refused, on every rank, not lost.
    from lightning_megatron.tensor_parallel import recompute

    shared = nn.Linear(16, 16)
    mark_replicated(shared.parameters())
    buffer = GradBuffer(buffer_order([shared]), dp_group=ps.group("dp"), overlap_grad_reduce=True)
    buffer.start(1)
    x = inputs[0].float().requires_grad_()
    try:
        recompute(shared, torch.tanh(recompute(shared, x))).square().mean().backward()
        out["reused_refused"] = ""
    except RuntimeError as e:
        out["reused_refused"] = str(e)
    for b in buffer.buckets:  # the reduction the first gradient started
        if b.handle is not None:
            b.handle.wait()
    buffer.remove()
    # A bf16 sum of the microbatch grads: what the fp32 buffer avoids.
    model = _model(torch.bfloat16)
    for x in inputs:
        _loss(model, x).backward()
    bf16_sum = model["a"].weight.grad.double()
    dist.all_reduce(bf16_sum)
    out["bf16_sum_error"] = (bf16_sum / dist.get_world_size() - expected["a.weight"]).abs().max().item()
    return out


def test_grad_buffer_sums_microbatches_in_fp32_overlaps_and_holds_one_copy():
    results = run_distributed(_worker, 2, timeout=120)
    for r in results:
        assert "after its bucket's data-parallel reduction had started" in r["reused_refused"], r["reused_refused"]
        base = r["runs"][(False, False)]
        for (shm, overlap), run in r["runs"].items():
            # fp32 sums of bf16 grads, then the fp32 DP mean: rounding of the last fp32 op only.
            assert max(run["errors"].values()) < 1e-6, run["errors"]
            assert r["bf16_sum_error"] > 10 * max(run["errors"].values()), "the test must tell fp32 from bf16 sums"
            assert run["freed"]
            assert run["ptrs"][0] == run["ptrs"][1], "persistent buffer: no fresh fp32 grads per step"
            assert run["unused_zero"]
            # Overlap on or off, gloo or shared memory: the same collectives on the same bytes.
            for name, g in run["grads"].items():
                assert torch.equal(g, base["grads"][name]), (shm, overlap, name)
            # With overlap, the buckets before "unused" started during the last backward.
            assert all(n >= 2 for n in run["launched_in_backward"]) if overlap else \
                run["launched_in_backward"] == [0, 0], run["launched_in_backward"]
            buffer_bytes, param_bytes, buckets = run["bytes"]
            assert buckets >= 3
            assert param_bytes <= buffer_bytes < param_bytes + 4 * 2 * buckets
            assert run["all_views"] and run["fp32_grad_is_view"]
            assert run["grad_outside"] and run["removed"]


def test_cpu_grad_accumulation_is_bitwise_add_and_is_what_the_cpu_tuning_installs():
    from lightning_megatron.cpu import CPUTuning
    from lightning_megatron.cpu.accumulate import CHUNK_ELEMENTS, accumulate_grad
    from lightning_megatron.grads import GradBuffer

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n in (7, CHUNK_ELEMENTS, CHUNK_ELEMENTS + 1, 3 * CHUNK_ELEMENTS + 7):
            main = torch.randn(n, generator=gen)
            grad = (torch.randn(n, generator=gen) * 1e-3).to(dtype)
            expected = main.clone().add_(grad)
            accumulate_grad(main, grad)
            assert torch.equal(main, expected), (dtype, n)
    # Non-contiguous operands take torch's add_ (the same bits).
    main, grad = torch.randn(300, 700, generator=gen), torch.randn(700, 300, generator=gen).bfloat16().t()
    expected = main.clone().add_(grad)
    accumulate_grad(main, grad)
    assert torch.equal(main, expected)

    # In the buffer: three bf16 microbatches, fp32 sums equal to the default accumulation.
    def run(accumulate):
        torch.manual_seed(0)
        layer = nn.Linear(512, 384).bfloat16()
        buffer = GradBuffer(list(layer.parameters()), accumulate=accumulate)
        buffer.start(3)
        for i in range(3):
            layer(torch.randn(16, 512, generator=torch.Generator().manual_seed(i)).bfloat16()).square().sum().backward()
        buffer.finish_grad_sync()
        out = layer.weight.main_grad.clone()
        buffer.remove()
        return out

    assert 512 * 384 > CHUNK_ELEMENTS  # the weight goes through the pieces
    assert torch.equal(run(accumulate_grad), run(None))
    assert CPUTuning().grad_accumulation(torch.device("cpu")) is accumulate_grad
    assert CPUTuning(kernels=False).grad_accumulation(torch.device("cpu")) is None
    assert CPUTuning().grad_accumulation(torch.device("meta")) is None
    assert CPUTuning().grad_buffer_options(torch.device("cpu"))["accumulate"] is accumulate_grad
    assert CPUTuning().grad_buffer_options(torch.device("meta")) == {"accumulate": None, "norm_piece": None,
                                                                    "decide_on_host": False}


def test_row_sparse_word_embedding_grad_is_bitwise_the_dense_one():
    """The CPU tuning's first-stage word-embedding gradient as rows (cpu/embedding_grad.py): the row sums of the
    lookup without it (``tensor_parallel/embedding.py``: torch's CPU embedding backward in fp32, its rows summed in
    fp32 in bf16), bit for bit, and main_grad as the hook leaves it."""
    from lightning_megatron.cpu import CPUTuning
    from lightning_megatron.cpu.embedding_grad import RowSparseEmbeddingGrad, row_sums
    from lightning_megatron.grads import GradBuffer
    from lightning_megatron.parallel_state import ParallelState
    from lightning_megatron.tensor_parallel import WeightGradPolicy
    from lightning_megatron.tensor_parallel.embedding import embedding

    gen = torch.Generator().manual_seed(0)
    vocab, hidden = 3000, 48
    batches = []
    for i in range(3):
        ids = torch.randint(0, 40 if i == 1 else vocab, (2, 64), generator=gen)
        ids[0, :30] = 7  # a long run of one token: 30 additions in order
        batches.append(ids)
    for dtype in (torch.bfloat16, torch.float32):
        grads = [torch.randn(2, 64, hidden, generator=gen).to(dtype) for _ in batches]
        weight = torch.randn(vocab, hidden, generator=gen).to(dtype).requires_grad_()
        embedding(batches[0], weight).backward(grads[0])
        rows, sums = row_sums(batches[0], grads[0])
        assert torch.equal(weight.grad[rows], sums) and int(weight.grad.abs().sum(1).ne(0).sum()) <= len(rows)

        def main_grad(row_sparse: bool) -> torch.Tensor:
            w = torch.nn.Parameter(weight.detach().clone())
            buffer, lookup = GradBuffer([w]), RowSparseEmbeddingGrad()
            buffer.start(len(batches))
            if row_sparse:
                lookup.open(buffer.add_grad_rows)
            for ids, g in zip(batches, grads):
                lookup.lookup(ids, w).backward(g)
            lookup.close()
            assert w.grad is None
            buffer.finish_grad_sync()
            out = w.main_grad.clone()
            buffer.remove()
            return out

        assert torch.equal(main_grad(True), main_grad(False)), dtype
    # Installed by the tuning on a pipeline's first stage only, and never off the CPU.
    embedding = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    none = {"embedding_grad_rows": 0, "weight_grads_per_step": 0}
    tuning = CPUTuning(weight_grads_per_step=True)
    assert tuning.configure_grads(WeightGradPolicy(), embedding, ParallelState.single_process(),
                                  torch.device("cpu")) == none


def test_finiteness_check_of_the_grad_buffer_is_exact():
    """The training step's NaN/Inf guard (``StepRunner._check_finite``, one ``aminmax`` over the fp32 buffer): the
    largest finite gradients pass (no overflow of a sum), a single +inf, -inf or NaN anywhere stops the step and
    names its parameter; so does the error the optimizers' pass raises through ``non_finite_grads`` when the step
    checked only the loss (``grads=False``), and a non-finite loss still names a non-finite gradient."""
    import pytest

    from lightning_megatron.grads import GradBuffer
    from lightning_megatron.step import NonFiniteLossOrGradError, StepRunner

    a, b = nn.Parameter(torch.zeros(3, 4)), nn.Parameter(torch.zeros(1000))
    buffer = GradBuffer([a, b])
    runner = StepRunner.__new__(StepRunner)  # only what the guard reads: the parameters' names
    runner.named_parameters = [("a", a), ("b", b)]
    finfo = torch.finfo(torch.float32)
    buffer.data.fill_(finfo.max)
    buffer.data[::2] = -finfo.max  # sums of these would overflow fp32 many times over
    runner._check_finite(buffer, torch.tensor(2.5), 7, False)
    for bad, word in ((float("inf"), "inf"), (-float("inf"), "inf"), (float("nan"), "nan")):
        buffer.data.zero_()
        buffer.main_grad_of(b)[999] = bad
        with pytest.raises(NonFiniteLossOrGradError, match=rf"at step 7 .*the gradient is not finite \({word}\); "
                                                             r"first parameter with a non-finite gradient on rank 0: b"):
            runner._check_finite(buffer, torch.tensor(2.5), 7, False)
        # The optimizer's pass found it (grads=False here: the loss only, then the optimizer's hook).
        runner._check_finite(buffer, torch.tensor(2.5), 7, False, grads=False)
        with pytest.raises(NonFiniteLossOrGradError, match=rf"at step 7 .*the gradient is not finite \({word}\); "
                                                             r"first parameter with a non-finite gradient on rank 0: b"):
            runner.non_finite_grads(buffer, 7)
    buffer.data.zero_()
    for grads in (True, False):  # a non-finite loss checks the gradients too, for the message
        with pytest.raises(NonFiniteLossOrGradError, match=r"the loss is nan; no gradient is non-finite"):
            runner._check_finite(buffer, torch.tensor(float("nan")), 7, False, grads=grads)
    buffer.main_grad_of(a)[1, 2] = float("nan")
    with pytest.raises(NonFiniteLossOrGradError, match=r"the loss is nan and the gradient is not finite \(nan\); "
                                                         r"first parameter with a non-finite gradient on rank 0: a"):
        runner._check_finite(buffer, torch.tensor(float("nan")), 7, False, grads=False)
