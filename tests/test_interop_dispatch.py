"""Interop goes through the adapter of the module class, never a family guessed from tensor names.

- A checkpoint written by the strategy (one rank, a Llama-shaped GPTLightningModule) records the class
  that wrote it (``module_class`` in ``extra.pt``); ``export hf`` takes that class's adapter: a Llama folder
  whose logits equal the module's within 1e-5. The same ``decoder.*`` tensors recorded as BERT go to
  BERT's adapter, which refuses the Llama spec (a reader that sniffed ``decoder.`` would have written Llama).
- Megatron-LM and Hugging Face sources are read by the reading class's family: GPT's ``decoder.*`` rank
  files read by ``BertLightningModule`` get BERT's architecture rules; a folder of the other family is
  refused naming the types the class reads; a class without an adapter reads our checkpoints only.
- Checkpoints written before the record (the rule of ``lightning_megatron.export``): the committed BERT
  ``ckpt_v1_tp2`` exports as the CLI's default class; a GPT one without a record fails through BERT's
  adapter with an error naming ``--model-class``, and exports with it, or with LightningCLI's
  ``_class_path``; a record outside ``lightning_megatron`` needs ``--model-class``, which may not disagree
  with a record.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_utils import run_distributed
from megatron_testing import make_trainer

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 97, 16
LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, max_sequence_length=SEQ,  # GPTConfig
             hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5, init_method_std=0.2,
             spec="llama_layer_spec", num_query_groups=2, ffn_hidden_size=48, activation="silu",
             gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, rotary_base=5000.0)
GPT = "lightning_megatron.models.gpt.module.GPTLightningModule"
BERT = "lightning_megatron.models.bert.module.BertLightningModule"


def _worker(root: str) -> None:
    from torch.utils.data import DataLoader

    from lightning_megatron.models.gpt.module import GPTLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    g = torch.Generator().manual_seed(11)
    seq = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    batch = {"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": torch.ones(4, SEQ)}
    trainer = make_trainer(MegatronStrategy(micro_batch_size=2), 1, 1)
    trainer.fit(GPTLightningModule(LLAMA, lr=1e-2), train_dataloaders=DataLoader([batch], batch_size=None))
    trainer.save_checkpoint(f"{root}/gpt.ckpt")


@pytest.fixture(scope="module")
def gpt_ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dispatch")
    run_distributed(_worker, 1, str(root), timeout=300)
    return root / "gpt.ckpt"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<|endoftext|>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def _with_extra(src: Path, dst: Path, change: Callable[[dict], None]) -> Path:
    """A copy of checkpoint ``src`` whose ``extra.pt`` ``change`` edited, its size and checksum re-recorded."""
    from lightning_megatron import checkpoint as ckpt

    shutil.copytree(src, dst)
    extra = torch.load(dst / "extra.pt", weights_only=True)
    change(extra)
    torch.save(extra, dst / "extra.pt")
    marker = json.loads((dst / ckpt.MARKER).read_text())
    marker["files"]["extra.pt"] = (dst / "extra.pt").stat().st_size
    marker["sha256"]["extra.pt"] = ckpt.file_sha256(dst / "extra.pt")
    (dst / ckpt.MARKER).write_text(json.dumps(marker))
    return dst


def _logits_equal_the_module(folder: Path, ckpt: Path) -> None:
    from lightning_megatron.models.gpt.module import GPTLightningModule

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ours = GPTLightningModule.load_from_checkpoint(ckpt)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ours.model_chunks[0](tokens)[..., :VOCAB]
        got = hf(input_ids=tokens).logits
    assert float((want - got).abs().max()) <= 1e-5


def test_new_checkpoints_record_the_class_that_wrote_them(gpt_ckpt, tmp_path):
    import warnings

    import torch.distributed as dist

    from lightning_megatron.saved_model import read_model_checkpoint

    assert torch.load(gpt_ckpt / "extra.pt", weights_only=True)["module_class"] == GPT
    # read on this process alone (init_from, export), also inside a run's process group: DCP's "assuming the intent
    # is to load in a single process" is what we ask for, not news for a user of a 2-rank run
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    for _ in ("in a process group", "without one"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert read_model_checkpoint(gpt_ckpt).module_class == GPT
        assert not [w for w in caught if "single process" in str(w.message)], [str(w.message) for w in caught]
        if dist.is_initialized():
            dist.destroy_process_group()


def test_export_takes_the_recorded_class_adapter_not_the_tensor_names(gpt_ckpt, tokenizer, tmp_path):
    from lightning_megatron.cli import main
    from lightning_megatron.export import export_hf

    main(["export", "hf", "--ckpt_path", str(gpt_ckpt), "--output", str(tmp_path / "llama"),
          "--tokenizer", str(tokenizer)])
    _logits_equal_the_module(tmp_path / "llama", gpt_ckpt)
    as_bert = _with_extra(gpt_ckpt, tmp_path / "as_bert", lambda e: e.update(module_class=BERT))
    with pytest.raises(ValueError, match="spec='llama_layer_spec' has no transformers equivalent: export supports "
                                         "'bert_layer_post_norm_spec'"):
        export_hf(as_bert, tmp_path / "out", tokenizer=tokenizer)
    assert not (tmp_path / "out").exists()


def test_sources_are_read_by_the_reading_class_family(tmp_path):
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.models.gpt import hf as ghf
    from lightning_megatron.models.gpt import hf_config as ghc
    from lightning_megatron.models.gpt.module import GPTLightningModule
    from lightning_megatron.module import MegatronLightningModule

    from test_gpt_megatron_import import _args, _models, _write_legacy

    models = _models()
    for family in ("llama", "gpt2"):
        arch = ghc.hf_architecture(models[family].config)
        _write_legacy(tmp_path / family, ghf.gpt_state_dict_from_hf(models[family].state_dict(), arch), arch,
                      _args(family))
        assert GPTLightningModule.read_pretrained(str(tmp_path / family)).hparams["spec"] == arch["spec"]
    # decoder.* rank files read by the BERT class: BERT's rules on args, never the GPT reader
    with pytest.raises(ValueError, match=r"swiglu=True \(a SwiGLU MLP\).*BertLightningModule has no equivalent"):
        BertLightningModule.read_pretrained(str(tmp_path / "llama"))
    saved = BertLightningModule.read_pretrained(str(tmp_path / "gpt2"))  # args BERT can express: BERT's arguments
    assert saved.hparams["spec"] == "bert_layer_local_spec" and "num_query_groups" not in saved.hparams
    assert BertLightningModule.read_architecture(tmp_path / "gpt2") == saved.hparams
    # Hugging Face folders: the class's model types only
    models["llama"].save_pretrained(tmp_path / "llama_hf")
    transformers.BertModel(transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                                   num_attention_heads=4, intermediate_size=64)).save_pretrained(
        tmp_path / "bert_hf")
    with pytest.raises(ValueError, match="holds a 'llama' model; BertLightningModule reads 'bert' and 'megatron-bert'"):
        BertLightningModule.read_pretrained(str(tmp_path / "llama_hf"))
    with pytest.raises(ValueError, match="holds a 'bert' model; GPTLightningModule reads 'llama' and 'gpt2'"):
        GPTLightningModule.read_architecture(str(tmp_path / "bert_hf"))

    class NoAdapter(MegatronLightningModule):
        pass

    with pytest.raises(ValueError, match="the only source NoAdapter reads"):
        NoAdapter.read_pretrained(str(tmp_path / "llama_hf"))


def test_export_of_checkpoints_without_a_record_follows_the_rule(gpt_ckpt, tokenizer, tmp_path, capsys):
    from lightning_megatron.cli import main
    from lightning_megatron.export import export_hf

    from test_checkpoint_verify import DATA, _format_2

    # the committed BERT checkpoint (no record, written by Python): the CLI's default class
    v1 = _format_2(DATA / "ckpt_v1_tp2", tmp_path / "v1")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(995)]))
    export_hf(v1, tmp_path / "v1_hf", vocab_file=vocab)
    config = json.loads((tmp_path / "v1_hf" / "config.json").read_text())
    assert config["architectures"] == ["MegatronBertForPreTraining"]

    # a GPT checkpoint without a record: BERT's adapter refuses it, and the error names the way out
    old = _with_extra(gpt_ckpt, tmp_path / "old", lambda e: e.pop("module_class"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["export", "hf", "--ckpt_path", str(old), "--output", str(tmp_path / "x"), "--tokenizer", str(tokenizer)])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.count("\n") == 1, err
    assert "exported as BertLightningModule, the CLI's default model class" in err and "--model-class" in err, err
    main(["export", "hf", "--ckpt_path", str(old), "--output", str(tmp_path / "by_flag"), "--tokenizer", str(tokenizer),
          "--model-class", GPT])
    _logits_equal_the_module(tmp_path / "by_flag", gpt_ckpt)
    with pytest.raises(ValueError, match=f"written by {GPT}; --model-class {BERT} disagrees"):
        export_hf(gpt_ckpt, tmp_path / "y", tokenizer=tokenizer, model_class=BERT)

    # LightningCLI's record of a class named by class_path
    cli = _with_extra(gpt_ckpt, tmp_path / "cli", lambda e: (e.pop("module_class"),
                                                            e["hyper_parameters"].update(_class_path=GPT)))
    export_hf(cli, tmp_path / "cli_hf", tokenizer=tokenizer)
    _logits_equal_the_module(tmp_path / "cli_hf", gpt_ckpt)

    # a class of the training script (run as __main__): `--model-class __main__.X` imports nothing, the script's
    # module path was refused as disagreeing; the same class name by its importable path is taken
    script = _with_extra(gpt_ckpt, tmp_path / "script", lambda e: e.update(module_class="__main__.GPTLightningModule"))
    with pytest.raises(ValueError, match=r"a class of the script that trained it .* pass --model-class with its "
                                         r"importable path, e\.g\. my_script\.GPTLightningModule"):
        export_hf(script, tmp_path / "s", tokenizer=tokenizer)
    with pytest.raises(ValueError, match=f"--model-class {BERT} disagrees with it: pass the script's "
                                         f"GPTLightningModule by its module's path"):
        export_hf(script, tmp_path / "s", tokenizer=tokenizer, model_class=BERT)
    export_hf(script, tmp_path / "script_hf", tokenizer=tokenizer, model_class=GPT)
    _logits_equal_the_module(tmp_path / "script_hf", gpt_ckpt)

    # a class outside lightning_megatron is imported only when the user names it
    mine = _with_extra(gpt_ckpt, tmp_path / "mine", lambda e: e.update(module_class="my_pkg.models.MyModule"))
    with pytest.raises(ValueError, match="pass --model-class my_pkg.models.MyModule"):
        export_hf(mine, tmp_path / "z", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="my_pkg.models.MyModule cannot be imported"):
        export_hf(mine, tmp_path / "z", tokenizer=tokenizer, model_class="my_pkg.models.MyModule")


def test_export_takes_the_tokenizer_the_runs_data_was_tokenized_with(tmp_path, monkeypatch):
    """A run on a preprocessed corpus with ``data.vocab_file: null`` tokenizes with the vocabulary the dataset's
    ``.vocab.json`` names (``dataset_tokenizer``). `export hf` took it from the run's ``vocab_file`` alone: a GPT
    run's folder got no tokenizer ("the checkpoint names no tokenizer"), a BERT run's the packaged bert-base-uncased
    vocabulary (refused only when the sizes differ), and a cased WordPiece vocabulary was always exported
    lowercasing. Export follows the data's rule: the folder's tokenizer gives the ids ours gave the training text."""
    from lightning_megatron.data.bpe_tokenizer import train_bpe_tokenizer
    from lightning_megatron.data.dataset_vocab import dataset_tokenizer
    from lightning_megatron.data.preprocess import preprocess_corpus
    from lightning_megatron.data.tokenizer import train_wordpiece_tokenizer
    from lightning_megatron.models.bert.interop import BertInterop
    from lightning_megatron.models.gpt.interop import GPTInterop

    monkeypatch.chdir(tmp_path)  # the run's relative data_prefix, as a run folder holds it
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"Tensor Parallel layer {i} splits the Weights of MLP {i % 7}.\nThen it Gathers."
                                for i in range(60)) + "\n")
    for family, adapter, train in (("bpe", GPTInterop(), lambda: train_bpe_tokenizer([text], 400, tmp_path / "bpe")),
                                   ("wordpiece", BertInterop(),
                                    lambda: train_wordpiece_tokenizer([text], 120, tmp_path / "wp", lowercase=False))):
        ours = dataset_tokenizer(train(), None, default=family)
        preprocess_corpus([text], f"data/{family}", ours, append_eod=family == "bpe", progress=False)
        for dm in ({"data_prefix": f"data/{family}", "vocab_file": None},  # the dataset's record names it
                   {"data_prefix": None, "vocab_file": str(ours.vocab_file)}):  # the run named it (cased: not lowered)
            _assert_exported_tokenizer(adapter, dm, ours, tmp_path / f"hf_{family}_{dm['data_prefix'] is None}")
    with pytest.raises(FileNotFoundError, match="the run trained on data_prefix 'elsewhere/gpt', which is not here"):
        _assert_exported_tokenizer(GPTInterop(), {"data_prefix": "elsewhere/gpt", "vocab_file": None}, ours,
                                   tmp_path / "hf_elsewhere")


def saved_decoder(vocab_size: int, dm: dict) -> tuple[Any, Any]:
    """A saved decoder of a run of datamodule arguments ``dm`` (its sizes from its tensors: one layer of 2 heads of
    4, ``vocab_size`` rows), and a config record for an adapter's ``hf_tokenizer`` to fill in."""
    import types

    from lightning_megatron.saved_model import SavedModel

    layer = {f"decoder.layers.0.{k}": torch.zeros(shape) for k, shape in (
        ("self_attention.linear_qkv.weight", (24, 8)), ("mlp.linear_fc1.weight", (16, 8)),
        ("mlp.linear_fc2.weight", (8, 16)))}
    weights = {"embedding.word_embeddings.weight": torch.zeros(vocab_size, 8), **layer}
    saved = SavedModel(state_dict=weights, hparams={"num_attention_heads": 2}, datamodule_hparams=dm)
    return saved, types.SimpleNamespace(vocab_size=vocab_size, max_position_embeddings=64)


