"""fp32 main grads (lightning_megatron.grads): microbatches summed in fp32, DP mean, persistent buffers, hooks scoped."""

from __future__ import annotations

import torch
from torch import nn

from dist_utils import run_distributed

MICROBATCHES = 3


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    # A bf16 layer, an fp32 layer and a bf16 layer that gets no gradient.
    model = nn.ModuleDict({"a": nn.Linear(16, 32, dtype=dtype), "b": nn.Linear(32, 4),
                           "unused": nn.Linear(4, 4, dtype=dtype)})
    return model


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model["b"](torch.tanh(model["a"](x)).float()).square().mean()


def _worker() -> dict[str, object]:
    import torch.distributed as dist

    from lightning_megatron.grads import MainGrads
    from lightning_megatron.parallel_state import initialize_model_parallel

    ps = initialize_model_parallel(1, 1)
    rank = dist.get_rank()
    model = _model(torch.bfloat16)
    inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * rank + i)).bfloat16()
              for i in range(MICROBATCHES)]

    # Reference: each microbatch's grad on its own (bf16 for bf16 params), summed in fp32, DP mean.
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
    model.zero_grad(set_to_none=True)

    grads = MainGrads([model])
    out: dict[str, object] = {"ptrs": [], "freed": True}
    for _step in range(2):
        grads.start()
        for x in inputs:
            _loss(model, x).backward()
            # The hook frees every 16-bit grad as soon as it is added in fp32.
            out["freed"] = out["freed"] and all(p.grad is None for p in model.parameters() if p.dtype != torch.float32)
        grads.finish(ps)
        out["ptrs"].append({n: p.main_grad.data_ptr() for n, p in model.named_parameters() if p.dtype != torch.float32})
        out["dtypes"] = {n: p.main_grad.dtype for n, p in model.named_parameters()}
        out["errors"] = {n: (p.main_grad.double() - expected[n]).abs().max().item()
                         for n, p in model.named_parameters() if n in expected}
        out["unused_zero"] = all(torch.equal(p.main_grad, torch.zeros_like(p.main_grad))
                                 for n, p in model.named_parameters() if n.startswith("unused"))
        grads.expose(reads_main_grad=True)
        out["exposed"] = {n: p.grad is not None for n, p in model.named_parameters()}
        grads.release()
    # Outside start() / finish() the hooks stay out of the way.
    model.zero_grad(set_to_none=True)
    _loss(model, inputs[0]).backward()
    out["grad_outside"] = model["a"].weight.grad is not None and model["a"].weight.grad.dtype == torch.bfloat16
    grads.remove()
    out["removed"] = not any(hasattr(p, "main_grad") for p in model.parameters())
    # A bf16 sum of the microbatch grads: what the main grads avoid.
    model.zero_grad(set_to_none=True)
    for x in inputs:
        _loss(model, x).backward()
    bf16_sum = model["a"].weight.grad.double()
    dist.all_reduce(bf16_sum)
    out["bf16_sum_error"] = (bf16_sum / dist.get_world_size() - expected["a.weight"]).abs().max().item()
    return out


def test_main_grads_sum_microbatches_in_fp32_and_take_the_dp_mean():
    results = run_distributed(_worker, 2, timeout=120)
    for r in results:
        # fp32 sums of bf16 grads, then the fp32 DP mean: rounding of the last fp32 op only.
        assert max(r["errors"].values()) < 1e-6, r["errors"]
        assert r["bf16_sum_error"] > 10 * max(r["errors"].values()), "the test must tell fp32 from bf16 sums"
        assert r["freed"]
        assert all(dt == torch.float32 for dt in r["dtypes"].values())
        assert r["ptrs"][0] == r["ptrs"][1], "persistent buffers: no fresh fp32 grads per step"
        assert r["unused_zero"]
        # fp32 params get .grad = main_grad; bf16 params stay without .grad for a wrapper that reads main_grad.
        assert r["exposed"] == {"a.weight": False, "a.bias": False, "b.weight": True, "b.bias": True,
                                "unused.weight": False, "unused.bias": False}
        assert r["grad_outside"] and r["removed"]
