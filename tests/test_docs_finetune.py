"""docs/finetune.md runs as written: every bash and python block (but the parse-only ones, which
tests/test_docs_blocks.py parses), in order, from a scratch directory that holds the repository's
recipes (so the page's relative paths resolve as in a checkout): pretraining, a GLUE-shaped JSONL task
fine-tuned, validated and predicted through the CLI, the export. Bash runs the bash blocks; their
``lightning-megatron`` and the python blocks (as ``python block.py``) start from a server that imported torch and
Lightning (tests/dist_utils.py ``commands_from_forkserver``, ``run_python``; the installed ``lightning-megatron``
itself runs in tests/test_cli_run_folder.py). The predictions (one JSON line per row,
in order, at DP=2 and at TP=2, without the training file) equal the checkpoint's in one plain process."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import commands_from_forkserver, run_python

ROOT = Path(__file__).resolve().parents[1]
PREDICTIONS = Path("runs") / "bert_tiny_sst2" / "predictions" / "predictions.jsonl"


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced bash/python block of a Markdown page that is not parse-only."""
    found = re.finditer(r"(<!-- doc-test: parse-only[^>]*-->\s*\n)?```(bash|python)\n(.*?)```", page.read_text(), re.S)
    return [(m.group(2), m.group(3)) for m in found if m.group(1) is None]


def test_finetune_walkthrough_runs_as_written(tmp_path):
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ["PATH"], WANDB_MODE="offline", WANDB_SILENT="true",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), HF_HUB_OFFLINE="1")
    found = blocks(ROOT / "docs" / "finetune.md")
    assert [lang for lang, _ in found] == ["bash", "python", "bash", "bash", "python", "bash", "bash", "python",
                                           "bash", "python"]
    outputs, predicted = [], []
    with commands_from_forkserver({"lightning-megatron": ["-m", "lightning_megatron.cli"]}, timeout=900) as commands:
        env["PATH"] = commands + os.pathsep + env["PATH"]
        _run_blocks(tmp_path, env, found, outputs, predicted)
        refused = _refusals(tmp_path, env)
    assert "520 training rows, 129 validation rows" in outputs[1]
    assert (tmp_path / "runs" / "bert_tiny_sst2" / "checkpoints" / "last.ckpt").is_dir()
    for metric in ("val_accuracy", "val_f1", "val_matthews_corrcoef", "val_loss"):  # printed by `finetune validate`
        assert metric in outputs[2], metric
    assert (tmp_path / "runs" / "bert_tiny_hf" / "model.safetensors").is_file()

    # predict: the validation split at DP=2 (129 rows: the last global batch of 32 holds 1 row and 31 padding),
    # then a .txt file of texts at TP=2
    validation = [json.loads(line) for line in (tmp_path / "data" / "sst2" / "validation.jsonl").open()]
    texts = (tmp_path / "texts.txt").read_text().splitlines()
    split_rows, file_rows = predicted
    assert [r["index"] for r in split_rows] == list(range(len(validation)))
    assert [r["text"] for r in split_rows] == [r["sentence"] for r in validation]
    assert [r["index"] for r in file_rows] == [0, 1] and [r["text"] for r in file_rows] == texts
    for row in split_rows + file_rows:
        assert set(row) == {"index", "text", "label", "label_id", "probabilities"}
        assert sum(row["probabilities"]) == pytest.approx(1.0, abs=1e-6)
        assert row["label_id"] == max(range(2), key=row["probabilities"].__getitem__)
        assert row["label"] == ["asyncio", "email"][row["label_id"]]
    # the accuracy of the predicted labels (the page prints it) is `finetune validate`'s val_accuracy
    accuracy = float(re.search(r"129 rows, accuracy (\S+)", outputs[4]).group(1))
    assert accuracy == pytest.approx(float(re.search(r"val_accuracy\D+([0-9.]+)", outputs[2]).group(1)), abs=1e-4)
    # the same probabilities from the checkpoint in one plain process (no strategy, sampler or writer)
    sources = (split_rows, tmp_path / "data" / "sst2" / "validation.jsonl"), (file_rows, tmp_path / "texts.txt")
    for rows, source in sources:
        torch.testing.assert_close(torch.tensor([r["probabilities"] for r in rows]),
                                   _single_process_probabilities(tmp_path, source), rtol=0, atol=1e-5)

    # the classifier exported to transformers (its tokenizer, its id2label) gives those probabilities too
    exported = _exported_probabilities(tmp_path / "runs" / "bert_tiny_sst2_hf", texts)
    torch.testing.assert_close(exported, torch.tensor([r["probabilities"] for r in file_rows]), rtol=0, atol=1e-5)
    printed = outputs[7].splitlines()
    assert [line.split(" {")[0] for line in printed] == texts
    assert all(set(ast.literal_eval(line[line.index(" {") + 1:])) == {"asyncio", "email"} for line in printed)

    # the labels in another order name every prediction and metric by the other class (the accuracy of the page's
    # check would read 1 - accuracy): the checkpoint records the class names, and the command is refused before launch
    assert ("was trained with the classes ['asyncio', 'email'] (in class-id order); this run's data names "
            "['email', 'asyncio']") in refused["labels"], refused["labels"]
    # resuming the page's pretraining run (40 steps, AdamW, the recipe's lr_schedule) with another optimizer, or to
    # the step it has reached, is refused before launch from what its checkpoint records
    assert "optimizer class: checkpoint torch.optim.AdamW, this run torch.optim.SGD" in refused["optimizer"]
    assert "resumes at step 40, and trainer.max_steps=40 ends the run there" in refused["max_steps"]


