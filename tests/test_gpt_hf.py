"""Hugging Face Llama / GPT-2 <-> our GPT state dict (megatron-core names), one process, no model of ours.

- HF -> ours -> HF is bit-exact for a tiny random ``LlamaForCausalLM`` (grouped-query attention: 4 heads,
  2 key/value heads, untied head) and ``GPT2LMHeadModel`` (tied head), and transformers loads the result
  with no missing or unexpected keys.
- The layout of the fused tensors is checked against an independent computation: a plain-torch forward
  written in this file from the decoder-family contract (qkv rows per query group ``[q heads, k, v]``,
  SwiGLU ``linear_fc1 = [gate; up]``, rotate-half rotary), run on our tensors -- at TP=1, and at TP=2 as
  two ranks that each compute their heads / FFN columns from :func:`shard_full_state_dict`'s shard
  (``[gate_r; up_r]``) with the row-parallel partial sums added -- gives transformers' logits within
  1e-5 (fp32). A wrong layout (q/k/v not grouped, fc1 halves swapped, shards cut as plain row chunks)
  is off by O(1).
- Settings our model cannot reproduce are refused by name.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_megatron.models.gpt import hf as ghf
from lightning_megatron.models.gpt import hf_config as ghc

VOCAB, SEQ = 97, 12
LLAMA_KW = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
                initializer_range=0.2, bos_token_id=0, eos_token_id=0)
GPT2_KW = dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=None,
               activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
               initializer_range=0.2, bos_token_id=0, eos_token_id=0)


def hf_model_from_saved(saved, **kwargs):
    """``export hf``'s transformers model and tokenizer writer of a saved GPT model (its interop adapter)."""
    from lightning_megatron.interop.hf_folder import hf_model_from_saved as export
    from lightning_megatron.models.gpt.module import GPTLightningModule

    return export(saved, GPTLightningModule.interop, **kwargs)


def _llama(**kw):
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA_KW, "rope_theta": 5000.0, **kw}))
    with torch.no_grad():  # norms away from 1 so a swapped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def _gpt2(**kw):
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**GPT2_KW, **kw}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name or name.endswith(".bias"):
                p.uniform_(-0.5, 1.5)
    return model.eval()


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _theirs(model):
    with torch.no_grad():
        return model(input_ids=_tokens()).logits


# ------------------------------------------------- a forward written from the contract, plain torch


def _norm(x, w, b, eps, rms):
    if rms:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    return F.layer_norm(x, (x.size(-1),), w, b, eps)


