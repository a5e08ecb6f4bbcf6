"""DistributedOptimizer (ZeRO-1): parity with the non-distributed wrappers, grad norm, memory, resume.

Every rank holds the same tiny hand-sharded model (TP attributes set as the parallel layers do) and
feeds both optimizers the same per-rank gradients: the DistributedOptimizer reduce-scatters the raw
grads itself; the reference (FP32Optimizer / Float16OptimizerWithFloat16Params on a copy of the
params) gets the DP mean as ``main_grad``. After every step the params must agree within 1e-6 and
the grad norms must be equal.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from lightning_megatron.tensor_parallel.param_facts import param_facts, set_param_facts
from lightning_megatron.parallel_dims import ParallelDims

STEPS = 10


def _tiny_model(tp: int, tp_rank: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Column (sharded) + row (sharded weight, duplicated bias) + norm + tied embedding; odd numel."""
    g = torch.Generator().manual_seed(100 + tp_rank)  # shards differ per TP rank, same over DP
    gd = torch.Generator().manual_seed(7)  # duplicated params: identical on every rank

    def param(shape, gen, **attrs):
        p = torch.nn.Parameter((0.5 * torch.randn(*shape, generator=gen)).to(dtype))
        set_param_facts(p, **attrs)
        return p

    return [
        param((6 // tp * 2, 5), g, sharded_over=("tp",), replicated_over=(), partition_dim=0),  # column weight
        param((6 // tp * 2,), g, sharded_over=("tp",), replicated_over=(), partition_dim=0),  # column bias
        param((3, 6 // tp * 2), g, sharded_over=("tp",), replicated_over=(), partition_dim=1),  # row weight
        param((3,), gd),  # row bias (duplicated over TP)
        param((5,), gd),  # norm weight (duplicated)
        param((7, 5), g, sharded_over=("tp",), replicated_over=(), partition_dim=0, shared_embedding=True),  # embedding
    ]


def _groups(params):
    # Two groups with their own hyperparameters (weight-decayed matrices, no decay on vectors).
    return [
        {"params": [p for p in params if p.dim() == 2], "weight_decay": 0.1, "lr": 1e-2},
        {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0, "lr": 3e-2},
    ]


def _grads(params, step, tp_rank, dp_rank, scale=1.0):
    out = []
    for i, p in enumerate(params):
        sharded = param_facts(p).tensor_model_parallel
        seed = 1000 * step + 10 * i + dp_rank + (100_000 * (tp_rank + 1) if sharded else 0)
        out.append(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return out


def _run_parity(ps, dtype, *, clip_grad=0.0, scaler_factory=None, inject_inf_step=None, fused=False):
    import torch.distributed as dist

    from lightning_megatron.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
    from lightning_megatron.grads import GradBuffer
    from lightning_megatron.optimizer.distrib_optimizer import DistributedOptimizer

    model = _tiny_model(ps.tp_size, ps.tp_rank, dtype)
    ref_model = [torch.nn.Parameter(p.detach().clone()) for p in model]
    for p, r in zip(model, ref_model):
        r.__dict__.update(p.__dict__)
    mp = dict(model_parallel_group=ps.mp_group, coordinates=ps.coordinates)
    # fused: ZeRO-1 clips and skips on the device, reading it once after the update; the reference (a plain
    # AdamW) decides on the host.
    opt = DistributedOptimizer(torch.optim.AdamW(_groups(model), betas=(0.9, 0.95), fused=fused), clip_grad=clip_grad,
                               data_parallel_group=ps.dp_group, grad_scaler=scaler_factory and scaler_factory(),
                               **mp)
    wrapper = FP32Optimizer if dtype == torch.float32 else Float16OptimizerWithFloat16Params
    # The reference reads fp32 DP-mean grads from a grad buffer of its own (the strategy's role).
    ref_buffer = GradBuffer(ref_model, bucket_bytes=float("inf"))
    ref = wrapper(torch.optim.AdamW(_groups(ref_model), betas=(0.9, 0.95)), clip_grad=clip_grad,
                  grad_scaler=scaler_factory and scaler_factory(), grad_buffer=ref_buffer, **mp)
    assert opt.decides_on_device() == fused and not ref.decides_on_device()
    max_diff, norms, skipped = 0.0, [], []
    for step in range(STEPS):
        grads = _grads(model, step, ps.tp_rank, ps.dp_rank, scale=1.0 if scaler_factory is None else 64.0)
        if step == inject_inf_step and ps.dp_rank == ps.dp_size - 1 and ps.tp_rank == 0:
            grads[3][0] = float("inf")  # one bad value on one rank: every rank must skip
        for p, g in zip(model, grads):
            p.grad = g.to(dtype)
        for r, g in zip(ref_model, grads):
            mean = g.to(dtype).float().clone()  # never alias the model grad
            dist.all_reduce(mean, group=ps.dp_group)
            ref_buffer.main_grad_of(r).copy_(mean / ps.dp_size)
            r.grad = None
        opt.step()
        ref.step()
        assert opt.last_step_skipped == ref.last_step_skipped
        skipped.append(opt.last_step_skipped)
        if not opt.last_step_skipped:
            assert abs(opt.last_grad_norm - ref.last_grad_norm) <= 1e-6 * ref.last_grad_norm, (
                opt.last_grad_norm, ref.last_grad_norm)
            norms.append(opt.last_grad_norm)
        ref_main = [ref.main_param(r) for r in ref_model]
        for p, r in zip(model, ref_model):
            assert p.dtype == dtype
            max_diff = max(max_diff, (p.float() - r.float()).abs().max().item())
        # the fp32 main shard equals the reference's fp32 main params over this rank's range
        main_full = torch.zeros(opt.padded_numel)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(main_full, opt.main_shard, group=ps.dp_group)
        order = [p for g in opt.model_groups for p in g]
        ref_flat = torch.cat([ref_main[[id(m) for m in model].index(id(p))].detach().reshape(-1).float()
                              for p in order])
        max_diff = max(max_diff, (main_full[: opt.numel] - ref_flat).abs().max().item())
        opt.zero_grad()
        ref.zero_grad()
    return {"max_diff": max_diff, "norms": norms, "skipped": skipped, "opt": opt, "model": model}


def _memory_check(opt, dtype):
    mem = opt.memory_bytes()
    s = opt.shard_size
    assert mem["main_params"] == 4 * s
    # AdamW: exp_avg + exp_avg_sq, fp32, over this rank's params only (not the padding)
    assert mem["optimizer_state"] == 8 * sum(m.numel() for m in opt.main_params)
    assert mem["grad_buffer"] == 4 * opt.padded_numel
    assert opt.padded_numel == s * opt.dp_size and opt.padded_numel - opt.numel < opt.dp_size
    return {k: v / opt.numel for k, v in mem.items()}


def _worker(tp: int, check_resume: bool):
    import torch.distributed as dist

    from lightning_megatron.optimizer import ConstantGradScaler, DynamicGradScaler
    from lightning_megatron.optimizer.distrib_optimizer import DistributedOptimizer
    from lightning_megatron.parallel_state import initialize_model_parallel

    ps = initialize_model_parallel(ParallelDims(tp=tp))
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        r = _run_parity(ps, dtype)
        out[name] = r["max_diff"]
        out[name + "_norms"] = r["norms"]
        out[name + "_mem"] = _memory_check(r["opt"], dtype)
    # clipping active on every step (norms are ~5-10): the clipped runs still agree
    out["clip"] = _run_parity(ps, torch.float32, clip_grad=0.5)["max_diff"]
    # fp16 + dynamic loss scale with an inf on one rank at step 3: every rank skips that step
    r = _run_parity(ps, torch.float16, inject_inf_step=3,
                    scaler_factory=lambda: DynamicGradScaler(initial_scale=64.0, min_scale=1.0, growth_factor=2.0,
                                                             backoff_factor=0.5, growth_interval=100, hysteresis=1))
    out["fp16"], out["fp16_skipped"] = r["max_diff"], r["skipped"]
    # the step decided on the device (fused AdamW): clipped every step, an inf on one rank at step 3 skipped
    r = _run_parity(ps, torch.float32, clip_grad=0.5, inject_inf_step=3, fused=True,
                    scaler_factory=lambda: ConstantGradScaler(1.0))
    out["on_device"], out["on_device_skipped"] = r["max_diff"], r["skipped"]

    if check_resume:
        # After a few steps: per-param pieces cover every param exactly once over DP and hold its
        # values (what the sharded checkpoint saves; resharding is tests/test_checkpoint_zero1.py).
        model = _tiny_model(ps.tp_size, ps.tp_rank, torch.float32)
        opt = DistributedOptimizer(torch.optim.AdamW(_groups(model)), data_parallel_group=ps.dp_group)
        for step in range(3):
            for p, g in zip(model, _grads(model, step, ps.tp_rank, ps.dp_rank)):
                p.grad = g
            opt.step()
        covered = [torch.zeros(p.numel()) for p in model]
        for piece in opt.sharded_state_for_checkpoint():
            i = [id(p) for p in model].index(id(piece["param"]))
            covered[i][piece["start"]: piece["end"]] += 1
            values = model[i].detach().reshape(-1)[piece["start"]: piece["end"]]
            assert torch.equal(piece["tensors"]["main_param"], values)
            assert set(piece["tensors"]) == {"main_param", "exp_avg", "exp_avg_sq"}
        for c in covered:
            dist.all_reduce(c, group=ps.dp_group)
            assert torch.equal(c, torch.ones_like(c))
        try:
            opt.state_dict()
        except TypeError as e:
            assert "sharded checkpoint" in str(e)
        else:
            raise AssertionError("DistributedOptimizer.state_dict must refuse")
    return out


@pytest.mark.parametrize("tp,world", [(1, 2), (2, 4)], ids=["tp1-dp2", "tp2-dp2"])
def test_distributed_optimizer_matches_non_distributed(tp, world):
    results = run_distributed(_worker, world, tp, tp == 1, timeout=120)
    for r in results:
        for key in ("fp32", "bf16", "clip", "fp16", "on_device"):
            assert r[key] <= 1e-6, (key, r[key])
        assert r["fp16_skipped"] == r["on_device_skipped"] == [i == 3 for i in range(STEPS)]
        # every rank reports the same (global) norm
        assert r["fp32_norms"] == results[0]["fp32_norms"]
        # measured bytes/param: 12/d for main + Adam moments (padding < d elements), 4 for the fp32 grads
        d = 2
        for name in ("fp32_mem", "bf16_mem"):
            mem = r[name]
            assert abs(mem["main_params"] + mem["optimizer_state"] - 12 / d) <= 12 * d / (world * 20), mem
            assert abs(mem["grad_buffer"] - 4) <= 0.2
        assert r["bf16_mem"]["model_params"] == 2 and r["fp32_mem"]["model_params"] == 4


def test_the_buffer_mode_is_switched_by_declared_methods_only():
    """The DistributedOptimizer switches its GradBuffer to reduce-scatter with use_reduce_scatter() and
    hands back consumed grads with mark_consumed(); neither mode is an assignable attribute any more, and
    the dead layout helpers are gone."""
    from lightning_megatron.grads import GradBuffer
    from lightning_megatron.optimizer import DistributedOptimizer

    params = _tiny_model(1, 0, torch.float32)
    buffer = GradBuffer(params, bucket_bytes=float("inf"))
    assert not buffer.reduces_by_scatter
    opt = DistributedOptimizer(torch.optim.AdamW(_groups(params)), data_parallel_group=None, grad_buffer=buffer)
    assert buffer.reduces_by_scatter and not buffer.reduced
    with pytest.raises(AttributeError):
        buffer.reduced = True  # was a plain attribute the optimizer assigned
    for p, g in zip(params, _grads(params, 0, 0, 0)):
        p.grad = g
    opt.step()
    assert not buffer.reduced
    for name in ("bucket_of",):
        assert name not in vars(GradBuffer)
    for name in ("layout", "_all_segments"):
        assert name not in vars(DistributedOptimizer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_flat_step_over_the_strategys_buffer_meets_one_run_per_group_and_bucket(dtype, monkeypatch):
    """The strategy's buffer is laid out in reverse model order, where the weight-decay groups alternate (a layer's
    weight, its bias, a norm's weight...). The ZeRO-1 step over it holds one flat main param per run of one group
    inside a bucket: it must meet one run per group and bucket (its inner optimizer then steps a few tensors, not
    one per parameter), and its updates equal a plain AdamW's over each parameter, the same groups: fp32 clipped
    (the norm summed in another order: within 1e-6), bf16 unclipped, where the model params must be the
    reference's fp32 params rounded, bit for bit (at one rank they are copied from the main params directly).
    The norm squares runs of adjacent gradients, not a tensor per parameter."""
    from lightning_megatron.grads import GradBuffer, buffer_order
    from lightning_megatron.optimizer import DistributedOptimizer, get_param_groups
    from lightning_megatron.tensor_parallel import mark_replicated

    torch.manual_seed(0)
    layers = [layer for _ in range(6) for layer in (torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))]
    model = torch.nn.Sequential(*layers).to(dtype)
    mark_replicated(list(model.parameters()))  # plain layers, as the strategy declares them at set-up
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_of = {id(p): r for p, r in zip(model.parameters(), reference)}
    bucket_bytes = 4 * 3 * (16 * 16 + 3 * 16)  # three layers a bucket: two buckets
    buffer = GradBuffer(buffer_order([model]), bucket_bytes=bucket_bytes)
    groups = get_param_groups(model, lr=1e-2, weight_decay=0.1)
    assert [len(g["params"]) for g in groups] == [6, 18]
    ref_groups = [{**g, "params": [ref_of[id(p)] for p in g["params"]]} for g in groups]
    clip = 1.0 if dtype == torch.float32 else 0.0
    opt = DistributedOptimizer(torch.optim.AdamW(groups, betas=(0.9, 0.95)), data_parallel_group=None,
                               clip_grad=clip, grad_buffer=buffer)
    ref = torch.optim.AdamW(ref_groups, betas=(0.9, 0.95))
    assert len(buffer.buckets) == 2
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]  # was 6 and 6: a run per alternation
    normed: list[int] = []
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda tensors, *a, **k: normed.append(len(tensors))
                        or foreach_norm(tensors, *a, **k))
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in model.parameters()]
        norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]).double()).item()
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
            ref_of[id(p)].grad = g.float() * (min(1.0, clip / (norm + 1e-6)) if clip else 1.0)
        opt.step()
        ref.step()
        assert abs(opt.last_grad_norm - norm) <= 1e-6 * norm
        for p in model.parameters():
            if dtype == torch.float32:
                torch.testing.assert_close(p.detach(), ref_of[id(p)].detach(), rtol=0, atol=1e-6)
            else:
                assert torch.equal(p.detach(), ref_of[id(p)].detach().to(dtype))
    assert normed == [1] * 4  # every gradient counted, the two buckets adjacent: one run (was 24, one a parameter)
    with pytest.raises(RuntimeError, match="before the first step"):
        buffer.order_within_buckets(lambda p: 0)


def test_an_optimizer_that_is_not_elementwise_is_refused():
    """ZeRO-1 steps flat pieces of its shard, several parameters (and parts of them) in one tensor: that is the step
    over each parameter for an elementwise optimizer only. torch's Adafactor factors a matrix's second moment by its
    rows and columns, and a subclass of AdamW may step otherwise: over flat pieces either would take other steps,
    silently. Refused at construction (before the first step), naming the class and the fix."""
    from lightning_megatron.optimizer import DistributedOptimizer

    class LoggingAdamW(torch.optim.AdamW):
        pass

    model = torch.nn.Linear(4, 4)
    for inner, name in ((torch.optim.Adafactor(model.parameters()), "Adafactor"),
                        (LoggingAdamW(model.parameters()), "LoggingAdamW")):
        with pytest.raises(ValueError, match=f"{name}.*use_distributed_optimizer=False"):
            DistributedOptimizer(inner, data_parallel_group=None)
    DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data_parallel_group=None)
