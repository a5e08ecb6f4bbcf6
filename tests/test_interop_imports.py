"""Every way in gives the source framework's logits, single process (runs in CI, no `bench` extra).

The module is started with ``BertLightningModule.from_pretrained(source)`` (the architecture read from
the source, as ``--model.init_from`` does on the command line) and its masked-LM and binary logits are
compared with ``transformers`` on the same weights, in eval mode:

- a Hugging Face ``BertForPreTraining`` folder (post-norm, ``gelu_new``, eps 1e-6, vocabulary 100);
- a ``MegatronBertForPreTraining`` folder (pre-norm);
- a Megatron-LM legacy ``model_optim_rng.pt`` written with ``--bias-gelu-fusion`` (tanh GELU in the MLP,
  exact GELU in the LM head), its vocabulary padded to 128 rows, and its ``args`` holding Megatron-LM enums
  (pickled from a stand-in module named ``megatron.core.transformer.enums``): the reference is
  transformers' ``MegatronBertForPreTraining`` with the MLP's tanh GELU and the LM head's activation set
  to the exact GELU -- the numerics such a checkpoint was trained with.

Tolerance: 2e-5 relative to the largest logit (fp32; the activation mix-up this guards against is ~1e-3).
"""

from __future__ import annotations

import argparse
import enum
import io
import pickle
import sys
import types
import warnings

import pytest
import torch

VOCAB, SEQ = 100, 16
HF_KW = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=SEQ, type_vocab_size=2, initializer_range=0.3, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0)


def _inputs():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(5, VOCAB, (3, SEQ), generator=g)
    mask = torch.ones_like(tokens)
    mask[1, 11:] = 0
    types_ = (torch.arange(SEQ) >= 6).long().expand(3, SEQ).clone()
    return tokens, mask, types_


def _ours(module):
    tokens, mask, types_ = _inputs()
    module.configure_model()
    module.eval()
    with torch.no_grad():
        lm, binary = module.model_chunks[0](tokens, mask, types_)
    return lm[..., :VOCAB], binary


def _theirs(model):
    tokens, mask, types_ = _inputs()
    with torch.no_grad():
        out = model.eval()(input_ids=tokens, attention_mask=mask, token_type_ids=types_)
    return out.prediction_logits, out.seq_relationship_logits


def _close(ours, theirs):
    for a, b in zip(ours, theirs):
        err = float((a - b).abs().max() / b.abs().max())
        assert err <= 2e-5, f"relative logit error {err:.2e}"


def _hf_model(megatron: bool, **kw):
    import transformers

    torch.manual_seed(0)
    cls = transformers.MegatronBertForPreTraining if megatron else transformers.BertForPreTraining
    cfg = (transformers.MegatronBertConfig if megatron else transformers.BertConfig)(**{**HF_KW, **kw})
    return cls(cfg)


@pytest.mark.parametrize("megatron", [False, True], ids=["bert", "megatron-bert"])
def test_hf_folder_logits_match_transformers(tmp_path, megatron):
    from lightning_megatron.models.bert.module import BertLightningModule

    model = _hf_model(megatron, hidden_act="gelu_new", layer_norm_eps=1e-6)
    model.save_pretrained(tmp_path / "hf")
    module = BertLightningModule.from_pretrained(str(tmp_path / "hf"))
    assert module.config.activation == "gelu_tanh" and module.config.layernorm_epsilon == 1e-6
    _close(_ours(module), _theirs(model))


@pytest.mark.parametrize("megatron", [False, True], ids=["bert", "megatron-bert"])
def test_an_untied_hf_output_layer_is_refused(tmp_path, megatron):
    """A folder saved with ``tie_word_embeddings=False`` has an MLM decoder of its own: BertModel ties it to the word
    embedding, and the import dropped it without a word (masked-LM logits 130-163% of the largest off)."""
    from lightning_megatron.models.bert.module import BertLightningModule

    model = _hf_model(megatron, tie_word_embeddings=False)
    with torch.no_grad():
        model.cls.predictions.decoder.weight.normal_(0, 0.2)  # untied: its own values
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"cls.predictions.decoder.weight\) is not the word embedding "
                                         r"\(tie_word_embeddings=False\): BertLightningModule ties them"):
        BertLightningModule.from_pretrained(str(tmp_path / "hf")).configure_model()  # the weights are read here


