"""The mixture-of-experts layer on one process, against transformers' own blocks on the same weights.

- ``MoELayer`` with Mixtral's routing (top-k of the logits, softmax over the k) equals transformers'
  ``MixtralSparseMoeBlock``, and with ``moe_router_pre_softmax`` plus a gated shared expert equals
  ``Qwen2MoeSparseMoeBlock`` (``norm_topk_prob=False``): outputs and every gradient, fp32, 1e-6.
- The load-balancing loss is megatron-core's formula, written out here from the routing; for one
  layer it is transformers' ``load_balancing_loss_func`` divided by k; the z-loss is the mean squared
  logsumexp; the aux loss reaches the router's gradient with its coefficient.
- Capacity: each expert keeps its ``ceil(f k n / E)`` most probable assignments.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_megatron.models.gpt.config import GPTConfig
from lightning_megatron.transformer.moe import MoELayer, capacity_mask, route

transformers = pytest.importorskip("transformers")

H, FFN, E, K = 32, 48, 4, 2


def _config(**overrides) -> GPTConfig:
    fields = dict(num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN, spec="llama_moe_layer_spec",
                  num_moe_experts=E, moe_router_topk=K, add_bias_linear=False, gated_linear_unit=True,
                  activation="silu", vocab_size=100, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTConfig(**(fields | overrides)).with_layout(1, False, 1)


def _copy_experts(layer: MoELayer, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    with torch.no_grad():
        for e, expert in enumerate(layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(gate_up[e])
            expert.linear_fc2.weight.copy_(down[e])


def _grads_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    for name, g in theirs.items():
        torch.testing.assert_close(ours[name], g, rtol=1e-6, atol=1e-6, msg=name)


@pytest.fixture
def one_thread() -> None:
    """The blocks' weight gradients sum over tokens in torch's threaded reductions, each framework in its own
    order: at two threads the router's differs from Hugging Face's by 2.4e-6 (5 fp32 ulps of its largest element,
    ~6), at one within 1e-6, the tolerance stated. The suite's workers run one thread each (conftest); this pins it
    for a file run alone (``pytest tests/test_moe.py``, the README's way). conftest restores the count."""
    torch.set_num_threads(1)


@pytest.mark.usefixtures("one_thread")
def test_mixtral_block_equal():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    theirs = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=FFN, num_local_experts=E,
                                                 num_experts_per_tok=K))
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = MoELayer(_config())
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
    _copy_experts(ours, theirs.experts.gate_up_proj, theirs.experts.down_proj)
    x = torch.randn(6, 3, H)
    x1, x2 = x.clone().requires_grad_(), x.transpose(0, 1).contiguous().requires_grad_()
    out, bias = ours(x1)
    ref = theirs(x2).transpose(0, 1)
    assert bias is None
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    (ref * torch.linspace(-1, 1, ref.numel()).view_as(ref)).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad.transpose(0, 1), rtol=1e-6, atol=1e-6)
    g_up = torch.stack([e.linear_fc1.weight.grad for e in ours.experts.local_experts])
    g_down = torch.stack([e.linear_fc2.weight.grad for e in ours.experts.local_experts])
    _grads_close({"gate": ours.router.weight.grad, "up": g_up, "down": g_down},
                 {"gate": theirs.gate.weight.grad, "up": theirs.experts.gate_up_proj.grad,
                  "down": theirs.experts.down_proj.grad})


@pytest.mark.usefixtures("one_thread")
def test_qwen2_moe_block_equal():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    torch.manual_seed(1)
    shared = 24
    theirs = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=FFN, num_experts=E,
                                                   num_experts_per_tok=K, norm_topk_prob=False,
                                                   shared_expert_intermediate_size=shared))
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = MoELayer(_config(moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=shared,
                            moe_shared_expert_gate=True))
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        s = theirs.shared_expert
        ours.shared_experts.linear_fc1.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
        ours.shared_experts.linear_fc2.weight.copy_(s.down_proj.weight)
        ours.shared_expert_gate.copy_(theirs.shared_expert_gate.weight)
    _copy_experts(ours, theirs.experts.gate_up_proj, theirs.experts.down_proj)
    x = torch.randn(5, 2, H)
    out, _ = ours(x)
    ref = theirs(x.transpose(0, 1).contiguous()).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    out.square().sum().backward()
    ref.square().sum().backward()
    _grads_close({"gate": ours.router.weight.grad, "shared_gate": ours.shared_expert_gate.grad,
                  "down": torch.stack([e.linear_fc2.weight.grad for e in ours.experts.local_experts])},
                 {"gate": theirs.gate.weight.grad, "shared_gate": theirs.shared_expert_gate.weight.grad,
                  "down": theirs.experts.down_proj.grad})


