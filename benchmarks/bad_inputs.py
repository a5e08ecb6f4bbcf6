"""Runs a catalogue of bad inputs and prints what each gets (docs/reliability.md's table is its output).

    python benchmarks/bad_inputs.py [--markdown out.md] [--skip-setup]

Most cases run in this process in milliseconds: the config-only check the CLI runs before launching
(:func:`lightning_megatron.config_checks.check_config`), the constructors the CLI instantiates before
launching, the checkpoint validation, the data pipeline and the CLI's argument parser. The cases
that only show at set-up (precision against the parameters, Trainer options the strategy replaces,
a layout the world size cannot hold) run in one spawned rank (a few seconds). Each row: the error
type and the first line of its message, or ``accepted`` when nothing was raised, and when it comes.
Cases that other changes cover and that this checkout cannot show are listed by ``AFTER_MERGE``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (ROOT, ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

BEFORE = "before launch"
SETUP = "at setup (after launch, before step 1)"
LATE = "late (during training)"

GOOD_CONFIG = dict(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, max_sequence_length=128,
                   params_dtype="float32")
GOOD_DATA = dict(max_seq_length=128, global_batch_size=16, micro_batch_size=4, masked_lm_prob=0.15)
GOOD_STRATEGY = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
GOOD_TRAINER = dict(devices=4, num_nodes=1, precision="32-true", max_steps=100)
GOOD_SCHED = dict(init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=10, lr_decay_steps=None)


def _config(model=None, data=None, strategy=None, trainer=None, sched=None, has_cb: bool = True,
            lr: float = 1e-3) -> Callable[[], Any]:
    """``model``: the model's config fields that differ from GOOD_CONFIG."""
    from lightning_megatron.config_checks import validate_config
    from lightning_megatron.models.bert.module import BertLightningModule

    # the model's class is the CLI's: its records' rules (heads, FFN against TP) are the module's
    return lambda: validate_config({"config": {**GOOD_CONFIG, **(model or {})}, "lr": lr},
                                   {**GOOD_DATA, **(data or {})},
                                   {**GOOD_STRATEGY, **(strategy or {})}, {**GOOD_TRAINER, **(trainer or {})},
                                   {**GOOD_SCHED, **(sched or {})}, has_optimizer_callback=has_cb,
                                   model_class=BertLightningModule)


