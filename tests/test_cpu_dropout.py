"""The opt-in CPU dropout kernel: its law (drop rate, unbiased scale), its gradient, replay, and its use in
attention once the CPU kernels are installed; the library's default dropout is torch's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_megatron.tensor_parallel.random import get_rng_tracker, model_parallel_seed
from lightning_megatron.cpu.dropout import cpu_dropout as dropout
from lightning_megatron.cpu.dropout import keep_mask
from lightning_megatron.cpu.kernels import CPUKernels
from lightning_megatron.transformer import AttnMaskType, DotProductAttention, Dropout, TransformerConfig, set_kernels
from lightning_megatron.transformer import dropout as default_dropout

BASE = dict(num_layers=1, hidden_size=64, num_attention_heads=4)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_drop_rate_and_scale_are_unbiased(p):
    torch.manual_seed(0)
    n = 1 << 22
    y = dropout(torch.ones(n), p)
    dropped = (y == 0).double().mean().item()
    # Binomial: 5 standard deviations of the dropped fraction (p(1-p)/n)^0.5 <= 2.5e-4.
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n) + 2**-16
    kept = y[y != 0]
    keep_prob = 1 - round(p * 2**16) / 2**16
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / keep_prob), rtol=1e-7, atol=0)
    assert abs(y.double().mean().item() - 1.0) < 5 * math.sqrt(p / (1 - p) / n)


def test_each_16_bit_lane_is_uniform():
    # The mask reads four 16-bit lanes of every int64 word: a lane stuck in half its range (torch's
    # plain random_() leaves the top bit of an int64 at 0) would drop at twice or zero times p.
    torch.manual_seed(1)
    keep, _ = keep_mask((1 << 20, 4), 0.5)
    assert set(keep.unique().tolist()) == {0.0, 1.0}
    per_lane = 1 - keep.double().mean(0)
    assert torch.all((per_lane - 0.5).abs() < 3e-3), per_lane


def test_bf16_scale_multiplies_in_fp32_and_rounds_once():
    torch.manual_seed(0)
    x = torch.randn(1 << 16).bfloat16()
    y = dropout(x, 0.1)
    kept = y != 0
    scale = 1 / (1 - round(0.1 * 2**16) / 2**16)
    # x * scale computed in fp32 and rounded to bf16 once, not x * bf16(scale) = x * 1.109375.
    assert torch.equal(y[kept], (x[kept].float() * scale).bfloat16())
    assert not torch.equal(y[kept], x[kept] * torch.tensor(scale).bfloat16())


def test_gradient_is_the_same_mask_and_scale():
    torch.manual_seed(0)
    x = torch.randn(64, 33, requires_grad=True)
    y = dropout(x, 0.3)
    g = torch.randn_like(y)
    y.backward(g)
    keep = y != 0
    torch.testing.assert_close(x.grad, torch.where(keep, g * (y / x.detach()), 0.0), rtol=1e-6, atol=0)
    assert 0.2 < 1 - keep.float().mean().item() < 0.4


def test_identity_when_off_and_bad_p_rejected():
    x = torch.randn(10)
    assert dropout(x, 1e-6) is x  # rounds to p = 0: nothing drawn
    assert dropout(x, 0.0) is x
    assert dropout(x, 0.5, training=False) is x
    module = Dropout(0.5).eval()
    assert module(x) is x
    with pytest.raises(ValueError, match=r"p=1.0 must be in \[0, 1\)"):
        dropout(x, 1.0)
    with pytest.raises(ValueError, match=r"p=1.0 must be in \[0, 1\)"):
        default_dropout(x, 1.0)
    with pytest.raises(ValueError, match=r"p=-0.1 must be in \[0, 1\)"):
        Dropout(-0.1)


def test_masks_replay_from_the_generator_and_the_tracker():
    x = torch.randn(1000)
    torch.manual_seed(5)
    a = dropout(x, 0.5)
    torch.manual_seed(5)
    assert torch.equal(a, dropout(x, 0.5))
    model_parallel_seed(123, tp_rank=0)
    state = torch.get_rng_state()
    with get_rng_tracker().fork():
        b = dropout(x, 0.5)
    assert torch.equal(torch.get_rng_state(), state), "the fork must leave the default stream untouched"
    model_parallel_seed(123, tp_rank=0)
    with get_rng_tracker().fork():
        assert torch.equal(b, dropout(x, 0.5))
    model_parallel_seed(123, tp_rank=1)
    with get_rng_tracker().fork():
        assert not torch.equal(b, dropout(x, 0.5)), "TP ranks draw from different streams"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_attention_with_dropout_is_the_formula_with_the_same_mask(dtype):
    torch.manual_seed(0)
    s, b, n, d = 9, 2, 4, 16
    q, k, v = (torch.randn(s, b, n, d, dtype=dtype) for _ in range(3))
    cfg = TransformerConfig(**BASE, attention_dropout=0.25, params_dtype=dtype)
    core = DotProductAttention(cfg, 1, AttnMaskType.no_mask).train()
    assert set_kernels(core, CPUKernels()) == 1
    model_parallel_seed(7, tp_rank=0)
    out = core(q, k, v, None)
    # The reference: fp32 softmax of the rounded scores, then the mask drawn from the same stream.
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = (qq.float() @ kk.float().transpose(-1, -2) / math.sqrt(d)).to(dtype)
    probs = torch.softmax(scores.float(), -1).to(dtype)
    model_parallel_seed(7, tp_rank=0)
    with get_rng_tracker().fork():
        keep, keep_prob = keep_mask(probs.shape, 0.25, dtype)
    expected = ((probs * keep).float() / keep_prob).to(dtype) @ vv
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, expected.permute(2, 0, 1, 3).reshape(s, b, n * d), **tol)
    # and the probabilities really were dropped: turning dropout off changes the output.
    assert not torch.allclose(out, F.scaled_dot_product_attention(qq, kk, vv).permute(2, 0, 1, 3).reshape(s, b, -1))


def test_default_dropout_is_torchs_and_kernels_install_on_every_site():
    x = torch.randn(1000)
    torch.manual_seed(3)
    expected = F.dropout(x, 0.3, training=True)
    torch.manual_seed(3)
    assert torch.equal(default_dropout(x, 0.3), expected)
    torch.manual_seed(3)
    assert torch.equal(Dropout(0.3)(x), expected)
    from lightning_megatron.transformer import TransformerBlock
    from lightning_megatron.models.bert.specs import bert_layer_local_spec

    block = TransformerBlock(TransformerConfig(**BASE, attention_dropout=0.1), bert_layer_local_spec)
    kernels = CPUKernels()
    # per layer: the core attention and the layer's bias-dropout-adds
    assert set_kernels(block, kernels) == 2
    assert all(m.kernels is kernels for m in block.modules() if hasattr(m, "kernels"))
    block.train()(torch.randn(4, 2, 64), None).sum().backward()  # runs with the kernels installed


class _StridedOperands(CPUKernels):
    """The CPU kernels with the attention operands left as the projections' strided views."""

    def attention_operands(self, q, k, v):
        return q, k, v


