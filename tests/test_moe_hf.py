"""Hugging Face Mixtral / Qwen2-MoE (and dense Qwen2) <-> our GPT (``llama_moe_layer_spec``), one process.

- Import: a tiny random ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` (2 layers, hidden 32, GQA 4/2,
  4 experts, top-2, a shared expert with its sigmoid gate and the q/k/v bias for Qwen2-MoE, both
  ``norm_topk_prob`` settings) saved with ``save_pretrained``; ``GPTLightningModule.from_pretrained(folder)``
  (the architecture read from ``config.json``, as ``--model.init_from``) gives transformers' logits within
  1e-5 (fp32), and the same greedy tokens through its KV cache as transformers' ``generate``.
- Expert layouts: transformers 5 holds the experts fused (``mlp.experts.gate_up_proj`` / ``down_proj``) but
  its ``save_pretrained`` writes the per-expert names of transformers 4 and the hub (Mixtral's
  ``block_sparse_moe.experts.<e>.w1/w3/w2``, Qwen2-MoE's ``mlp.experts.<e>.gate_proj/up_proj/down_proj``);
  that folder, one written with ``save_original_format=False`` (fused on disk) and one written here with
  safetensors from the per-expert names read into the same tensors.
- Export: our module (its weights moved off the imported ones) -> the transformers model ``export hf`` builds
  (the fused tensors, loaded strictly) -> ``export hf``'s folder writer -> ``from_pretrained``: transformers'
  class, our logits within 1e-5, the file names transformers' own ``save_pretrained`` writes; HF -> ours -> HF
  is bit-exact.
- Dense Qwen2 (q/k/v bias, no o_proj bias: ``add_qkv_bias``) in and out the same way.
- Refused by name: what our MoE layer cannot compute (Qwen2-MoE's dense layers, sliding windows) and what
  transformers' classes cannot (sigmoid routing, an ungated shared expert).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from lightning_megatron.models.gpt import hf as ghf
from lightning_megatron.models.gpt import hf_config as ghc

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 97, 12
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=0, eos_token_id=0)
MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.02)


def _randomise(model):
    """Norms away from 1, biases away from 0, experts and routers at std 0.2, so a swapped tensor shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
            elif ".mlp." in name:
                p.normal_(0.0, 0.2)
    return model.eval()


def _mixtral(**kw):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**{**COMMON, **MOE, "intermediate_size": 48, "num_local_experts": 4,
                                           "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}, **kw})
    return _randomise(transformers.MixtralForCausalLM(config))


def _qwen2_moe(**kw):
    torch.manual_seed(1)
    config = transformers.Qwen2MoeConfig(**{**COMMON, **MOE, "intermediate_size": 64, "moe_intermediate_size": 48,
                                            "shared_expert_intermediate_size": 40, "num_experts": 4, **kw})
    return _randomise(transformers.Qwen2MoeForCausalLM(config))


def _qwen2(**kw):
    torch.manual_seed(2)
    return _randomise(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**COMMON, "intermediate_size": 48,
                                                                                 **kw})))


def _qwen3(**kw):
    torch.manual_seed(5)
    return _randomise(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**COMMON, "intermediate_size": 48,
                                                                                 "head_dim": 16, **kw})))


def _qwen3_moe(**kw):
    torch.manual_seed(6)
    config = transformers.Qwen3MoeConfig(**{**COMMON, **MOE, "intermediate_size": 64, "moe_intermediate_size": 48,
                                            "num_experts": 4, "norm_topk_prob": True, "head_dim": 16, **kw})
    return _randomise(transformers.Qwen3MoeForCausalLM(config))


MODELS = {"mixtral": _mixtral, "qwen2_moe": lambda: _qwen2_moe(),
          "qwen2_moe_norm_topk": lambda: _qwen2_moe(norm_topk_prob=True), "qwen2": _qwen2,
          "qwen2_moe_no_shared": lambda: _qwen2_moe(shared_expert_intermediate_size=0), "qwen3": _qwen3,
          "qwen3_moe": _qwen3_moe}