def _rope(x, base):  # x [b, s, heads, d], rotate-half convention
    d, s = x.size(-1), x.size(1)
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], -1)[None, :, None, :]
    x1, x2 = x.chunk(2, -1)
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def _reference_logits(full, arch, tokens, tp: int):
    """Our model's math on our tensors, as ``tp`` ranks each computing from its own shard."""
    llama = arch["spec"] == ghc.LLAMA_SPEC
    n, h = arch["num_attention_heads"], arch["hidden_size"]
    g, d, eps = arch["num_query_groups"] or n, arch["kv_channels"] or h // n, arch["layernorm_epsilon"]
    shards = [ghf.shard_full_state_dict(full, r, tp, gated_linear_unit=llama, num_query_groups=g)
              for r in range(tp)]
    sd = full
    x = sd["embedding.word_embeddings.weight"][tokens]
    if not llama:
        x = x + sd["embedding.position_embeddings.weight"][: tokens.size(1)]
    b, s = tokens.shape
    for i in range(arch["num_layers"]):
        p = f"decoder.layers.{i}."
        y = _norm(x, sd[p + "input_layernorm.weight"], sd.get(p + "input_layernorm.bias"), eps, llama)
        attn = 0
        for r in range(tp):
            w = shards[r]
            qkv = F.linear(y, w[p + "self_attention.linear_qkv.weight"], w.get(p + "self_attention.linear_qkv.bias"))
            qkv = qkv.view(b, s, g // tp, n // g + 2, d)
            q = qkv[:, :, :, : n // g].reshape(b, s, n // tp, d)
            k = qkv[:, :, :, n // g].repeat_interleave(n // g, dim=2)
            v = qkv[:, :, :, n // g + 1].repeat_interleave(n // g, dim=2)
            if llama:
                q, k = _rope(q, arch["rotary_base"]), _rope(k, arch["rotary_base"])
            ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, scale=1 / math.sqrt(d))
            attn = attn + F.linear(ctx.transpose(1, 2).reshape(b, s, -1), w[p + "self_attention.linear_proj.weight"])
        x = x + attn + (0 if llama else sd[p + "self_attention.linear_proj.bias"])
        y = _norm(x, sd[p + "pre_mlp_layernorm.weight"], sd.get(p + "pre_mlp_layernorm.bias"), eps, llama)
        mlp = 0
        for r in range(tp):
            w = shards[r]
            a = F.linear(y, w[p + "mlp.linear_fc1.weight"], w.get(p + "mlp.linear_fc1.bias"))
            if llama:
                gate, up = a.chunk(2, dim=-1)
                a = F.silu(gate) * up
            else:
                a = F.gelu(a, approximate="tanh")
            mlp = mlp + F.linear(a, w[p + "mlp.linear_fc2.weight"])
        x = x + mlp + (0 if llama else sd[p + "mlp.linear_fc2.bias"])
    x = _norm(x, sd["decoder.final_layernorm.weight"], sd.get("decoder.final_layernorm.bias"), eps, llama)
    head = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
    return F.linear(x, head)


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_to_ours_to_hf_is_bit_exact_and_loads_strictly(family):
    model = _llama() if family == "llama" else _gpt2()
    arch = ghc.hf_architecture(model.config)
    hf_sd = model.state_dict()
    ours = ghf.gpt_state_dict_from_hf(hf_sd, arch)
    layer = ours["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert layer.shape == ((4 + 2 * (arch["num_query_groups"] or 4)) * 8, 32)
    assert ("output_layer.weight" in ours) == (family == "llama")
    back = ghf.hf_state_dict_from_gpt(ours, arch)
    for key, value in hf_sd.items():
        if key in back:
            assert torch.equal(back[key], value), key
    fresh = type(model)(ghc.hf_config_from_architecture(arch))
    result = fresh.load_state_dict(back, strict=False)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if not k.endswith("attn.bias")]


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fused_layouts_compute_transformers_logits(family, tp):
    model = _llama() if family == "llama" else _gpt2()
    arch = ghc.hf_architecture(model.config)
    ours = ghf.gpt_state_dict_from_hf(model.state_dict(), arch)
    with torch.no_grad():
        logits = _reference_logits(ours, arch, _tokens(), tp)
    theirs = _theirs(model)
    err = float((logits - theirs).abs().max())
    assert err <= 1e-5, f"max |logits - transformers| = {err:.2e} (largest logit {float(theirs.abs().max()):.2f})"


def test_a_wrong_layout_is_caught_by_the_reference():
    """The check can fail: q/k/v concatenated instead of grouped, and fc1 shards cut as plain row chunks."""
    model = _llama()
    arch = ghc.hf_architecture(model.config)
    ours = ghf.gpt_state_dict_from_hf(model.state_dict(), arch)
    theirs = _theirs(model)
    hf_sd = model.state_dict()
    plain = dict(ours)
    plain["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.cat(
        [hf_sd[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    with torch.no_grad():
        assert float((_reference_logits(plain, arch, _tokens(), 1) - theirs).abs().max()) > 1e-2
        # shards cut as plain row chunks: rank 0 holds both gate halves
        shard = ghf.shard_full_state_dict(ours, 0, 2, gated_linear_unit=False, num_query_groups=2)
        good = ghf.shard_full_state_dict(ours, 0, 2, gated_linear_unit=True, num_query_groups=2)
    key = "decoder.layers.0.mlp.linear_fc1.weight"
    assert not torch.equal(shard[key], good[key])
    gate = ours[key][:48]
    assert torch.equal(good[key][:24], gate[:24]) and torch.equal(good[key][24:], ours[key][48:72])


def test_shards_merge_back_to_the_full_state_dict_with_vocab_padding():
    model = _llama()
    arch = ghc.hf_architecture(model.config)
    ours = ghf.gpt_state_dict_from_hf(model.state_dict(), arch)
    shards = [ghf.shard_full_state_dict(ours, r, 2, gated_linear_unit=True, num_query_groups=2,
                                        make_vocab_size_divisible_by=8) for r in range(2)]
    assert shards[0]["embedding.word_embeddings.weight"].shape == (56, 32)  # 97 -> 112 rows over 2 ranks
    assert torch.count_nonzero(shards[1]["output_layer.weight"][-15:]) == 0
    merged = ghf.merge_tp_shards(shards, gated_linear_unit=True, vocab_size=VOCAB)
    assert merged.keys() == ours.keys()
    for key in ours:
        assert torch.equal(merged[key], ours[key]), key
    with pytest.raises(ValueError, match="num_query_groups=2 and tp_size=3: one must divide the other"):
        ghf.shard_full_state_dict(ours, 0, 3, gated_linear_unit=True, num_query_groups=2)


def test_llama_rope_theta_and_tied_embeddings_are_carried():
    model = _llama(tie_word_embeddings=True)
    arch = ghc.hf_architecture(model.config)
    assert arch["rotary_base"] == 5000.0 and not arch["untie_embeddings_and_output_weights"]
    assert arch["num_query_groups"] == 2 and arch["layernorm_epsilon"] == 1e-5
    ours = ghf.gpt_state_dict_from_hf(model.state_dict(), arch)
    assert "output_layer.weight" not in ours
    with torch.no_grad():
        err = float((_reference_logits(ours, arch, _tokens(), 2) - _theirs(model)).abs().max())
    assert err <= 1e-5
    config = ghc.hf_config_from_architecture(arch)
    assert config.tie_word_embeddings and config.num_key_value_heads == 2
    assert ghc.hf_architecture(config)["rotary_base"] == 5000.0


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""Meta-Llama-3.1-8B's rope (its ``config.json``'s ``rope_scaling`` and ``rope_theta``; Llama 3.2's factor is 32)."""


def test_llama_3_1_rope_scaling_is_read_computed_and_written_as_transformers_does(tmp_path):
    """Llama 3.1 / 3.2's frequency scaling (``rope_type: llama3``; megatron-core's ``rope_scaling`` and
    ``rope_scaling_factor``) was refused on import ("rope scaling"): no Llama 3.1 or 3.2 could be fine-tuned. Read
    from a folder, our rope's frequencies are transformers' and our GPTModel gives its logits within 1e-5 over 512
    positions (transformers without the scaling differs by more than 1e-3: the test can fail); export writes the
    scaling back and transformers computes the same logits from the folder. Low/high frequency factors and an
    original length other than Meta's (1, 4, 8192), which megatron-core fixes, are refused by name."""
    import transformers

    from lightning_megatron.models.gpt import GPTConfig
    from lightning_megatron.models.gpt.module import GPTLightningModule
    from lightning_megatron.saved_model import SavedModel

    shape = dict(head_dim=16, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16384)
    hf = _llama(rope_parameters=dict(LLAMA3_ROPE), **shape)
    hf.save_pretrained(tmp_path / "hf")
    module = GPTLightningModule.from_pretrained(str(tmp_path / "hf"))
    config = module.config
    assert (config.rope_scaling, config.rope_scaling_factor, config.rotary_base) == (True, 8.0, 500000.0)
    module.configure_model()
    chunk = module.eval().model_chunks[0]
    assert torch.equal(chunk._rotary[0].inv_freq, hf.model.rotary_emb.inv_freq)
    tokens = torch.randint(0, VOCAB, (1, 512), generator=torch.Generator().manual_seed(2))
    plain = _llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **shape)
    plain.load_state_dict(hf.state_dict())
    with torch.no_grad():
        ours, theirs = chunk(tokens)[..., :VOCAB], hf(input_ids=tokens).logits
        unscaled = plain(input_ids=tokens).logits
    assert float((ours - theirs).abs().max()) <= 1e-5
    assert float((unscaled - theirs).abs().max()) > 1e-3
    # export: the scaling written back, transformers' logits from the folder
    arch = ghc.hf_architecture(hf.config)
    hparams = {k: v for k, v in arch.items() if k not in ("gated_linear_unit", "vocab_size")}
    model, write_tokenizer = hf_model_from_saved(
        SavedModel(state_dict=ghf.gpt_state_dict_from_hf(hf.state_dict(), arch), hparams=hparams),
        tokenizer=_tokenizer_json(tmp_path / "tokenizer.json"))
    model.save_pretrained(tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert {k: loaded.config.rope_parameters[k] for k in LLAMA3_ROPE} == LLAMA3_ROPE
    with torch.no_grad():
        assert float((loaded(input_ids=tokens).logits - theirs).abs().max()) <= 1e-5
    with pytest.raises(ValueError, match="rope_scaling=True would not be used: position_embedding_type="):
        GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, rope_scaling=True)
    for key, value in (("low_freq_factor", 2.0), ("high_freq_factor", 8.0), ("original_max_position_embeddings", 4096)):
        other = transformers.LlamaConfig(**{**LLAMA_KW, **shape, "rope_parameters": {**LLAMA3_ROPE, key: value}})
        with pytest.raises(ValueError, match=f"{key}={value!r}"):
            ghc.hf_architecture(other)


def test_llama_head_dim_other_than_hidden_over_heads_becomes_kv_channels():
    model = _llama(head_dim=16)
    arch = ghc.hf_architecture(model.config)
    assert arch["kv_channels"] == 16
    ours = ghf.gpt_state_dict_from_hf(model.state_dict(), arch)
    assert ours["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 16, 32)
    with torch.no_grad():
        err = float((_reference_logits(ours, arch, _tokens(), 2) - _theirs(model)).abs().max())
    assert err <= 1e-5
    assert ghc.hf_config_from_architecture(arch).head_dim == 16


def test_mistral_folder_is_the_llama_shape_read_through_from_pretrained_and_exported_as_llama(tmp_path):
    """``MistralForCausalLM`` (Mistral 7B v0.2 / v0.3, Mistral-Nemo's ``head_dim``: no sliding window) holds
    Llama's tensors under Llama's names: read from its folder, transformers' logits within 1e-5; export writes
    ``LlamaForCausalLM``, which computes the same. A sliding window (Mistral 7B v0.1's 4096) is refused, naming
    the fix. (Until 2026-12-07 a Mistral folder was refused as an unknown model type.)"""
    import transformers

    from lightning_megatron.models.gpt.module import GPTLightningModule

    torch.manual_seed(0)
    kw = {k: v for k, v in LLAMA_KW.items() if k != "tie_word_embeddings"}
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**kw, head_dim=16, sliding_window=None,
                                                                         rope_theta=1e6)).eval()
    mistral.save_pretrained(tmp_path / "mistral")
    module = GPTLightningModule.from_pretrained(str(tmp_path / "mistral"))
    module.configure_model()
    module.eval()
    with torch.no_grad():
        ours = module.model_chunks[0](_tokens())[..., :VOCAB]
    assert float((ours - _theirs(mistral)).abs().max()) <= 1e-5
    arch = ghc.hf_architecture(mistral.config)
    assert arch["kv_channels"] == 16 and arch["rotary_base"] == 1e6 and arch["spec"] == ghc.LLAMA_SPEC
    config = ghc.hf_config_from_architecture(arch)
    assert type(config).__name__ == "LlamaConfig" and config.head_dim == 16
    llama = transformers.LlamaForCausalLM(config).eval()
    llama.load_state_dict(ghf.hf_state_dict_from_gpt(ghf.gpt_state_dict_from_hf(mistral.state_dict(), arch), arch))
    assert torch.equal(_theirs(llama), _theirs(mistral))
    with pytest.raises(ValueError, match=r"sliding_window=4096 .*set \"sliding_window\": null"):
        ghc.hf_architecture(transformers.MistralConfig(**kw, sliding_window=4096))


def test_llama_pretraining_tp_is_read_as_the_same_model():
    """``pretraining_tp`` only split Meta's matmuls into slices summed again (transformers 5 ignores it): the
    architecture is the one without it, transformers' logits within 1e-5 (it was refused until 2026-12-07)."""
    model = _llama(pretraining_tp=2)
    arch = ghc.hf_architecture(model.config)
    assert arch == ghc.hf_architecture(_llama().config)
    ours = ghf.gpt_state_dict_from_hf(model.state_dict(), arch)
    with torch.no_grad():
        err = float((_reference_logits(ours, arch, _tokens(), 1) - _theirs(model)).abs().max())
    assert err <= 1e-5


@pytest.mark.parametrize(("kw", "named"), [
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope scaling"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
], ids=["rope_scaling", "attention_bias", "mlp_bias", "hidden_act"])
def test_llama_settings_we_cannot_compute_are_refused_by_name(kw, named):
    import transformers

    config = transformers.LlamaConfig(**{**LLAMA_KW, **kw})
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("[", r"\[")):
        ghc.hf_architecture(config)


@pytest.mark.parametrize(("kw", "named"), [
    (dict(activation_function="silu"), "activation_function='silu'"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings=False"),
    (dict(scale_attn_weights=False), "scale_attn_weights=False"),
], ids=["activation", "inverse_layer_idx", "untied", "unscaled"])
def test_gpt2_settings_we_cannot_compute_are_refused_by_name(kw, named):
    import transformers

    with pytest.raises(ValueError, match=named):
        ghc.hf_architecture(transformers.GPT2Config(**{**GPT2_KW, **kw}))


def test_unused_tensors_and_other_model_types_are_refused():
    import transformers

    model = _llama()
    arch = ghc.hf_architecture(model.config)
    sd = dict(model.state_dict())
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    with pytest.raises(ValueError, match="q_proj.bias"):
        ghf.gpt_state_dict_from_hf(sd, arch)
    with pytest.raises(ValueError, match="model_type='bert'"):
        ghc.hf_architecture(transformers.BertConfig())


def test_export_config_refuses_architectures_transformers_cannot_compute():
    llama = ghc.hf_architecture(_llama().config)
    gpt2 = ghc.hf_architecture(_gpt2().config)
    with pytest.raises(ValueError, match=r"rotary_percent=0.5 \(needs 1.0\)"):
        ghc.hf_config_from_architecture({**llama, "rotary_percent": 0.5})
    with pytest.raises(ValueError, match="gated_linear_unit=True"):
        ghc.hf_config_from_architecture({**gpt2, "gated_linear_unit": True})
    with pytest.raises(ValueError, match="num_query_groups=2"):
        ghc.hf_config_from_architecture({**gpt2, "num_query_groups": 2})
    with pytest.raises(ValueError, match="spec='bert_layer_local_spec' has no transformers equivalent"):
        ghc.hf_config_from_architecture({**gpt2, "spec": "bert_layer_local_spec"})


# ------------------------------------------------------------------ folders: init_from's reader, export's writer


def test_hf_folder_reads_through_init_from_sharded_or_not_and_refuses_auto_map(tmp_path):
    import json

    from lightning_megatron.models.gpt.module import GPTLightningModule

    read_pretrained = GPTLightningModule.read_pretrained
    read_architecture = GPTLightningModule.read_architecture

    model = _llama()
    arch = ghc.hf_architecture(model.config)
    want = ghf.gpt_state_dict_from_hf(model.state_dict(), arch)
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    for folder in ("one", "sharded"):
        saved = read_pretrained(str(tmp_path / folder))
        assert saved.state_dict.keys() == want.keys()
        assert all(torch.equal(saved.state_dict[k], want[k]) for k in want)
        assert saved.hparams == arch == read_architecture(tmp_path / folder)
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    (tmp_path / "one" / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(ValueError, match="auto_map"):
        read_pretrained(str(tmp_path / "one"))
    # the Hugging Face hub cache's layout (snapshot_download, from_pretrained): snapshots/<rev>/<shard> links to
    # ../../blobs/<sha>; a sharded snapshot was refused ("shards must be .safetensors files inside the folder")
    import os
    import shutil

    snapshot, blobs = tmp_path / "hub" / "snapshots" / "abc123", tmp_path / "hub" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted((tmp_path / "sharded").iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / f.name)
    saved = read_pretrained(str(snapshot))
    assert all(torch.equal(saved.state_dict[k], want[k]) for k in want)
    # a damaged weights file, or a pickle that names code: refused naming the file (a traceback of 23 frames ended in
    # SafetensorError "incomplete metadata", or torch's advice to load with weights_only=False); nothing runs
    shutil.copytree(tmp_path / "one", tmp_path / "cut")
    (tmp_path / "cut" / "config.json").write_text(json.dumps(config))
    data = (tmp_path / "cut" / "model.safetensors").read_bytes()
    (tmp_path / "cut" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors' cannot be read \(.*\): the file is damaged or "
                                         r"incomplete; download it again"):
        read_pretrained(str(tmp_path / "cut"))

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    (tmp_path / "cut" / "model.safetensors").unlink()
    torch.save({"model.norm.weight": Evil()}, tmp_path / "cut" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model.bin' holds more than tensors \(.*system.*\): refused, "
                                         r"nothing in it was run"):
        read_pretrained(str(tmp_path / "cut"))
    assert not (tmp_path / "ran").exists()
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="inside the folder"):
        read_pretrained(str(tmp_path / "sharded"))


def _tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<|endoftext|>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_export_of_a_saved_model_gives_the_contract_logits_in_transformers(tmp_path, family):
    """A saved model of ours (full tensors + module arguments) -> transformers folder -> from_pretrained."""
    import transformers

    from lightning_megatron.saved_model import SavedModel

    source = _llama() if family == "llama" else _gpt2()
    arch = ghc.hf_architecture(source.config)
    ours = ghf.gpt_state_dict_from_hf(source.state_dict(), arch)
    with torch.no_grad():
        want = _reference_logits(ours, arch, _tokens(), 1)
    hparams = {k: v for k, v in arch.items() if k not in ("num_query_groups", "gated_linear_unit", "vocab_size")}
    model, write_tokenizer = hf_model_from_saved(SavedModel(state_dict=ours, hparams=hparams),
                                                 tokenizer=_tokenizer_json(tmp_path / "tokenizer.json"))
    model.save_pretrained(tmp_path / "out")
    write_tokenizer(tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == ("LlamaForCausalLM" if family == "llama" else "GPT2LMHeadModel")
    err = float((_theirs(loaded) - want).abs().max())
    assert err <= 1e-5, f"max |transformers - contract forward| = {err:.2e}"
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok("w3 w5 <|endoftext|>")["input_ids"] == [3, 5, VOCAB - 1] and loaded.config.eos_token_id == VOCAB - 1
    with pytest.raises(ValueError, match="has 10 tokens but the model's vocabulary is 97"):
        from tokenizers import Tokenizer, models

        Tokenizer(models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0")).save(str(tmp_path / "t10.json"))
        hf_model_from_saved(SavedModel(state_dict=ours, hparams=hparams), tokenizer=tmp_path / "t10.json")
    # a tensor of the user's own (a subclass's learned logit scale): the mapping knows no place for it, and the
    # export left it out, unsaid; refused, naming it
    extra = {**ours, "decoder.layers.1.mlp.extra_bias": torch.zeros(8), "logit_scale": torch.ones(())}
    with pytest.raises(ValueError, match=r"holds 2 tensor\(s\) that \w+ has no place for: "
                                         r"decoder\.layers\.1\.mlp\.extra_bias, logit_scale \(a parameter"):
        hf_model_from_saved(SavedModel(state_dict=extra, hparams=hparams), tokenizer=tmp_path / "tokenizer.json")


def test_init_from_gives_each_tp_rank_its_strided_swiglu_slice():
    """load_full_state_dict (init_from, load_from_checkpoint) on a parameter declared with Megatron's
    partition_stride=2 (the gated fc1): rank r gets [gate_r; up_r] of the full [gate; up], as
    shard_full_state_dict; a stride-1 parameter keeps the plain row chunk."""
    from torch import nn

    from lightning_megatron.saved_model import load_full_state_dict
    from lightning_megatron.tensor_parallel import set_param_facts

    full = {"decoder.layers.0.mlp.linear_fc1.weight": torch.arange(48.0).view(12, 4),
            "decoder.layers.0.self_attention.linear_qkv.weight": torch.arange(32.0).view(8, 4)}
    for rank in range(2):
        fc1, qkv = nn.Parameter(torch.empty(6, 4)), nn.Parameter(torch.empty(4, 4))
        set_param_facts(fc1, sharded_over=("tp",), replicated_over=(), partition_dim=0, partition_stride=2)
        set_param_facts(qkv, sharded_over=("tp",), replicated_over=(), partition_dim=0, partition_stride=1)
        params = [("decoder.layers.0.mlp.linear_fc1.weight", fc1),
                  ("decoder.layers.0.self_attention.linear_qkv.weight", qkv)]
        load_full_state_dict([], params, full, coordinates={"tp": rank}, sizes={"tp": 2}, num_layers=1,
                             source_name="x")
        want = ghf.shard_full_state_dict(full, rank, 2, gated_linear_unit=True, num_query_groups=2)
        assert torch.equal(fc1, want["decoder.layers.0.mlp.linear_fc1.weight"])
        assert torch.equal(qkv, full["decoder.layers.0.self_attention.linear_qkv.weight"][4 * rank: 4 * rank + 4])


def test_export_takes_the_packaged_bpe_when_the_run_used_gpt_datamodules_default(tmp_path):
    """A checkpoint whose GPTDataModule had vocab_file None (the packaged 8,192-piece BPE) exports with it;
    another vocabulary size is refused rather than shipped with the wrong tokenizer."""
    import transformers

    from lightning_megatron.saved_model import SavedModel

    config = transformers.GPT2Config(vocab_size=8192, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    arch = ghc.hf_architecture(config)
    ours = ghf.gpt_state_dict_from_hf(transformers.GPT2LMHeadModel(config).state_dict(), arch)
    dm = {"vocab_file": None, "data_prefix": None}
    model, write_tokenizer = hf_model_from_saved(SavedModel(state_dict=ours, hparams=arch, datamodule_hparams=dm))
    write_tokenizer(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 8192 and tokenizer.eos_token == "<|endoftext|>"
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    small = {k: (v[:100] if "word_embeddings" in k else v) for k, v in ours.items()}
    with pytest.raises(ValueError, match="has 8192 tokens but the model's vocabulary is 100"):
        hf_model_from_saved(SavedModel(state_dict=small, hparams={**arch, "vocab_size": 100}, datamodule_hparams=dm))


def test_export_takes_a_gpt2_vocab_json_with_its_merges(tmp_path):
    import json

    import transformers

    from lightning_megatron.saved_model import SavedModel

    vocab = {chr(ord("a") + i % 26) * (1 + i // 26): i for i in range(VOCAB - 1)} | {"<|endoftext|>": VOCAB - 1}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    model = _gpt2()
    arch = ghc.hf_architecture(model.config)
    saved = SavedModel(state_dict=ghf.gpt_state_dict_from_hf(model.state_dict(), arch), hparams=arch)
    hf, write_tokenizer = hf_model_from_saved(saved, tokenizer=tmp_path / "vocab.json")
    write_tokenizer(tmp_path / "out")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.convert_tokens_to_ids(["c", "<|endoftext|>"]) == [2, VOCAB - 1]
    assert hf.config.eos_token_id == VOCAB - 1
    (tmp_path / "merges.txt").unlink()
    with pytest.raises(FileNotFoundError, match="merges.txt"):
        hf_model_from_saved(saved, tokenizer=tmp_path / "vocab.json")


def test_export_of_a_model_whose_documents_end_with_its_eos_token(tmp_path):
    """A decoder trained on a folder's tokenizer whose end of document is its ``</s>`` (a Llama 2 / Mistral folder:
    no ``<|endoftext|>``; the data ended documents with it) exported with no eos at all (``eos_token_id`` unset, so
    ``generate`` never stopped) and dropped the folder's ``<pad>``. The export's eos is the data's end of document,
    its pad the folder's; the logits are transformers' own."""
    import json

    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from lightning_megatron.data.bpe_tokenizer import BPETokenizer
    from lightning_megatron.saved_model import SavedModel

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = ["the model ends each document with its own token", "and pads with another"] * 20
    tok.train_from_iterator(text, trainer=trainers.BpeTrainer(
        vocab_size=300, show_progress=False, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "src"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>",
                                                              "pad_token": "<pad>"}))
    vocab = tok.get_vocab_size()
    source = _gpt2(vocab_size=vocab)
    arch = ghc.hf_architecture(source.config)
    ours = ghf.gpt_state_dict_from_hf(source.state_dict(), arch)
    hparams = {k: v for k, v in arch.items() if k not in ("num_query_groups", "gated_linear_unit", "vocab_size")}
    model, write_tokenizer = hf_model_from_saved(SavedModel(state_dict=ours, hparams=hparams), tokenizer=folder)
    model.save_pretrained(tmp_path / "out")
    write_tokenizer(tmp_path / "out")
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert exported.eos_token == "</s>" and loaded.config.eos_token_id == BPETokenizer(folder).eod == 2
    assert exported.pad_token == "<pad>" and exported.pad_token_id == 3
    tokens = _tokens() % vocab
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, source(tokens).logits, rtol=0, atol=1e-5)


def test_a_folder_s_dropouts_are_the_module_s_unless_given(tmp_path):
    """A Hugging Face folder's dropouts came in as our defaults (0.1 and 0.1): a Llama (no hidden dropout,
    ``attention_dropout`` 0.0) fine-tuned with dropout transformers never applies, its train-mode losses noisy where
    transformers' are deterministic. The folder's values now, as export writes them (Llama's ``attention_dropout``,
    GPT-2's ``resid_pdrop`` / ``attn_pdrop``; an argument given to ``from_pretrained`` or on the command line
    wins), and a Megatron-LM checkpoint's ``--hidden-dropout`` / ``--attention-dropout`` the same way."""
    import argparse

    from lightning_megatron.models.gpt.interop import gpt_architecture_from_args
    from lightning_megatron.models.gpt.module import GPTLightningModule

    _llama(attention_dropout=0.05).save_pretrained(tmp_path / "llama")
    _gpt2(resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.3).save_pretrained(tmp_path / "gpt2")
    for folder, want in (("llama", (0.0, 0.05)), ("gpt2", (0.2, 0.3))):
        config = GPTLightningModule.from_pretrained(str(tmp_path / folder)).config
        assert (config.hidden_dropout, config.attention_dropout) == want, folder
    config = GPTLightningModule.from_pretrained(str(tmp_path / "llama"), config={"hidden_dropout": 0.1}).config
    assert (config.hidden_dropout, config.attention_dropout) == (0.1, 0.05)
    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                              attention_dropout=0.0)
    assert {k: gpt_architecture_from_args(args, 2)[k] for k in ("hidden_dropout", "attention_dropout")} == \
        {"hidden_dropout": 0.0, "attention_dropout": 0.0}