class _FakeEnumModule:
    """``megatron.core.transformer.enums`` as current Megatron-LM has it, only while pickling."""

    def __enter__(self):
        mod = types.ModuleType("megatron.core.transformer.enums")

        class AttnBackend(enum.Enum):
            flash, fused, unfused, local, auto = 1, 2, 3, 4, 5

        AttnBackend.__module__, AttnBackend.__qualname__ = mod.__name__, "AttnBackend"
        mod.AttnBackend = AttnBackend
        self.saved = {k: sys.modules.get(k) for k in ("megatron", "megatron.core", "megatron.core.transformer",
                                                      mod.__name__)}
        for name in list(self.saved)[:-1]:
            sys.modules[name] = types.ModuleType(name)
        sys.modules[mod.__name__] = mod
        return AttnBackend

    def __exit__(self, *exc):
        for name, old in self.saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def _megatron_legacy(tmp_path, megatron_hf_model, extra=None, **more_args):
    """A legacy Megatron-LM checkpoint (TP=1, PP=1) of ``megatron_hf_model``'s weights, padded vocabulary
    (``extra``: tensors added to it, our names; ``more_args``: its args; ``bert_binary_head=False``: no pooler,
    binary head or token types, as Megatron-LM's ``--bert-no-binary-head`` builds BERT)."""
    from lightning_megatron.models.bert.hf import bert_config_from_hf, bert_state_dict_from_hf

    cfg = bert_config_from_hf(megatron_hf_model.config)
    sd = bert_state_dict_from_hf(megatron_hf_model.state_dict(), cfg, make_vocab_size_divisible_by=128)
    if more_args.get("bert_binary_head") is False:
        sd = {k: v for k, v in sd.items() if not k.startswith(("pooler.", "binary_head.", "embedding.tokentype"))}
    sd.update(extra or {})
    assert sd["embedding.word_embeddings.weight"].size(0) == 128  # Megatron's padded rows travel along
    with _FakeEnumModule() as AttnBackend:
        args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                  max_position_embeddings=SEQ, norm_epsilon=1e-5, bias_gelu_fusion=True,
                                  normalization="LayerNorm", position_embedding_type="learned_absolute",
                                  add_bias_linear=True, make_vocab_size_divisible_by=128, padded_vocab_size=128,
                                  attention_backend=AttnBackend.auto, params_dtype=torch.float32, **more_args)
        d = tmp_path / "megatron" / "iter_0000001" / "mp_rank_00"
        d.mkdir(parents=True)
        torch.save({"model": sd, "args": args, "iteration": 1, "checkpoint_version": 3.0}, d / "model_optim_rng.pt")
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("1")
    return tmp_path / "megatron"


def test_megatron_lm_legacy_logits_match_transformers_with_the_bias_gelu_fusion_numerics(tmp_path):
    """The checkpoint's args say --bias-gelu-fusion: tanh GELU in the MLP, exact GELU in the LM head; both
    must reach the model (the masked-LM logits were off by ~1e-3 relative with the tanh GELU in the head)."""
    from lightning_megatron.models.bert.module import BertLightningModule

    model = _hf_model(True, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-5)
    model.cls.predictions.transform.transform_act_fn = torch.nn.GELU()  # exact, as Megatron's LM head
    source = _megatron_legacy(tmp_path, model)
    module = BertLightningModule.from_pretrained(str(source), config={"vocab_size": VOCAB})
    assert (module.config.activation, module.config.lm_head_activation) == ("gelu_tanh", "gelu")
    _close(_ours(module), _theirs(model))


