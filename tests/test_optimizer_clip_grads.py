"""Model-parallel gradient norm and clipping equal torch.nn.utils.clip_grad_norm_ on the one-process model.

The "model" is a list of parameters with known full gradients; each rank holds its tensor-parallel
slice or replica of the parameters of its pipeline stage, with Megatron's metadata, exactly as the
parallel layers would leave them. Tolerance: 1e-6 relative on the norm, 1e-6 on the clipped grads.
"""

from __future__ import annotations

import math

import pytest
import torch

from dist_utils import run_distributed
from lightning_megatron.optimizer import clip_grad_norm, count_zeros_fp32, get_grad_norm_fp32, grads_for_norm
from lightning_megatron.tensor_parallel.param_facts import set_param_facts
from lightning_megatron.parallel_dims import ParallelDims

# name, full shape, how TP holds it (col: split dim 0, row: split dim 1, rep: replicated), pipeline stage
# ("both": the tied word embedding on the first and the last stage).
SPECS = [
    ("word_embedding", (12, 6), "col", "both"),
    ("fc1.weight", (8, 6), "col", 0),
    ("fc1.bias", (8,), "col", 0),
    ("fc2.weight", (6, 8), "row", 0),
    ("fc2.bias", (6,), "rep", 0),
    ("norm.weight", (6,), "rep", 1),
    ("head.weight", (10, 6), "col", 1),
    ("head.bias", (10,), "rep", 1),
]
CASES = [(2.0, 0.5), (2.0, 1e3), (math.inf, 0.5), (math.inf, 1e3)]  # (norm_type, max_norm): clip and no-clip


def _full_grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    grads = {name: torch.randn(shape, generator=g) for name, shape, _, _ in SPECS}
    grads["fc1.weight"][::3] = 0.0  # zeros for count_zeros
    grads["head.bias"][:4] = 0.0
    return grads


def _reference(norm_type: float, max_norm: float) -> tuple[float, dict[str, torch.Tensor], int]:
    full = _full_grads()
    params = {}
    for name, grad in full.items():
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad.clone()
        params[name] = p
    zeros = sum(int((p.grad == 0).sum()) for p in params.values())
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm, norm_type)
    return float(norm), {n: p.grad for n, p in params.items()}, zeros