def _assert_exported_tokenizer(adapter, dm, ours, folder) -> None:
    """The folder ``adapter`` writes for a run of datamodule arguments ``dm`` tokenizes as ``ours`` did."""
    from transformers import AutoTokenizer

    saved, config = saved_decoder(ours.vocab_size, dm)
    adapter.hf_tokenizer(saved, config, None)(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    sample = "Tensor Parallel layer 3 splits the Weights."
    assert theirs.encode(sample, add_special_tokens=False) == ours.tokenize(sample), dm
    assert len(theirs) == ours.vocab_size, dm


def test_export_of_a_chat_run_renders_its_chats_as_the_run_did(tmp_path):
    """An SFT run on the packaged BPE (no BOS of its own) with a Llama-style template that opens with
    ``{{ bos_token }}``: the run rendered it empty, but the exported tokenizer named ``<|endoftext|>`` its BOS, so
    ``apply_chat_template`` (lm-eval's ``--apply_chat_template``) put a token the model never saw before every chat
    (exact match 0.03 against 0.58 as trained). The exported tokenizer sees the special tokens the run's did."""
    from transformers import AutoTokenizer

    from lightning_megatron.data.bpe_tokenizer import packaged_bpe_tokenizer_file
    from lightning_megatron.data.chat import ChatTokenizer
    from lightning_megatron.models.gpt.interop import GPTInterop

    template = ("{{ bos_token }}{% for m in messages %}{{ '### ' + m['role'] + ':\n' + m['content'] }}"
                "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '### assistant:\n' }}{% endif %}")
    dm = {"tokenizer": None, "chat_template": template, "eos_token": None}
    trained = ChatTokenizer(packaged_bpe_tokenizer_file(), chat_template=template)
    saved, config = saved_decoder(trained.vocab_size, dm)
    GPTInterop().hf_tokenizer(saved, config, None)(tmp_path / "hf")
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    chat = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}]
    assert exported.apply_chat_template(chat, tokenize=False) == trained.template().render(chat)
    assert exported.apply_chat_template(chat, tokenize=True, return_dict=False) == trained.tokenize(
        trained.template().render(chat))
    assert exported.eos_token == trained.eos_token and config.eos_token_id == trained.eos_id
