"""Mixed-precision optimizer wrappers: fp32 main params, overflow skip, state round trip, torch optimizers."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from lightning_megatron.optimizer import (
    ConstantGradScaler,
    DynamicGradScaler,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
)
from lightning_megatron.tensor_parallel.param_facts import set_param_facts


# ---------------------------------------------------------------------------------------------
# bf16: fp32 main params keep updates smaller than half a bf16 ulp
# ---------------------------------------------------------------------------------------------
def _regression(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Least squares with weights in [1, 2): a bf16 ulp there is 2^-7, and SGD steps are ~1e-3."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 128, generator=g)
    w_true = 1.2 + 0.6 * torch.rand(128, generator=g)
    # Start from bf16-representable weights so that every run starts from the same loss.
    w0 = (w_true + 0.5 * torch.randn(128, generator=g)).bfloat16().float()
    return x, x @ w_true, w0


def _bf16_curve(mode: str, steps: int = 50, lr: float = 2e-3) -> list[float]:
    x, y, w0 = _regression()
    w = torch.nn.Parameter(w0.clone() if mode == "fp32" else w0.clone().bfloat16())
    opt: torch.optim.Optimizer = torch.optim.SGD([w], lr=lr)
    if mode == "main":
        opt = Float16OptimizerWithFloat16Params(opt)  # bf16 without any loss scaling
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        # fp32 arithmetic on the (possibly bf16) weights: the runs differ only in how updates are stored.
        loss = ((x @ w.float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_bf16_main_params_track_fp32():
    fp32, main, bf16 = _bf16_curve("fp32"), _bf16_curve("main"), _bf16_curve("bf16")
    rel = [abs(m - f) / f for m, f in zip(main, fp32)]
    assert max(rel) <= 2e-2, max(rel)  # measured: ~1e-3
    assert fp32[-1] < 0.7 * fp32[0]  # the task does move
    assert abs(main[-1] - fp32[-1]) < 0.1 * abs(bf16[-1] - fp32[-1])  # bf16 params lose most updates


# ---------------------------------------------------------------------------------------------
# fp16 with dynamic loss scaling: injected inf/nan steps are skipped, nothing moves
# ---------------------------------------------------------------------------------------------
def _fp16_setup(initial_scale: float = 2.0**10, hysteresis: int = 1):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    model = torch.nn.Linear(8, 1).half()
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    scaler = DynamicGradScaler(initial_scale=initial_scale, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                               growth_interval=4, hysteresis=hysteresis)
    opt = Float16OptimizerWithFloat16Params(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                            grad_scaler=scaler)
    return x, y, model, opt


def _fp16_step(x, y, model, opt, inject: float | None = None) -> float:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = ((model(x.half()).float() - y) ** 2).mean()
        opt.scale_loss(loss).backward()
        if inject is not None:
            model.weight.grad[0, 3] = inject  # one bad value on one rank is enough
        return loss

    return float(opt.step(closure).detach())


def _snapshot(model, opt) -> dict:
    return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})


def _bit_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_bit_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_bit_equal(u, v) for u, v in zip(a, b))
    return a == b


def test_fp16_injected_overflow_steps_are_skipped():
    x, y, model, opt = _fp16_setup()
    bad = {4: float("inf"), 11: float("nan"), 12: float("-inf")}
    skipped, losses = [], []
    for step in range(40):
        before = _snapshot(model, opt)
        scale_before = float(opt.get_loss_scale().item())
        losses.append(_fp16_step(x, y, model, opt, bad.get(step)))
        if opt.last_step_skipped:
            skipped.append(step)
            after = _snapshot(model, opt)
            # Parameters, main params and momentum untouched; only the scaler moved.
            assert _bit_equal(before["model"], after["model"])
            assert _bit_equal(before["opt"]["optimizer"], after["opt"]["optimizer"])
            assert _bit_equal(before["opt"]["fp32_from_fp16_params"], after["opt"]["fp32_from_fp16_params"])
            assert float(opt.get_loss_scale().item()) == scale_before / 2
            assert opt.last_grad_norm is None
        else:
            assert opt.last_grad_norm is not None and opt.last_grad_norm == opt.last_grad_norm  # finite
    assert skipped == sorted(bad)
    assert opt.num_skipped_steps == len(bad)
    assert losses[-1] < 1e-4 * losses[0]  # measured: ~2e-7 of the start


def test_fp16_huge_initial_scale_backs_off_then_trains():
    """2**32 * grad overflows fp16 (max 65504): the scaler halves, skipping, until steps go through."""
    x, y, model, opt = _fp16_setup(initial_scale=2.0**32, hysteresis=1)
    skipped, losses = [], []
    for step in range(60):
        losses.append(_fp16_step(x, y, model, opt))
        if opt.last_step_skipped:
            skipped.append(step)
    first_ok = next(i for i in range(60) if i not in skipped)
    # |grad| ~ 10 at the start: the scale must fall below 65504 / 10, about 2**12, i.e. >= 15 halvings.
    assert first_ok >= 15 and skipped[:first_ok] == list(range(first_ok))
    assert losses[-1] < 1e-4 * losses[0]


def test_scale_loss_is_fp32_and_scaler_free_wrapper_works():
    x, y, model, _ = _fp16_setup()
    opt = Float16OptimizerWithFloat16Params(torch.optim.SGD(model.parameters(), lr=0.1))
    loss = torch.tensor(3.0, dtype=torch.float16)
    assert float(opt.get_loss_scale().item()) == 1.0
    assert opt.scale_loss(loss).dtype == torch.float32 and float(opt.scale_loss(loss)) == 3.0
    scaled = Float16OptimizerWithFloat16Params(torch.optim.SGD(torch.nn.Linear(2, 2).half().parameters(), lr=0.1),
                                               grad_scaler=ConstantGradScaler(2.0**20))
    out = scaled.scale_loss(loss)
    assert out.dtype == torch.float32 and out.shape == () and float(out) == 3.0 * 2.0**20


# ---------------------------------------------------------------------------------------------
# state_dict: scaler, main params and inner state survive a round trip exactly
# ---------------------------------------------------------------------------------------------
def test_float16_state_dict_round_trip_continues_bit_identically():
    x, y, model, opt = _fp16_setup(hysteresis=2)
    for step in range(6):
        _fp16_step(x, y, model, opt, float("inf") if step in (2, 3) else None)
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd) == {"optimizer", "grad_scaler", "fp32_from_fp16_params"}
    assert sd["fp32_from_fp16_params"][0][0].dtype == torch.float32

    twin = copy.deepcopy(model)
    twin_opt = Float16OptimizerWithFloat16Params(
        torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.5),
        grad_scaler=DynamicGradScaler(initial_scale=4.0, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                                      growth_interval=4, hysteresis=2),
    )
    twin_opt.load_state_dict(sd)
    assert _bit_equal(twin_opt.state_dict(), opt.state_dict())
    for step in range(8):
        inject = float("nan") if step == 5 else None
        _fp16_step(x, y, model, opt, inject)
        _fp16_step(x, y, twin, twin_opt, inject)
    assert _bit_equal(model.state_dict(), twin.state_dict())
    assert _bit_equal(opt.state_dict(), twin_opt.state_dict())


def test_fp32_state_dict_round_trip_and_bare_torch_state():
    model = torch.nn.Linear(4, 3)
    opt = FP32Optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd) == {"optimizer", "grad_scaler"}
    fresh = FP32Optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    fresh.load_state_dict(sd)
    assert _bit_equal(fresh.state_dict(), sd)
    bare = FP32Optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    bare.load_state_dict(sd["optimizer"])  # a checkpoint written without the wrapper
    assert _bit_equal(bare.state_dict()["optimizer"], sd["optimizer"])


# ---------------------------------------------------------------------------------------------
# Any torch optimizer: the fp32 wrapper is the optimizer itself (and clipping is torch's)
# ---------------------------------------------------------------------------------------------
OPTIMIZERS = {
    "sgd-momentum-dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.3),
    "sgd-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("clip", [0.0, 0.3])
def test_fp32_wrapper_equals_torch_optimizer(name, clip):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    mine = copy.deepcopy(ref)
    ref_opt = OPTIMIZERS[name](ref.parameters())
    opt = FP32Optimizer(OPTIMIZERS[name](mine.parameters()), clip_grad=clip)
    assert opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state
    data = torch.randn(6, 8, 6)
    for batch in data:
        for m, o in ((ref, ref_opt), (mine, opt)):
            o.zero_grad()
            m(batch).square().mean().backward()
            if o is ref_opt and clip > 0:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            o.step()
    for a, b in zip(ref.parameters(), mine.parameters()):
        if clip == 0.0:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_float16_wrapper_keeps_fp32_params_and_moves_existing_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).bfloat16(), torch.nn.LayerNorm(4))
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    w = model[0].weight
    inner.state[w]["marker"] = torch.tensor(1.0)
    opt = Float16OptimizerWithFloat16Params(inner)
    assert w not in inner.state and inner.state[opt.main_param(w)]["marker"].item() == 1.0
    assert opt.main_param(model[1].weight) is model[1].weight  # fp32 params are their own main params
    assert opt.fp32_from_fp32_groups[0] == [model[1].weight, model[1].bias]
    with pytest.raises(TypeError, match="already"):
        FP32Optimizer(opt)
    with pytest.raises(ValueError, match="clip_grad"):
        FP32Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), clip_grad=-1.0)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_overflow_in_a_duplicate_the_norm_skips_is_still_found(bad, fused):
    """On TP rank 1 a replicated parameter is left out of the norm (rank 0 counts it) but is checked (fused: by
    the device's flag that skips the kernel's update)."""
    sharded = torch.nn.Parameter(torch.ones(4).bfloat16())
    set_param_facts(sharded, sharded_over=("tp",), replicated_over=(), partition_dim=0)
    replicated = torch.nn.Parameter(torch.ones(3).bfloat16())
    inner = (torch.optim.AdamW([sharded, replicated], lr=0.1, fused=True) if fused
             else torch.optim.SGD([sharded, replicated], lr=0.1))
    opt = Float16OptimizerWithFloat16Params(inner, grad_scaler=ConstantGradScaler(1.0), coordinates={"tp": 1})
    assert opt.decides_on_device() == fused
    sharded.grad = torch.full((4,), 2.0).bfloat16()
    replicated.grad = torch.full((3,), 5.0).bfloat16()
    opt.step()
    assert not opt.last_step_skipped
    assert opt.last_grad_norm == pytest.approx(4.0)  # ||(2, 2, 2, 2)||: the duplicate is not counted
    before = (sharded.detach().clone(), replicated.detach().clone())
    sharded.grad = torch.full((4,), 2.0).bfloat16()
    replicated.grad = torch.tensor([1.0, bad, 1.0]).bfloat16()
    opt.step()
    assert opt.last_step_skipped and opt.last_grad_norm is None
    assert torch.equal(sharded, before[0]) and torch.equal(replicated, before[1])


def test_main_params_are_copied_into_the_16_bit_params_by_one_foreach_call_per_group():
    """Issue 39's "no per-parameter Python in the step": after the update, the fp32 main params are rounded
    into the 16-bit model params by one ``_foreach_copy_`` per param group (an accelerator's few fused kernels
    instead of a launch per parameter), with the bits of a per-parameter ``copy_``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(5))).bfloat16()
    params = list(model.parameters())
    opt = Float16OptimizerWithFloat16Params(torch.optim.AdamW(
        [{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0}], lr=0.1))
    model(torch.randn(3, 8).bfloat16()).float().square().sum().backward()
    with torch.profiler.profile() as prof:
        opt.step()
    calls = [e.name for e in prof.events()]
    assert calls.count("aten::_foreach_copy_") == 2, [c for c in calls if "copy" in c]
    for p in params:  # each model param is its main param rounded to nearest, once
        assert torch.equal(p, opt.main_param(p).to(torch.bfloat16))
        assert not torch.equal(opt.main_param(p), opt.main_param(p).to(torch.bfloat16).float())  # it did round