def test_routing_semantics():
    logits = torch.randn(7, E)
    mixtral = route(logits, K)  # top-k of the logits, softmax over them
    full = torch.softmax(logits, dim=-1)
    top, idx = full.topk(K, dim=-1)
    assert torch.equal(mixtral.experts, idx)
    torch.testing.assert_close(mixtral.probs, top / top.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    pre = route(logits, K, pre_softmax=True)  # no renormalisation
    torch.testing.assert_close(pre.probs, top)
    sig = route(logits, K, "sigmoid")
    s, i = torch.sigmoid(logits).topk(K, dim=-1)
    assert torch.equal(sig.experts, i)
    torch.testing.assert_close(sig.probs, s / s.sum(-1, keepdim=True))


def test_aux_losses_formula_and_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(2)
    coeff, zc = 0.01, 0.001
    layer = MoELayer(_config(moe_aux_loss_coeff=coeff, moe_z_loss_coeff=zc))
    x = torch.randn(6, 2, H)
    layer(x)
    aux, z = layer.stats[:2]
    tokens = layer.stats[2:]
    logits = torch.nn.functional.linear(x.reshape(-1, H), layer.router.weight).detach()
    n = logits.shape[0]
    p = torch.softmax(logits, -1)
    chosen = torch.zeros(n, E).scatter(1, logits.topk(K, -1).indices, 1.0)
    expected = coeff * E / (K * n * n) * (p.sum(0) * chosen.sum(0)).sum()
    torch.testing.assert_close(aux, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(z, zc * torch.logsumexp(logits, -1).square().mean(), rtol=1e-6, atol=0)
    assert torch.equal(tokens, chosen.sum(0)) and tokens.sum() == n * K
    theirs = load_balancing_loss_func((logits,), E, K)
    torch.testing.assert_close(aux / coeff * K, theirs, rtol=1e-5, atol=0)

    seq = MoELayer(_config(moe_aux_loss_coeff=coeff, moe_router_load_balancing_type="seq_aux_loss"))
    x = torch.randn(5, 3, H)
    seq(x)
    lg = torch.nn.functional.linear(x, seq.router.weight).detach()  # [s, b, E]
    ps_ = torch.softmax(lg, -1)
    ch = torch.zeros_like(lg).scatter(2, lg.topk(K, -1).indices, 1.0)
    s_len = x.shape[0]
    per_seq = ((ch.sum(0) * E / (K * s_len)) * ps_.mean(0)).sum(-1).mean() * coeff
    torch.testing.assert_close(seq.stats[0], per_seq, rtol=1e-6, atol=0)


def test_a_recomputed_layer_counts_its_routing_once():
    """Under activation recomputation a layer runs twice (without gradients, then again in backward); its logged
    statistics (aux loss, z-loss, tokens per expert) counted both until 2026-12-07: the logged aux loss doubled."""
    from lightning_megatron.tensor_parallel import recompute

    torch.manual_seed(3)
    layer = MoELayer(_config(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=1e-3))
    x = torch.randn(4, 2, H, requires_grad=True)
    out, _ = layer(x)
    out.sum().backward()
    plain = layer.stats.clone()
    layer.stats.zero_()
    recompute(lambda t: layer(t)[0], x).sum().backward()
    assert plain[2:].sum() == 4 * 2 * K  # every token's k assignments, once
    torch.testing.assert_close(layer.stats, plain)


def test_aux_loss_reaches_the_router_gradient():
    """The scaled-in aux loss gives the router the gradient of (output . g + coeff * aux) (autograd reference)."""
    from lightning_megatron.transformer.moe.router import load_balancing_losses

    torch.manual_seed(3)
    coeff = 0.5
    cfg = _config(moe_aux_loss_coeff=coeff)
    layer = MoELayer(cfg)
    x = torch.randn(4, 2, H)
    out, _ = layer(x)
    out.sum().backward()
    with_aux = layer.router.weight.grad.clone()
    layer.router.weight.grad = None
    layer.eval()  # no aux loss attached
    out, _ = layer(x)
    routing = layer.router(x.reshape(-1, H))
    aux, _, _ = load_balancing_losses(routing, cfg, num_tokens_per_sequence=4, token_group=None)
    (out.sum() + aux).backward()
    torch.testing.assert_close(layer.router.weight.grad, with_aux, rtol=1e-6, atol=1e-8)
    assert not torch.allclose(with_aux, with_aux - layer.router.weight.grad + 1)  # non-trivial


def test_capacity_keeps_the_most_probable():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])
    experts = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 3]])
    keep, capacity = capacity_mask(probs, experts, num_experts=4, capacity_factor=1.0)
    assert capacity == math.ceil(1.0 * 2 * 4 / 4) == 2
    # expert 0 keeps tokens 0 and 1 (0.9, 0.8); expert 1 has two (kept); experts 2 and 3 one each
    assert keep.tolist() == [[True, True], [True, True], [False, True], [False, True]]
    cfg = _config(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    layer = MoELayer(cfg)
    x = torch.randn(8, 2, H)
    padded, _ = layer(x)
    unpadded = MoELayer(_config(moe_expert_capacity_factor=1.0))
    unpadded.load_state_dict(layer.state_dict())
    torch.testing.assert_close(unpadded(x)[0], padded, rtol=1e-6, atol=1e-6)


def test_capacity_ties_go_to_the_earlier_token_in_any_row_order():
    """Assignments of exactly equal probability at an expert's capacity (documents that begin with the same token):
    the one earlier in the sequence (``order``: the rows' one-process index) is kept, whatever order the rows come
    in (the ranks that split a sequence gather theirs in rank order). The reference sorts each expert's
    assignments by probability, then by order, in plain Python."""
    g = torch.Generator().manual_seed(0)
    n, experts_n = 24, 4
    probs = torch.tensor([0.25, 0.5, 0.75])[torch.randint(0, 3, (n, K), generator=g)]  # many exact ties
    experts = torch.stack([torch.randperm(experts_n, generator=g)[:K] for _ in range(n)])
    order = torch.randperm(n, generator=g)
    keep, capacity = capacity_mask(probs, experts, num_experts=experts_n, capacity_factor=1.0, order=order)
    assert capacity == 12
    want = torch.zeros(n, K, dtype=torch.bool)
    for e in range(experts_n):
        chosen = sorted(((-float(probs[r, j]), int(order[r]), r, j) for r in range(n) for j in range(K)
                         if experts[r, j] == e))
        for *_, r, j in chosen[:capacity]:
            want[r, j] = True
    assert keep.tolist() == want.tolist()
    assert (~want).sum() > 0
    # the same rows in sequence order, without an order: the same choice
    natural = torch.argsort(order)
    keep_natural, _ = capacity_mask(probs[natural], experts[natural], num_experts=experts_n, capacity_factor=1.0)
    assert keep_natural.tolist() == want[natural].tolist()


def test_config_refusals():
    with pytest.raises(ValueError, match="num_moe_experts=4 but spec='llama_layer_spec' has a dense MLP"):
        GPTConfig(spec="llama_layer_spec", num_moe_experts=4, add_bias_linear=False, gated_linear_unit=True)
    with pytest.raises(ValueError, match="set num_moe_experts"):
        GPTConfig(spec="llama_moe_layer_spec")
    with pytest.raises(ValueError, match="not divisible by expert_model_parallel_size=3"):
        GPTConfig(spec="llama_moe_layer_spec", num_moe_experts=4, add_bias_linear=False,
                  gated_linear_unit=True).with_layout(1, False, 3)
    with pytest.raises(ValueError, match="moe_router_topk=5"):
        _config(moe_router_topk=5)


def test_cpu_kernels_pad_16bit_expert_rows_to_a_multiple_of_128():
    """The opt-in CPU tuning runs bf16 expert matmuls on rows rounded up to 128 (oneDNN builds a kernel per new
    row count): the same outputs and gradients as without it, to bf16 rounding; fp32 is left alone."""
    from lightning_megatron.cpu.kernels import CPUKernels
    from lightning_megatron.transformer import set_kernels

    cpu = CPUKernels()
    assert cpu.expert_rows(5, torch.zeros(1, dtype=torch.bfloat16)) == 128
    assert cpu.expert_rows(129, torch.zeros(1, dtype=torch.bfloat16)) == 256
    assert cpu.expert_rows(5, torch.zeros(1)) == 5 and cpu.expert_rows(0, torch.zeros(1, dtype=torch.bfloat16)) == 0
    torch.manual_seed(4)
    plain = MoELayer(_config(params_dtype="bfloat16"))
    tuned = MoELayer(_config(params_dtype="bfloat16"))
    tuned.load_state_dict(plain.state_dict())
    assert set_kernels(tuned, cpu) == 1
    x = torch.randn(6, 2, H, dtype=torch.bfloat16)
    out_plain, out_tuned = plain(x)[0], tuned(x)[0]
    torch.testing.assert_close(out_tuned, out_plain, rtol=1e-2, atol=1e-2)
    out_plain.float().square().sum().backward()
    out_tuned.float().square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), tuned.parameters()):
        torch.testing.assert_close(b.grad.float(), a.grad.float(), rtol=2e-2, atol=2e-2, msg=name)