EXPECTED = {  # our config fields each HF config maps to
    "mixtral": dict(spec="llama_moe_layer_spec", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                    moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=None,
                    moe_shared_expert_gate=False, add_qkv_bias=False, moe_aux_loss_coeff=0.02, rotary_base=5000.0),
    "qwen2_moe": dict(spec="llama_moe_layer_spec", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                      ffn_hidden_size=64, moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=40,
                      moe_shared_expert_gate=True, add_qkv_bias=True, moe_aux_loss_coeff=0.02),
    "qwen2_moe_norm_topk": dict(moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=40),
    "qwen2": dict(spec="llama_layer_spec", add_qkv_bias=True, add_bias_linear=False, num_moe_experts=None),
    "qwen2_moe_no_shared": dict(moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False),
    "qwen3": dict(spec="llama_layer_spec", qk_layernorm=True, add_qkv_bias=False, kv_channels=16, num_moe_experts=None),
    "qwen3_moe": dict(spec="llama_moe_layer_spec", qk_layernorm=True, add_qkv_bias=False, kv_channels=16,
                      num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_router_pre_softmax=False,
                      moe_shared_expert_intermediate_size=None, moe_aux_loss_coeff=0.02),
}
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
           "qwen2_moe_norm_topk": "Qwen2MoeForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen2_moe_no_shared": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM"}


def _tokens(n=SEQ):
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(3))


def _ours(folder):
    from lightning_megatron.models.gpt.module import GPTLightningModule

    module = GPTLightningModule.from_pretrained(str(folder))
    module.configure_model()
    return module.eval()


def _logits(module, tokens):
    with torch.no_grad():
        return module.model_chunks[0](tokens)[..., :VOCAB]


def _theirs(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _max_err(a, b):
    return float((a - b).abs().max())


# ------------------------------------------------------------------------------------------- import


@pytest.mark.parametrize("name", list(MODELS))
def test_folder_import_gives_transformers_logits_and_greedy_tokens(tmp_path, name):
    hf = MODELS[name]()
    hf.save_pretrained(tmp_path / name)
    module = _ours(tmp_path / name)
    config = module.hparams["config"]
    assert {k: config[k] for k in EXPECTED[name]} == EXPECTED[name]
    params = dict(module.model_chunks[0].global_named_parameters())
    assert ("decoder.layers.1.self_attention.linear_qkv.bias" in params) == name.startswith("qwen2")
    assert ("decoder.layers.1.self_attention.q_layernorm.weight" in params) == name.startswith("qwen3")
    assert "decoder.layers.1.self_attention.linear_proj.bias" not in params  # Qwen's o_proj has none
    err = _max_err(_logits(module, _tokens()), _theirs(hf, _tokens()))
    assert err <= 1e-5, f"{name}: max |ours - transformers| = {err:.2e}"
    if name in ("qwen2_moe_norm_topk", "qwen2_moe_no_shared"):
        return  # the variants: the logits suffice
    prompt = _tokens(5)
    ours = module.generate(prompt, 8, stop_token=None)
    theirs = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                         attention_mask=torch.ones_like(prompt))
    assert torch.equal(ours, theirs), (ours, theirs)


def _per_expert(hf_sd, name):
    """The per-expert names of transformers 4 (and of hub checkpoints) for transformers 5's fused tensors,
    written out here from the layouts (gate_up_proj[e] = [gate_e; up_e], Mixtral's w1 / w3 / w2)."""
    out = {}
    for key, value in hf_sd.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            layer = key.removesuffix("mlp.experts.gate_up_proj")
            for e, fused in enumerate(value):
                gate, up = fused.chunk(2)
                if name == "mixtral":
                    out[f"{layer}block_sparse_moe.experts.{e}.w1.weight"] = gate.clone()
                    out[f"{layer}block_sparse_moe.experts.{e}.w3.weight"] = up.clone()
                else:
                    out[f"{layer}mlp.experts.{e}.gate_proj.weight"] = gate.clone()
                    out[f"{layer}mlp.experts.{e}.up_proj.weight"] = up.clone()
        elif key.endswith("mlp.experts.down_proj"):
            layer = key.removesuffix("mlp.experts.down_proj")
            for e, down in enumerate(value):
                old = f"block_sparse_moe.experts.{e}.w2" if name == "mixtral" else f"mlp.experts.{e}.down_proj"
                out[f"{layer}{old}.weight"] = down.clone()
        elif name == "mixtral" and key.endswith("mlp.gate.weight"):
            out[key.replace("mlp.gate.", "block_sparse_moe.gate.")] = value.clone()
        else:
            out[key] = value.clone()
    return out


