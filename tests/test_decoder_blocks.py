"""Decoder building blocks against transformers' Llama modules on copied weights (fp32, single process):
grouped-query attention with rotary embeddings and causal masking, the gated (SwiGLU) MLP, the rotary
embedding itself, a two-layer block with every recomputation mode; config validation of the new fields;
the KV cache against the full sequence, the sampling filters against transformers' warpers, greedy
generation with the cache against recomputing the sequence; and ONE 2-process run: TP=2 (GQA g=2 and
g=1 of n=4, SwiGLU, rotary), with and without sequence parallelism, equal to the TP=1 model built from the same
seed, and TP=2 greedy generation (g=2 and g=1) equal to TP=1."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf

from dist_utils import run_distributed
from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from lightning_megatron.transformer import (
    MLP,
    LayerNorm,
    AttnMaskType,
    DotProductAttention,
    MLPSubmodules,
    ModuleSpec,
    RMSNorm,
    SelfAttention,
    SelfAttentionSubmodules,
    TransformerBlock,
    TransformerConfig,
    TransformerLayer,
    TransformerLayerSubmodules,
    get_bias_dropout_add,
)
from lightning_megatron.transformer.rotary import RotaryEmbedding, RotaryTable, apply_rotary_pos_emb
from lightning_megatron.parallel_dims import ParallelDims

H, N, D, F_HIDDEN = 64, 4, 16, 96
BASE = dict(num_layers=2, hidden_size=H, num_attention_heads=N, ffn_hidden_size=F_HIDDEN, hidden_dropout=0.0,
            attention_dropout=0.0, add_bias_linear=False, normalization="RMSNorm", layernorm_epsilon=1e-6,
            activation="silu", gated_linear_unit=True, rotary_base=500000.0)
TOL = dict(rtol=1e-5, atol=2e-6)


def _attention_spec() -> ModuleSpec:
    return ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                         core_attention=DotProductAttention,
                                                         linear_proj=RowParallelLinear))


def _layer_spec() -> ModuleSpec:
    """A Llama-shaped layer written here (the registered decoder specs live in models/gpt)."""
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=RMSNorm, self_attention=_attention_spec(), self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=RMSNorm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))


def _hf_config(g: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=H, num_attention_heads=N, num_key_value_heads=g, head_dim=D,
                       intermediate_size=F_HIDDEN, rope_theta=500000.0, attn_implementation="eager",
                       hidden_act="silu", attention_bias=False, mlp_bias=False, rms_norm_eps=1e-6)


def _causal_additive(s: int) -> torch.Tensor:
    return torch.full((s, s), float("-inf")).triu(1)[None, None]


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: int) -> torch.Tensor:
    """megatron-core's fused layout: per query group [its n/g query heads, its key head, its value head]."""
    return torch.cat([q.view(g, N // g * D, H), k.view(g, D, H), v.view(g, D, H)], dim=1).reshape(-1, H)


def _qkv_from_hf(attn: hf.LlamaAttention, g: int) -> torch.Tensor:
    return _fuse_qkv(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, g)


def _copy_layer(ours: TransformerLayer, theirs: hf.LlamaDecoderLayer, g: int) -> None:
    with torch.no_grad():
        ours.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
        ours.pre_mlp_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)
        ours.self_attention.linear_qkv.weight.copy_(_qkv_from_hf(theirs.self_attn, g))
        ours.self_attention.linear_proj.weight.copy_(theirs.self_attn.o_proj.weight)
        ours.mlp.linear_fc1.weight.copy_(torch.cat([theirs.mlp.gate_proj.weight, theirs.mlp.up_proj.weight]))
        ours.mlp.linear_fc2.weight.copy_(theirs.mlp.down_proj.weight)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs,field,fix", [
    (dict(num_query_groups=3), "num_query_groups=3", "divides num_attention_heads=4"),
    (dict(num_query_groups=0), "num_query_groups=0", "positive"),
    (dict(num_attention_heads=6, hidden_size=96, num_query_groups=3, tensor_model_parallel_size=2),
     "num_query_groups=3", "multiple or a divisor of tensor_model_parallel_size=2"),
    (dict(rotary_percent=0.0), "rotary_percent=0.0", "(0, 1]"),
    (dict(rotary_base=0.0), "rotary_base=0.0", "10000"),
])
def test_bad_decoder_config_raises_naming_field_and_fix(kwargs, field, fix):
    with pytest.raises(ValueError) as info:
        TransformerConfig(**{**BASE, **kwargs})
    assert field in str(info.value) and fix in str(info.value), str(info.value)


def test_rotary_refuses_an_odd_number_of_rotary_channels():
    with pytest.raises(ValueError, match=r"rotary_percent=0.3125 of kv_channels=16 gives 5 .*even"):
        RotaryEmbedding(16, 0.3125, 10000.0)


def test_num_query_groups_defaults_to_the_head_count():
    assert TransformerConfig(**BASE).num_query_groups == N
    assert TransformerConfig(**BASE, num_query_groups=2, tensor_model_parallel_size=2).num_query_groups == 2
    # Fewer key/value heads than TP ranks, as megatron-core allows when g divides t.
    assert TransformerConfig(**BASE, num_query_groups=1, tensor_model_parallel_size=4).num_query_groups == 1