def test_top1_softmax_routing_after_the_top_k_is_refused():
    """A softmax over the one chosen logit is 1 for every token: the language-model loss never trained the router
    (its gradient exactly 0 without an aux loss). megatron-core refuses it ("use --moe-router-pre-softmax when topk
    is 1"); so does the config, naming the fix; pre-softmax and sigmoid top-1 route with real weights."""
    with pytest.raises(ValueError, match=r"moe_router_topk=1 with moe_router_pre_softmax=False.*set "
                                         r"moe_router_pre_softmax=True"):
        _config(moe_router_topk=1)
    for fields in (dict(moe_router_pre_softmax=True), dict(moe_router_score_function="sigmoid")):
        layer = MoELayer(_config(moe_router_topk=1, **fields))
        x = torch.randn(6, 2, H)
        out, _ = layer(x)
        out.square().sum().backward()
        assert layer.router.weight.grad.abs().max() > 0, fields


def test_capacity_is_megatron_core_s():
    """An expert's capacity is megatron-core's ``get_capacity(n k, E, f) = ceil((n k / E) f)`` in floating point:
    ``ceil(f k n / E)`` rounds the other way where the exact value is an integer (E=6, top-2, 100 tokens, f=0.9:
    30 here, 31 there; 4 assignments more dropped, the layer's output 0.77 off megatron-core's)."""
    probs, experts = torch.rand(100, 2), torch.stack([torch.randperm(6)[:2] for _ in range(100)])
    for f, want in ((0.9, 31), (1.8, 61), (1.0, 34)):
        assert capacity_mask(probs, experts, num_experts=6, capacity_factor=f)[1] == want == \
            math.ceil((100 * 2 / 6) * f)