def _local_params(tp: int, tp_rank: int, pp: int, pp_rank: int) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters with the full grads sliced as the parallel layers would hold them."""
    out = {}
    for name, _, kind, stage in SPECS:
        here = pp_rank in (0, pp - 1) if stage == "both" else stage % pp == pp_rank
        if not here:
            continue
        grad = _full_grads()[name]
        if kind != "rep":
            dim = 0 if kind == "col" else 1
            grad = grad.chunk(tp, dim=dim)[tp_rank]
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad.clone()
        set_param_facts(p, sharded_over=() if kind == "rep" else ("tp",), replicated_over=("tp",) if kind == "rep" else (),
                        partition_dim=-1 if kind == "rep" else 0 if kind == "col" else 1, shared_embedding=stage == "both")
        out[name] = p
    return out


def _slice(name: str, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    kind = next(k for n, _, k, _ in SPECS if n == name)
    return full if kind == "rep" else full.chunk(tp, dim=0 if kind == "col" else 1)[tp_rank]


def _check_layouts(layouts: list[tuple[int, int]]) -> list[dict]:
    from lightning_megatron.parallel_state import initialize_model_parallel

    import torch.distributed as dist

    results = []
    for tp, pp in layouts:
        ps = initialize_model_parallel(ParallelDims(tp=tp, pp=pp))
        # What a user porting Megatron code does first: torch.distributed on the groups the state exposes.
        torch_groups = {name: getattr(ps, f"{name}_group") for name in
                        ("tp", "cp", "dp", "dp_cp", "pp", "mp", "ep", "expert_tp", "expert_dp", "embedding")}
        seen = {}
        for name, g in torch_groups.items():
            if g is None:  # a middle pipeline stage holds no embedding group
                seen[name] = None
                continue
            ones = torch.ones(1)
            dist.all_reduce(ones, group=g)
            seen[name] = (dist.get_world_size(g), dist.get_rank(g), dist.get_process_group_ranks(g),
                          int(ones.item()), ps.dims.group_ranks(name))
        for norm_type, max_norm in CASES:
            ref_norm, ref_grads, ref_zeros = _reference(norm_type, max_norm)
            params = _local_params(tp, ps.tp_rank, pp, ps.pp_rank)
            kwargs = dict(model_parallel_group=ps.mp_group, coordinates=ps.coordinates)
            zeros = count_zeros_fp32(params.values(), **kwargs)
            unclipped = get_grad_norm_fp32(grads_for_norm(params.values(), coordinates=ps.coordinates),
                                           norm_type, ps.mp_group)
            norm = clip_grad_norm(params.values(), max_norm, norm_type, **kwargs)
            grad_err = max(
                float((p.grad - _slice(n, ref_grads[n], tp, ps.tp_rank)).abs().max()) for n, p in params.items()
            )
            results.append(dict(layout=(tp, pp), norm_type=norm_type, max_norm=max_norm, norm=norm,
                                unclipped=unclipped, ref_norm=ref_norm, grad_err=grad_err, zeros=zeros,
                                ref_zeros=ref_zeros, groups=seen, rank=dist.get_rank()))
    return results


def _assert_results(per_rank: list[list[dict]]) -> None:
    for rank_results in per_rank:
        for r in rank_results:
            tag = f"layout tp,pp={r['layout']} p={r['norm_type']} max_norm={r['max_norm']}"
            for name, got in r["groups"].items():  # torch.distributed takes every group of the state
                assert got is not None, f"{tag}: {name} group is None"
                size, rank, ranks, total, layout_groups = got
                assert ranks in layout_groups and r["rank"] in ranks, (tag, name, ranks)
                assert size == len(ranks) == total and rank == ranks.index(r["rank"]), (tag, name, got)
            assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-6), tag
            assert r["unclipped"] == r["norm"], tag
            assert r["grad_err"] <= 1e-6, tag
            assert r["zeros"] == r["ref_zeros"], tag
    # Every rank saw the same norm (one decision for the whole replica).
    assert len({r["norm"] for rank_results in per_rank for r in rank_results
                if r["norm_type"] == 2.0 and r["layout"] == per_rank[0][0]["layout"]}) == 1


def test_single_process_equals_torch():
    for norm_type, max_norm in CASES:
        ref_norm, ref_grads, ref_zeros = _reference(norm_type, max_norm)
        params = _local_params(1, 0, 1, 0)
        assert count_zeros_fp32(params.values()) == ref_zeros
        assert clip_grad_norm(params.values(), max_norm, norm_type) == pytest.approx(ref_norm, rel=1e-6)
        for n, p in params.items():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(params.values(), 0.0)


def test_duplicates_would_change_the_norm():
    """Guard for the test itself: counting replicas twice gives a different norm."""
    params = _local_params(1, 0, 1, 0)
    wrong = get_grad_norm_fp32([p.grad for p in params.values()] + [params["fc2.bias"].grad])
    assert wrong != pytest.approx(get_grad_norm_fp32([p.grad for p in params.values()]), rel=1e-6)


def _overflow_on_one_rank() -> list[bool]:
    """A Float16 wrapper per rank of a TP=2 group; only rank 1 sees an inf. Both must skip."""
    import torch.distributed as dist

    from lightning_megatron.optimizer import DynamicGradScaler, Float16OptimizerWithFloat16Params
    from lightning_megatron.parallel_state import initialize_model_parallel

    ps = initialize_model_parallel(ParallelDims(tp=2, pp=1))
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    set_param_facts(w, sharded_over=("tp",), replicated_over=(), partition_dim=0)
    opt = Float16OptimizerWithFloat16Params(
        torch.optim.SGD([w], lr=0.1),
        grad_scaler=DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                                      growth_interval=10, hysteresis=1),
        model_parallel_group=ps.mp_group, coordinates=ps.coordinates)
    skipped = []
    for step in range(2):
        w.grad = torch.full((4,), 8.0, dtype=torch.bfloat16)
        if step == 0 and dist.get_rank() == 1:
            w.grad[2] = float("inf")
        opt.step()
        skipped.append(opt.last_step_skipped)
    return skipped + [float(w[0]), float(opt.get_loss_scale().item())]


def _world2() -> tuple[list[dict], list]:
    return _check_layouts([(2, 1), (1, 2)]), _overflow_on_one_rank()


def test_tp2_and_pp2():
    per_rank = run_distributed(_world2, 2, timeout=120)
    _assert_results([r[0] for r in per_rank])
    # inf on rank 1 only: both ranks skip step 0 (MAX-reduced flag), halve the scale, and take step 1
    # with grad 8 / 4 = 2: w = 1 - 0.1 * 2 on both.
    for _, overflow in per_rank:
        assert overflow[:2] == [True, False] and overflow[2] == pytest.approx(0.8, abs=4e-3) and overflow[3] == 4.0


def test_tp2_pp2_and_tp2_dp2():
    per_rank = run_distributed(_check_layouts, 4, [(2, 2), (2, 1)], timeout=180)
    _assert_results(per_rank)


def test_l2_norm_is_exact_however_the_gradient_is_cut():
    """fp64 sums of squares: one tensor, 7 pieces (a TP / DP cut) and the found-inf path give the
    exact norm within 1e-12; an fp32 accumulation is off by ~4e-4 on this 4M-element gradient."""
    from lightning_megatron.optimizer.clip_grads import grad_norm_and_found_inf

    g = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 1e-3
    g[:100] += 0.5  # a few large entries, as in a word embedding's gradient
    exact = math.sqrt(math.fsum((g.double() ** 2).tolist()))
    norms = {"whole": get_grad_norm_fp32([g]), "pieces": get_grad_norm_fp32(list(g.chunk(7))),
             # an empty gradient, a transposed one and a short one after a long one (the reused scratch)
             "shapes": get_grad_norm_fp32([g[:0], g[: 1 << 21].view(1024, 2048).t(), g[1 << 21:], g[:0]]),
             "found_inf_path": grad_norm_and_found_inf(list(g.chunk(3)), [g[:10]])[0]}
    for name, norm in norms.items():
        assert abs(norm - exact) <= 1e-12 * exact, (name, norm, exact)
    fp32 = torch.linalg.vector_norm(g, 2, dtype=torch.float32).item()
    assert abs(fp32 - exact) > 1e-5 * exact, "the test must tell an fp32 accumulation from an exact one"


def test_l2_norm_is_one_fused_kernel_by_default_and_the_cpu_tuning_passes_cache_sized_pieces(monkeypatch):
    """By default (the accelerators' way) the fp64 squares are one fused ``torch._foreach_norm`` with fp64 sums
    over every gradient, whatever their sizes and the host's threads: on a GPU one multi-tensor kernel reads
    each gradient once (the fp64 ``dot`` of 16 Mi-element pieces took 16 ms of bert-large's 136 ms step on an
    H200; with 64 Ki elements per host thread, torchrun's ``OMP_NUM_THREADS=1`` would have made a 7 B-parameter
    gradient ~110,000 pieces). Gradients longer than 16 Mi elements go to it as views of 16 Mi: where torch's
    fp64 foreach norm goes tensor by tensor (a CPU), each tensor's fp64 copy stays within 128 MiB. The opt-in CPU
    tuning passes cache-sized pieces (``CPUTuning.norm_piece``; the strategy hands them to the optimizers with the
    grad buffer), none off the CPU. The meta device stands in for an accelerator (shapes, no memory)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_megatron.cpu import CPUTuning
    from lightning_megatron.optimizer.clip_grads import sum_of_squares_fp64

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grads = [torch.empty(1 << 25, device="meta"), torch.empty(3, device="meta"), torch.empty(0, device="meta"),
                 torch.empty(3 << 22, device="meta").view(3, 1 << 22)]
        handed: list[list[int]] = []
        foreach_norm = torch._foreach_norm
        monkeypatch.setattr(torch, "_foreach_norm", lambda ts, *a, **k: handed.append([t.numel() for t in ts])
                            or foreach_norm(ts, *a, **k))
        with Ops() as ops:
            total = sum_of_squares_fp64(grads)
        assert total.device.type == "meta" and total.dtype == torch.float64 and total.dim() == 0
        # one fused norm; the rest are views (the long gradients' pieces) and three small ops on the norms
        assert ops.names.count("_foreach_norm.Scalar") == 1, ops.names
        assert set(ops.names) <= {"_foreach_norm.Scalar", "stack.default", "pow.Tensor_Scalar", "sum.default",
                                  "view.default", "slice.Tensor", "_reshape_alias.default"}, ops.names
        # no tensor over 16 Mi elements: where torch's norm goes tensor by tensor (a CPU) it makes an fp64 copy of
        # each, so the largest transient is 128 MiB however large a gradient is (a 7 B model's word embedding: 4 GiB)
        assert handed == [[1 << 24, 1 << 24, 3, 0, 3 << 22]], handed
        cpu = torch.device("cpu")
        tuned = CPUTuning().norm_piece(cpu)
        assert tuned is not None and 1 << 16 < tuned <= 1 << 20  # cache-sized
        assert CPUTuning().norm_piece(torch.device("meta")) is None and CPUTuning(kernels=False).norm_piece(cpu) is None
        pieces: list[int] = []
        dot = torch.dot
        monkeypatch.setattr(torch, "dot", lambda a, b: pieces.append(a.numel()) or dot(a, b))
        g = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0))
        total = sum_of_squares_fp64([g], piece=tuned)
        assert len(pieces) >= 4 and sum(pieces) == g.numel()
        assert abs(total.item() - math.fsum((g.double() ** 2).tolist())) <= 1e-12 * total.item()
        with pytest.raises(ValueError, match="piece=0 must be a positive number of elements"):
            sum_of_squares_fp64([g], piece=0)
    finally:
        torch.set_num_threads(threads)