def _keys(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_fused_and_per_expert_folders_read_the_same(tmp_path, name):
    """transformers 5 holds the experts fused in memory but ``save_pretrained`` writes the per-expert names
    (``save_original_format=True``, its default); ``save_original_format=False`` writes the fused tensors. Both
    folders, and one written here from the per-expert names, read into the same tensors."""
    from safetensors.torch import save_file

    from lightning_megatron.models.gpt.module import GPTLightningModule

    hf = MODELS[name]()
    hf.save_pretrained(tmp_path / "default")
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    per_expert = _per_expert(hf.state_dict(), name)
    (tmp_path / "written").mkdir()
    hf.config.save_pretrained(tmp_path / "written")
    save_file(per_expert, str(tmp_path / "written" / "model.safetensors"), metadata={"format": "pt"})
    assert _keys(tmp_path / "default") == set(per_expert)  # transformers writes the old names
    assert "model.layers.1.mlp.experts.gate_up_proj" in _keys(tmp_path / "fused")
    want = GPTLightningModule.read_pretrained(str(tmp_path / "fused")).state_dict
    for folder in ("default", "written"):
        got = GPTLightningModule.read_pretrained(str(tmp_path / folder)).state_dict
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), folder
    err = _max_err(_logits(_ours(tmp_path / "fused"), _tokens()), _theirs(hf, _tokens()))
    assert err <= 1e-5, f"{name} (fused folder): max |ours - transformers| = {err:.2e}"


# ------------------------------------------------------------------------------------------- export


def _saved(module):
    """What ``export hf`` reads of a checkpoint: the full state dict (global names, real vocabulary) and the
    flat hyper-parameters."""
    from lightning_megatron.saved_model import SavedModel

    vocab = ("embedding.word_embeddings.weight", "output_layer.weight")
    state = {k: (p[:VOCAB] if k in vocab else p).detach().clone()
             for k, p in module.model_chunks[0].global_named_parameters()}
    return SavedModel(state_dict=state, hparams=module.flat_hparams(module.hparams))


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen2", "qwen2_moe_no_shared", "qwen3", "qwen3_moe"])
def test_export_round_trip_loads_in_transformers_with_our_logits(tmp_path, name):
    """(Qwen2-MoE without a shared expert, ``shared_expert_intermediate_size`` 0, was refused by export until
    2026-12-07: its empty shared expert is written back, with a zero gate in place of the one it multiplies.)"""
    from lightning_megatron.interop.hf_folder import hf_model_from_saved, write_hf_folder
    from lightning_megatron.models.gpt.module import GPTLightningModule

    hf = MODELS[name]()
    arch = ghc.hf_architecture(hf.config)
    back = ghf.hf_state_dict_from_gpt(ghf.gpt_state_dict_from_hf(hf.state_dict(), arch), arch)
    assert back.keys() == hf.state_dict().keys()
    gates = {k for k in back if k.endswith("shared_expert_gate.weight")} if name == "qwen2_moe_no_shared" else set()
    assert all(torch.equal(back[k], torch.zeros_like(v)) for k, v in hf.state_dict().items() if k in gates)
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items() if k not in gates), \
        "HF -> ours -> HF is not bit-exact"
    hf.save_pretrained(tmp_path / "in")
    module = _ours(tmp_path / "in")
    with torch.no_grad():  # weights of our own: the export must carry ours, not echo the import
        g = torch.Generator().manual_seed(4)
        for _, p in module.model_chunks[0].global_named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    want = _logits(module, _tokens())
    exported, _ = hf_model_from_saved(_saved(module), GPTLightningModule.interop)
    write_hf_folder(exported, lambda folder: None, tmp_path / "out")  # export hf's writer (no tokenizer here)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(loaded).__name__ == CLASSES[name]
    err = _max_err(_theirs(loaded, _tokens()), want)
    assert err <= 1e-5, f"{name} export: max |transformers - ours| = {err:.2e}"
    hf.save_pretrained(tmp_path / "theirs")
    assert _keys(tmp_path / "out") == _keys(tmp_path / "theirs")  # the names transformers itself writes
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    if name not in ("qwen2", "qwen3"):
        assert config["router_aux_loss_coef"] == 0.02 and config["num_experts_per_tok"] == 2
    if name == "qwen2_moe_no_shared":
        assert config["shared_expert_intermediate_size"] == 0