def _config_cases() -> list[tuple[str, str, Callable[[], Any], str]]:
    c = _config
    return [
        ("config", "world size 4 with tensor_model_parallel_size=3", c(strategy=dict(tensor_model_parallel_size=3)), BEFORE),
        ("config", "num_attention_heads=3 with TP=2", c(model=dict(num_attention_heads=3, hidden_size=96)), BEFORE),
        ("config", "hidden_size=130 with 4 heads", c(model=dict(hidden_size=130)), BEFORE),
        ("config", "ffn_hidden_size=501 with TP=2", c(model=dict(ffn_hidden_size=501)), BEFORE),
        ("config", "num_layers=3 with PP=2 x VP=2", c(model=dict(num_layers=3), strategy=dict(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
         BEFORE),
        ("config", "virtual pipeline without PP", c(strategy=dict(virtual_pipeline_model_parallel_size=2)), BEFORE),
        ("config", "sequence_parallel with TP=1", c(strategy=dict(tensor_model_parallel_size=1,
                                                                  sequence_parallel=True)), BEFORE),
        ("config", "global_batch_size=10, micro_batch_size=4", c(data=dict(global_batch_size=10)), BEFORE),
        ("config", "global_batch_size=12 with micro 4 x DP 2", c(data=dict(global_batch_size=12)), BEFORE),
        ("config", "interleaved schedule, 3 microbatches, PP=2", c(strategy=dict(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            data=dict(global_batch_size=24)), BEFORE),
        ("config", "data max_seq_length=256 > model max_sequence_length=128", c(data=dict(max_seq_length=256)),
         BEFORE),
        ("config", "masked_lm_prob=1.5", c(data=dict(masked_lm_prob=1.5)), BEFORE),
        ("config", "model lr=-1", c(lr=-1.0), BEFORE),
        ("config", "accumulate_grad_batches=4", c(trainer=dict(accumulate_grad_batches=4)), BEFORE),
        ("config", "gradient_clip_val=1.0", c(trainer=dict(gradient_clip_val=1.0)), BEFORE),
        ("config", "lr_warmup_steps=100 with max_steps=100 (lr_decay_steps null)", c(sched=dict(lr_warmup_steps=100)),
         BEFORE),
        ("config", "lr_decay_steps null with max_steps=-1", c(trainer=dict(max_steps=-1)), BEFORE),
        ("config", "max_lr < min_lr", c(sched=dict(max_lr=1e-6)), BEFORE),
        ("config", "init_lr > max_lr", c(sched=dict(init_lr=1.0)), BEFORE),
        ("config", "override and use-checkpoint scheduler flags both set", c(sched=dict(
            override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True)), BEFORE),
        ("precision", "precision 32-true with params_dtype bfloat16", c(model=dict(params_dtype="bfloat16")), BEFORE),
        ("precision", "precision bf16-true with params_dtype float32", c(trainer=dict(precision="bf16-true")), BEFORE),
        ("precision", "precision bf16-mixed with params_dtype bfloat16", c(
            trainer=dict(precision="bf16-mixed"), model=dict(params_dtype="bfloat16")), BEFORE),
        ("precision", "precision 64-true", c(trainer=dict(precision="64-true")), BEFORE),
        ("precision", "params_dtype float16 without MegatronOptimizerCallback", c(
            trainer=dict(precision="16-true"), model=dict(params_dtype="float16"), has_cb=False), BEFORE),
    ]


def _constructor_cases() -> list[tuple[str, str, Callable[[], Any], str]]:
    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.optimizer import OptimizerConfig
    from lightning_megatron.datamodules.pretraining import BertDataModule
    from lightning_megatron.models.bert import BertConfig
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.optimizer.scheduler import OptimizerParamScheduler
    from lightning_megatron.strategy import MegatronStrategy
    from lightning_megatron.transformer.config import TransformerConfig

    class _Opt:
        param_groups: list = [{}]

    def sched(**kw):
        args = dict(init_lr=0.0, max_lr=1e-3, min_lr=0.0, lr_warmup_steps=1, lr_decay_steps=10,
                    lr_decay_style="linear", start_wd=0.0, end_wd=0.0, wd_incr_steps=10, wd_incr_style="constant")
        args.update(kw)
        return lambda: OptimizerParamScheduler(_Opt(), **args)

    def module_then_build(**kw):
        def f():
            m = BertLightningModule(BertConfig(vocab_size=100, **kw))
            m.configure_model()
        return f

    tc = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
    return [
        ("strategy", "MegatronStrategy(tensor_model_parallel_size=0)", lambda: MegatronStrategy(0), BEFORE),
        ("strategy", "MegatronStrategy(virtual_pipeline_model_parallel_size=2), PP=1",
         lambda: MegatronStrategy(virtual_pipeline_model_parallel_size=2), BEFORE),
        ("strategy", "MegatronStrategy(sequence_parallel=True), TP=1", lambda: MegatronStrategy(sequence_parallel=True),
         BEFORE),
        ("strategy", "MegatronStrategy(ddp_bucket_size_mb=0)", lambda: MegatronStrategy(ddp_bucket_size_mb=0), BEFORE),
        ("strategy", "MegatronStrategy(micro_batch_size=0)", lambda: MegatronStrategy(micro_batch_size=0), BEFORE),
        ("model", "params_dtype='float64'", lambda: BertConfig(params_dtype="float64"), BEFORE),
        ("model", "optimizer='lamb'", lambda: BertLightningModule(optimizer="lamb"), BEFORE),
        ("model", "hidden_size=130, 4 heads", lambda: BertConfig(hidden_size=130), BEFORE),
        ("model", "hidden_dropout=1.0", lambda: BertConfig(hidden_dropout=1.0), BEFORE),
        ("model", "recompute_granularity='full' without a method",
         lambda: BertConfig(recompute_granularity="full"), BEFORE),
        ("model", "recompute_num_layers=8 > num_layers=2", lambda: BertConfig(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=8), BEFORE),
        ("model", "spec='nope' (unregistered)", module_then_build(spec="nope"), SETUP),
        ("model", "TransformerConfig(activation='swish')", lambda: TransformerConfig(**tc, activation="swish"), BEFORE),
        ("model", "TransformerConfig(normalization='BatchNorm')",
         lambda: TransformerConfig(**tc, normalization="BatchNorm"), BEFORE),
        ("model", "TransformerConfig(layernorm_epsilon=0)", lambda: TransformerConfig(**tc, layernorm_epsilon=0.0),
         BEFORE),
        ("model", "TransformerConfig(init_method_std=0)", lambda: TransformerConfig(**tc, init_method_std=0.0), BEFORE),
        ("data", "BertDataModule(global_batch_size=10, micro_batch_size=4)",
         lambda: BertDataModule(global_batch_size=10, micro_batch_size=4), BEFORE),
        ("data", "BertDataModule(shuffle='bogus')", lambda: BertDataModule(shuffle="bogus"), BEFORE),
        ("data", "BertDataModule(binary_head='xyz')", lambda: BertDataModule(binary_head="xyz"), BEFORE),
        ("data", "BertDataModule(splits='a,b')", lambda: BertDataModule(splits="a,b"), BEFORE),
        ("optimizer", "MegatronOptimizerCallback(OptimizerConfig(clip_grad=-1))", lambda: MegatronOptimizerCallback(OptimizerConfig(clip_grad=-1)),
         BEFORE),
        ("optimizer", "MegatronOptimizerCallback(OptimizerConfig(loss_scale=0))", lambda: MegatronOptimizerCallback(OptimizerConfig(loss_scale=0)),
         BEFORE),
        ("schedule", "lr_decay_style='step'", sched(lr_decay_style="step"), BEFORE),
        ("schedule", "lr_decay_style='WSD' without wsd_decay_steps", sched(lr_decay_style="WSD"), BEFORE),
        ("schedule", "wd_incr_style='constant' with start_wd != end_wd", sched(end_wd=0.1), BEFORE),
        ("schedule", "min_lr=-1", sched(min_lr=-1.0), BEFORE),
    ]


def _data_and_checkpoint_cases(tmp: Path) -> list[tuple[str, str, Callable[[], Any], str]]:
    from lightning_megatron import checkpoint as ckpt
    from lightning_megatron.datamodules.pretraining import BertDataModule
    from lightning_megatron.data.preprocess import preprocess_corpus

    (tmp / "empty.txt").write_text("")
    (tmp / "partial.ckpt").mkdir()
    return [
        ("data", "data_prefix that does not exist", lambda: BertDataModule(data_prefix=str(tmp / "nope")).setup("fit"),
         SETUP),
        ("data", "vocab_file that does not exist",
         lambda: BertDataModule(vocab_file=str(tmp / "vocab.txt")).setup("fit"), SETUP),
        ("data", "preprocess of a missing input file",
         lambda: preprocess_corpus([str(tmp / "missing.txt")], str(tmp / "o1"), None), BEFORE),
        ("data", "preprocess of an empty file", lambda: preprocess_corpus([str(tmp / "empty.txt")], str(tmp / "o2"),
                                                                          None), BEFORE),
        ("data", "splits='100,0,0,5' (four values)", lambda: BertDataModule(splits="100,0,0,5"), BEFORE),
        ("data", "max_seq_length=2", lambda: BertDataModule(max_seq_length=2), BEFORE),
        ("checkpoint", "ckpt_path that does not exist",
         lambda: ckpt.verify_checkpoint(tmp / "missing.ckpt"), SETUP),
        ("checkpoint", "ckpt_path is a file (another strategy's .ckpt)",
         lambda: ckpt.verify_checkpoint(tmp / "empty.txt"), SETUP),
        ("checkpoint", "interrupted save (directory without the marker)",
         lambda: ckpt.verify_checkpoint(tmp / "partial.ckpt"), SETUP),
    ]


def _trust_cases(tmp: Path) -> list[tuple[str, str, Callable[[], Any], str]]:
    """Damaged or hostile checkpoints, model folders, recipes and data on every path that reads them."""
    import json
    import shutil

    import numpy as np

    from lightning_megatron import checkpoint as ckpt
    from lightning_megatron.cli import main
    from lightning_megatron.data.bert_dataset import BertDataset
    from lightning_megatron.data.dataset_vocab import check_dataset_vocab, vocab_sidecar_path
    from lightning_megatron.data.indexed_dataset import IndexedDataset
    from lightning_megatron.data.preprocess import preprocess_corpus
    from lightning_megatron.data.tokenizer import BertTokenizer, packaged_vocab_file
    from lightning_megatron.models.bert.module import BertLightningModule

    read_pretrained = BertLightningModule.read_pretrained

    v1_dir = ROOT / "tests" / "data" / "ckpt_v1_tp2"
    v1_model = json.loads((ROOT / "tests" / "data" / "ckpt_v1_tp2.json").read_text())["model"]

    def copy(name: str, how: str) -> Path:
        d = tmp / name
        shutil.copytree(v1_dir, d)
        marker = json.loads((d / ckpt.MARKER).read_text())
        if how != "format1":
            names = ckpt._files(d)
            marker.update(format_version=2, files={n: (d / n).stat().st_size for n in names},
                          sha256={n: ckpt.file_sha256(d / n) for n in names})
        if how == "flip":
            data = bytearray((d / "__1_0.distcp").read_bytes())
            data[len(data) // 2] ^= 0x40
            (d / "__1_0.distcp").write_bytes(bytes(data))
        elif how == "sum":
            marker["sha256"]["__0_0.distcp"] = "0" * 64
        elif how == "nosums":
            del marker["sha256"]
        (d / ckpt.MARKER).write_text(json.dumps(marker))
        return d

    flipped, altered, nosums = copy("flipped", "flip"), copy("altered", "sum"), copy("nosums", "nosums")
    v1 = copy("v1", "format1")

    def init_from(path: Path) -> Callable[[], Any]:
        return lambda: BertLightningModule(**BertLightningModule.upgrade_hparams(v1_model),
                                           init_from=str(path)).configure_model()

    def export(path: Path) -> Callable[[], Any]:
        return lambda: main(["export", "hf", "--ckpt_path", str(path), "--output", str(tmp / f"{path.name}-hf")])

    (tmp / "ckpts").mkdir()
    (tmp / "ckpts" / "last.ckpt.tmp-1a2b3c4d").mkdir()  # a save interrupted before its marker
    remote = tmp / "remote_code"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "x.EvilConfig"}}))
    latin1 = tmp / "latin1_vocab.txt"
    latin1.write_bytes(packaged_vocab_file().read_bytes()[:2000] + b"\ncaf\xe9\n")
    (tmp / "evil_base.yaml").write_text("model:\n  x: !!python/object/apply:os.system ['true']\n")
    (tmp / "uses_evil.yaml").write_text("base: evil_base.yaml\n")
    text = "\n\n".join("The quick brown fox jumps over the lazy dog.\nA second sentence here." for _ in range(8))
    (tmp / "corpus.txt").write_text(text + "\n")
    preprocess_corpus([str(tmp / "corpus.txt")], str(tmp / "ds"), None, max_seq_length=64)
    indexed = IndexedDataset(tmp / "ds")
    data = np.memmap(f"{tmp / 'ds'}.bin", dtype=indexed.dtype, mode="r+")
    data[int(np.sum(indexed.sizes[: int(indexed.doc_idx[3])])) + 1] = 65000  # one id in document 3
    data.flush()
    del data

    def bad_sample():
        ds = BertDataset(IndexedDataset(tmp / "ds"), BertTokenizer(), max_seq_length=64, num_epochs=1,
                         samples_cache_dir=False)
        for i in range(len(ds)):
            ds[i]

    def no_sidecar():
        vocab_sidecar_path(tmp / "ds").unlink(missing_ok=True)
        check_dataset_vocab(tmp / "ds", BertTokenizer(), None)

    return [
        ("checkpoint", "same-size byte flip, init_from", init_from(flipped), SETUP),
        ("checkpoint", "same-size byte flip, export hf", export(flipped), BEFORE),
        ("checkpoint", "same-size byte flip, load_from_checkpoint",
         lambda: BertLightningModule.load_from_checkpoint(flipped), BEFORE),
        ("checkpoint", "checksum altered in the marker, init_from", init_from(altered), SETUP),
        ("checkpoint", "format-2 marker with its checksums deleted, load_from_checkpoint",
         lambda: BertLightningModule.load_from_checkpoint(nosums), BEFORE),
        ("checkpoint", "format 1 (no checksums), export hf, no opt-in", export(v1), BEFORE),
        ("checkpoint", "--ckpt_path last: last.ckpt missing, only an incomplete last.ckpt.tmp-<id>",
         lambda: main(["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--trainer.default_root_dir",
                       str(tmp), "--trainer.devices", "1", "--trainer.strategy.init_args.tensor_model_parallel_size",
                       "1", "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={tmp / 'ckpts'}",
                       "--ckpt_path", "last"]), BEFORE),
        ("model", "Hugging Face folder whose config.json has auto_map (remote code)",
         lambda: read_pretrained(str(remote)), SETUP),
        ("data", "vocab_file that is not UTF-8", lambda: BertTokenizer(latin1), BEFORE),
        ("data", "token id 65000 in a .bin (vocabulary of 30522), drawn by a sample", bad_sample, LATE),
        ("data", "dataset without .vocab.json holding id 65000", no_sidecar, SETUP),
        ("CLI", "--trainer.strategy.init_args.timeout 0",
         lambda: main(["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--trainer.default_root_dir",
                       str(tmp), "--trainer.strategy.init_args.timeout", "0"]), BEFORE),
        ("CLI", "!!python/object tag in a base: recipe",
         lambda: main(["fit", "--config", str(tmp / "uses_evil.yaml")]), BEFORE),
    ]


