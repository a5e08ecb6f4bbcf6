"""Every recipe parses and builds; the default recipe trains through the real CLI; TP=1 equals TP=2."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import accelerator

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if not p.name.startswith("_"))  # _*: bases


def _build_worker(recipe: str) -> dict:
    from lightning_megatron.cli import _lightning_cli
    from lightning_megatron.models.bert.classification import BertClassificationModule
    from lightning_megatron.models.bert.docstring_task import StdlibDocstringDataModule

    classes = (dict(model_class=BertClassificationModule, datamodule_class=StdlibDocstringDataModule)
               if recipe.endswith("_finetune.yaml") else {})
    # CPU stand-ins for the cluster settings, everything else exactly as written (the recipe's
    # precision too: the config checks before launch compare it with model.params_dtype).
    cli = _lightning_cli(**classes, run=False, args=[
        "--config", recipe, "--trainer.accelerator", accelerator(), "--trainer.num_nodes", "1",
        "--trainer.logger", "false"])
    strategy = cli.trainer.strategy
    return {"model": type(cli.model).__name__, "data": type(cli.datamodule).__name__,
            "tp": strategy.tensor_model_parallel_size, "pp": strategy.pipeline_model_parallel_size,
            "callbacks": sorted(type(c).__name__ for c in cli.trainer.callbacks),
            "hidden": cli.model.hparams.hidden_size, "global_batch": cli.datamodule.global_batch_size}


def test_recipes_exist():
    assert {p.name for p in RECIPES} >= {"bert_tiny.yaml", "bert_base.yaml", "bert_large.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_and_builds(recipe):
    from dist_utils import run_distributed

    [built] = run_distributed(_build_worker, 1, str(recipe), timeout=180)
    if recipe.stem.endswith("_finetune"):
        assert built["model"] == "BertClassificationModule" and built["data"] == "StdlibDocstringDataModule"
    else:
        assert built["model"] == "BertLightningModule" and built["data"] == "BertDataModule"
    assert "MegatronOptimizerCallback" in built["callbacks"]
    assert "OptimizerParamSchedulerCallback" in built["callbacks"]
    expected = {"bert_tiny": 128, "bert_base": 768, "bert_large": 1024, "bert_tiny_finetune": 128}[recipe.stem]
    assert built["hidden"] == expected


def _fit(tmp: Path, devices: int, tp: int, name: str, wandb: bool) -> list[float]:
    run_dir = tmp / name
    loggers = ('[{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "%s", "name": "csv"}}'
               % run_dir)
    if wandb:
        loggers += (', {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": '
                    '{"project": "lm-test", "save_dir": "%s", "offline": true}}' % run_dir)
    loggers += "]"
    # The recipe as written, with only what a 12-step run needs changed (warm-up, checkpoint folder).
    import yaml

    from lightning_megatron.recipes import read_recipe

    recipe = read_recipe(ROOT / "recipes/bert_tiny.yaml")  # with its base: merged in
    # The recipe's 30 warm-up steps are longer than this run: the CLI shortens them with a warning.
    for cb in recipe["trainer"]["callbacks"]:
        if cb["class_path"].endswith("ModelCheckpoint"):
            cb["init_args"].update(dirpath=str(run_dir / "ckpt"), every_n_train_steps=12)
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "lightning_megatron.cli", "fit", "--config", str(config),
           "--trainer.devices", str(devices), "--trainer.strategy.tensor_model_parallel_size", str(tp),
           "--trainer.max_steps", "12", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
           "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(run_dir),
           "--trainer.logger", loggers, "--model.hidden_dropout", "0.0", "--model.attention_dropout", "0.0",
           "--model.num_layers", "1", "--data.global_batch_size", "8", "--data.micro_batch_size", "4",
           "--data.max_seq_length", "64", "--model.max_sequence_length", "64",
           "--megatron_optimizer.clip_grad", "0.5"]  # a Megatron callback's argument from the command line
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "lr_warmup_steps=30 is not below" in proc.stderr and "args parameter" not in proc.stderr
    # The model summary counts the whole model (every TP shard), the run summary the throughput
    [whole] = re.findall(r"Whole model: ([\d.]+ [KMB]) parameters", proc.stdout + proc.stderr)
    assert "Total FLOPs: 0" not in proc.stdout + proc.stderr
    assert re.search(r"mfu +median over steps", proc.stdout) and re.search(r"tokens_per_sec +median", proc.stdout), \
        proc.stdout[-3000:]
    [metrics] = list(run_dir.rglob("metrics.csv"))
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("train_lm_loss")]
    assert (run_dir / "ckpt").exists() and any((run_dir / "ckpt").iterdir()), "a checkpoint must be saved"
    if wandb:
        assert list(run_dir.rglob("*.wandb")), "W&B offline run files must exist"
        # The run config (in the offline run's records) has the layout, the strategy and the precision.
        records = b"".join(p.read_bytes() for p in run_dir.rglob("*.wandb"))
        assert all(k in records for k in (b"tensor_model_parallel_size", b"MegatronStrategy", b"precision"))
    return [float(r["train_lm_loss"]) for r in rows], whole


def test_cli_fit_tp1_equals_tp2(tmp_path):
    """`lightning-megatron fit --config recipes/bert_tiny.yaml` (few steps) at TP=1 and TP=2 logs equal
    losses (fp32, dropout off) within 1e-5."""
    tp2, whole_tp2 = _fit(tmp_path, 2, 2, "tp2", wandb=True)
    tp1, whole_tp1 = _fit(tmp_path, 1, 1, "tp1", wandb=False)
    assert whole_tp2 == whole_tp1, "the summary counts every TP shard"
    assert len(tp1) == len(tp2) == 12
    for a, b in zip(tp1, tp2):
        assert abs(a - b) <= 1e-5 * abs(a), (tp1, tp2)
    # The TP=2 checkpoint: `test` (docs/recipes.md) and `export hf` through the CLI.
    ckpt = tmp_path / "tp2" / "ckpt" / "last.ckpt"
    assert ckpt.is_dir()
    test = subprocess.run([sys.executable, "-m", "lightning_megatron.cli", "test", "--config", str(tmp_path / "tp2.yaml"),
                           "--trainer.devices", "1", "--trainer.strategy.tensor_model_parallel_size", "1",
                           "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                           "--model.num_layers", "1", "--data.global_batch_size", "8", "--data.micro_batch_size", "4",
                           "--data.max_seq_length", "64", "--model.max_sequence_length", "64",
                           "--trainer.limit_test_batches", "2", "--ckpt_path", str(ckpt)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert test.returncode == 0 and "test_lm_loss" in test.stdout, test.stdout[-3000:] + test.stderr[-3000:]
    export = subprocess.run([sys.executable, "-m", "lightning_megatron.cli", "export", "hf", "--ckpt_path", str(ckpt),
                             "--output", str(tmp_path / "hf")], capture_output=True, text=True, timeout=600)
    assert export.returncode == 0, export.stderr[-3000:]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["MegatronBertForPreTraining"]


def test_help_lists_every_command():
    proc = subprocess.run([sys.executable, "-m", "lightning_megatron.cli", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    for command in ("fit", "validate", "test", "predict", "preprocess", "train-tokenizer", "plot", "export"):
        assert f"  {command} " in proc.stdout, proc.stdout


def test_preprocess_and_plot_commands(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes("The first document has two sentences. Here is the second one.\n\n"
                       "Another document follows.\n\n\n".encode() + b"bad bytes \xff\xfe here.\n")
    proc = subprocess.run([sys.executable, "-m", "lightning_megatron.cli", "preprocess", "--input", str(corpus),
                           "--output-prefix", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out.bin").is_file() and (tmp_path / "out.idx").is_file()
    assert "documents" in proc.stdout
    missing = subprocess.run([sys.executable, "-m", "lightning_megatron.cli", "preprocess", "--input",
                              str(tmp_path / "nope.txt"), "--output-prefix", str(tmp_path / "x")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "nope.txt" in missing.stderr

    from lightning_megatron.cli import plot_runs

    for run, scale in (("run_a", 1.0), ("run_b", 0.9)):
        d = tmp_path / run / "csv" / "version_0"
        d.mkdir(parents=True)
        with (d / "metrics.csv").open("w") as fh:
            fh.write("step,train_lm_loss,val_lm_loss\n")
            for step in range(10):
                fh.write(f"{step},{scale * (10 - step * 0.3)},\n")
    out = plot_runs([tmp_path / "run_a", tmp_path / "run_b"], tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(FileNotFoundError, match="no metrics.csv"):
        plot_runs([tmp_path / "empty"], tmp_path / "x.png")