# ------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("make", "named"), [
    (lambda: transformers.Qwen2MoeConfig(**COMMON, decoder_sparse_step=2), "decoder_sparse_step=2"),
    (lambda: transformers.Qwen2MoeConfig(**COMMON, mlp_only_layers=[1]), r"mlp_only_layers=\[1\]"),
    (lambda: transformers.Qwen2MoeConfig(**COMMON, num_experts=0), "num_experts=0"),
    (lambda: transformers.Qwen2MoeConfig(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=2),
     "sliding_attention"),
    (lambda: transformers.MixtralConfig(**COMMON, sliding_window=8), "sliding_window=8"),
    (lambda: transformers.MixtralConfig(**COMMON, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 1e4}), "rope scaling"),
], ids=["sparse_step", "mlp_only_layers", "no_experts", "qwen_sliding", "mixtral_sliding", "rope_scaling"])
def test_hf_settings_our_model_cannot_compute_are_refused_by_name(make, named):
    with pytest.raises(ValueError, match=named):
        ghc.hf_architecture(make())


def test_qwen2_moe_mlp_only_layers_past_the_last_layer_name_no_dense_layer():
    """transformers makes a layer dense when its index is in ``mlp_only_layers``: indices past the last layer
    name none, every layer is a mixture of experts, as ours (refused until 2026-12-07)."""
    config = transformers.Qwen2MoeConfig(**COMMON, mlp_only_layers=[2, 5])
    assert ghc.hf_architecture(config) == ghc.hf_architecture(transformers.Qwen2MoeConfig(**COMMON))
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[1\]"):
        ghc.hf_architecture(transformers.Qwen2MoeConfig(**COMMON, mlp_only_layers=[1, 5]))


def test_router_jitter_is_dropped_with_a_warning_and_bad_expert_shapes_are_refused():
    with pytest.warns(UserWarning, match="router_jitter_noise=0.1"):
        arch = ghc.hf_architecture(transformers.MixtralConfig(**COMMON, router_jitter_noise=0.1))
    assert arch["num_moe_experts"] == 8  # MixtralConfig's default
    hf = _mixtral()
    arch = ghc.hf_architecture(hf.config)
    sd = dict(hf.state_dict())
    sd["model.layers.0.mlp.experts.gate_up_proj"] = sd["model.layers.0.mlp.experts.gate_up_proj"].transpose(1, 2)
    with pytest.raises(ValueError, match=r"gate_up_proj is \(4, 32, 96\)"):
        ghf.gpt_state_dict_from_hf(sd, arch)
    sd = dict(hf.state_dict())
    sd["model.layers.2.mlp.gate.weight"] = torch.zeros(4, 32)
    with pytest.raises(ValueError, match="tensors the conversion does not use"):
        ghf.gpt_state_dict_from_hf(sd, arch)


def test_export_refuses_what_mixtral_and_qwen2_moe_cannot_compute():
    mixtral = ghc.hf_architecture(_mixtral().config)
    qwen = ghc.hf_architecture(_qwen2_moe().config)
    assert ghc.hf_class_name(mixtral) == "MixtralForCausalLM" and ghc.hf_class_name(qwen) == "Qwen2MoeForCausalLM"
    with pytest.raises(ValueError, match="moe_router_score_function='sigmoid'"):
        ghc.hf_config_from_architecture({**mixtral, "moe_router_score_function": "sigmoid"})
    with pytest.raises(ValueError, match="moe_shared_expert_gate=False"):
        ghc.hf_config_from_architecture({**qwen, "moe_shared_expert_gate": False})
    # unrenormalised top-k probabilities without shared experts: Qwen2-MoE with an empty one (Mixtral renormalises)
    config = ghc.hf_config_from_architecture({**mixtral, "moe_router_pre_softmax": True})
    assert type(config).__name__ == "Qwen2MoeConfig" and config.shared_expert_intermediate_size == 0
    assert not config.norm_topk_prob and not config.qkv_bias
    config = ghc.hf_config_from_architecture({**qwen, "moe_router_pre_softmax": False})
    assert config.norm_topk_prob and config.qkv_bias and config.shared_expert_intermediate_size == 40