def _cli_cases(tmp: Path) -> list[tuple[str, str, Callable[[], Any], str]]:
    from lightning_megatron.cli import main

    recipe = str(ROOT / "recipes" / "bert_tiny.yaml")

    def cli(*args: str) -> Callable[[], Any]:
        # Short and local if a case were accepted: 50 tiny steps, 1 process, everything written under tmp.
        base = ["fit", "--config", recipe, "--trainer.default_root_dir", str(tmp), "--trainer.max_steps", "50",
                "--trainer.devices", "1", "--trainer.strategy.init_args.tensor_model_parallel_size", "1"]

        def f():
            cwd = os.getcwd()
            os.chdir(tmp)
            try:
                main([*base, *args])
            finally:
                os.chdir(cwd)
        return f

    return [
        ("CLI", "misspelled key --model.config.num_layrs 2", cli("--model.config.num_layrs", "2"), BEFORE),
        ("CLI", "a config field in its old place --model.num_layers 2", cli("--model.num_layers", "2"), BEFORE),
        ("CLI", "wrong type --model.config.num_layers two", cli("--model.config.num_layers", "two"), BEFORE),
        ("CLI", "--trainer.precision bf17", cli("--trainer.precision", "bf17"), BEFORE),
        ("CLI", "--config that does not exist", lambda: main(["fit", "--config", str(tmp / "nope.yaml")]), BEFORE),
        ("CLI", "--model.config.params_dtype float64", cli("--model.config.params_dtype", "float64"), BEFORE),
        ("CLI", "TP=4 on devices=2, 6 heads, max_sequence_length 64", cli(
            "--trainer.strategy.init_args.tensor_model_parallel_size", "4", "--trainer.devices", "2",
            "--model.config.num_attention_heads", "6",
            "--model.config.hidden_size", "96", "--model.config.max_sequence_length", "64"), BEFORE),
        ("CLI", "--trainer.precision 32-true with --model.config.params_dtype bfloat16",
         cli("--model.config.params_dtype", "bfloat16"), BEFORE),
    ]


