"""Single-process checks of the transformer package and BertModel: config validation, specs and the
registry, parameter counts, norms, attention backends, pipeline chunks and the loss."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from lightning_megatron.models.bert import BertModel, bert_layer_spec, bert_loss, count_parameters
from lightning_megatron.transformer import (
    AttnMaskType,
    DotProductAttention,
    LayerNorm,
    ModuleSpec,
    RMSNorm,
    TransformerConfig,
    build_module,
    get_spec,
    list_specs,
    register_spec,
)

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4)


@pytest.mark.parametrize("kwargs,field,fix", [
    (dict(hidden_size=66), "hidden_size=66", "multiple of the head count"),
    (dict(tensor_model_parallel_size=3), "num_attention_heads=4", "TP size that divides"),
    (dict(num_attention_heads=8, ffn_hidden_size=100, tensor_model_parallel_size=8, hidden_size=64),
     "ffn_hidden_size=100", "multiple of 8"),
    (dict(hidden_dropout=1.0), "hidden_dropout=1.0", "use 0.0 to turn dropout off"),
    (dict(normalization="BatchNorm"), "normalization='BatchNorm'", "LayerNorm"),
    (dict(activation="tanh"), "activation='tanh'", "gelu"),
    (dict(recompute_granularity="full"), "recompute_method=None", "'uniform' or 'block'"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
     "recompute_num_layers=3", "at most 2"),
    (dict(recompute_method="uniform"), "recompute_method='uniform'", "set them to None"),
    (dict(layernorm_epsilon=0.0), "layernorm_epsilon=0.0", "1e-5"),
    (dict(params_dtype=torch.int32), "params_dtype=torch.int32", "float32"),
])
def test_bad_config_raises_naming_field_and_fix(kwargs, field, fix):
    with pytest.raises(ValueError) as info:
        TransformerConfig(**{**BASE, **kwargs})
    assert field in str(info.value) and fix in str(info.value), str(info.value)


def test_config_defaults_and_useless_sequence_parallel_warns():
    cfg = TransformerConfig(**BASE)
    assert (cfg.kv_channels, cfg.ffn_hidden_size) == (16, 256)
    with pytest.warns(UserWarning, match="sequence_parallel=True has no effect"):
        TransformerConfig(**BASE, sequence_parallel=True)


def test_model_rejects_tp_group_config_mismatch():
    with pytest.raises(ValueError, match="set config.tensor_model_parallel_size=1"):
        BertModel(TransformerConfig(**BASE, tensor_model_parallel_size=2), "bert_layer_local_spec", 100, 8)


def test_build_errors_name_the_module_being_built():
    spec = bert_layer_spec()
    with pytest.raises(TypeError, match=r"while building TransformerLayer"):
        build_module(spec, config=TransformerConfig(**BASE), no_such_argument=1)
    assert build_module(ModuleSpec(module=F.gelu)) is F.gelu  # functions are slots, not factories


def test_registry_builtins_user_specs_and_errors():
    assert {"bert_layer_local_spec", "bert_layer_post_norm_spec", "bert_layer_rmsnorm_spec"} <= set(list_specs())
    with pytest.raises(ValueError, match="already registered"):
        register_spec("test_post_rms_taken", bert_layer_spec(), overwrite=True)
        register_spec("test_post_rms_taken", bert_layer_spec())
    # a built-in name is never replaced: export read a checkpoint's spec name as the built-in architecture (a
    # ReLU^2 MLP registered over gpt_layer_spec exported as GPT-2's GELU, its own bias left out, unsaid)
    importlib.import_module("lightning_megatron.models.gpt")  # registers the decoder specs
    for name in ("bert_layer_local_spec", "gpt_layer_spec"):
        with pytest.raises(ValueError, match=rf"spec '{name}' is built in: .*register_spec\('my_{name}'"):
            register_spec(name, bert_layer_spec(), overwrite=True)
    with pytest.raises(ValueError, match="unknown spec 'nope'.*register_spec"):
        get_spec("nope")
    # A user's own spec, referred to by name: post-norm with RMSNorm.
    register_spec("test_post_rms", bert_layer_spec(RMSNorm, "post"), overwrite=True)
    model = BertModel(TransformerConfig(**BASE), "test_post_rms", 100, 8)
    assert isinstance(model.encoder.layers[1].post_mlp_layernorm, RMSNorm)
    assert isinstance(model.embedding.layernorm, RMSNorm) and model.encoder.final_layernorm is None


def test_parameter_count_closed_form():
    cfg = TransformerConfig(**BASE)
    # By hand (h=64, P=64, f=256, V=pad(1000)=1024, S=32, T=2), pre-norm LayerNorm:
    # layer = 3*64*64 + 64*64 + 2*64*256 + (192+64+256+64) + 2*128 = 49984
    # embeddings = 1024*64 + 32*64 + 2*64 = 67712; heads = (4096+64+128) + 1024 + (4096+64) + 130 = 9602
    # final norm = 128  ->  2*49984 + 67712 + 9602 + 128 = 177410
    assert count_parameters(cfg, 1000, 32) == 177410
    cases = [
        (cfg, "bert_layer_local_spec", {}),
        (cfg, "bert_layer_post_norm_spec", {}),
        (cfg, "bert_layer_rmsnorm_spec", dict(add_binary_head=False)),
        (TransformerConfig(**BASE, normalization="RMSNorm", add_bias_linear=False), "bert_layer_local_spec",
         dict(share_embeddings_and_output_weights=False, num_tokentypes=0)),
        (TransformerConfig(**BASE, kv_channels=8, ffn_hidden_size=96), "bert_layer_local_spec", {}),
    ]
    for config, spec, kw in cases:
        model = BertModel(config, spec, 1000, 32, **kw)
        assert sum(p.numel() for p in model.parameters()) == count_parameters(config, 1000, 32, spec=spec, **kw)


def test_norms_match_their_formulas():
    cfg = TransformerConfig(**BASE, layernorm_epsilon=1e-6)
    x = torch.randn(5, 3, 64)
    ln, rms = LayerNorm(cfg, 64), RMSNorm(cfg, 64)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_(), rms.weight.normal_()
    torch.testing.assert_close(ln(x), F.layer_norm(x, (64,), ln.weight, ln.bias, 1e-6), rtol=1e-6, atol=1e-6)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * rms.weight
    torch.testing.assert_close(rms(x), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_torchs_op_with_the_fp32_arithmetic(dtype):
    """RMSNorm is torch's ``rms_norm`` when its weight has the activation's dtype: one fused kernel each way where
    the device has one (CUDA; our arithmetic spelled out eagerly moves 148 bytes per element forward and backward,
    ``benchmarks/norm_bytes.py``), with the same arithmetic, spelled out below as the reference: fp32 statistics
    and products, one rounding to the activation's dtype. On CPU torch's op is that composite: the output and both
    gradients bit for bit; on a GPU (the GPU check runs this file there) its reduction may round the last bit
    differently. An fp32 weight on 16-bit activations keeps the arithmetic spelled out (torch's fused op wants one
    dtype, and would warn)."""
    import warnings

    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)

    for weight_dtype in {dtype, torch.float32}:
        rms = RMSNorm(TransformerConfig(**BASE, layernorm_epsilon=1e-6, params_dtype=weight_dtype), 64)
        with torch.no_grad():
            rms.weight.uniform_(0.5, 1.5)
        x = (torch.randn(5, 3, 64) * 3).to(dtype).requires_grad_()
        dy = torch.randn(5, 3, 64).to(dtype)
        with Calls() as calls, warnings.catch_warnings():
            warnings.simplefilter("error")  # no "cannot dispatch to fused implementation"
            y = rms(x)
        assert ("rms_norm" in calls.names) == (weight_dtype == dtype), (weight_dtype, calls.names)
        y.backward(dy)
        xr, wr = x.detach().clone().requires_grad_(), rms.weight.detach().clone().requires_grad_()
        expected = reference(xr, wr)
        expected.backward(dy)
        for got, want in ((y, expected), (x.grad, xr.grad), (rms.weight.grad, wr.grad)):
            assert got.dtype == want.dtype
            if torch.get_default_device().type == "cpu":
                assert torch.equal(got, want), (weight_dtype, (got.float() - want.float()).abs().max())
            else:
                torch.testing.assert_close(got, want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def test_sdpa_and_unfused_attention_agree_with_padding():
    torch.manual_seed(0)
    s, b, n, d = 7, 3, 4, 16
    q, k, v = (torch.randn(s, b, n, d, requires_grad=True) for _ in range(3))
    mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    mask[1, ..., 4:] = True
    outs = []
    for backend in ("sdpa", "unfused"):
        cfg = TransformerConfig(**BASE, attention_backend=backend, attention_dropout=0.0)
        core = DotProductAttention(cfg, 1, AttnMaskType.padding)
        out = core(q, k, v, mask)
        grads = torch.autograd.grad((out * torch.arange(out.numel()).view_as(out).sin()).sum(), (q, k, v))
        outs.append((out, grads))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-6, atol=1e-6)
    for a, c in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    # Padding really hides keys: changing a hidden value leaves sequence 1 unchanged.
    core = DotProductAttention(TransformerConfig(**BASE, attention_dropout=0.0), 1, AttnMaskType.padding)
    v2 = v.detach().clone()
    v2[5, 1] += 10.0
    assert torch.equal(core(q, k, v, mask)[:, 1], core(q, k, v2, mask)[:, 1])


def test_pipeline_chunks_rebuild_the_full_model():
    cfg = TransformerConfig(**{**BASE, "num_layers": 4}, hidden_dropout=0.0, attention_dropout=0.0)
    full = BertModel(cfg, "bert_layer_local_spec", 100, 8).eval()
    first = BertModel(cfg, "bert_layer_local_spec", 100, 8, post_process=False, layer_range=range(0, 2)).eval()
    last = BertModel(cfg, "bert_layer_local_spec", 100, 8, pre_process=False, layer_range=range(2, 4)).eval()
    # Same init, whichever chunk builds a layer; the last stage's tied copy equals the first stage's.
    torch.testing.assert_close(last.encoder.layers[0].state_dict(), full.encoder.layers[2].state_dict(),
                               rtol=0, atol=0)
    assert torch.equal(last.shared_embedding_or_output_weight(), first.shared_embedding_or_output_weight())
    from lightning_megatron.tensor_parallel.param_facts import param_facts

    assert param_facts(last.shared_embedding_or_output_weight()).shared_embedding
    assert param_facts(first.shared_embedding_or_output_weight()).shared_embedding
    tokens = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 5:] = 0
    hidden = first(tokens, mask)
    assert hidden.shape == (8, 2, 64)
    last.set_input_tensor(hidden)
    logits, binary = last(tokens, mask)
    expected_logits, expected_binary = full(tokens, mask)
    assert logits.shape == (2, 8, 128)  # padded vocab
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(binary, expected_binary, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="must start at layer 0"):
        BertModel(cfg, "bert_layer_local_spec", 100, 8, layer_range=range(1, 4))


def test_bert_loss_averages_over_masked_tokens():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    loss_mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    binary_logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    binary_labels = torch.tensor([0, 0])
    total, stats = bert_loss(per_token, loss_mask, binary_logits, binary_labels)
    binary = (math.log(1 + math.exp(-2.0)) + math.log(1 + math.exp(1.0))) / 2
    assert stats["lm_loss"].item() == pytest.approx((1 + 3 + 6) / 3)
    assert stats["binary_loss"].item() == pytest.approx(binary)
    assert total.item() == pytest.approx(10 / 3 + binary)


def test_padded_vocab_columns_never_count_in_the_loss():
    cfg = TransformerConfig(**BASE, hidden_dropout=0.0, attention_dropout=0.0)
    model = BertModel(cfg, "bert_layer_local_spec", 100, 8)
    tokens = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    logits, _ = model(tokens, mask)
    lm_loss, _ = model(tokens, mask, lm_labels=tokens)
    torch.testing.assert_close(lm_loss, F.cross_entropy(logits[..., :100].transpose(1, 2), tokens, reduction="none"))