def _refusals(tmp_path: Path, env: dict[str, str]) -> dict[str, str]:
    """What ``lightning-megatron`` (the forkserver's, on ``env``'s PATH) says refusing, before launch, commands on the
    page's checkpoints: its classifier's labels in another order, its pretraining run resumed with SGD or to the step
    it reached."""
    resume = ["fit", "--config", "recipes/bert_tiny.yaml", "--ckpt_path", "runs/bert_tiny/checkpoints/last.ckpt"]
    commands = {
        "labels": ["finetune", "predict", "--config", "recipes/bert_tiny_sst2.yaml", "--data.labels",
                   "[email, asyncio]", "--ckpt_path", "runs/bert_tiny_sst2/checkpoints/last.ckpt"],
        "optimizer": [*resume, "--trainer.max_steps", "41", "--optimizer", "torch.optim.SGD"],
        "max_steps": [*resume, "--trainer.max_steps", "40"]}
    said = {}
    for name, args in commands.items():
        run = subprocess.run(["lightning-megatron", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode != 0 and "found before launching any process" in run.stderr, run.stderr[-3000:]
        said[name] = run.stderr
    return said


def _run_blocks(tmp_path: Path, env: dict[str, str], found: list[tuple[str, str]], outputs: list[str],
                predicted: list[list[dict]]) -> None:
    """Every block in order, each required to succeed; what each prints goes to ``outputs``, each prediction file
    to ``predicted``."""
    for lang, code in found:
        if "finetune predict" in code and (tmp_path / "data" / "sst2" / "train.jsonl").exists():
            # predict reads only its input: the training file may be gone (kept aside for the reference below)
            (tmp_path / "data" / "sst2" / "train.jsonl").rename(tmp_path / "train.jsonl")
        if lang == "bash":
            proc = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=900)
        else:  # `python block.py`, from the forkserver that has imported torch and Lightning
            script = tmp_path / f"block{len(outputs)}.py"
            script.write_text(code)
            proc = run_python([str(script)], tmp_path, env, timeout=900)
        assert proc.returncode == 0, code + "\n" + proc.stdout[-3000:] + proc.stderr[-5000:]
        outputs.append(proc.stdout)  # the checks below read what the command prints
        if "finetune predict" in code:
            predicted.append([json.loads(line) for line in (tmp_path / PREDICTIONS).open()])


def _exported_probabilities(folder: Path, texts: list[str]) -> torch.Tensor:
    """softmax of transformers' logits for ``texts`` (padded to one batch) from the exported folder, in its
    ``id2label`` order checked to be the fine-tune's class order."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    assert type(model).__name__ == "MegatronBertForSequenceClassification"
    assert model.config.id2label == {0: "asyncio", 1: "email"}
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return model(**tokenizer(texts, padding=True, return_tensors="pt")).logits.softmax(-1)


def _single_process_probabilities(run: Path, predict_file: Path) -> torch.Tensor:
    """softmax of the fine-tuned checkpoint's logits on ``predict_file``'s rows (as the recipe encodes them),
    one batch, one process."""
    from torch.utils.data import default_collate

    from lightning_megatron.datamodules.finetune import LabelledTextDataModule
    from lightning_megatron.models.bert.classification import BertClassificationModule
    from lightning_megatron.saved_model import read_model_checkpoint

    saved = read_model_checkpoint(run / "runs" / "bert_tiny_sst2" / "checkpoints" / "last.ckpt")
    model = BertClassificationModule(**BertClassificationModule.checkpoint_arguments(saved, {}))
    model.configure_model()
    model.load_pretrained(saved, everything=True)
    model.eval()
    dm = LabelledTextDataModule(predict_file=str(predict_file), labels=["asyncio", "email"], max_seq_length=64)
    dm.setup("predict")
    batch = default_collate([dm.predict_dataset[i] for i in range(len(dm.predict_dataset))])
    with torch.no_grad():
        return model.predict_step(batch, 0)