@pytest.mark.parametrize("router_dtype", ["fp32", "fp64"])
def test_the_router_dtype_computes_a_16_bit_model_s_logits_wider(router_dtype):
    """megatron-core's ``moe_router_dtype``: the router's logits of a bf16 model in fp32 (or fp64), its gradient
    reaching the bf16 weight; in the parameters' dtype they routed 2 of 256 tokens elsewhere and the router's
    gradient was 0.44 off (of 22). The reference is the plain wide product."""
    wide = {"fp32": torch.float32, "fp64": torch.float64}[router_dtype]
    layer = MoELayer(_config(params_dtype=torch.bfloat16, moe_router_dtype=router_dtype))
    x = torch.randn(64, H, dtype=torch.bfloat16, requires_grad=True)
    routing = layer.router(x)
    want = torch.nn.functional.linear(x.detach().to(wide), layer.router.weight.detach().to(wide))
    assert routing.logits.dtype == wide
    torch.testing.assert_close(routing.logits.detach(), want, rtol=0, atol=0)
    top = torch.topk(want, K, dim=-1).indices
    assert torch.equal(routing.experts, top)
    routing.probs.sum().backward()
    assert layer.router.weight.grad.dtype == torch.bfloat16 and layer.router.weight.grad.abs().max() > 0
    with pytest.raises(ValueError, match="moe_router_dtype='fp16'"):
        _config(moe_router_dtype="fp16")