def _decoder_predict_finetune_cases(tmp: Path) -> list[tuple[str, str, Callable[[], Any], str]]:
    """Issue 34's bad inputs of the decoder, predict, fine-tuning and check surfaces, through the CLI's
    ``main`` in this process (each is refused before the Trainer is built), and the two data/checkpoint
    ones that show when the data is read."""
    import json
    import pickle
    import shutil

    import numpy as np

    from lightning_megatron import checkpoint as ckpt
    from lightning_megatron.cli import main
    from lightning_megatron.data.bpe_tokenizer import BPETokenizer
    from lightning_megatron.data.gpt_dataset import GPTDataset, document_lengths
    from lightning_megatron.data.indexed_dataset import IndexedDataset
    from lightning_megatron.data.preprocess import preprocess_corpus
    from lightning_megatron.models.bert.module import BertLightningModule

    d = tmp / "issue34"
    d.mkdir()
    text = "\n\n".join(f"Document {i} is about tensor parallel layers.\nIt splits the weights." for i in range(40))
    (d / "docs.txt").write_text(text + "\n")
    preprocess_corpus([d / "docs.txt"], d / "gpt", BPETokenizer(), append_eod=True, progress=False)
    shutil.copy(f"{d / 'gpt'}.bin", f"{d / 'oov'}.bin")
    shutil.copy(f"{d / 'gpt'}.idx", f"{d / 'oov'}.idx")
    indexed = IndexedDataset(d / "oov")
    data = np.memmap(f"{d / 'oov'}.bin", dtype=indexed.dtype, mode="r+")
    data[int(document_lengths(indexed)[:5].sum()) + 1] = 9000  # in document 5; the BPE has 8192 pieces
    data.flush()
    del data
    (d / "prompts.txt").write_text("The function returns\nA list of\n")
    (d / "long.txt").write_text("The function returns\n" + " ".join(["word"] * 60) + "\n")
    (d / "latin1.txt").write_bytes(b"The function returns\ncaf\xe9 au lait\n")
    rows = [{"sentence": f"a fine film number {i}", "label": ["negative", "positive"][i % 2]} for i in range(40)]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "empty.jsonl").write_text("")
    ids = [{"sentence": r["sentence"], "label": i % 2} for i, r in enumerate(rows)]
    ids[30]["label"] = 7
    (d / "ids.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ids))

    class Payload:
        def __reduce__(self):
            import os
            return (os.system, (f"touch {d / 'payload-ran'}",))

    chunk = d / "chunk_payload"
    shutil.copytree(ROOT / "tests" / "data" / "ckpt_v1_tp2", chunk)
    shard = chunk / "__1_0.distcp"
    shard.write_bytes(pickle.dumps(Payload(), protocol=2))
    names = ckpt._files(chunk)
    marker = json.loads((chunk / ckpt.MARKER).read_text())
    marker.update(format_version=2, files={n: (chunk / n).stat().st_size for n in names},
                  sha256={n: ckpt.file_sha256(chunk / n) for n in names})  # the attacker rewrites the checksums
    (chunk / ckpt.MARKER).write_text(json.dumps(marker))

    def oov_sample():
        ds = GPTDataset(IndexedDataset(d / "oov"), seq_length=16, num_epochs=1, samples_cache_dir=False,
                        vocab_size=BPETokenizer().vocab_size)
        for i in range(len(ds)):
            ds[i]

    gpt = ["--config", str(ROOT / "recipes" / "gpt_tiny.yaml"), "--trainer.default_root_dir", str(d / "run")]
    predict = ["predict", *gpt, "--data.predict_file", str(d / "prompts.txt")]
    finetune = ["finetune", "fit", "--config", str(ROOT / "recipes" / "bert_tiny_sst2.yaml"),
                "--trainer.default_root_dir", str(d / "ftrun"), "--data.init_args.validation", str(d / "train.jsonl")]

    def cli(*argv: str) -> Callable[[], Any]:
        return lambda: main(list(argv))

    return [
        ("decoder", "GPT data_prefix, vocab_file null (its .vocab.json names the BPE): not refused for the vocabulary "
                    "(stopped by an added timeout 0)",
         cli("fit", *gpt, "--data.data_prefix", str(d / "gpt"), "--trainer.strategy.init_args.timeout", "0"), BEFORE),
        ("decoder", "GPT data seq_length 256 > max_sequence_length 128", cli("fit", *gpt, "--data.seq_length", "256"),
         BEFORE),
        ("decoder", "token id 9000 in a GPT .bin (BPE of 8192 pieces), drawn by a sample", oov_sample, LATE),
        ("predict", "--model.predict_temperature 0 (sampling)",
         cli(*predict, "--model.predict_greedy", "false", "--model.predict_temperature", "0"), BEFORE),
        ("predict", "--model.predict_top_p 1.5 (sampling)",
         cli(*predict, "--model.predict_greedy", "false", "--model.predict_top_p", "1.5"), BEFORE),
        ("predict", "60-token prompt + --model.predict_max_new_tokens 100, 128 positions",
         cli(*predict[:-1], str(d / "long.txt"), "--model.predict_max_new_tokens", "100"), BEFORE),
        ("predict", "prompts file that is not UTF-8", cli(*predict[:-1], str(d / "latin1.txt")), BEFORE),
        ("predict", "--ckpt_path that does not exist", cli(*predict, "--ckpt_path", str(d / "nope.ckpt")), BEFORE),
        ("finetune", "empty train file", cli(*finetune, "--data.init_args.train", str(d / "empty.jsonl")), BEFORE),
        ("finetune", "label id 7 with num_classes 2",
         cli(*finetune, "--data.init_args.train", str(d / "ids.jsonl"), "--data.init_args.validation",
             str(d / "ids.jsonl"), "--data.init_args.labels", "null", "--data.init_args.num_classes", "2"), BEFORE),
        ("finetune", "--data.label_key labl (the files have 'label')",
         cli(*finetune, "--data.init_args.train", str(d / "train.jsonl"), "--data.init_args.label_key", "labl"),
         BEFORE),
        ("check", "check --layouts tp3 with 4 heads",
         cli("check", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--layouts", "tp3"), BEFORE),
        ("CLI", "abbreviated option --trainer.max_step 50", cli("fit", *gpt, "--trainer.max_step", "50"), BEFORE),
        ("checkpoint", "pickle payload as tensor chunk __1_0.distcp, checksums rewritten, load_from_checkpoint",
         lambda: BertLightningModule.load_from_checkpoint(chunk), BEFORE),
    ]


def _setup_worker() -> list[tuple[str, str, str, str]]:
    """Cases that show only once the Trainer runs: one spawned rank, each fit stops at set-up."""
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.optimizer import OptimizerConfig
    from lightning_megatron.strategy import MegatronStrategy
    from lightning_megatron.models.bert import BertConfig
    from megatron_testing import TINY_CONFIG, TINY_OPTIONS, dataloader, make_trainer

    def fit(strategy_kw=None, model_kw=None, trainer_kw=None, callback=True):
        def f():
            cbs = [MegatronOptimizerCallback(OptimizerConfig(clip_grad=0.0))] if callback else []
            trainer = make_trainer(MegatronStrategy(micro_batch_size=4, **(strategy_kw or {})), 1, 1, callbacks=cbs,
                                   **(trainer_kw or {}))
            trainer.fit(BertLightningModule(BertConfig(**{**TINY_CONFIG, **(model_kw or {})}), **TINY_OPTIONS),
                        train_dataloaders=dataloader(8, 1, 0))
        return f

    scaler = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    cases = [
        ("precision", "Trainer(precision='32-true'), params_dtype bfloat16 (Python API)",
         fit(model_kw=dict(params_dtype="bfloat16")), SETUP),
        ("precision", "Trainer(precision='bf16-true'), params_dtype float32 (Python API)",
         fit(trainer_kw=dict(precision="bf16-true")), SETUP),
        ("precision", "fp16 parameters without MegatronOptimizerCallback (Python API)",
         fit(model_kw=dict(params_dtype="float16"), trainer_kw=dict(precision="16-true"), callback=False), SETUP),
        ("precision", "bf16 parameters without MegatronOptimizerCallback (Python API)",
         fit(model_kw=dict(params_dtype="bfloat16"), trainer_kw=dict(precision="bf16-true"), callback=False), SETUP),
        ("precision", "precision='16-mixed' with torch's GradScaler (as on GPU)", fit(trainer_kw=dict(
            plugins=[scaler])), SETUP),
        ("launch", "TP=2 in a 1-process world (Python API)", fit(strategy_kw=dict(tensor_model_parallel_size=2)),
         SETUP),
        ("launch", "Trainer(accumulate_grad_batches=2) (Python API)", fit(trainer_kw=dict(accumulate_grad_batches=2)),
         SETUP),
        ("launch", "Trainer(gradient_clip_val=1.0) (Python API)", fit(trainer_kw=dict(gradient_clip_val=1.0)), SETUP),
    ]
    return [(g, name, *_outcome(f), when) for g, name, f, when in cases]


def _outcome(f: Callable[[], Any]) -> tuple[str, str]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            f()
    except SystemExit as e:  # argparse / the CLI: the message went to stderr, or is the exit code
        if isinstance(e.code, int):
            text = err.getvalue()
            msg = (_first_problem(text[text.find("error:"):] if "error:" in text else text[-300:])
                   if "problem(s), found before" not in text else _first_problem(text))
            return f"exit {e.code}", msg
        return "exit 1", _first_problem(str(e.code).replace("lightning-megatron: ", ""))
    except BaseException as e:  # noqa: BLE001 - every outcome is a row
        return type(e).__name__, _first_problem(str(e))
    return "accepted", ""


def _first_problem(msg: str) -> str:
    """A ConfigError's message without its header: the problems, one after another."""
    if "problem(s), found before" in msg:  # the CLI's ConfigError, check's layout problems
        msg = " | ".join(ln.strip()[2:] for ln in msg.splitlines()[1:] if ln.strip().startswith("- "))
    return msg


def _row(group: str, name: str, kind: str, msg: str, when: str) -> dict[str, str]:
    msg = " ".join(msg.split())
    if len(msg) > 200:
        msg = msg[:197] + "..."
    if kind == "accepted":
        when = "-"
    return {"group": group, "input": name, "gets": kind, "message": msg, "when": when}


AFTER_MERGE = [
    ("checkpoint", "planted pickle payload in DCP .metadata (fit, validate)", "CheckpointError naming the file; "
     "nothing runs", SETUP, "tests/test_checkpoint_trust.py"),
    ("checkpoint", "eval / exec / getattr / __import__ / subprocess / os.system payloads in .metadata",
     "CheckpointError 'refusing to load global ...'; nothing runs", SETUP, "tests/test_checkpoint_format.py"),
    ("checkpoint", "same-size byte flip, altered checksum, checksums deleted: fit --ckpt_path", "CheckpointError "
     "naming the file / 'cannot be verified' with the opt-in to use", SETUP, "tests/test_checkpoint_trust.py"),
    ("checkpoint", "checkpoint of a model with another head count", "CheckpointError listing the differing "
     "hyper-parameters", BEFORE + " (the CLI; at setup through the Python API)",
     "tests/test_checkpoint_trust.py, tests/test_cli_run_folder.py (another depth)"),
    ("checkpoint", "checkpoint of a model with another hidden size", "one short CheckpointError (the shapes' lines "
     "at setup)", BEFORE + " (the CLI; at setup through the Python API)", "tests/test_checkpoint_trust.py"),
    ("checkpoint", "disk full while saving (2-rank CLI run)", "one line from rank 0 naming the directory and the free "
     "space, exit 1; other ranks quiet (was 243 lines, 10 tracebacks)", LATE, "benchmarks/trust_faults.py"),
    ("checkpoint", "--ckpt_path last: last.ckpt missing, a complete last.ckpt.tmp-<id>", "resumes from it with a "
     "warning (was: step 0, the temporary deleted)", BEFORE, "tests/test_cli_run_folder.py"),
    ("checkpoint", "fit without --ckpt_path into a checkpoint folder that holds checkpoints", "exit 1 naming the "
     "folder, its checkpoints (run, step) and the two ways on: --ckpt_path last, a new --trainer.default_root_dir "
     "(was: a second run's last-v1.ckpt beside the first's)", BEFORE, "tests/test_cli_run_folder.py"),
    ("checkpoint", "--ckpt_path last where last.ckpt and last-v1.ckpt are two runs'", "exit 1 naming each with its "
     "run and step (was: the newest file, of either run)", BEFORE, "tests/test_cli_run_folder.py"),
    ("checkpoint", "a save (SIGTERM's, ModelCheckpoint's, save_checkpoint) onto another run's checkpoint",
     "CheckpointError naming both runs; nothing written (was: replaced)", LATE,
     "tests/test_checkpoint_trust.py, tests/test_cli_run_folder.py"),
    ("training", "NaN gradient at step 2 (fp32 plain or wrapped optimizer, bf16, ZeRO-1; 2 ranks TP=2, NaN on rank 1 "
     "only)", "NonFiniteLossOrGradError naming the step and the parameter on every rank; last.ckpt untouched (was: "
     "NaN every step, exit 0; without the megatron_optimizer group still so before this round)", LATE,
     "tests/test_checkpoint_trust.py, tests/test_optimizer_callbacks.py, tests/test_cli_run_folder.py"),
    ("training", "NaN loss with fp16 dynamic loss scaling", "NonFiniteLossOrGradError (an overflow with a finite loss "
     "is still skipped)", LATE, "tests/test_optimizer_callbacks.py"),
    ("data", "model vocab_size smaller than the data's token ids", "error before training", SETUP,
     "tests/test_data_inputs.py"),
    ("data", "dataset made with another vocabulary", "error naming both vocabularies", SETUP,
     "tests/test_data_inputs.py"),
    ("launch", "SIGKILL of rank 0 with shared-memory collectives", "rank 1 exits non-zero naming the dead peer",
     LATE, "tests/test_cpu_shared_memory.py"),
]


def collect(skip_setup: bool = False) -> list[dict[str, str]]:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.environ.setdefault("WANDB_MODE", "disabled")
        for group, name, f, when in (_config_cases() + _constructor_cases() + _data_and_checkpoint_cases(tmp)
                                     + _trust_cases(tmp) + _cli_cases(tmp) + _decoder_predict_finetune_cases(tmp)):
            rows.append(_row(group, name, *_outcome(f), when))
    if not skip_setup:
        from dist_utils import run_distributed

        for group, name, kind, msg, when in run_distributed(_setup_worker, 1, timeout=600)[0]:
            rows.append(_row(group, name, kind, msg, when))
    return rows


def markdown(rows: list[dict[str, str]]) -> str:
    order = ["config", "precision", "strategy", "model", "optimizer", "schedule", "data", "decoder", "predict",
             "finetune", "checkpoint", "check", "CLI", "launch", "training"]
    out = ["| group | bad input | gets | message (excerpt) | when |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: order.index(r["group"]) if r["group"] in order else 99):
        msg = r["message"].replace("|", "\\|")
        out.append(f"| {r['group']} | {r['input']} | {r['gets']} | {msg} | {r['when']} |")
    out.append("")
    out.append("Covered by the tests (or the benchmark) named, not run here:")
    out.append("")
    out.append("| group | bad input | gets | when | shown by |")
    out.append("|---|---|---|---|---|")
    for group, name, gets, when, by in AFTER_MERGE:
        out.append(f"| {group} | {name} | {gets} | {when} | {by} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--skip-setup", action="store_true", help="skip the set-up cases (one spawned rank)")
    a = parser.parse_args()
    rows = collect(a.skip_setup)
    table = markdown(rows)
    print(table)
    counts: dict[str, int] = {}
    for r in rows:
        key = "accepted" if r["gets"] == "accepted" else r["when"]
        counts[key] = counts.get(key, 0) + 1
    print(f"\n{len(rows)} inputs run: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    if a.markdown:
        Path(a.markdown).write_text(table + "\n")


if __name__ == "__main__":
    main()