def test_a_megatron_lm_bert_without_binary_head_or_token_types_is_read(tmp_path):
    """``--bert-no-binary-head``: Megatron-LM builds BERT without the pooler, the binary head and the token-type
    embeddings (``num_tokentypes`` 0). Read as such (until 2026-12-07 refused: the heads missing, with advice about
    the spec); its masked-LM logits equal transformers' on the same weights with token types that add nothing."""
    from lightning_megatron.models.bert.module import BertLightningModule

    model = _hf_model(True, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-5)
    model.cls.predictions.transform.transform_act_fn = torch.nn.GELU()  # exact, as Megatron's LM head
    with torch.no_grad():
        model.bert.embeddings.token_type_embeddings.weight.zero_()  # the source has none: they add nothing
    source = _megatron_legacy(tmp_path, model, bert_binary_head=False)
    module = BertLightningModule.from_pretrained(str(source), config={"vocab_size": VOCAB})
    assert (module.config.num_tokentypes, module.config.add_binary_head) == (0, False)
    lm, binary = _ours(module)  # the batch's token types are not the model's: left out
    assert binary is None
    assert "embedding.tokentype_embeddings.weight" not in dict(module.model_chunks[0].named_parameters())
    _close([lm], [_theirs(model)[0]])


def test_source_tensors_no_parameter_takes_are_refused(tmp_path):
    """A source's tensor the model has no parameter for was dropped without a word, though the source computes
    with it: a folder whose config.json says fewer layers than its weights hold imported the first layers only; a
    Megatron-LM checkpoint's extra norm was left out. Refused by name. Another task's head (the classifier of a
    ``BertForSequenceClassification``) is no weight of the model: said, and the rest imported."""
    import json

    import transformers

    from lightning_megatron.models.bert.module import BertLightningModule

    _hf_model(False).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    module = BertLightningModule.from_pretrained(str(tmp_path / "hf"))
    assert module.config.num_layers == 1
    with pytest.raises(ValueError, match=r"the folder has 16 tensors the conversion does not read, e.g. "
                                         r"\['encoder.layer.1.attention.output.LayerNorm.bias'"):
        module.configure_model()

    model = _hf_model(True, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-5)
    norm = {"encoder.layers.1.self_attention.q_layernorm.weight": torch.ones(8)}
    source = _megatron_legacy(tmp_path, model, extra=norm)
    module = BertLightningModule.from_pretrained(str(source), config={"vocab_size": VOCAB})
    with pytest.raises(ValueError, match=r"has 1 tensors no parameter of the model takes, e.g. "
                                         r"\['encoder.layers.1.self_attention.q_layernorm.weight'\]"):
        module.configure_model()

    torch.manual_seed(0)
    transformers.BertForSequenceClassification(transformers.BertConfig(**HF_KW, num_labels=3)).save_pretrained(
        tmp_path / "classifier")
    module = BertLightningModule.from_pretrained(str(tmp_path / "classifier"))
    with pytest.warns(UserWarning, match=r"classifier': \['classifier.bias', 'classifier.weight'\] are not read "
                                         r"\(another task's head"):  # the folder named (its config.json was)
        module.configure_model()


@pytest.mark.parametrize("types", [1, 3])
def test_a_folder_with_another_number_of_token_types_is_refused_by_its_setting(tmp_path, types):
    """BertLightningModule has two token types (segments A and B); a folder with ``type_vocab_size`` 1 or 3 was
    refused by a tensor's shape, naming no setting."""
    from lightning_megatron.models.bert.module import BertLightningModule

    _hf_model(False, type_vocab_size=types).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match=rf"type_vocab_size={types}: BertLightningModule has 2 token types"):
        BertLightningModule.from_pretrained(str(tmp_path / "hf"))