@pytest.mark.parametrize("clip", [0.0, 0.3])
@pytest.mark.parametrize("wrapper", ["fp32", "bf16", "zero1-bf16"])
def test_the_step_decided_on_the_device_has_the_host_decisions_bits(wrapper, clip):
    """With a fused optimizer the wrapper clips by the norm on the device and leaves the skip of a non-finite
    step to the kernel's found-inf flag, reading the device once after the update: parameters, optimizer
    state, the norm and the skipped steps are the host decision's (the same wrapper made to decide on the host),
    bit for bit, through a skipped step (a NaN gradient at step 3; a constant scaler skips it). ZeRO-1's
    DistributedOptimizer too (its norm over the shard's pieces, reduced over DP and the model-parallel group)."""
    from lightning_megatron.optimizer import DistributedOptimizer

    def run(on_device: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
        if wrapper != "fp32":
            model = model.bfloat16()
        inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, fused=True)
        if wrapper == "zero1-bf16":
            opt = DistributedOptimizer(inner, clip_grad=clip, grad_scaler=ConstantGradScaler(1.0),
                                       data_parallel_group=None)
        else:
            cls = Float16OptimizerWithFloat16Params if wrapper == "bf16" else FP32Optimizer
            opt = cls(inner, clip_grad=clip, grad_scaler=ConstantGradScaler(1.0))
        assert opt.decides_on_device()
        if not on_device:
            opt.decides_on_device = lambda: False
        norms = []
        for i, batch in enumerate(torch.randn(6, 8, 6, generator=torch.Generator().manual_seed(1))):
            opt.zero_grad()
            loss = model(batch.to(model[0].weight.dtype)).float().square().mean() * (float("nan") if i == 3 else 1)
            loss.backward()
            opt.step()
            norms.append(opt.last_grad_norm)
        state = [v for st in inner.state.values() for v in st.values()]
        return list(model.parameters()), state, norms, opt.num_skipped_steps

    params, state, norms, skipped = run(True)
    params_ref, state_ref, norms_ref, skipped_ref = run(False)
    assert skipped == skipped_ref == 1 and norms[3] is None and norms_ref[3] is None
    del norms[3], norms_ref[3]
    assert norms == pytest.approx(norms_ref, rel=1e-15)
    assert all(torch.equal(a, b) for a, b in zip(params, params_ref))
    assert all(torch.equal(a, b) for a, b in zip(state, state_ref))


