"""The shared language-model layer and the config records: BertConfig / GPTConfig as the modules take them,
the layout fields left to the strategy, plain hyper-parameters, the one mapping of the flat hyper-parameters
written before the records (checkpoints load, resume and export through it), and the refusal of the old
flat spelling in recipes and on the command line, naming the new one. One process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lightning_megatron import checkpoint as ckpt
from lightning_megatron.models.bert import BertConfig
from lightning_megatron.models.bert.module import BertLightningModule
from lightning_megatron.models.gpt import GPTConfig
from lightning_megatron.models.gpt.module import GPTLightningModule

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
VOCAB, SEQ = 64, 8
GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, max_sequence_length=SEQ,
           hidden_dropout=0.0, attention_dropout=0.0)

# GPTLightningModule's constructor arguments before the record (its flat hyper-parameters, as checkpoints of
# that version hold them), with their defaults.
OLD_GPT_ARGUMENTS = dict(
    num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=None, ffn_hidden_size=None,
    kv_channels=None, vocab_size=None, max_sequence_length=128, spec="gpt_layer_spec",
    position_embedding_type="learned_absolute", normalization=None, activation="gelu", add_bias_linear=True,
    gated_linear_unit=False, untie_embeddings_and_output_weights=False, rotary_base=10000.0, rotary_percent=1.0,
    hidden_dropout=0.1, attention_dropout=0.1, layernorm_epsilon=1e-5, init_method_std=0.02, params_dtype="float32",
    make_vocab_size_divisible_by=128, recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
    num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
    defer_embedding_wgrad_compute=False, attention_backend="auto", init_seed=1234, optimizer="adamw", lr=3e-4,
    weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, sgd_momentum=0.9, fused_optimizer=True,
    compile=False, predict_max_new_tokens=32, predict_greedy=True, predict_temperature=1.0, predict_top_k=0,
    predict_top_p=1.0, predict_stop_at_eod=True, optimizer_class=None, optimizer_kwargs=None,
    lr_scheduler_class=None, lr_scheduler_kwargs=None, init_from=None)


def test_records_validate_name_dtypes_and_leave_the_layout_to_the_strategy():
    config = BertConfig(num_layers=2, hidden_size=32, num_attention_heads=4, params_dtype="bf16")
    assert config.params_dtype == torch.bfloat16 and config.as_dict()["params_dtype"] == "bfloat16"
    assert BertConfig(params_dtype="float16").params_dtype == torch.float16
    with pytest.raises(ValueError, match="params_dtype='float64' is not supported"):
        BertConfig(params_dtype="float64")
    assert (config.tensor_model_parallel_size, config.sequence_parallel) == (None, None)
    assert BertConfig.coerce(config.as_dict()) == config  # the dict a checkpoint holds gives the record back
    with pytest.raises(ValueError, match="BertConfig has no field 'num_layer'"):
        BertConfig.coerce({"num_layer": 2})
    with pytest.raises(TypeError, match="a BertConfig is needed here, not a GPTConfig"):
        BertLightningModule(GPTConfig())
    # sizes at TP=1 now, TP-dependent rules at the strategy's TP size
    laid = BertConfig(num_attention_heads=4, hidden_size=32).with_layout(2, True)
    assert (laid.tensor_model_parallel_size, laid.sequence_parallel) == (2, True)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_model_parallel_size=8"):
        BertConfig(num_attention_heads=4, hidden_size=32).with_layout(8, False)
    with pytest.raises(ValueError, match=r"config.tensor_model_parallel_size=2 but the strategy runs "
                                         r"tensor_model_parallel_size=1: .*MegatronStrategy\(tensor_model_parallel_size"):
        BertConfig(tensor_model_parallel_size=2).with_layout(1, False)
    with pytest.raises(ValueError, match="config.sequence_parallel=True but the strategy runs sequence_parallel=False"):
        BertConfig(sequence_parallel=True).with_layout(2, False)
    # GPT: the spec's norm unless given; the record's, not the module's, rules
    assert GPTConfig(spec="llama_layer_spec").normalization == "RMSNorm"
    with pytest.raises(ValueError, match="position_embedding_type='alibi'"):
        GPTConfig(position_embedding_type="alibi")


def test_hparams_are_plain_values_and_the_flat_ones_of_before_map_into_the_record():
    module = GPTLightningModule(GPTConfig(**GPT), lr=1e-3)
    hparams = dict(module.hparams)
    assert hparams["config"] == GPTConfig(**GPT).as_dict() and hparams["lr"] == 1e-3
    assert "num_layers" not in hparams  # the record's fields are not arguments of the module
    assert json.loads(json.dumps(hparams)) == hparams  # plain: weights_only=True loads them
    # the BERT checkpoint in tests/data was written with the flat arguments
    v1 = json.loads((DATA / "ckpt_v1_tp2.json").read_text())["model"]
    up = BertLightningModule.upgrade_hparams(v1)
    assert set(up) == {"config", "lr", "weight_decay"} and up["config"]["make_vocab_size_divisible_by"] == 8
    assert up["config"]["ffn_hidden_size"] == 32 and up["config"]["kv_channels"] == 8  # resolved as the record does
    assert BertLightningModule.upgrade_hparams(up) == up  # today's spelling maps to itself
    old = {**OLD_GPT_ARGUMENTS, **GPT, "lr": 1e-3}
    added = {"lora", "init_from_sha256", "predict_stop_strings", "calculate_per_token_loss",  # born after the flat
             "predict_seed"}  # spelling
    assert GPTLightningModule.upgrade_hparams(old) == {k: v for k, v in hparams.items() if k not in added}
    with pytest.raises(TypeError, match="num_layers=... is now config.num_layers"):
        GPTLightningModule.from_pretrained("unused", num_layers=2)


def _tokenizer(path: Path) -> Path:
    """A word-level ``tokenizer.json`` of VOCAB tokens (the last one the end of document), for ``export hf``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB - 1)} | {"<|endoftext|>": VOCAB - 1},
                                     unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def _old_checkpoint(new: Path, old: Path) -> Path:
    """A copy of checkpoint ``new`` as GPTLightningModule wrote it before the record: flat hyper-parameters
    (the constructor's arguments of then), the marker's checksums rewritten for the changed extra.pt."""
    shutil.copytree(new, old)
    extra = torch.load(old / "extra.pt", weights_only=True)
    hp = extra["hyper_parameters"]
    config = {k: v for k, v in hp.pop("config").items() if k in OLD_GPT_ARGUMENTS}
    config.update(normalization=None, num_query_groups=None, kv_channels=None)  # as given, unresolved
    extra["hyper_parameters"] = {k: v for k, v in {**hp, **config}.items() if k in OLD_GPT_ARGUMENTS}
    torch.save(extra, old / "extra.pt")
    marker = json.loads((old / ckpt.MARKER).read_text())
    names = ckpt._files(old)
    marker.update(files={n: (old / n).stat().st_size for n in names},
                  sha256={n: ckpt.file_sha256(old / n) for n in names})
    (old / ckpt.MARKER).write_text(json.dumps(marker))
    return old