@pytest.mark.parametrize("megatron", [False, True], ids=["BertLMHeadModel", "MegatronBertForCausalLM"])
def test_a_causal_bert_folder_is_refused_by_its_setting(tmp_path, megatron):
    """A BERT that attends causally (``is_decoder: true``: transformers' ``BertLMHeadModel``,
    ``MegatronBertForCausalLM``) has a masked-LM folder's tensors; it imported as a bidirectional encoder, its logits
    4.2 off transformers' (largest 5.2), unsaid."""
    import transformers

    from lightning_megatron.models.bert.module import BertLightningModule

    cls = transformers.MegatronBertForCausalLM if megatron else transformers.BertLMHeadModel
    config = (transformers.MegatronBertConfig if megatron else transformers.BertConfig)(**HF_KW, is_decoder=True)
    cls(config).save_pretrained(tmp_path / "causal")
    with pytest.raises(ValueError, match=r"is_decoder=True: the folder's BERT attends causally \(each token to the "
                                         r"ones before it\); BertLightningModule attends both ways"):
        BertLightningModule.from_pretrained(str(tmp_path / "causal"))


def test_a_folder_of_sharded_bin_weights_reads_as_its_safetensors(tmp_path):
    """A folder saved as ``pytorch_model.bin.index.json`` and its shards (older transformers, many hub models) loads
    in transformers; ours said it had "neither model.safetensors (or its index) nor pytorch_model.bin". Its tensors
    are read (``weights_only``) equal to the same model's safetensors; a shard outside the folder is refused."""
    import json

    from lightning_megatron.interop.hf_folder import read_hf_weights

    model = _hf_model(False)
    model.save_pretrained(tmp_path / "safe")
    (tmp_path / "bin").mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(state)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: state[k] for k in part}, tmp_path / "bin" / name)
        weight_map.update(dict.fromkeys(part, name))
    (tmp_path / "bin" / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    safe, binary = read_hf_weights(tmp_path / "safe"), read_hf_weights(tmp_path / "bin")
    assert set(binary) >= set(safe) and all(torch.equal(binary[k], safe[k]) for k in safe)
    weight_map[keys[0]] = "../elsewhere.bin"
    (tmp_path / "bin" / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"names '../elsewhere.bin': shards must be .bin files inside the folder"):
        read_hf_weights(tmp_path / "bin")


def test_restricted_unpickler_maps_megatron_enums_and_refuses_other_globals(tmp_path):
    """Megatron-LM's enums become inert records; any other global (here one named like a Megatron class
    but outside the known list, and os.system) is refused; nothing from the file runs."""
    from lightning_megatron.interop.megatron_lm import MegatronRecord, read_args

    with _FakeEnumModule() as AttnBackend:
        torch.save({"args": argparse.Namespace(attention_backend=AttnBackend.local, hidden_size=8)},
                   tmp_path / "ok.pt")
    args = read_args(tmp_path / "ok.pt")
    assert isinstance(args.attention_backend, MegatronRecord)
    assert args.attention_backend.name == "megatron.core.transformer.enums.AttnBackend"
    assert args.attention_backend.args == (4,) and args.hidden_size == 8

    # Hand-written protocol-2 pickles: GLOBAL, an argument tuple, REDUCE (a call), as torch.save frames it.
    def pickled(module: str, name: str) -> bytes:
        body = (b"\x80\x02" + b"c" + module.encode() + b"\n" + name.encode() + b"\n" + b"X\x02\x00\x00\x00hi"
                + b"\x85" + b"R" + b".")
        return body

    for module, name in (("megatron.core.transformer.enums", "Evil"), ("os", "system"),
                         ("megatron.training.checkpointing", "load_checkpoint")):
        path = tmp_path / f"{name}.pt"
        buf = io.BytesIO()
        torch.save({"args": None}, buf)  # a real zip container; its data.pkl replaced below
        import zipfile

        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(path, "w") as dst:
            for item in src.infolist():
                data = src.read(item.filename)
                if item.filename.endswith("data.pkl"):
                    data = pickled(module, name)
                dst.writestr(item, data)
        with pytest.raises(ValueError, match=f"{module}.{name}"):
            read_args(path)
    assert pickle.loads(pickled("builtins", "str")) == "hi"  # the hand-written frames are well formed


def test_hf_config_vocab_size_must_equal_the_embedding_rows(tmp_path):
    import json

    from lightning_megatron.models.bert.module import BertLightningModule

    read_hf_folder = BertLightningModule.read_pretrained  # a config.json folder: the Hugging Face reader

    _hf_model(False).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["vocab_size"] = VOCAB + 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"vocab_size={VOCAB + 8}.*{VOCAB} rows"):
        read_hf_folder(tmp_path)