def test_the_cpu_tuning_has_the_host_decide():
    """A grad buffer that asks for the host's decision (``decide_on_host``: the opt-in CPU tuning's, on CPU, where a
    read waits for nothing) keeps the read before the update; on any other device the tuning leaves it to the
    device."""
    from lightning_megatron.cpu import CPUTuning
    from lightning_megatron.grads import GradBuffer

    assert CPUTuning().grad_buffer_options(torch.device("cpu"))["decide_on_host"]
    assert not CPUTuning().grad_buffer_options(torch.device("meta"))["decide_on_host"]
    assert not CPUTuning(kernels=False).grad_buffer_options(torch.device("cpu"))["decide_on_host"]
    for on_host in (False, True):
        model = torch.nn.Linear(4, 4).bfloat16()
        buffer = GradBuffer(list(model.parameters()), decide_on_host=on_host)
        opt = Float16OptimizerWithFloat16Params(torch.optim.AdamW(model.parameters(), lr=0.1, fused=True),
                                                grad_scaler=ConstantGradScaler(1.0), grad_buffer=buffer)
        assert opt.decides_on_device() != on_host
        buffer.remove()


@pytest.mark.parametrize("wrapper", ["fp32", "bf16", "zero1-bf16"])
def test_a_step_after_the_first_reads_no_parameters_facts_and_builds_no_main_grad_views(wrapper, monkeypatch):
    """Issue 39's "no per-parameter Python in the step" (on a GPU the host's step is the device's idle time): which
    parameters this rank counts in the norm and where each main grad lives in the grad buffer do not change
    between steps, so a step after the first looks up neither (a ``param_facts`` record costs a dict and a
    dataclass per parameter; a main grad a slice and a view). Its norm, skip and update are still the step's
    own: the norm equals the one over the public ``grads_for_norm`` of this step's gradients, the duplicate
    is checked (an inf in it skips the step) and not counted. The norm squares, and the clipping scales, runs of
    gradients adjacent in the buffer, not a tensor per parameter."""
    from lightning_megatron.grads import GradBuffer
    from lightning_megatron.optimizer import DistributedOptimizer
    from lightning_megatron.optimizer.clip_grads import sum_of_squares_fp64

    facts_module = importlib.import_module("lightning_megatron.tensor_parallel.param_facts")

    torch.manual_seed(0)
    dtype = torch.float32 if wrapper == "fp32" else torch.bfloat16
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)).to(dtype)
    weight, bias = model[0].weight, model[0].bias
    set_param_facts(weight, sharded_over=("tp",), replicated_over=(), partition_dim=0)
    set_param_facts(bias, sharded_over=("tp",), replicated_over=(), partition_dim=0)
    # model[2]'s weight and bias stay replicated over TP: on TP rank 1 they are checked, not counted.
    buffer = GradBuffer(list(model.parameters()))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    if wrapper == "zero1-bf16":  # one data-parallel rank: the whole shard
        opt = DistributedOptimizer(inner, grad_scaler=ConstantGradScaler(1.0), coordinates={"tp": 1},
                                   grad_buffer=buffer, data_parallel_group=None, clip_grad=1e-3)
    else:
        cls = FP32Optimizer if wrapper == "fp32" else Float16OptimizerWithFloat16Params
        opt = cls(inner, grad_scaler=ConstantGradScaler(1.0), coordinates={"tp": 1}, grad_buffer=buffer,
                  clip_grad=1e-3)  # clipped every step

    lookups = {"facts": 0, "views": 0}
    stored, view = facts_module._stored, GradBuffer.main_grad_view

    def counting_stored(p):
        lookups["facts"] += 1
        return stored(p)

    def counting_view(self, p):
        lookups["views"] += 1
        return view(self, p)

    monkeypatch.setattr(facts_module, "_stored", counting_stored)
    monkeypatch.setattr(GradBuffer, "main_grad_view", counting_view)
    normed: list[int] = []  # tensors handed to the fused fp64 norm, a call each
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda tensors, *a, **k: normed.append(len(tensors))
                        or foreach_norm(tensors, *a, **k))
    scaled: list[int] = []  # tensors handed to a foreach product: the clipping's (no unscaling at a scale of 1)
    foreach_mul_ = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda tensors, *a, **k: scaled.append(len(tensors))
                        or foreach_mul_(tensors, *a, **k))

    def step(i: int, bad: bool = False) -> None:
        opt.zero_grad()
        buffer.start(1)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i)).to(dtype)
        model(x).float().square().mean().backward()
        buffer.finish_grad_sync()
        buffer.finish_deferred()  # as finalize_model_grads ends a step's reduction
        if bad:
            model[2].bias.main_grad[1] = float("inf")
        counted = [buffer.main_grad_of(p) for p in (weight, bias)]
        expected = float(sum_of_squares_fp64(counted, torch.device("cpu"))) ** 0.5
        lookups.update(facts=0, views=0)
        normed.clear()
        scaled.clear()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        if i == 0:  # the first step looks them up, once (ZeRO-1's pieces are slices of the buffer's data; the
            # flat 16-bit wrapper's main grads were handed over when it was built)
            assert lookups["facts"] > 0 and (lookups["views"] > 0 or wrapper != "fp32")
        else:
            assert lookups == {"facts": 0, "views": 0}, lookups
            # the counted weight and bias lie side by side in the buffer: one run, not a tensor each; the clipping
            # scales every gradient: one run too (by 1 on the NaN step, decided on the device)
            assert normed == [1] and scaled == [1], (normed, scaled)
        if bad:
            assert opt.last_step_skipped and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        else:
            assert not opt.last_step_skipped and opt.last_grad_norm == pytest.approx(expected, rel=1e-12)
            assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))

    for i in range(3):
        step(i)
    step(3, bad=True)
    step(4)
    buffer.remove()


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
def test_the_16_bit_wrapper_over_the_strategys_buffer_steps_one_run_per_group_and_bucket(fused, device):
    """Issue 39's "a fused optimizer step over the flat fp32 buffer" on the default path (no ZeRO-1): under the
    strategy the fp32 main params are views of one flat buffer laid out as the grad buffer (each bucket's
    parameters by weight-decay group), and the inner optimizer steps one run per group and bucket, not a tensor
    per parameter. The updates are a plain AdamW's over each parameter in fp32, the same groups, clipped every
    step (within 1e-6: the norm is summed in another order); each 16-bit parameter is its fp32 reference rounded,
    and each main param's optimizer state (read per parameter, as a checkpoint reads it) is the reference's.
    ``state_dict()`` keeps the per-parameter format: a wrapper without a buffer (a tensor per parameter) loads it
    and continues as the flat one does, and the flat one loads its own."""
    from lightning_megatron.grads import GradBuffer, buffer_order
    from lightning_megatron.optimizer import get_param_groups
    from lightning_megatron.tensor_parallel import mark_replicated

    def build(model, flat: bool):
        mark_replicated(list(model.parameters()))  # plain layers, as the strategy declares them at set-up
        groups = get_param_groups(model, lr=1e-2, weight_decay=0.1)
        buffer = GradBuffer(buffer_order([model]), bucket_bytes=4 * 3 * (16 * 16 + 3 * 16)) if flat else None
        opt = Float16OptimizerWithFloat16Params(torch.optim.AdamW(groups, betas=(0.9, 0.95), fused=fused),
                                                clip_grad=0.5, grad_buffer=buffer)
        return opt, buffer

    torch.manual_seed(0)
    layers = [layer for _ in range(6) for layer in (torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))]
    model = torch.nn.Sequential(*layers).bfloat16().to(device)  # the GPU check runs it with --device cuda
    twin = copy.deepcopy(model)
    params = list(model.parameters())
    reference = [p.detach().float().clone().requires_grad_() for p in params]
    ref_of = {id(p): r for p, r in zip(params, reference)}
    opt, buffer = build(model, flat=True)
    ref = torch.optim.AdamW([{**g, "params": [ref_of[id(p)] for p in g["params"]]}
                             for g in get_param_groups(model, lr=1e-2, weight_decay=0.1)], betas=(0.9, 0.95))
    assert len(buffer.buckets) == 2
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]  # was 6 and 18: a tensor per parameter

    def grads(step: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        return [torch.randn(p.shape, generator=gen).bfloat16().to(device) for p in like]

    def step_flat(opt, buffer, model_params, step: int) -> None:
        for p, g in zip(model_params, grads(step, model_params)):  # where the strategy's backward hooks put them
            buffer.main_grad_of(p).copy_(g)
        opt.step()
        opt.zero_grad()

    for step in range(4):
        step_flat(opt, buffer, params, step)
        gs = grads(step, params)
        norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in gs]).double()).item()
        for p, g in zip(params, gs):
            ref_of[id(p)].grad = g.float() * min(1.0, 0.5 / (norm + 1e-6))
        ref.step()
        assert abs(opt.last_grad_norm - norm) <= 1e-6 * norm
    for p in params:
        main = opt.main_param(p)
        assert main.shape == p.shape and main.dtype == torch.float32
        torch.testing.assert_close(main, ref_of[id(p)].detach(), rtol=0, atol=1e-6)
        assert torch.equal(p.detach(), main.to(torch.bfloat16))
        state, ref_state = opt.param_state(main), ref.state[ref_of[id(p)]]
        assert set(state) == set(ref_state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 4
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].shape == p.shape
            torch.testing.assert_close(state[key], ref_state[key], rtol=1e-5, atol=1e-9)

    saved = copy.deepcopy(opt.state_dict())
    assert set(saved) == {"optimizer", "grad_scaler", "fp32_from_fp16_params"}
    assert [len(g["params"]) for g in saved["optimizer"]["param_groups"]] == [6, 18]  # a parameter each
    per_param_model = copy.deepcopy(twin)
    per_param, _ = build(per_param_model, flat=False)
    per_param.load_state_dict(saved)
    assert [len(g["params"]) for g in per_param.param_groups] == [6, 18]
    flat_twin, twin_buffer = build(twin, flat=True)
    flat_twin.load_state_dict(saved)
    twin_params = list(twin.parameters())
    assert _bit_equal(flat_twin.state_dict(), saved)
    for step in range(4, 6):
        step_flat(opt, buffer, params, step)
        step_flat(flat_twin, twin_buffer, twin_params, step)
        for p, g in zip(per_param_model.parameters(), grads(step, params)):  # no buffer: the grads in .grad
            p.grad = g
        per_param.step()
        per_param.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params))
    for p, q in zip(params, per_param_model.parameters()):  # its norm summed by parameter: within 1e-6
        torch.testing.assert_close(opt.main_param(p), per_param.main_param(q), rtol=0, atol=1e-6)
    # Built over a buffer that holds a step's values (its layout can no longer change), or for an optimizer that is
    # not elementwise (torch's Adafactor factors a matrix's second moment): a tensor per parameter.
    late = Float16OptimizerWithFloat16Params(torch.optim.AdamW(get_param_groups(model, lr=1e-2, weight_decay=0.1)),
                                             grad_buffer=buffer)
    fresh = copy.deepcopy(per_param_model)
    mark_replicated(list(fresh.parameters()))
    adafactor = torch.optim.Adafactor(get_param_groups(fresh, lr=1e-2, weight_decay=0.1))
    factored = Float16OptimizerWithFloat16Params(adafactor, grad_buffer=GradBuffer(buffer_order([fresh])))
    assert [len(g["params"]) for g in late.param_groups] == [len(g["params"]) for g in factored.param_groups] == [6, 18]
    assert _bit_equal(flat_twin.state_dict(), opt.state_dict())