def test_a_gpt_checkpoint_written_before_the_record_loads_resumes_and_exports(tmp_path):
    from lightning.pytorch import Trainer
    from test_custom_module import hermetic
    from torch.utils.data import DataLoader

    from lightning_megatron.export import export_hf
    from lightning_megatron.saved_model import read_model_checkpoint
    from lightning_megatron.strategy import MegatronStrategy

    g = torch.Generator().manual_seed(0)
    rows = [{"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(SEQ)}
            for t in torch.randint(0, VOCAB, (8, SEQ + 1), generator=g)]

    def trainer(steps: int) -> Trainer:
        return Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), max_steps=steps,
                       logger=False, enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                       use_distributed_sampler=False)

    with hermetic():
        t = trainer(1)
        module = GPTLightningModule(GPTConfig(**GPT), lr=1e-3)
        t.fit(module, DataLoader(rows, batch_size=4))
        t.save_checkpoint(tmp_path / "new")
        old = _old_checkpoint(tmp_path / "new", tmp_path / "old")
        assert "num_layers" in read_model_checkpoint(old).module_hparams  # the flat spelling of before
        weights = dict(module.sharded_named_parameters())
        # load: the same module, the same weights
        loaded = GPTLightningModule.load_from_checkpoint(old)
        assert loaded.config == GPTLightningModule.load_from_checkpoint(tmp_path / "new").config
        for name, p in loaded.sharded_named_parameters():  # the vocabulary's padding rows are not saved
            real = slice(0, VOCAB) if name == "embedding.word_embeddings.weight" else slice(None)
            assert torch.equal(p[real], weights[name][real]), name
        # resume: the hyper-parameters compared field by field through the mapping
        resumed = trainer(2)
        resumed.fit(GPTLightningModule(GPTConfig(**GPT), lr=1e-3), DataLoader(rows, batch_size=4), ckpt_path=old)
        assert resumed.global_step == 2
        with pytest.raises(ckpt.CheckpointError, match="config.num_layers: checkpoint 2, model 3"):
            trainer(2).fit(GPTLightningModule(GPTConfig(**{**GPT, "num_layers": 3}), lr=1e-3),
                           DataLoader(rows, batch_size=4), ckpt_path=old)
    # export: the flat architecture of either spelling
    export_hf(old, tmp_path / "hf", tokenizer=_tokenizer(tmp_path / "tokenizer.json"))
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (exported["n_layer"], exported["vocab_size"], exported["n_embd"]) == (2, VOCAB, 32)


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")  # pytest's own argv is there too
def test_the_flat_spelling_of_before_is_refused_before_launch_naming_the_new_one(tmp_path):
    from lightning_megatron.cli_lightning import lightning_cli

    recipe = str(ROOT / "recipes" / "bert_tiny.yaml")
    with pytest.raises(SystemExit, match=r"--model.num_layers is now --model.config.num_layers"):
        lightning_cli(run=False, args=["--config", recipe, "--model.num_layers", "1"])
    old = tmp_path / "old.yaml"
    old.write_text(f"base: {recipe}\nmodel:\n  num_layers: 1\n  spec: bert_layer_post_norm_spec\n")
    with pytest.raises(SystemExit, match=r"the recipe's model.num_layers is now model.config.num_layers; the recipe's "
                                         r"model.spec is now model.config.spec"):
        lightning_cli(run=False, args=["--config", str(old)])
    gpt = str(ROOT / "recipes" / "gpt_tiny.yaml")
    with pytest.raises(SystemExit, match=r"--model.init_args.hidden_size is now --model.init_args.config.hidden_size"):
        lightning_cli(run=False, args=["--config", gpt, "--model.init_args.hidden_size=64"])