def test_the_fused_l2_norm_is_exact_in_every_dtype_and_propagates_what_is_not_finite():
    """The default's fp64 sums over fp32, bf16 and a mix of both (torch's foreach norm then goes tensor by
    tensor), against ``math.fsum`` of the exact squares, within 1e-12 (the per-tensor norm's root squared back:
    two roundings of fp64); an inf or a nan in any gradient makes the sum inf or nan (the found-inf check). The GPU
    check runs it on the GPU (``gpu_check.TEST_FILES``), where the fused multi-tensor kernel does the sums."""
    from lightning_megatron.optimizer.clip_grads import sum_of_squares_fp64

    gen, device = torch.Generator().manual_seed(1), torch.get_default_device()  # the GPU check runs it on a GPU
    fp32 = [(torch.randn(n, generator=gen, device="cpu") * s).to(device)
            for n, s in ((1 << 20, 1e-3), (4097, 2.0), (1, 1e-20), (0, 1.0))]
    bf16 = [t.bfloat16() for t in fp32]
    for name, grads in {"fp32": fp32, "bf16": bf16, "mixed": fp32[:2] + bf16[2:]}.items():
        exact = math.fsum(x * x for t in grads for x in t.double().tolist())
        total = sum_of_squares_fp64(grads)
        assert total.dtype == torch.float64 and abs(total.item() - exact) <= 1e-12 * exact, (name, total, exact)
    for bad, expected in ((math.inf, math.inf), (math.nan, math.nan)):
        grads = [t.clone() for t in fp32]
        grads[1][7] = bad
        total = sum_of_squares_fp64(grads).item()
        assert (math.isnan(total) if math.isnan(expected) else total == expected), (bad, total)