def test_encoder_only_hf_model_gets_fresh_heads_with_one_warning():
    """all-MiniLM-L6-v2 (the test extra's copy: a transformers BertModel, no MLM / binary heads): the
    architecture comes from its config.json, the encoder and pooler are loaded, the heads start fresh
    with one warning naming them, and the encoder output equals transformers'."""
    import transformers

    from lightning_megatron.models.bert.module import BertLightningModule

    from test_bert_hf import _minilm_dir

    module = BertLightningModule.from_pretrained(_minilm_dir())
    assert (module.config.num_layers, module.config.hidden_size, module.config.num_attention_heads) == (6, 384, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.configure_model()
    heads = [str(w.message) for w in caught if "initialised fresh" in str(w.message)]
    assert len(heads) == 1 and "lm_head.dense.weight" in heads[0] and "binary_head.weight" in heads[0], heads
    assert "pooler" not in heads[0]  # MiniLM saves its pooler
    tokens, mask, types_ = _inputs()
    encoder = transformers.BertModel.from_pretrained(_minilm_dir())
    with torch.no_grad():
        hidden = module.eval().model_chunks[0](tokens, mask, types_, return_hidden_states=True)
        want = encoder.eval()(input_ids=tokens, attention_mask=mask, token_type_ids=types_).last_hidden_state
    torch.testing.assert_close(hidden.transpose(0, 1), want, rtol=0, atol=2e-5)


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")  # pytest's own argv is there too
def test_cli_init_from_reads_the_architecture_and_refuses_disagreeing_flags(tmp_path):
    """`fit --config recipes/bert_tiny.yaml --model.init_from HF_FOLDER`: the architecture comes from its
    config.json (replacing the recipe's); a command-line flag that disagrees is refused, all listed."""
    import transformers

    from lightning_megatron.cli_lightning import lightning_cli

    from test_cli_recipes import ROOT

    config = transformers.BertConfig(**{**HF_KW, "vocab_size": 30522, "num_hidden_layers": 3, "layer_norm_eps": 1e-7})
    transformers.BertModel(config).save_pretrained(tmp_path / "hf")
    args = ["--config", str(ROOT / "recipes/bert_tiny.yaml"), "--trainer.accelerator", "cpu", "--trainer.devices", "1",
            "--trainer.strategy.tensor_model_parallel_size", "1", "--trainer.logger", "false",
            "--data.max_seq_length", str(SEQ), "--model.init_from", str(tmp_path / "hf")]
    with pytest.warns(UserWarning, match="replaces the recipe's config.num_layers=2 \\(now 3\\)"):
        cli = lightning_cli(run=False, args=args)
    hp = cli.model.hparams["config"]  # saved as a plain dict of the record's fields
    assert (hp["num_layers"], hp["hidden_size"], hp["ffn_hidden_size"], hp["spec"], hp["layernorm_epsilon"],
            hp["vocab_size"]) == (3, 32, 64, "bert_layer_post_norm_spec", 1e-7, 30522)
    with pytest.raises(SystemExit, match=r"--model.config.num_layers 2 \(the source has 3\), "
                                         r"--model.config.hidden_size 64 \(the source has 32\)"):
        lightning_cli(run=False, args=[*args, "--model.config.num_layers", "2", "--model.config.hidden_size=64"])


def test_predict_batches_cover_every_sample_once_at_any_size():
    """Any dataset size, any DP size: full local batches, every index once, the tail padded with -1."""
    from lightning_megatron.data.predict import PredictBatchSampler

    for total, local, dp in ((11, 4, 1), (11, 2, 2), (3, 4, 2), (16, 4, 2)):
        per_rank = [list(PredictBatchSampler(total_samples=total, local_batch_size=local, data_parallel_rank=r,
                                             data_parallel_size=dp)) for r in range(dp)]
        assert len({len(batches) for batches in per_rank}) == 1  # every rank runs the same number of steps
        flat = [i for batches in per_rank for b in batches for i in b]
        assert all(len(b) == local for batches in per_rank for b in batches)
        assert sorted(i for i in flat if i >= 0) == list(range(total)), (total, local, dp, per_rank)


def test_a_failed_export_leaves_the_existing_folder_whole(tmp_path, monkeypatch):
    """export hf writes a temporary folder next to the target and swaps it in only when complete."""
    from lightning_megatron import export as convert
    from lightning_megatron.models.bert import interop as bert_interop
    from lightning_megatron.models.bert.hf import bert_config_from_hf, bert_state_dict_from_hf

    model = _hf_model(True)
    sd = bert_state_dict_from_hf(model.state_dict(), bert_config_from_hf(model.config), make_vocab_size_divisible_by=1)
    saved = convert.SavedModel(state_dict=sd, hparams=dict(num_attention_heads=4, spec="bert_layer_local_spec"))
    monkeypatch.setattr(convert, "read_model_checkpoint", lambda path: saved)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]))
    target = tmp_path / "hf"
    target.mkdir()
    (target / "config.json").write_text("{}")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(bert_interop, "_save_tokenizer", broken)
    with pytest.raises(OSError, match="disk full"):
        convert.export_hf("ckpt", target, vocab_file=vocab, overwrite=True)
    assert [p.name for p in tmp_path.iterdir() if p.name != "vocab.txt"] == ["hf"]  # no temporary folder left
    assert [p.name for p in target.iterdir()] == ["config.json"] and (target / "config.json").read_text() == "{}"
    monkeypatch.undo()
    monkeypatch.setattr(convert, "read_model_checkpoint", lambda path: saved)
    convert.export_hf("ckpt", target, vocab_file=vocab, overwrite=True)
    assert (target / "model.safetensors").is_file() and (target / "config.json").read_text() != "{}"
    # --overwrite replaces an earlier export, never a folder of something else (it was deleted whole)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.tex").write_text("years of work")
    with pytest.raises(FileExistsError, match=r"is not an earlier export .*--overwrite would delete what it holds"):
        convert.export_hf("ckpt", tmp_path / "notes", vocab_file=vocab, overwrite=True)
    assert (tmp_path / "notes" / "thesis.tex").read_text() == "years of work"


