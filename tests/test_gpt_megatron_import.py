"""init_from Megatron-LM GPT checkpoints, one process, no megatron-core needed.

A tiny random ``LlamaForCausalLM`` (grouped-query, SwiGLU, rope base 5000, untied) and a
``GPT2LMHeadModel`` (tied, learned positions) are written the way megatron-core's GPTModel saves them:

- legacy ``iter_0000010/mp_rank_0T_00P/model_optim_rng.pt`` at TP=2 x PP=2: stage-local layer numbers,
  each TP rank's slice (``linear_qkv`` rows of its query groups, SwiGLU ``linear_fc1`` rows
  ``[gate_r; up_r]``), the vocabulary padded to 256 rows, the tied output layer's copy on the last stage,
  ``_extra_state`` entries, ``args`` as an ``argparse.Namespace``;
- ``torch_dist``: DCP global tensors with the layers stacked, ``args`` in ``common.pt``.

Reading them back through ``init_from``'s reader gives our full state dict of the same weights exactly
(the one ``tests/test_gpt_hf.py`` proves computes transformers' logits within 1e-5) and the
architecture their config gives; settings our model lacks are refused by name.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from lightning_megatron.models.gpt import hf as ghf
from lightning_megatron.models.gpt import hf_config as ghc

VOCAB = 97


def _models():
    import transformers

    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0, bos_token_id=0,
        eos_token_id=0, initializer_range=0.2))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new",
        bos_token_id=0, eos_token_id=0))
    return {"llama": llama, "gpt2": gpt2}


def _args(family: str, **kw) -> argparse.Namespace:
    common = dict(num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8, max_position_embeddings=64,
                  padded_vocab_size=256, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                  hidden_dropout=0.0, attention_dropout=0.0)  # argparse always has them (0.1 by default)
    if family == "llama":
        common.update(group_query_attention=True, num_query_groups=2, ffn_hidden_size=48, swiglu=True,
                      normalization="RMSNorm", norm_epsilon=1e-5, position_embedding_type="rope", rotary_base=5000,
                      rotary_percent=1.0, add_bias_linear=False, untie_embeddings_and_output_weights=True)
    else:
        common.update(group_query_attention=False, num_query_groups=1, ffn_hidden_size=128, swiglu=False,
                      normalization="LayerNorm", norm_epsilon=1e-5, position_embedding_type="learned_absolute",
                      add_bias_linear=True, bias_gelu_fusion=True, untie_embeddings_and_output_weights=False,
                      max_position_embeddings=32)
    return argparse.Namespace(**{**common, **kw})


def _write_legacy(root, full, arch, args, extra=None):
    """``extra``: tensors added to every TP rank's files of the stage their layer is on (ours, global names)."""
    gated = arch["spec"] == ghc.LLAMA_SPEC
    it = root / "iter_0000010"
    (root / "latest_checkpointed_iteration.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    for t in range(2):
        shard = ghf.shard_full_state_dict(full, t, 2, gated_linear_unit=gated,
                                          num_query_groups=arch["num_query_groups"] or 4)
        if "output_layer.weight" not in shard:  # tied: the last stage holds a copy of the embedding
            shard["output_layer.weight"] = shard["embedding.word_embeddings.weight"].clone()
        shard.update(extra or {})
        for p in range(2):
            model = {}
            for key, value in shard.items():
                if key.startswith(f"decoder.layers.{p}."):
                    model[key.replace(f"decoder.layers.{p}.", "decoder.layers.0.")] = value
                elif key.startswith("embedding.") and p == 0 or key.startswith(("decoder.final", "output_")) and p:
                    model[key] = value
            model["decoder.layers.0.self_attention.core_attention._extra_state"] = None
            d = it / f"mp_rank_{t:02d}_{p:03d}"
            d.mkdir(parents=True)
            torch.save({"args": args, "model": model, "iteration": 10}, d / "model_optim_rng.pt")


def _write_torch_dist(root, full, arch, args):
    import json

    import torch.distributed.checkpoint as dcp

    padded = ghf.shard_full_state_dict(full, 0, 1, gated_linear_unit=False, num_query_groups=1,
                                       make_vocab_size_divisible_by=256)  # padded at TP=2, as the legacy files
    state = {k: v for k, v in padded.items() if not k.startswith("decoder.layers.")}
    for name in {k.split(".", 3)[3] for k in padded if k.startswith("decoder.layers.")}:
        state[f"decoder.layers.{name}"] = torch.stack([padded[f"decoder.layers.{i}.{name}"] for i in range(2)])
    dcp.save(state, checkpoint_id=str(root), no_dist=True)
    (root / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({"args": args}, root / "common.pt")


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_megatron_gpt_checkpoint_reads_as_our_state_dict_and_architecture(tmp_path, family, fmt):
    from lightning_megatron.models.gpt.module import GPTLightningModule

    read_pretrained = GPTLightningModule.read_pretrained
    read_architecture = GPTLightningModule.read_architecture

    model = _models()[family]
    arch = ghc.hf_architecture(model.config)
    full = ghf.gpt_state_dict_from_hf(model.state_dict(), arch)
    (_write_legacy if fmt == "legacy" else _write_torch_dist)(tmp_path / "ckpt", full, arch, _args(family))
    saved = read_pretrained(str(tmp_path / "ckpt"))
    assert saved.state_dict.keys() == full.keys()
    for key, value in full.items():
        got = saved.state_dict[key]
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert got.size(0) == 256 and torch.count_nonzero(got[VOCAB:]) == 0  # Megatron's padding rows
            got = got[:VOCAB]
        assert torch.equal(got, value), key
    want = {k: v for k, v in arch.items() if k != "vocab_size"} | {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    if family == "gpt2":
        want.pop("rotary_base"), want.pop("rotary_percent")
    assert saved.hparams == want
    assert read_architecture(tmp_path / "ckpt") == want


def test_a_megatron_llama_3_1_with_rope_scaling_is_read_with_its_factor(tmp_path):
    """``--use-rope-scaling --rope-scaling-factor 32`` (a Llama 3.2 trained with Megatron-LM) was refused; it is our
    ``rope_scaling`` with its factor (the frequencies, transformers' ``llama3``: ``tests/test_gpt_hf.py``)."""
    from lightning_megatron.models.gpt.module import GPTLightningModule

    model = _models()["llama"]
    arch = ghc.hf_architecture(model.config)
    args = _args("llama", use_rope_scaling=True, rope_scaling_factor=32.0)
    _write_legacy(tmp_path / "ckpt", ghf.gpt_state_dict_from_hf(model.state_dict(), arch), arch, args)
    hparams = GPTLightningModule.read_architecture(tmp_path / "ckpt")
    assert (hparams["rope_scaling"], hparams["rope_scaling_factor"]) == (True, 32.0)
    assert not arch["rope_scaling"]  # the folder's (transformers' default rope) for contrast


@pytest.mark.parametrize(("kw", "named"), [
    (dict(rotary_seq_len_interpolation_factor=2), "rotary_seq_len_interpolation_factor=2"),
    (dict(num_experts=8, moe_layer_freq=2), "moe_layer_freq=2"),  # dense layers among the experts
    # megatron-core's older spelling of group-limited routing (num_groups = the EP size): read as plain top-k
    # until 2026-12-07
    (dict(num_experts=8, moe_router_topk_limited_devices=2), "moe_router_topk_limited_devices=2"),
    (dict(rotary_interleaved=True), "rotary_interleaved=True"),
    (dict(position_embedding_type="relative"), "position_embedding_type='relative'"),
    # GPT-OSS- / Llama-4-style settings megatron-core has and our layer does not: imported without a word, their
    # logits off by 2.7 (off-by-one softmax) and 4.0 (L2-normalised queries and keys) of a largest 4.1-4.3
    (dict(softmax_type="off-by-one", qk_l2_norm=True, quick_geglu=True, glu_linear_offset=1.0,
          activation_func_clamp_value=7.0, attention_output_gate=True, no_rope_freq=4, window_size=(128, 0),
          window_attn_skip_freq=2),
     r"softmax_type='off-by-one' .*qk_l2_norm=True .*quick_geglu=True .*glu_linear_offset=1.0 .*"
     r"activation_func_clamp_value=7.0 .*attention_output_gate=True .*no_rope_freq=4 .*window_size=\(128, 0\)"),
], ids=["interpolation", "moe_layer_freq", "limited_devices", "interleaved", "relative", "gpt_oss"])
def test_megatron_gpt_args_our_model_lacks_are_refused_by_name(tmp_path, kw, named):
    from lightning_megatron.models.gpt.module import GPTLightningModule

    read_pretrained = GPTLightningModule.read_pretrained

    model = _models()["llama"]
    arch = ghc.hf_architecture(model.config)
    _write_legacy(tmp_path / "ckpt", ghf.gpt_state_dict_from_hf(model.state_dict(), arch), arch, _args("llama", **kw))
    with pytest.raises(ValueError, match=named):
        read_pretrained(str(tmp_path / "ckpt"))


def test_a_megatron_checkpoint_with_qk_layernorm_gives_qwen3_s_logits(tmp_path):
    """``--qk-layernorm`` (each head's queries and keys normed: Qwen3 trained with Megatron-LM) was refused; legacy
    files at TP=2 x PP=2 of a Qwen3 model's weights give transformers' Qwen3 logits within 1e-5 (megatron-core's own
    model with ``qk_layernorm``: ``tests/test_gpt_megatron_core.py``, the bench extra)."""
    import transformers

    torch.manual_seed(0)
    qwen3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
        initializer_range=0.2)).eval()
    with torch.no_grad():  # the norms of queries and keys away from 1, so a missing one shows
        for name, p in qwen3.named_parameters():
            if name.endswith("_norm.weight"):
                p.uniform_(0.5, 1.5)
    arch = ghc.hf_architecture(qwen3.config)
    full = ghf.gpt_state_dict_from_hf(qwen3.state_dict(), arch)
    _write_legacy(tmp_path / "ckpt", full, arch, _args("llama", qk_layernorm=True))
    module, error = _from_pretrained_logit_error(tmp_path / "ckpt", qwen3)
    assert module.hparams["config"]["qk_layernorm"] and error <= 1e-5


def _from_pretrained_logit_error(checkpoint, hf_model):
    """``GPTLightningModule.from_pretrained(checkpoint)`` and its largest logit difference from ``hf_model`` on the
    same tokens."""
    from lightning_megatron.models.gpt.module import GPTLightningModule

    module = GPTLightningModule.from_pretrained(str(checkpoint), config={"vocab_size": VOCAB})
    module.configure_model()
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = module.eval().model_chunks[0](tokens)[..., :VOCAB]
        theirs = hf_model.eval()(input_ids=tokens).logits
    return module, float((ours - theirs).abs().max())


def test_gpt_module_from_a_megatron_checkpoint_gives_transformers_logits(tmp_path):
    """GPTLightningModule.from_pretrained(Megatron-LM legacy TP=2 x PP=2 dir): the architecture from args,
    the padded vocabulary trimmed to the model's, transformers' logits on the same weights within 1e-5."""
    model = _models()["llama"].eval()
    arch = ghc.hf_architecture(model.config)
    _write_legacy(tmp_path / "ckpt", ghf.gpt_state_dict_from_hf(model.state_dict(), arch), arch, _args("llama"))
    assert _from_pretrained_logit_error(tmp_path / "ckpt", model)[1] <= 1e-5


def test_a_megatron_tensor_no_parameter_takes_is_refused_by_name(tmp_path):
    """A checkpoint whose layer holds a tensor our model has no parameter for (a bias of ``linear_fc2`` its args do
    not declare, a norm the spec lacks) was read with the tensor dropped: the source computes with it, the model
    did not (the logits differ). Refused by name, whichever stage holds it."""
    from lightning_megatron.models.gpt.module import GPTLightningModule

    model = _models()["llama"]
    arch = ghc.hf_architecture(model.config)
    full = ghf.gpt_state_dict_from_hf(model.state_dict(), arch)
    extra = {"decoder.layers.1.mlp.linear_fc2.bias": torch.randn(32),
             "decoder.final_layernorm.bias": torch.randn(32)}
    _write_legacy(tmp_path / "ckpt", full, arch, _args("llama"), extra=extra)
    module = GPTLightningModule.from_pretrained(str(tmp_path / "ckpt"), config={"vocab_size": VOCAB})
    with pytest.raises(ValueError, match=r"has 2 tensors no parameter of the model takes, e.g. "
                                         r"\['decoder.final_layernorm.bias', 'decoder.layers.1.mlp.linear_fc2.bias'\]"):
        module.configure_model()


class _NotAllowed:
    """A class no allow-list names (a newer Megatron-LM's enum): its pickle is refused, never imported."""


def test_a_checkpoint_that_is_not_one_whole_save_is_refused_naming_what_is_wrong(tmp_path):
    """Until 2026-12-07: a rank file of another iteration was merged without a word (logits 7.2 off); a torch_dist
    ``common.pt`` the allow-list refuses had its args dropped with a warning (a wrong rotary base went through,
    0.87 off); missing pipeline stages or one rank's file given alone were read as a smaller model or refused with
    advice about the vocabulary; a tracker naming no folder, or holding no number, got a generic message or
    Python's int() error; the refusal of a file repeated torch's advice to load it with weights_only=False."""
    import shutil

    from lightning_megatron.models.gpt.module import GPTLightningModule

    read_pretrained = GPTLightningModule.read_pretrained
    model = _models()["llama"]
    arch = ghc.hf_architecture(model.config)
    full = ghf.gpt_state_dict_from_hf(model.state_dict(), arch)
    root = tmp_path / "ckpt"
    _write_legacy(root, full, arch, _args("llama"))
    rank = root / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt"
    saved = torch.load(rank, weights_only=False)
    torch.save({**saved, "iteration": 12}, rank)
    with pytest.raises(ValueError, match=r"iteration 12 .*mp_rank_01_001.* iteration 10"):
        read_pretrained(str(root))
    torch.save(saved, rank)
    # one rank's file (or its folder) of a TP=2 x PP=2 save
    for one in (rank, rank.parent):
        with pytest.raises(ValueError, match=r"one rank's file of a checkpoint saved at tensor_model_parallel_size=2 "
                                             r"x pipeline_model_parallel_size=2"):
            read_pretrained(str(one))
    # the last stage's folders gone: the args' layout names them
    for t in range(2):
        shutil.rmtree(root / "iter_0000010" / f"mp_rank_{t:02d}_001")
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=2, but its rank files make 1 pipeline stage"):
        read_pretrained(str(root))
    (root / "latest_checkpointed_iteration.txt").write_text("5\n")
    with pytest.raises(ValueError, match=r"latest_checkpointed_iteration.txt' says 5, and .*iter_0000005' is not "
                                         r"there \(iterations there: iter_0000010\)"):
        read_pretrained(str(root))
    (root / "latest_checkpointed_iteration.txt").write_text("iter_1")
    with pytest.raises(ValueError, match=r"latest_checkpointed_iteration.txt' holds 'iter_1': an iteration number "
                                         r"or 'release' was expected"):
        read_pretrained(str(root))
    (root / "latest_checkpointed_iteration.txt").unlink()  # no tracker beside the iterations: which one is meant
    shutil.copytree(root / "iter_0000010", root / "iter_0000020")
    with pytest.raises(ValueError, match=r"has no latest_checkpointed_iteration.txt: give one of its iteration "
                                         r"folders \(iter_0000010, iter_0000020\)"):
        read_pretrained(str(root))
    # torch_dist: a common.pt whose args the allow-list refuses is refused, as a legacy file's is
    _write_torch_dist(tmp_path / "dist", full, arch, _args("llama", rotary_base=500))
    torch.save({"args": argparse.Namespace(**{**vars(_args("llama")), "backend": _NotAllowed()})},
               tmp_path / "dist" / "common.pt")
    with pytest.raises(ValueError, match=r"common.pt' cannot be read .*_NotAllowed") as refused:
        read_pretrained(str(tmp_path / "dist"))
    assert "weights_only" not in str(refused.value).split("cannot be read with torch.load(weights_only=True)")[1]


def test_a_vocabulary_larger_than_the_checkpoint_s_names_the_tokenizer_not_a_padded_size(tmp_path):
    """A model whose vocabulary (the data's tokenizer) is larger than a Megatron-LM checkpoint's padded rows: the
    advice was to set vocab_size to the padded rows (256 here: neither the checkpoint's tokenizer, 97, nor the data's);
    the refusal names the tokenizer the checkpoint was trained with."""
    from lightning_megatron.models.gpt.module import GPTLightningModule

    model = _models()["llama"]
    arch = ghc.hf_architecture(model.config)
    _write_legacy(tmp_path / "ckpt", ghf.gpt_state_dict_from_hf(model.state_dict(), arch), arch, _args("llama"))
    module = GPTLightningModule.from_pretrained(str(tmp_path / "ckpt"), config={"vocab_size": 8192})
    with pytest.raises(ValueError, match=r"has a vocabulary of 256 rows, the model's vocab_size is 8192: the source "
                                         r"was trained with another tokenizer than the data's.*at most 256"):
        module.configure_model()


def test_a_checkpoint_that_is_not_one_save_is_refused_before_any_weight_is_read(tmp_path):
    """``--model.init_from``'s check before launch (``read_architecture``: the args of one file) refuses what reading
    the weights refuses (a rank file of another iteration, missing stages): they came after the ranks launched, a
    traceback per rank."""
    import shutil

    from lightning_megatron.models.gpt.module import GPTLightningModule

    model = _models()["llama"]
    arch = ghc.hf_architecture(model.config)
    full = ghf.gpt_state_dict_from_hf(model.state_dict(), arch)
    root = tmp_path / "ckpt"
    _write_legacy(root, full, arch, _args("llama"))
    assert GPTLightningModule.read_architecture(root)["num_layers"] == 2
    rank = root / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt"
    torch.save({**torch.load(rank, weights_only=False), "iteration": 12}, rank)
    with pytest.raises(ValueError, match=r"not of one save: iteration 12"):
        GPTLightningModule.read_architecture(root)
    for t in range(2):
        shutil.rmtree(root / "iter_0000010" / f"mp_rank_{t:02d}_001")
    with pytest.raises(ValueError, match=r"its rank files make 1 pipeline stage"):
        GPTLightningModule.read_architecture(root)