# ---------------------------------------------------------------- rotary


def test_rotary_matches_transformers_llama_and_offsets_slice_the_table():
    s = 9
    rope = RotaryEmbedding(D, 1.0, 500000.0)
    freqs = rope(s)
    assert freqs.shape == (s, 1, 1, D) and freqs.dtype == torch.float32
    cos, sin = hf.LlamaRotaryEmbedding(_hf_config(2))(torch.zeros(1), torch.arange(s)[None])
    torch.manual_seed(0)
    q = torch.randn(1, N, s, D)  # HF layout [b, n, s, d]
    expected, _ = hf.apply_rotary_pos_emb(q, q, cos, sin)
    ours = apply_rotary_pos_emb(q.permute(2, 0, 1, 3), freqs).permute(1, 2, 0, 3)  # ours [s, b, n, d]
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert torch.equal(rope(4, offset=5), freqs[5:])


def test_partial_rotary_rotates_the_leading_channels_only():
    s, rot = 5, D // 2
    freqs = RotaryEmbedding(D, 0.5, 10000.0)(s)
    assert freqs.shape == (s, 1, 1, rot)
    torch.manual_seed(0)
    t = torch.randn(s, 2, 3, D)
    inv = 1.0 / 10000.0 ** (torch.arange(0, rot, 2).float() / rot)
    angle = torch.arange(s).float()[:, None] * inv  # [s, rot/2]
    cos, sin = (f(angle).repeat(1, 2)[:, None, None] for f in (torch.cos, torch.sin))
    x1, x2 = t[..., :rot // 2], t[..., rot // 2:rot]
    expected = torch.cat([t[..., :rot] * cos + torch.cat([-x2, x1], -1) * sin, t[..., rot:]], -1)
    torch.testing.assert_close(apply_rotary_pos_emb(t, freqs), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rotary_has_the_bits_of_rotate_half_through_autograd_without_its_copies(percent, dtype):
    """RoPE and its gradient are the bits of ``t * cos + rotate_half(t) * sin`` (its passing channels appended)
    through autograd, on a strided view as the qkv split gives; rotate_half's negation and concatenation are not
    made (no ``neg`` or ``cat`` at dispatch, forward or backward: the backward rotates by the same tables with
    the sin terms' signs swapped), and the second derivative is taken through it (the backward is the rotation by
    the opposite angle). The same bits from a :class:`RotaryTable`, whose cos and sin are made once. Compiled, one
    graph."""
    from torch.utils._python_dispatch import TorchDispatchMode

    s, rot = 6, int(D * percent)
    freqs = RotaryEmbedding(D, percent, 10000.0)(s)
    torch.manual_seed(0)
    wide = torch.randn(s, 2, 3, 3 * D, dtype=dtype)
    t = wide[..., D:2 * D].detach().requires_grad_(True)  # strided, like a query from linear_qkv's output
    ref = t.detach().clone().requires_grad_(True)
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)

    def expression(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :rot // 2], x[..., rot // 2:rot]
        return torch.cat([x[..., :rot] * cos + torch.cat([-x2, x1], -1) * sin, x[..., rot:]], -1)

    want = expression(ref)
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = [a for a in args if isinstance(a, torch.Tensor)] + [b for a in args if isinstance(a, list)
                                                                          for b in a if isinstance(b, torch.Tensor)]
            seen.append((func.overloadpacket.__name__, max((a.numel() for a in tensors), default=0)))
            return func(*args, **(kwargs or {}))

    g = torch.randn(s, 2, 3, D, dtype=dtype)
    with Ops():
        got = apply_rotary_pos_emb(t, freqs)
        got.backward(g)
    want.backward(g)
    assert torch.equal(got, want) and torch.equal(t.grad, ref.grad), (percent, dtype)
    assert not [(op, n) for op, n in seen if op in ("neg", "cat")], seen
    table = RotaryTable(freqs)  # the model's: cos and sin made once for all the layers, the same bits
    t.grad = None
    got_from_table = apply_rotary_pos_emb(t, table)
    got_from_table.backward(g)
    assert torch.equal(got_from_table, want) and torch.equal(t.grad, ref.grad)
    assert table.cos_sin(dtype)[0] is table.cos_sin(dtype)[0]
    (gg,) = torch.autograd.grad(apply_rotary_pos_emb(t, freqs).pow(2).sum(), t, create_graph=True)
    (want_gg,) = torch.autograd.grad(expression(ref).pow(2).sum(), ref, create_graph=True)
    assert torch.equal(torch.autograd.grad(gg.sum(), t)[0], torch.autograd.grad(want_gg.sum(), ref)[0])
    torch._dynamo.reset()
    explained = torch._dynamo.explain(apply_rotary_pos_emb)(t, freqs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [b.reason for b in explained.break_reasons]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rotating_the_query_and_key_heads_in_one_pass_has_the_bits_of_rotating_each(percent, dtype):
    """``apply_rotary_pos_emb_heads`` on linear_qkv's group-major output (2 groups of 3 query heads, a key and a
    value) rotates every query and key head and copies the value: the bits of RoPE on the split query and key
    (which ``apply_rotary_pos_emb`` is, against the expression above), gradients and second derivatives too, in
    fewer ops than the two at dispatch, forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_megatron.transformer.rotary import apply_rotary_pos_emb_heads

    s, groups, per_group = 6, 2, 3
    freqs = RotaryEmbedding(D, percent, 10000.0)(s)
    torch.manual_seed(0)
    mixed = torch.randn(s, 2, groups, per_group + 2, D, dtype=dtype, requires_grad=True)
    ref = mixed.detach().clone().requires_grad_(True)

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    g = torch.randn(s, 2, groups, per_group + 2, D, dtype=dtype)
    with Ops() as joint:
        got = apply_rotary_pos_emb_heads(mixed, freqs, per_group + 1)
        got.backward(g)
    with Ops() as apart:
        q, k, v = ref.split([per_group, 1, 1], dim=-2)
        want = torch.cat([apply_rotary_pos_emb(q, freqs.unsqueeze(-2)), apply_rotary_pos_emb(k, freqs.unsqueeze(-2)),
                          v], dim=-2)
        want.backward(g)
    assert torch.equal(got, want) and torch.equal(mixed.grad, ref.grad), (percent, dtype)
    assert joint.count < apart.count * 2 // 3, (joint.count, apart.count)
    (gg,) = torch.autograd.grad(apply_rotary_pos_emb_heads(mixed, freqs, per_group + 1).pow(2).sum(), mixed,
                                create_graph=True)
    q, k, v = ref.split([per_group, 1, 1], dim=-2)
    rotated = torch.cat([apply_rotary_pos_emb(q, freqs.unsqueeze(-2)), apply_rotary_pos_emb(k, freqs.unsqueeze(-2)),
                         v], dim=-2)
    (want_gg,) = torch.autograd.grad(rotated.pow(2).sum(), ref, create_graph=True)
    assert torch.equal(torch.autograd.grad(gg.sum(), mixed)[0], torch.autograd.grad(want_gg.sum(), ref)[0])
    for rotate in (lambda t, f: apply_rotary_pos_emb(t, f.unsqueeze(-2)),
                   lambda t, f: apply_rotary_pos_emb_heads(t, f, 1)):
        with pytest.raises(ValueError, match="rotary table has 5 positions but the tensor has sequence length 6"):
            rotate(mixed, freqs[:5])  # a table of other positions than the tensor's sequence is refused


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rotating_grouped_query_heads_where_they_lie_has_the_bits_of_rotating_their_copy(percent):
    """Grouped-query attention rotates its query heads as they lie in linear_qkv's group-major output (a
    [s, b, groups, heads, d] view with that output's strides) into a new contiguous tensor, the queries'
    [s, b, n, d] a view of it (no copy beside it to keep for the backward): the bits, and the gradient's, of
    rotating their [s, b, n, d] copy."""
    s, groups, per_group = 6, 2, 3
    freqs = RotaryEmbedding(D, percent, 10000.0)(s)
    torch.manual_seed(0)
    mixed = torch.randn(s, 2, groups, per_group + 2, D, requires_grad=True)
    ref = mixed.detach().clone().requires_grad_(True)
    got = apply_rotary_pos_emb(mixed[..., :per_group, :], freqs)
    assert got.is_contiguous() and got.shape == (s, 2, groups, per_group, D)
    got = got.view(s, 2, groups * per_group, D)
    want = apply_rotary_pos_emb(ref[..., :per_group, :].reshape(s, 2, groups * per_group, D), freqs)
    g = torch.randn_like(want)
    got.backward(g)
    want.backward(g)
    assert torch.equal(got, want) and torch.equal(mixed.grad, ref.grad)


# ---------------------------------------------------------------- attention and MLP


@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
@pytest.mark.parametrize("g", [1, 2, 4])
def test_gqa_rope_causal_attention_matches_llama_attention(g, backend):
    torch.manual_seed(0)
    theirs = hf.LlamaAttention(_hf_config(g), layer_idx=0)
    cfg = TransformerConfig(**BASE, num_query_groups=g, attention_backend=backend)
    ours = SelfAttention(cfg, _attention_spec().submodules, 1, AttnMaskType.causal)
    assert ours.linear_qkv.weight.shape == ((N + 2 * g) * D, H)
    with torch.no_grad():
        ours.linear_qkv.weight.copy_(_qkv_from_hf(theirs, g))
        ours.linear_proj.weight.copy_(theirs.o_proj.weight)
    s, b = 7, 2
    x = torch.randn(s, b, H, requires_grad=True)
    out, bias = ours(x, None, rotary_pos_emb=RotaryEmbedding(D, 1.0, 500000.0)(s))
    assert bias is None
    position = hf.LlamaRotaryEmbedding(_hf_config(g))(x, torch.arange(s)[None])
    xt = x.detach().transpose(0, 1).requires_grad_()
    expected, _ = theirs(xt, position, _causal_additive(s))
    torch.testing.assert_close(out.transpose(0, 1), expected, **TOL)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad.transpose(0, 1))
    torch.testing.assert_close(x.grad.transpose(0, 1), xt.grad, **TOL)
    expected_dw = _fuse_qkv(theirs.q_proj.weight.grad, theirs.k_proj.weight.grad, theirs.v_proj.weight.grad, g)
    torch.testing.assert_close(ours.linear_qkv.weight.grad, expected_dw, **TOL)
    torch.testing.assert_close(ours.linear_proj.weight.grad, theirs.o_proj.weight.grad, **TOL)


@pytest.mark.parametrize("g,rope,qk_norm", [(4, True, False), (2, True, False), (1, True, False), (2, False, False),
                                             (2, True, True)], ids=["mha", "gqa", "mqa", "gqa-no-rope", "gqa-qk-norms"])
def test_attention_keeps_its_queries_keys_values_and_context_and_nothing_they_were_cut_from(g, rope, qk_norm):
    """What self-attention keeps for its backward, measured (distinct storages of the saved tensors, parameters
    excluded): linear_qkv's input, the queries, keys and values, the context (linear_proj's input too), sdpa's
    log-sum-exp, RoPE's cos and sin, and with q/k norms their inputs and statistics: ``(2n + 2g) d`` a token for
    the attention, not ``linear_qkv``'s output held whole by key and value views beside queries that left it
    (copied to merge a group's heads, rotated or normed on their own)."""
    torch.manual_seed(0)
    cfg = TransformerConfig(**BASE, num_query_groups=g)
    spec = _attention_spec()
    if qk_norm:
        spec = ModuleSpec(module=SelfAttention, params=spec.params, submodules=dataclasses.replace(
            spec.submodules, q_layernorm=LayerNorm, k_layernorm=LayerNorm))
    ours = SelfAttention(cfg, spec.submodules, 1, AttnMaskType.causal)
    s, b = 8, 2
    x = torch.randn(s, b, H, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in ours.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = ours(x, None, rotary_pos_emb=RotaryEmbedding(D, 1.0, 10000.0)(s) if rope else None)
    expected = 4 * s * b * (H + (2 * N + 2 * g) * D) + 4 * b * N * s  # fp32: x, q, k, v, context; log-sum-exp
    expected += 2 * 4 * s * D if rope else 0  # cos, sin
    expected += (4 * s * b * (N + g) * D + 2 * 4 * s * b * (N + g)) if qk_norm else 0  # the norms' inputs, stats
    assert sum(kept.values()) == expected, (sum(kept.values()), expected)
    out.sum().backward()


def test_causal_attention_uses_sdpa_is_causal_and_hides_the_future(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    s, b, g = 6, 2, 2
    q, k, v = torch.randn(s, b, N, D), torch.randn(s, b, g, D), torch.randn(s, b, g, D)
    outs = {}
    for backend in ("sdpa", "unfused"):
        core = DotProductAttention(TransformerConfig(**BASE, num_query_groups=g, attention_backend=backend), 1,
                                   AttnMaskType.causal)
        outs[backend] = core(q, k, v, None)
    assert len(calls) == 1 and calls[0]["is_causal"] is True and calls[0]["attn_mask"] is None
    torch.testing.assert_close(outs["sdpa"], outs["unfused"], rtol=1e-6, atol=1e-6)
    v2 = v.clone()
    v2[4:] += 10.0  # the future of positions 0..3
    assert torch.equal(core(q, k, v2, None)[:4], outs["unfused"][:4])


def test_causal_attention_with_a_padding_mask_stays_causal_on_both_backends():
    torch.manual_seed(0)
    s, b = 6, 2
    q, k, v = (torch.randn(s, b, N, D) for _ in range(3))
    mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    mask[1, ..., 4:] = True  # sequence 1 is padded after position 3
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / D ** 0.5
    hidden = mask | torch.ones(s, s, dtype=torch.bool).triu(1)
    expected = torch.einsum("bnst,tbnd->sbnd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)
    for backend in ("sdpa", "unfused"):
        core = DotProductAttention(TransformerConfig(**BASE, attention_backend=backend), 1, AttnMaskType.causal)
        torch.testing.assert_close(core(q, k, v, mask), expected.reshape(s, b, N * D), rtol=1e-6, atol=1e-6)


def _graph_node_names(tensor: torch.Tensor) -> set[str]:
    """The names of the autograd nodes ``tensor``'s backward runs."""
    names, todo, seen = set(), [tensor.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unfused_attention_hides_keys_with_the_bits_and_gradients_of_masked_fill(dtype):
    # The unfused path fills the hidden scores in place and passes the gradient through them unmasked
    # (softmax's gradient is exactly zero where a probability is). The reference spells the formula out
    # with the same kernels (softmax in fp32, attention_softmax_in_fp32's default) and an out-of-place
    # masked_fill, whose backward masks the gradient.
    torch.manual_seed(0)
    s, b = 9, 3
    q0, k0, v0 = (torch.randn(s, b, N, D).to(dtype) for _ in range(3))
    mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    mask[1, ..., 6:] = True  # sequence 1 is padded after position 5
    mask[2, ..., 3] = True
    weights = torch.randn(s, b, N * D).to(dtype)
    for mask_type, given in [(AttnMaskType.causal, None), (AttnMaskType.causal, mask), (AttnMaskType.padding, mask)]:
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        rq, rk, rv = (t.clone().requires_grad_() for t in (q0, k0, v0))
        core = DotProductAttention(TransformerConfig(**BASE, attention_backend="unfused"), 1, mask_type)
        out = core(q, k, v, given)
        # Filled in place on the scores themselves, not on a view of them: a view filled in place makes
        # autograd rebase it (CopySlices and AsStridedBackward0: a copy of the scores and a zero-filled
        # scatter of their gradient in every backward).
        assert not {"CopySlices", "AsStridedBackward0"} & _graph_node_names(out), mask_type
        (out * weights).sum().backward()
        qb, kb, vb = (t.permute(1, 2, 0, 3).reshape(b * N, s, D) for t in (rq, rk, rv))
        scores = torch.baddbmm(qb.new_empty(b * N, s, s), qb, kb.transpose(1, 2), beta=0.0,
                               alpha=1.0 / D ** 0.5).view(b, N, s, s)
        hidden = torch.zeros(s, s, dtype=torch.bool) if given is None else given
        if mask_type == AttnMaskType.causal:
            hidden = hidden | torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1, dtype=torch.float32).to(dtype)
        expected = torch.matmul(probs, vb.view(b, N, s, D)).permute(2, 0, 1, 3).reshape(s, b, N * D)
        (expected * weights).sum().backward()
        assert torch.equal(out, expected), mask_type
        for name, got, want in [("q", q.grad, rq.grad), ("k", k.grad, rk.grad), ("v", v.grad, rv.grad)]:
            assert torch.equal(got, want), (mask_type, given is not None, name)
        if given is not None:  # hidden keys get no gradient
            assert k.grad[6:, 1].abs().sum() == 0 and k.grad[3, 2].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unfused_grouped_query_attention_multiplies_each_group_once_without_repeating_k_and_v(dtype):
    """With g < n key/value heads the unfused path multiplies each group's n/g query heads, stacked along the
    sequence, by the group's key and value head once: the output and gradients of the formula with k and v
    repeated per query head (computed in fp64; fp32 to 1e-6, bf16 to its rounding), without the repeats at
    dispatch (``repeat_interleave``'s unsqueeze and copy forward, or an ``index_select``; the sum over the
    copies backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    s, b, g = 7, 2, 2
    q, k, v = (torch.randn(s, b, heads, D).to(dtype).requires_grad_() for heads in (N, g, g))
    weights = torch.randn(s, b, N * D).to(dtype)
    names: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    core = DotProductAttention(TransformerConfig(**BASE, num_query_groups=g, attention_backend="unfused"), 1,
                               AttnMaskType.causal)
    with Ops():
        out = core(q, k, v, None)
        out.backward(weights)
    assert not {"repeat_interleave", "unsqueeze", "index_select", "sum"} & set(names), " ".join(sorted(set(names)))
    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = torch.einsum("sbnd,tbnd->bnst", rq, rk.repeat_interleave(N // g, dim=2)) / D ** 0.5
    hidden = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    expected = torch.einsum("bnst,tbnd->sbnd", probs, rv.repeat_interleave(N // g, dim=2)).reshape(s, b, N * D)
    (expected * weights.double()).sum().backward()
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), expected, **tol)
    for got, want in ((q.grad, rq.grad), (k.grad, rk.grad), (v.grad, rv.grad)):
        torch.testing.assert_close(got.double(), want, **tol)

def test_swiglu_mlp_matches_llama_mlp():
    torch.manual_seed(0)
    theirs = hf.LlamaMLP(_hf_config(2))
    ours = MLP(TransformerConfig(**BASE), _layer_spec().submodules.mlp.submodules)
    assert ours.linear_fc1.weight.shape == (2 * F_HIDDEN, H)
    with torch.no_grad():
        ours.linear_fc1.weight.copy_(torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight]))
        ours.linear_fc2.weight.copy_(theirs.down_proj.weight)
    x = torch.randn(5, 2, H)
    out, bias = ours(x)
    assert bias is None
    torch.testing.assert_close(out, theirs(x), **TOL)


def _saved_activation_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in ``module(x)``, the parameters' left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu"])
def test_gated_mlp_keeps_fc1s_output_not_the_activation_with_autograds_bits(activation, dtype):
    """A gated MLP (SwiGLU, GeGLU, ...) and a MoE expert save fc1's output [T, 2f] and the gated product (fc2's
    input) but not act(gate), which the backward computes again; their output and every gradient are the bits of
    act(gate) * up spelled out through autograd (the reference: the same linears on a copy, plain autograd), also
    under create_graph, through which a second derivative is taken."""
    import copy

    from lightning_megatron.transformer.moe.experts import ExpertMLP

    T, e = 5 * 2, torch.finfo(dtype).bits // 8
    for bias in (False, True):
        torch.manual_seed(0)
        cfg = TransformerConfig(**{**BASE, "activation": activation, "add_bias_linear": bias,
                                   "params_dtype": dtype})
        mlp = MLP(cfg, _layer_spec().submodules.mlp.submodules)
        expert = ExpertMLP(cfg, F_HIDDEN)
        if bias:  # nonzero biases, so that the bias path counts
            with torch.no_grad():
                for p in mlp.parameters():
                    if p.ndim == 1:
                        p.normal_()
        act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
               "relu": F.relu}[activation]

        def spelled_out(m, x):  # act(gate) * up through plain autograd, on m's own linears
            out = m.linear_fc1(x)
            inter = out[0] + out[1] if isinstance(out, tuple) and out[1] is not None else \
                (out[0] if isinstance(out, tuple) else out)
            gate, up = torch.chunk(inter, 2, dim=-1)
            y = m.linear_fc2(act(gate) * up)
            return y[0] if isinstance(y, tuple) else y

        for module in (mlp, expert):
            ref_module = copy.deepcopy(module)
            x = torch.randn(5, 2, H, dtype=dtype)
            x.requires_grad_(True)
            rx = x.detach().clone().requires_grad_(True)
            y = module(x)
            y = y[0] if isinstance(y, tuple) else y
            want = spelled_out(ref_module, rx)
            assert torch.equal(y, want), (activation, bias, type(module).__name__)
            g = torch.randn_like(y)
            y.backward(g)
            want.backward(g)
            assert torch.equal(x.grad, rx.grad), (activation, bias, type(module).__name__)
            for (name, p), q in zip(module.named_parameters(), ref_module.parameters()):
                if name == "linear_fc2.bias":  # returned apart, for the bias-dropout-add (no gradient here)
                    assert p.grad is None and q.grad is None
                    continue
                assert torch.equal(p.grad, q.grad), (activation, bias, type(module).__name__, name)
            # a second derivative (create_graph) as through the expression, within rounding (its graph sums in
            # another order)
            (gx,) = torch.autograd.grad(module(x)[0].pow(2).sum() if isinstance(module, MLP) else
                                        module(x).pow(2).sum(), x, create_graph=True)
            (want_gx,) = torch.autograd.grad(spelled_out(ref_module, rx).pow(2).sum(), rx, create_graph=True)
            assert torch.equal(gx, want_gx)
            torch.testing.assert_close(torch.autograd.grad(gx.sum(), x)[0], torch.autograd.grad(want_gx.sum(), rx)[0])
            if not bias:
                # x (fc1's input), fc1's output [T, 2f] and the product [T, f]; not act(gate) [T, f].
                assert _saved_activation_bytes(module, x) == e * T * (H + 3 * F_HIDDEN), type(module).__name__


@pytest.mark.parametrize("recompute", [None, "full", "selective"])
def test_block_with_rotary_matches_llama_layers_under_every_recompute(recompute):
    g = 2
    extra = dict(recompute_method="uniform", recompute_num_layers=1) if recompute == "full" else {}
    cfg = TransformerConfig(**BASE, num_query_groups=g, recompute_granularity=recompute, **extra)
    block = TransformerBlock(cfg, _layer_spec(), post_layer_norm=False)
    torch.manual_seed(0)
    theirs = [hf.LlamaDecoderLayer(_hf_config(g), layer_idx=i) for i in range(2)]
    for ours, layer in zip(block.layers, theirs):
        with torch.no_grad():
            for p in layer.parameters():  # norm weights away from 1 so a swapped norm shows
                p.add_(0.1 * torch.randn_like(p)) if p.dim() == 1 else None
        _copy_layer(ours, layer, g)
    s, b = 6, 2
    x = torch.randn(s, b, H, requires_grad=True)
    out = block(x, None, rotary_pos_emb=RotaryEmbedding(D, 1.0, 500000.0)(s))
    xt = x.detach().transpose(0, 1).requires_grad_()
    position = hf.LlamaRotaryEmbedding(_hf_config(g))(xt, torch.arange(s)[None])
    expected = xt
    for layer in theirs:
        expected = layer(expected, attention_mask=_causal_additive(s), position_embeddings=position)
    torch.testing.assert_close(out.transpose(0, 1), expected, **TOL)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad.transpose(0, 1))
    torch.testing.assert_close(x.grad.transpose(0, 1), xt.grad, **TOL)
    torch.testing.assert_close(block.layers[0].mlp.linear_fc1.weight.grad,
                               torch.cat([theirs[0].mlp.gate_proj.weight.grad, theirs[0].mlp.up_proj.weight.grad]),
                               **TOL)


# ---------------------------------------------------------------- KV cache and generation


class TinyDecoder(torch.nn.Module):
    """Embedding -> Llama-shaped block -> vocab-parallel output layer: the ``forward(tokens, offset,
    cache) -> logits`` that :func:`lightning_megatron.generation.generate` drives (GPTModel's job)."""

    def __init__(self, vocab: int = 40, tp_group=None, tp: int = 1, seed: int = 3, g: int = 2) -> None:
        super().__init__()
        from lightning_megatron.tensor_parallel import VocabParallelEmbedding
        from lightning_megatron.transformer import seeded

        cfg = TransformerConfig(**BASE, num_query_groups=g, tensor_model_parallel_size=tp)
        with seeded(seed, "embedding"):
            self.embedding = VocabParallelEmbedding(vocab, H, tp_group=tp_group)
        self.decoder = TransformerBlock(cfg, _layer_spec(), tp_group=tp_group, seed=seed)
        with seeded(seed, "output"):
            self.output_layer = ColumnParallelLinear(H, vocab, tp_group=tp_group, bias=False)
        self.rope = RotaryEmbedding(D, 1.0, 500000.0)

    def forward(self, tokens: torch.Tensor, offset: int = 0, cache=None) -> torch.Tensor:
        hidden = self.embedding(tokens).transpose(0, 1)  # [s, b, h]
        hidden = self.decoder(hidden, None, rotary_pos_emb=self.rope(tokens.shape[1], offset),
                              inference_context=cache)
        return self.output_layer(hidden)[0].transpose(0, 1)  # [b, s, V/t]


@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_kv_cache_attention_equals_the_full_sequence(backend):
    from lightning_megatron.transformer import InferenceContext

    torch.manual_seed(0)
    cfg = TransformerConfig(**BASE, num_query_groups=2, attention_backend=backend)
    attn = SelfAttention(cfg, _attention_spec().submodules, 1, AttnMaskType.causal).eval()
    rope = RotaryEmbedding(D, 1.0, 500000.0)
    s, b = 9, 2
    x = torch.randn(s, b, H)
    with torch.no_grad():
        full, _ = attn(x, None, rotary_pos_emb=rope(s))
        cache, outs = InferenceContext(max_batch_size=b, max_sequence_length=s), []
        for lo, hi in ((0, 5), (5, 6), (6, 8), (8, 9)):  # prompt, one token, two tokens, one token
            out, _ = attn(x[lo:hi], None, rotary_pos_emb=rope(hi - lo, lo), inference_context=cache)
            cache.advance(hi - lo)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs), full, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="max_sequence_length=9"):
        attn(x[:1], None, rotary_pos_emb=rope(1, 9), inference_context=cache)
    with pytest.raises(ValueError, match="attention_mask.*equal length"):
        attn(x[:2], torch.zeros(b, 1, 1, 2, dtype=torch.bool), inference_context=InferenceContext(b, s))


def test_sampling_filters_match_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from lightning_megatron.generation import filter_logits

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    for temperature, top_k, top_p in ((0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.9)):
        expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1.0:
            expected = TopPLogitsWarper(top_p)(None, expected)
        ours = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        assert torch.equal(ours.isinf(), expected.isinf()), (temperature, top_k, top_p)
        torch.testing.assert_close(ours[~ours.isinf()], expected[~expected.isinf()], rtol=0, atol=0)


def test_greedy_generation_with_cache_equals_recomputing_the_sequence():
    from lightning_megatron.generation import generate

    model = TinyDecoder().eval()
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    with_cache = generate(model, prompt, 8)
    without = generate(model, prompt, 8, use_cache=False)
    assert with_cache.shape == (2, 13) and torch.equal(with_cache[:, :5], prompt)
    assert torch.equal(with_cache, without)
    # By hand: argmax of the last position's logits, appended, 8 times.
    tokens = prompt
    with torch.no_grad():
        for _ in range(8):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(with_cache, tokens)
    # Sampling: reproducible from the generator, and cache-independent.
    kw = dict(greedy=False, temperature=0.8, top_k=10, top_p=0.9)
    a = generate(model, prompt, 6, generator=torch.Generator().manual_seed(5), **kw)
    b = generate(model, prompt, 6, generator=torch.Generator().manual_seed(5), use_cache=False, **kw)
    assert torch.equal(a, b)
    # A stop token ends a sequence; the finished one is padded with it.
    new = with_cache[0, 5:].tolist()
    stop = new[1]
    first = 5 + new.index(stop)
    stopped = generate(model, prompt, 8, stop_token=stop)
    assert torch.equal(stopped[0, :first + 1], with_cache[0, :first + 1]) and (stopped[0, first + 1:] == stop).all()


def test_greedy_generation_equals_transformers_llama_generate():
    from transformers import LlamaForCausalLM

    from lightning_megatron.generation import generate

    config = _hf_config(2)
    config.vocab_size, config.num_hidden_layers, config.tie_word_embeddings = 40, 2, False
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(config).eval()
    ours = TinyDecoder().eval()
    with torch.no_grad():
        for p in theirs.parameters():  # norm weights away from 1
            p.add_(0.1 * torch.randn_like(p)) if p.dim() == 1 else None
        ours.embedding.weight.copy_(theirs.model.embed_tokens.weight)
        for layer, hf_layer in zip(ours.decoder.layers, theirs.model.layers):
            _copy_layer(layer, hf_layer, 2)
        ours.decoder.final_layernorm.weight.copy_(theirs.model.norm.weight)
        ours.output_layer.weight.copy_(theirs.lm_head.weight)
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                               eos_token_id=2, pad_token_id=2)
    assert torch.equal(generate(ours, prompt, 10, stop_token=2), expected)


# ---------------------------------------------------------------- TP=2 (one 2-process run)


def _tp_worker() -> dict[str, float]:
    import torch.distributed as dist

    from lightning_megatron.parallel_state import initialize_model_parallel
    from lightning_megatron.tensor_parallel import all_reduce_sequence_parallel_grads

    ps = initialize_model_parallel(ParallelDims(tp=2))
    r, group = ps.tp_rank, ps.tp_group
    s, b = 8, 2
    diffs: dict[str, float] = {}

    def build(tp: int, g: int, sp: bool = False) -> TransformerBlock:
        cfg = TransformerConfig(**BASE, num_query_groups=g, tensor_model_parallel_size=tp, sequence_parallel=sp)
        return TransformerBlock(cfg, _layer_spec(), tp_group=group if tp > 1 else None, seed=7)

    def shard(name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a TP=1 tensor, as the TP=2 layer holds it."""
        if "linear_fc1" in name:  # [gate_r; up_r]
            gate, up = full.chunk(2, dim=0)
            return torch.cat([gate.chunk(2, dim=0)[r], up.chunk(2, dim=0)[r]])
        if "linear_qkv" in name:  # contiguous rows: whole query groups (g=2), or half a group (g=1)
            return full.chunk(2, dim=0)[r]
        if "linear_proj" in name or "linear_fc2" in name:
            return full.chunk(2, dim=1)[r]
        return full

    torch.manual_seed(0)
    x = torch.randn(s, b, H)
    grad = torch.randn(s, b, H)
    freqs = RotaryEmbedding(D, 1.0, 500000.0)(s)
    for g in (2, 1):  # g=1 < t=2: each rank all-gathers the qkv activations and takes its group's share
        reference = build(1, g)
        x1 = x.clone().requires_grad_()
        out1 = reference(x1, None, rotary_pos_emb=freqs)
        out1.backward(grad)
        ref_params = dict(reference.named_parameters())
        for sp in (False, True):
            tag = f"tp2g{g}" + ("sp" if sp else "")
            block = build(2, g, sp)
            for name, p in block.named_parameters():  # the same seed gives the slices of the TP=1 weights
                assert torch.equal(p, shard(name, ref_params[name])), (tag, name)
            lo, hi = (r * s // 2, (r + 1) * s // 2) if sp else (0, s)
            x2 = x[lo:hi].clone().requires_grad_()
            out2 = block(x2, None, rotary_pos_emb=freqs)  # full-sequence freqs: q/k are whole after the all-gather
            out2.backward(grad[lo:hi])
            if sp:
                all_reduce_sequence_parallel_grads(block.parameters(), group)
            diffs[f"{tag}_out"] = (out2 - out1[lo:hi]).abs().max().item()
            diffs[f"{tag}_dx"] = (x2.grad - x1.grad[lo:hi]).abs().max().item()
            diffs[f"{tag}_dw"] = max((p.grad - shard(n, ref_params[n].grad)).abs().max().item()
                                     for n, p in block.named_parameters())

    # Generation: TP=2 (vocab-parallel logits, the sampled token agreed over TP) equals one process.
    from lightning_megatron.generation import generate

    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    one, two = TinyDecoder().eval(), TinyDecoder(tp_group=group, tp=2).eval()
    greedy = [generate(m, prompt, 8, tp_group=g) for m, g in ((one, None), (two, group))]
    # Multi-query (g=1 < t=2): both ranks cache the one shared key/value head.
    mqa = [generate(TinyDecoder(g=1).eval(), prompt, 8),
           generate(TinyDecoder(tp_group=group, tp=2, g=1).eval(), prompt, 8, tp_group=group)]
    assert torch.equal(mqa[0], mqa[1]), mqa
    sampled = generate(two, prompt, 6, tp_group=group, greedy=False, top_k=5,
                       generator=torch.Generator().manual_seed(100 + r))  # different seeds: rank 0 decides
    dist.barrier()
    return diffs, greedy, sampled


def test_tp2_gqa_swiglu_rotary_and_sequence_parallel_equal_one_process():
    results = run_distributed(_tp_worker, 2, timeout=240.0)
    for diffs, (greedy_tp1, greedy_tp2), _ in results:
        print(diffs)
        for key, value in diffs.items():
            assert value < 2e-6, (key, value, diffs)
        assert torch.equal(greedy_tp1, greedy_tp2), (greedy_tp1, greedy_tp2)
    assert torch.equal(results[0][2], results[1][2])  # both TP ranks hold the same sampled tokens


def test_a_rotary_table_asked_in_inference_mode_still_trains():
    """A model keeps its RotaryTable from step to step, so a table a training step made may be asked for a new
    dtype inside ``torch.inference_mode()`` (generation, a Trainer's validation) and then by a training step again:
    tensors made in inference mode cannot be saved for a backward, so those stay with inference mode's asks."""
    s = 5
    table = RotaryTable(RotaryEmbedding(D, 1.0, 10000.0)(s))
    t = torch.randn(s, 2, 3, D, requires_grad=True)
    with torch.inference_mode():
        inferred = apply_rotary_pos_emb(t.detach(), table)
    trained = apply_rotary_pos_emb(t, table)
    trained.sum().backward()  # would raise: "Inference tensors cannot be saved for backward"
    assert torch.equal(trained.detach(), inferred) and t.grad is not None