@pytest.mark.parametrize("case", ["padding", "causal", "gqa", "cache"])
def test_contiguous_16_bit_attention_operands_give_the_strided_operands_bits(case):
    """The CPU kernels copy 16-bit Q, K, V contiguous before the unfused attention's batched matmuls (oneDNN
    copies strided operands itself, slower): forward and gradients are the same bits. Q, K, V are views of
    one projection's output, as in a layer; ``cache``: the queries are the last s of sk positions."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    s, b, n, d = 12, 3, 4, 16
    groups = 2 if case == "gqa" else n
    sk = s + 5 if case == "cache" else s
    cfg = TransformerConfig(**BASE, attention_dropout=0.0, params_dtype=dtype, num_query_groups=groups)
    mask = None
    if case in ("padding", "cache"):
        mask = torch.zeros(b, 1, 1, sk, dtype=torch.bool)
        mask[1, ..., sk - 3:] = True
    qp = torch.randn(s, b, n * d, dtype=dtype, requires_grad=True)
    kvp = torch.randn(sk, b, 2 * groups * d, dtype=dtype, requires_grad=True)
    weights = torch.randn(s, b, n * d)
    results = []
    for kernels in (CPUKernels(), _StridedOperands()):
        core = DotProductAttention(cfg, 1, AttnMaskType.padding if case == "padding" else AttnMaskType.causal)
        set_kernels(core.train(), kernels)
        k, v = kvp.view(sk, b, groups, 2 * d).split(d, dim=-1)  # strided views, as a layer's
        out = core(qp.view(s, b, n, d), k, v, mask)
        results.append((out, *torch.autograd.grad((out.float() * weights).sum(), (qp, kvp))))
    for ours, strided in zip(*results):
        assert torch.equal(ours, strided)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (qp.view(s, b, n, d), *kvp.view(sk, b, groups, 2 * d).split(d, -1)))
    assert not k.is_contiguous() and all(t.is_contiguous() for t in CPUKernels().attention_operands(q, k, v))
    assert CPUKernels().attention_operands(*(t.float() for t in (q, k, v)))[1].is_contiguous() is False  # fp32: as is