def test_the_binary_head_is_a_source_s_to_leave_not_to_invent(tmp_path):
    """A model without the binary head starts from a source with one (its heads unread); one with the head from a
    Megatron-LM checkpoint trained without it is refused, naming add_binary_head."""
    from lightning_megatron.models.bert.module import BertLightningModule

    model = _hf_model(True, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-5)
    with_head = _megatron_legacy(tmp_path / "with", model)
    module = BertLightningModule.from_pretrained(str(with_head), config={"vocab_size": VOCAB,
                                                                         "add_binary_head": False})
    module.configure_model()
    without = _megatron_legacy(tmp_path / "without", model, bert_binary_head=False)
    with pytest.raises(ValueError, match=r"add_binary_head=True but the source has False"):
        BertLightningModule.from_pretrained(str(without), config={"vocab_size": VOCAB, "add_binary_head": True})


def test_export_reads_the_vocabulary_as_training_did_and_declares_its_pad(tmp_path, monkeypatch):
    """A BERT trained with a WordPiece ``tokenizer.json`` (documented as accepted) could not be exported: its lines
    were counted as pieces ("has 345 pieces but the model's vocabulary is 195"), and a folder holding it was "not
    found"; and the export declared ``pad_token_id: 0`` whatever the vocabulary (a [PAD] last made transformers'
    padding_idx the [UNK] row). The vocabulary is read as the run's tokenizer reads it, its [PAD] declared; the
    exported folder's ids and logits are transformers' own."""
    import transformers
    from tokenizers.implementations import BertWordPieceTokenizer

    from lightning_megatron import export as convert
    from lightning_megatron.data.tokenizer import BertTokenizer
    from lightning_megatron.models.bert.hf import bert_config_from_hf, bert_state_dict_from_hf

    model = _hf_model(False)
    sd = bert_state_dict_from_hf(model.state_dict(), bert_config_from_hf(model.config), make_vocab_size_divisible_by=1)
    saved = convert.SavedModel(state_dict=sd, hparams=dict(num_attention_heads=4, spec="bert_layer_post_norm_spec"))
    monkeypatch.setattr(convert, "read_model_checkpoint", lambda path: saved)
    pieces = ["[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)] + ["[PAD]"]
    (tmp_path / "vocab.txt").write_text("\n".join(pieces) + "\n")
    (tmp_path / "tok").mkdir()
    BertWordPieceTokenizer(str(tmp_path / "vocab.txt"), lowercase=True).save(str(tmp_path / "tok" / "tokenizer.json"))
    for source in (tmp_path / "tok" / "tokenizer.json", tmp_path / "tok"):
        out = tmp_path / f"hf_{source.name}"
        convert.export_hf("ckpt", out, vocab_file=source)
        exported = transformers.AutoModelForPreTraining.from_pretrained(out)
        assert exported.config.pad_token_id == VOCAB - 1 == BertTokenizer(source).pad_id
        assert exported.bert.embeddings.word_embeddings.padding_idx == VOCAB - 1
        text = "w3 w17 w99 w42"
        assert transformers.AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False)["input_ids"] == \
            BertTokenizer(source).tokenize(text)
        _close(_theirs(exported), _theirs(model))