def test_qwen3_settings_our_model_or_transformers_cannot_compute_are_refused_by_name():
    """Qwen3's ``attention_bias`` puts a bias on q, k, v and o (ours: q, k, v only); its norms of queries and keys
    (``qk_layernorm``) have no place in Llama, Qwen2, Mixtral, Qwen2-MoE or GPT-2: export refuses the mixes no
    transformers class computes."""
    with pytest.raises(ValueError, match="attention_bias=True"):
        ghc.hf_architecture(transformers.Qwen3Config(**COMMON, attention_bias=True))
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[0\]"):
        ghc.hf_architecture(transformers.Qwen3MoeConfig(**COMMON, mlp_only_layers=[0]))
    qwen3 = ghc.hf_architecture(_qwen3().config)
    with pytest.raises(ValueError, match="qk_layernorm=True with add_qkv_bias=True"):
        ghc.hf_config_from_architecture({**qwen3, "add_qkv_bias": True})
    qwen3_moe = ghc.hf_architecture(_qwen3_moe().config)
    with pytest.raises(ValueError, match="qk_layernorm=True with shared experts"):
        ghc.hf_config_from_architecture({**qwen3_moe, "moe_shared_expert_intermediate_size": 32,
                                         "moe_shared_expert_gate": True})
    gpt2 = ghc.hf_architecture(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="qk_layernorm=True"):
        ghc.hf_config_from_architecture({**gpt2, "qk_layernorm": True})


def test_export_of_a_model_trained_with_token_dropping_warns():
    from lightning_megatron.models.gpt.module import GPTLightningModule
    from lightning_megatron.saved_model import SavedModel

    hf = _mixtral()
    arch = ghc.hf_architecture(hf.config)
    saved = SavedModel(state_dict=ghf.gpt_state_dict_from_hf(hf.state_dict(), arch),
                       hparams={**arch, "moe_expert_capacity_factor": 1.0})
    with pytest.warns(UserWarning, match="moe_expert_capacity_factor=1.0 .* drops none"):
        config = GPTLightningModule.interop.hf_config(saved)
    assert config.architectures == ["MixtralForCausalLM"] and config.num_local_experts == 4


def test_megatron_lm_add_qkv_bias_is_read_not_refused():
    from lightning_megatron.models.gpt.interop import gpt_architecture_from_args

    args = argparse.Namespace(num_attention_heads=4, hidden_size=32, add_bias_linear=False, add_qkv_bias=True,
                              normalization="RMSNorm", swiglu=True, position_embedding_type="rope")
    arch = gpt_architecture_from_args(args, 2)
    assert arch["add_qkv_bias"] and not arch["add_bias_linear"] and arch["spec"] == "llama_layer_spec"


def test_megatron_lm_router_settings_read_as_megatron_core_computes_them():
    """A Megatron-LM mixture of experts' router settings: ``moe_router_dtype`` (fp32 logits of a bf16 model) was
    dropped without a word; sigmoid scores with ``moe_router_pre_softmax`` (which megatron-core ignores under
    sigmoid) were refused; one group of one (plain top-k) was refused; a load-balancing type and coefficient given
    as one-element lists (megatron-core's per-type lists) were imported as no loss."""
    from lightning_megatron.models.gpt.interop import gpt_architecture_from_args

    base = dict(num_attention_heads=4, hidden_size=32, add_bias_linear=False, normalization="RMSNorm", swiglu=True,
                position_embedding_type="rope", num_experts=4, moe_router_topk=2)
    arch = gpt_architecture_from_args(argparse.Namespace(
        **base, moe_router_dtype="fp32", moe_router_score_function="sigmoid", moe_router_pre_softmax=True,
        moe_router_num_groups=1, moe_router_group_topk=1, moe_router_load_balancing_type=["seq_aux_loss"],
        moe_aux_loss_coeff=[1e-3]), 2)
    assert arch["moe_router_dtype"] == "fp32" and arch["moe_router_score_function"] == "sigmoid"
    assert arch["moe_router_pre_softmax"] is False
    assert (arch["moe_router_load_balancing_type"], arch["moe_aux_loss_coeff"]) == ("seq_aux_loss", 1e-3)
    from lightning_megatron.models.gpt.config import GPTConfig

    GPTConfig(**{**{k: v for k, v in arch.items() if k in {f.name for f in dataclasses.fields(GPTConfig)}},
                 "ffn_hidden_size": 64, "vocab_size": 100})