def test_export_of_a_16_bit_model_keeps_its_dtype(tmp_path):
    """A model trained in bf16 (``params_dtype bf16``, ``bf16-true``) exported float32 tensors: lossless, but twice
    the bytes, and the folder's config said float32. Its weights go out as they are, bit for bit, the config
    saying bfloat16; a float32 model's stay float32."""
    import transformers
    from lightning.pytorch import Trainer
    from safetensors.torch import load_file
    from test_custom_module import hermetic
    from torch.utils.data import DataLoader

    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.export import export_hf
    from lightning_megatron.saved_model import read_model_checkpoint
    from lightning_megatron.strategy import MegatronStrategy

    g = torch.Generator().manual_seed(0)
    rows = [{"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(SEQ)}
            for t in torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)]
    for dtype, precision in ((torch.bfloat16, "bf16-true"), (torch.float32, "32-true")):
        with hermetic():
            trainer = Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2), max_steps=1,
                              precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                              enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                              use_distributed_sampler=False, callbacks=[MegatronOptimizerCallback()])
            trainer.fit(GPTLightningModule(GPTConfig(**GPT, params_dtype=dtype), lr=1e-3),
                        DataLoader(rows, batch_size=4))
            trainer.save_checkpoint(tmp_path / str(dtype))
        folder = export_hf(tmp_path / str(dtype), tmp_path / f"hf-{dtype}", tokenizer=_tokenizer(tmp_path / "t.json"))
        weights = load_file(folder / "model.safetensors")
        assert {t.dtype for t in weights.values()} == {dtype}
        saved = read_model_checkpoint(tmp_path / str(dtype)).state_dict
        fc1 = saved["decoder.layers.1.mlp.linear_fc1.weight"]
        assert torch.equal(weights["transformer.h.1.mlp.c_fc.weight"].t(), fc1)  # GPT-2's Conv1D: transposed
        config = transformers.AutoConfig.from_pretrained(folder)
        assert getattr(config, "dtype", None) or config.torch_dtype == dtype


def test_the_last_checkpoint_holds_the_final_step_and_a_resume_from_it_logs_the_steps_it_takes(tmp_path):
    """A run of 3 steps saving every 2 ended with ``last.ckpt`` at step 2: the final step was lost to every later
    command. A run that saved no ``last`` before its end has Lightning save it then, and a resume from such a
    checkpoint logged each step one late (steps 3, 4, 5 as 4, 5, 6; the loop's counter had counted the last
    batch already). ``last`` holds the final step; the resumed run logs steps 3, 4, 5."""
    import csv

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from test_custom_module import hermetic
    from torch.utils.data import DataLoader

    from lightning_megatron.checkpoint import checkpoint_identity
    from lightning_megatron.strategy import MegatronStrategy

    g = torch.Generator().manual_seed(0)
    rows = [{"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(SEQ)}
            for t in torch.randint(0, VOCAB, (12, SEQ + 1), generator=g)]  # 3 batches: the datamodules' epoch
    # is the run's steps (a resumed run's: the steps left), so a run's last step ends its epoch

    def fit(root: Path, steps: int, every: int, ckpt_path=None) -> list[int]:
        with hermetic():
            logger = CSVLogger(root, name="csv")
            trainer = Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(micro_batch_size=2),
                              max_steps=steps, logger=logger, log_every_n_steps=1, enable_progress_bar=False,
                              enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=3,
                              check_val_every_n_epoch=None, use_distributed_sampler=False, callbacks=[ModelCheckpoint(
                                  dirpath=root / "checkpoints", save_last=True, every_n_train_steps=every)])
            trainer.fit(GPTLightningModule(GPTConfig(**GPT), lr=1e-3), DataLoader(rows, batch_size=4),
                        DataLoader(rows[:4], batch_size=4), ckpt_path=ckpt_path)  # validation at the last step
        with open(logger.log_dir + "/metrics.csv") as f:
            return [int(r["step"]) for r in csv.DictReader(f) if r.get("loss")]

    fit(tmp_path / "a", 3, every=2)
    assert checkpoint_identity(tmp_path / "a" / "checkpoints" / "last.ckpt")[1] == 3  # was 2
    fit(tmp_path / "b", 3, every=200)  # no save before the end: Lightning's own at the end
    assert checkpoint_identity(tmp_path / "b" / "checkpoints" / "last.ckpt")[1] == 3
    assert fit(tmp_path / "b", 6, every=200, ckpt_path=tmp_path / "b" / "checkpoints" / "last.ckpt") == [3, 4, 5]