def test_a_model_larger_than_its_recorded_vocabulary_exports(tmp_path, monkeypatch):
    """A model whose vocab_size was set past its tokenizer's (room for tokens, as Hugging Face configs often have)
    trained, and then no export took its vocabulary ("has 100 pieces but the model's vocabulary is 110"): a finished
    run that could not leave. With the checkpoint's record of its data's vocabulary (those 100 pieces) it exports, the
    rows kept; without the record, or with another tokenizer, it stays refused."""
    import transformers

    from lightning_megatron import export as convert
    from lightning_megatron.data.dataset_vocab import vocabulary_record
    from lightning_megatron.data.tokenizer import BertTokenizer
    from lightning_megatron.models.bert.hf import bert_config_from_hf, bert_state_dict_from_hf

    model = _hf_model(False, vocab_size=VOCAB + 10)
    sd = bert_state_dict_from_hf(model.state_dict(), bert_config_from_hf(model.config), make_vocab_size_divisible_by=1)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]))
    hparams = dict(num_attention_heads=4, spec="bert_layer_post_norm_spec")
    for record, refused in ((None, True), (vocabulary_record(BertTokenizer(vocab)), False)):
        saved = convert.SavedModel(state_dict=sd, hparams=hparams, vocabulary=record)
        monkeypatch.setattr(convert, "read_model_checkpoint", lambda path: saved)
        out = tmp_path / f"hf_{refused}"
        if refused:
            with pytest.raises(ValueError, match=rf"has {VOCAB} pieces but the model's vocabulary is {VOCAB + 10}"):
                convert.export_hf("ckpt", out, vocab_file=vocab)
            continue
        convert.export_hf("ckpt", out, vocab_file=vocab)
        exported = transformers.AutoModelForPreTraining.from_pretrained(out)
        assert exported.config.vocab_size == VOCAB + 10
        assert len(transformers.AutoTokenizer.from_pretrained(out)) == VOCAB
        _close(_theirs(exported), _theirs(model))
