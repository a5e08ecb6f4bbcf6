"""16-bit gradients summed over the tokens in fp32 on CPU: a LayerNorm's weight and bias gradients
(``transformer/norms.py``) and an embedding table's rows (``tensor_parallel/embedding.py``).

torch's CPU kernels (torch 2.13) sum them in the 16-bit dtype: a bf16 LayerNorm's bias gradient over 4096 tokens
came out 5-14% off the exact sum of the same bf16 inputs, an embedding row looked up 2048 times 5% off, and one
process (two intra-op threads) and a layout of two processes (one thread each) disagreed by 20% on a layer norm's
bias: the bf16 check's failures of docs/check.md, "bf16 on CPU". The reference here is the exact (fp64) result
from the same 16-bit inputs: ours is one 16-bit rounding from it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_megatron.tensor_parallel.embedding import embedding, row_sums
from lightning_megatron.transformer.config import TransformerConfig
from lightning_megatron.transformer.norms import LayerNorm

ONE_ROUNDING = 2.0 ** -8  # bf16: 8 significant bits


def _rel(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).abs().max() / exact.abs().max())


def _cancelling(rows: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """Output gradients whose column sums cancel (a layer norm bias's in training): small mean, large spread."""
    return (torch.randn(rows, hidden, generator=gen) * 1e-3 + 2e-5).to(torch.bfloat16)


def test_a_16_bit_layer_norms_weight_and_bias_gradients_are_one_rounding_from_the_exact_sums():
    gen = torch.Generator().manual_seed(0)
    rows, hidden = 4096, 64
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, params_dtype=torch.bfloat16)
    norm = LayerNorm(config, hidden)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.1 + 1)
        norm.bias.copy_(torch.randn(hidden, generator=gen) * 0.1)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    dy = _cancelling(rows, hidden, gen)
    # exact: fp64 from the same bf16 inputs
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, norm.weight, norm.bias))
    F.layer_norm(xd, (hidden,), wd, bd, norm.eps).backward(dy.double())
    seen = []
    for threads in (1, 2):  # torch's bias gradient: ~10% off on such rows, either way
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            xs = x.clone().requires_grad_()
            norm.zero_grad()
            y = norm(xs)
            y.backward(dy)
        finally:
            torch.set_num_threads(previous)
        assert torch.equal(y, F.layer_norm(x, (hidden,), norm.weight, norm.bias, norm.eps))  # torch's forward
        assert _rel(norm.bias.grad, bd.grad) <= ONE_ROUNDING, (threads, _rel(norm.bias.grad, bd.grad))
        assert _rel(norm.weight.grad, wd.grad) <= 2 * ONE_ROUNDING, (threads, _rel(norm.weight.grad, wd.grad))
        assert _rel(xs.grad, xd.grad) <= 4 * ONE_ROUNDING  # torch's input gradient
        seen.append((norm.weight.grad.clone(), norm.bias.grad.clone()))
    # the same bits on one thread and on two: one process and each rank of a layout of two sum alike
    assert all(torch.equal(a, b) for a, b in zip(*seen))
    # fp32 and without a gradient: torch's layer norm itself
    norm32 = LayerNorm(TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1), hidden)
    x32 = x.float().requires_grad_()
    norm32(x32).backward(dy.float())
    x32_ref, w_ref, b_ref = (t.detach().clone().requires_grad_() for t in (x.float(), norm32.weight, norm32.bias))
    F.layer_norm(x32_ref, (hidden,), w_ref, b_ref, norm32.eps).backward(dy.float())
    assert torch.equal(norm32.weight.grad, w_ref.grad) and torch.equal(norm32.bias.grad, b_ref.grad)
    assert torch.equal(x32.grad, x32_ref.grad)


def test_a_16_bit_embeddings_row_gradients_are_one_rounding_from_the_exact_sums():
    gen = torch.Generator().manual_seed(0)
    vocab, hidden, tokens = 50, 32, 4096
    ids = torch.randint(0, 3, (tokens,), generator=gen)  # three rows, ~1365 tokens each (BERT's token types)
    ids[::7] = torch.randint(0, vocab, (len(ids[::7]),), generator=gen)
    dy = _cancelling(tokens, hidden, gen)
    exact = torch.zeros(vocab, hidden, dtype=torch.float64).index_add_(0, ids, dy.double())
    weight = torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16).requires_grad_()
    out = embedding(ids, weight)
    assert torch.equal(out, F.embedding(ids, weight))
    out.backward(dy)
    assert _rel(weight.grad, exact) <= ONE_ROUNDING, _rel(weight.grad, exact)  # torch's kernel: 5%
    assert torch.equal(weight.grad.ne(0).any(1), exact.ne(0).any(1))  # the untouched rows are zero
    rows, sums = row_sums(ids, dy)  # the rows the CPU tuning's first stage hands to main_grad: the same bits
    assert torch.equal(rows, torch.unique(ids)) and torch.equal(weight.grad[rows], sums)
    # fp32: torch's embedding, bit for bit
    w32 = weight.detach().float().requires_grad_()
    w_ref = w32.detach().clone().requires_grad_()
    embedding(ids, w32).backward(dy.float())
    F.embedding(ids, w_ref).backward(dy.float())
    assert torch.equal(w32.grad, w_ref.grad)
