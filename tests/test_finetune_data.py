"""Fine-tuning on the user's own labelled text (LabelledTextDataModule), GLUE-shaped.

In process: rows from JSONL / CSV / TSV / a DatasetDict-like object, label names and ids, a held-out
fraction, and encodings equal to transformers' BertTokenizerFast (``truncation=True``,
``padding="max_length"``) for single texts and pairs; refusals name the value and the fix.
Through the real CLI (one 2-process run, data parallel 2): an STS-B-shaped regression from CSV files
of real text; the validation metrics it logs (torchmetrics, synchronised over the data-parallel
group) equal a single-process validation of the checkpoint it wrote.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dist_utils import run_python

from lightning_megatron.data.labelled_text import encode_rows
from lightning_megatron.data.tokenizer import BertTokenizer, packaged_vocab_file
from lightning_megatron.datamodules.finetune import LabelledTextDataModule
from lightning_megatron.models.bert.docstring_task import stdlib_docstrings

ROOT = Path(__file__).resolve().parents[1]


def _sentences(n: int) -> list[str]:
    """Real English sentences: the first sentences of standard-library docstrings."""
    out = []
    for doc, _ in stdlib_docstrings(("json", "logging", "email", "http")):
        first = doc.split(". ")[0].strip()
        if 4 <= len(first.split()) <= 30 and first not in out:
            out.append(first)
        if len(out) == n:
            return out
    raise AssertionError("not enough docstrings")


def _write(path: Path, rows: list[dict]) -> str:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        with path.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]), delimiter="\t" if path.suffix == ".tsv" else ",")
            w.writeheader()
            w.writerows(rows)
    return str(path)


def test_encoding_equals_transformers_for_texts_and_pairs():
    transformers = pytest.importorskip("transformers")
    texts = _sentences(12)
    rows = [(texts[i], None if i % 3 == 0 else texts[i + 1] * (1 + i % 4), i % 2) for i in range(11)]
    ours = encode_rows(BertTokenizer(), rows, 24)
    theirs = transformers.BertTokenizerFast(str(packaged_vocab_file()), do_lower_case=True)
    for i, (a, b, _) in enumerate(rows):
        enc = theirs(a, b, truncation=True, max_length=24, padding="max_length")
        item = ours[i]
        assert item["tokens"].tolist() == enc["input_ids"], i
        assert item["token_types"].tolist() == enc["token_type_ids"], i
        assert item["attention_mask"].tolist() == enc["attention_mask"], i


def test_files_labels_and_splits(tmp_path):
    texts = _sentences(40)
    names = ["negative", "positive"]
    rows = [{"sentence": t, "label": names[i % 2]} for i, t in enumerate(texts)]
    train = _write(tmp_path / "train.jsonl", rows[:30])
    val = _write(tmp_path / "val.csv", rows[30:])
    dm = LabelledTextDataModule(train, val, labels=names, global_batch_size=4, micro_batch_size=2,
                                max_seq_length=32)
    assert dm.num_classes == 2
    dm.setup("fit")
    assert len(dm.datasets["train"]) == 30 and len(dm.datasets["validation"]) == 10
    state = torch.get_rng_state()  # reading batches leaves dropout's generator alone (test_data_datamodule.py)
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        next(iter(loader))
    assert torch.equal(torch.get_rng_state(), state)
    assert dm.datasets["train"].labels.tolist() == [i % 2 for i in range(30)]
    # A pair task in TSV with class ids, validation and test carved from the training rows (seeded).
    pairs = [{"premise": t, "hypothesis": texts[-1 - i], "label": i % 3} for i, t in enumerate(texts)]
    dm = LabelledTextDataModule(_write(tmp_path / "pairs.tsv", pairs), text_key="premise", text_pair_key="hypothesis",
                                num_classes=3, val_fraction=0.2, test_fraction=0.1, max_seq_length=48,
                                global_batch_size=4, micro_batch_size=4)
    dm.setup("fit")
    sizes = {k: len(v) for k, v in dm.datasets.items()}
    assert sizes == {"train": 28, "validation": 8, "test": 4}
    assert (dm.datasets["train"].token_types.sum(1) > 0).all()  # every row is a pair
    again = LabelledTextDataModule(str(tmp_path / "pairs.tsv"), text_key="premise", text_pair_key="hypothesis",
                                   num_classes=3, val_fraction=0.2, test_fraction=0.1, max_seq_length=48,
                                   global_batch_size=4, micro_batch_size=4)
    again.setup("fit")
    assert torch.equal(again.datasets["validation"].tokens, dm.datasets["validation"].tokens)
    # A DatasetDict (here a mapping of splits, as datasets.load_from_disk returns), MNLI's split names.
    dd = {"train": pairs[:24], "validation_matched": pairs[24:]}
    dm = LabelledTextDataModule(dataset=dd, split_names={"validation": "validation_matched"}, text_key="premise",
                                text_pair_key="hypothesis", num_classes=3, global_batch_size=4, micro_batch_size=2)
    dm.setup("fit")
    assert len(dm.datasets["train"]) == 24 and len(dm.datasets["validation"]) == 16


def test_refusals_name_the_value_and_the_fix(tmp_path, monkeypatch):
    texts = _sentences(8)
    train = _write(tmp_path / "t.jsonl", [{"text": t, "label": "pos"} for t in texts])
    with pytest.raises(ValueError, match=r"t.jsonl' row 1 has no column 'sentence': its columns are \['label', "
                                         r"'text'\]; set --data.text_key"):
        LabelledTextDataModule(train, labels=["neg", "pos"], val_fraction=0.5).setup()
    with pytest.raises(ValueError, match=r"label 'pos' is not one of data.labels=\['no', 'yes'\]"):
        LabelledTextDataModule(train, text_key="text", labels=["no", "yes"], val_fraction=0.5).setup()
    with pytest.raises(ValueError, match=r"label 'pos' is not a class id \(or list the label names in data.labels\)"):
        LabelledTextDataModule(train, text_key="text", num_classes=2, val_fraction=0.5).setup()
    ids = _write(tmp_path / "ids.jsonl", [{"text": t, "label": i} for i, t in enumerate(texts)])
    with pytest.raises(ValueError, match=r"data.train '.*ids.jsonl' row 3: label 2 is outside the classes 0..1 "
                                         r"\(data.num_classes=2\); set data.num_classes"):
        LabelledTextDataModule(ids, text_key="text", num_classes=2, val_fraction=0.5).setup()
    # a score where a class id belongs (an STS-B file without task: regression), or true / false: truncated to a class
    # (3.17 trained as class 3), unsaid; an id written 1.0 is the class 1
    for value, said in ((3.17, "3.17"), (True, "True")):
        rows = [{"text": t, "label": value if i == 2 else i % 2} for i, t in enumerate(texts)]
        bad = _write(tmp_path / "frac.jsonl", rows)
        with pytest.raises(ValueError, match=rf"frac.jsonl' row 3: label {said} is not a class id \(a whole number; "
                                             rf"scores to predict: data.task regression\)"):
            LabelledTextDataModule(bad, text_key="text", num_classes=4, val_fraction=0.5).setup()
    whole = _write(tmp_path / "whole.jsonl", [{"text": t, "label": float(i % 2)} for i, t in enumerate(texts)])
    dm = LabelledTextDataModule(whole, text_key="text", num_classes=2, val_fraction=0.5)
    dm.setup()
    # a regression score that is not finite (JSON NaN, "nan", Infinity): a run died at step 3 blaming the embedding's
    # gradient, and one such validation row made val_mse and val_pearson nan and val_spearman a wrong number
    for value, said in ((float("nan"), "nan"), ("nan", "'nan'"), (float("inf"), "inf")):
        rows = [{"text": t, "label": value if i == 1 else 0.5} for i, t in enumerate(texts)]
        bad = _write(tmp_path / "nan.jsonl", rows)
        with pytest.raises(ValueError, match=rf"nan.jsonl' row 2: label {said} is not a finite number"):
            LabelledTextDataModule(bad, text_key="text", task="regression", val_fraction=0.5).setup()
    # a training file of one class (a wrong label column, a filtered file): fine-tuned without a word, F1 0
    from lightning_megatron.data.labelled_text import labelled_files_problems

    one = _write(tmp_path / "one.jsonl", [{"text": t, "label": "pos"} for t in texts])
    args = {"text_key": "text", "label_key": "label", "labels": ["neg", "pos"], "val_fraction": 0.5}
    assert labelled_files_problems({**args, "train": one}) == [
        f"data.train {one!r} holds one class only, 'pos' (class 1), in its 8 rows: a classifier trained on it "
        f"predicts that class alone; check the file and --data.label_key ('label')"]
    two = _write(tmp_path / "two.jsonl", [{"text": t, "label": ["neg", "pos"][i % 2]} for i, t in enumerate(texts)])
    assert labelled_files_problems({**args, "train": two}) == []
    (tmp_path / "empty.csv").write_text("text,label\n")  # a header, no rows: said so, not "no 'train' split"
    with pytest.raises(ValueError, match=r"data.train '.*empty.csv' is empty: it holds no rows"):
        LabelledTextDataModule(str(tmp_path / "empty.csv"), text_key="text", num_classes=2, val_fraction=0.5).setup()
    with pytest.raises(ValueError, match="needs the classes: data.labels"):
        LabelledTextDataModule(ids)
    with pytest.raises(ValueError, match="no validation split"):
        LabelledTextDataModule(ids, text_key="text", num_classes=8).setup()
    with pytest.raises(ValueError, match=r"task='regression' predicts one value: drop data.labels"):
        LabelledTextDataModule(ids, task="regression", labels=["a", "b"])
    with pytest.raises(ValueError, match=r"data.train='x.parquet': use .jsonl, .json"):
        LabelledTextDataModule("x.parquet", num_classes=2)
    with pytest.raises(FileNotFoundError, match="labelled data file 'missing.csv' does not exist"):
        LabelledTextDataModule("missing.csv", num_classes=2, val_fraction=0.5).setup()
    with pytest.raises(ValueError, match=r"has the splits \['train'\], not 'validation_matched': set "
                                         r"data.split_names.validation"):
        LabelledTextDataModule(dataset={"train": []}, split_names={"validation": "validation_matched"},
                               num_classes=2).setup()
    # A saved datasets folder without the optional `datasets` package: the extra to install.
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'lightning-megatron\[hf\]'"):
        LabelledTextDataModule(dataset=str(tmp_path), num_classes=2).setup()


def _stsb_rows(texts: list[str], offset: int) -> list[dict]:
    """Pairs of real sentences scored 0..5 by their word overlap (an STS-B-shaped regression)."""
    rows = []
    for i, a in enumerate(texts):
        b = texts[(i * 7 + offset) % len(texts)] if i % 2 else a.replace("the ", "a ")
        wa, wb = set(a.lower().split()), set(b.lower().split())
        rows.append({"sentence1": a, "sentence2": b, "label": round(5 * len(wa & wb) / len(wa | wb), 3)})
    return rows


def test_finetune_cli_regression_from_csv_dp2_metrics_equal_one_process(tmp_path):
    from lightning.pytorch import Trainer

    from lightning_megatron.models.bert.classification import BertClassificationModule
    from lightning_megatron.saved_model import read_model_checkpoint

    texts = _sentences(75)
    train = _write(tmp_path / "train.csv", _stsb_rows(texts[:48], 3))
    val_rows = _stsb_rows(texts[48:], 5)  # 27 rows: 3 full global batches of 8 and 3 rows padded to 8
    val = _write(tmp_path / "validation.csv", val_rows)
    run = tmp_path / "run"
    data = ["--data.init_args.train", train, "--data.init_args.validation", val,
            "--data.init_args.global_batch_size", "8", "--data.init_args.micro_batch_size", "4",
            "--data.init_args.max_seq_length", "32"]
    cmd = [sys.executable, "-m", "lightning_megatron.cli", "finetune", "fit", "--config",
           str(ROOT / "recipes" / "bert_tiny_stsb.yaml"), *data, "--trainer.devices", "2",
           "--trainer.strategy.tensor_model_parallel_size", "1", "--trainer.max_steps", "4",
           "--trainer.val_check_interval", "4", "--trainer.log_every_n_steps", "1", "--lr_schedule.lr_warmup_steps", "1",
           "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run)]
    env = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1")
    proc = run_python(cmd[1:], tmp_path, env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # no warning from LightningCLI holding the whole merged recipe in one line (finetune passes its arguments)
    assert "args parameter" not in proc.stderr and "base:" not in proc.stderr, proc.stderr[-3000:]
    [metrics_csv] = run.rglob("metrics.csv")
    with metrics_csv.open() as fh:
        logged = [r for r in csv.DictReader(fh) if r.get("val_pearson")]
    assert len(logged) == 1
    logged = {k: float(v) for k, v in logged[0].items() if k.startswith("val_") and v}
    assert set(logged) == {"val_loss", "val_pearson", "val_spearman", "val_mse"}
    # The checkpoint in one plain process, on the same validation file: the same numbers.
    # (Built from the checkpoint's parts here: load_from_checkpoint of CLI checkpoints is issue 24's.)
    saved = read_model_checkpoint(run / "checkpoints" / "last.ckpt")
    model = BertClassificationModule(**BertClassificationModule.checkpoint_arguments(saved, {}))
    model.configure_model()
    model.load_pretrained(saved, everything=True)
    assert model.hparams.num_classes == 1  # from the data: task regression
    dm = LabelledTextDataModule(train, val, text_key="sentence1", text_pair_key="sentence2", task="regression",
                                global_batch_size=8, micro_batch_size=4, max_seq_length=32)
    [single] = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False).validate(model, datamodule=dm, verbose=False)
    for key, value in logged.items():
        # Pearson of a 4-step model's nearly constant predictions (spread ~1e-3) moves by ~2e-5 with the
        # fp32 rounding of batches of 4 rows per rank vs 8 in one process; the ranks (Spearman) do not.
        assert value == pytest.approx(single[key], rel=1e-5, abs=1e-4 if key == "val_pearson" else 1e-6), key
    assert -1.0 <= logged["val_pearson"] <= 1.0
    # Every one of the 27 rows counts, once: the metrics of the model's predictions on all of them at
    # once, computed here in plain torch (before, the last 3 rows were dropped).
    rows = encode_rows(dm.tokenizer, [(r["sentence1"], r["sentence2"], r["label"]) for r in val_rows], 32,
                       regression=True)
    batch = torch.utils.data.default_collate([rows[i] for i in range(len(rows))])
    model.eval()
    with torch.no_grad():
        preds = model.predict_step(batch, 0).double()
    target = torch.tensor([r["label"] for r in val_rows], dtype=torch.float64)
    assert preds.shape == (27,)
    mse = float(((preds - target) ** 2).mean())
    assert logged["val_mse"] == pytest.approx(mse, rel=1e-5) and logged["val_loss"] == pytest.approx(mse, rel=1e-5)
    pearson = float(torch.corrcoef(torch.stack([preds, target]))[0, 1])
    assert logged["val_pearson"] == pytest.approx(pearson, rel=1e-5, abs=1e-4)



def test_epoch_metrics_values_and_nothing_logged_without_updates():
    """The torchmetrics of a whole split, by hand: binary, 3 classes (macro F1), regression (Pearson,
    Spearman); a stage with no update logs nothing (a subclass whose forward_step does not update)."""
    from lightning_megatron.models.bert.metrics import finetune_metrics, log_epoch_metrics, update_stage
    from lightning_megatron.parallel_state import ParallelState

    class Logger:
        device = torch.device("cpu")

        def __init__(self):
            self.logged = {}

        def log(self, name, value, **kwargs):
            self.logged[name] = float(value)

    ps = ParallelState.single_process()
    three = finetune_metrics(3, ps)["val"]
    out = Logger()
    assert log_epoch_metrics(out, three, "val", ps, True) == {} and out.logged == {}
    with pytest.raises(ValueError, match="pass the per-row loss"):
        update_stage({"val": three}, "val", torch.tensor([0]), torch.tensor([0]))
    update_stage({"val": three}, "val", torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2]),  # F1: 1, 2/3, 2/3
                 torch.tensor([0.5, 1.0, 1.5, 3.0]))
    update_stage({"val": three}, "val", torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long),
                 torch.tensor([]))  # a microbatch of padding only changes nothing
    log_epoch_metrics(out, three, "val", ps, True)
    assert out.logged == pytest.approx({"val_accuracy": 0.75, "val_f1": 7 / 9, "val_matthews_corrcoef": 0.7,
                                        "val_loss": 1.5})
    binary = finetune_metrics(2, ps)["test"]
    update_stage({"test": binary}, "test", torch.tensor([1, 1, 0, 0]), torch.tensor([1, 0, 0, 0]),  # F1 2/3
                 torch.zeros(4))
    log_epoch_metrics(out, binary, "test", ps, True)
    assert out.logged["test_f1"] == pytest.approx(2 / 3) and out.logged["test_matthews_corrcoef"] == pytest.approx(
        (1 * 2 - 1 * 0) / (2 * 1 * 3 * 2) ** 0.5)
    # Matthews' correlation as scikit-learn (GLUE's scorer) computes it, where it is undefined too (one class among
    # the targets or the predictions: 0; torchmetrics said -1 for all wrong and 1 for all right)
    from sklearn.metrics import matthews_corrcoef

    for classes, preds, target in ((2, [0, 0, 0], [1, 1, 1]), (2, [1, 1, 1], [1, 1, 1]), (2, [1, 0, 1], [1, 1, 1]),
                                   (2, [0, 1, 1, 0], [1, 0, 1, 0]), (3, [2, 2, 2], [0, 0, 0]),
                                   (3, [0, 1, 2, 2, 1], [0, 2, 2, 1, 1])):
        metrics = finetune_metrics(classes, ps)["val"]
        update_stage({"val": metrics}, "val", torch.tensor(preds), torch.tensor(target), torch.zeros(len(preds)))
        log_epoch_metrics(out, metrics, "val", ps, True)
        with warnings.catch_warnings():  # scikit-learn's "A single label was found": the cases asked for
            warnings.simplefilter("ignore", UserWarning)
            want = matthews_corrcoef(target, preds)
        assert out.logged["val_matthews_corrcoef"] == pytest.approx(want, abs=1e-7), (preds, target)
    regression = finetune_metrics(1, ps)["val"]
    x = torch.tensor([0.1, 0.4, 0.2, 0.9], dtype=torch.float64)
    y = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    update_stage({"val": regression}, "val", x, y, (x - y) ** 2)
    log_epoch_metrics(out, regression, "val", ps, True)
    assert out.logged["val_pearson"] == pytest.approx(float(torch.corrcoef(torch.stack([x, y]))[0, 1]))
    assert out.logged["val_spearman"] == pytest.approx(0.8)  # ranks 1 3 2 4 vs 1 2 3 4
    assert out.logged["val_mse"] == pytest.approx(float(((x - y) ** 2).mean()))
    assert out.logged["val_loss"] == pytest.approx(out.logged["val_mse"])


def test_a_resumed_fine_tune_reads_on_where_it_stopped(tmp_path):
    """A fine-tune's training batches through Lightning: a run stopped after 2 steps and resumed from its checkpoint
    reads the batches the uninterrupted run read next, across epochs (each epoch another shuffle). With torch's
    DistributedSampler and no state it started its epoch again (step 3 read step 1's rows), and a checkpoint written
    at the end of an epoch went on with the next epoch's shuffle."""
    import warnings

    import lightning.pytorch as pl
    from dist_utils import accelerator

    texts = _sentences(30)
    train = _write(tmp_path / "train.jsonl", [{"sentence": t, "label": i % 2} for i, t in enumerate(texts)])

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[list[int]] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch["tokens"][:, 1:4].tolist())  # the rows' first word pieces
            return (self.weight * batch["tokens"].float().sum()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(max_steps, root, ckpt_path=None):
        model = Recorder()
        dm = LabelledTextDataModule(train, train, num_classes=2, global_batch_size=8, micro_batch_size=8,
                                    max_seq_length=16)
        trainer = pl.Trainer(max_steps=max_steps, accelerator=accelerator(), devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=root, num_sanity_val_steps=0, limit_val_batches=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return trainer, model

    _, full = fit(8, tmp_path / "full")  # 3 steps an epoch (30 rows, 8 a step)
    assert len(full.seen) == 8 and full.seen[:3] != full.seen[3:6]
    for stop in (2, 3):  # mid-epoch, and at an epoch's end
        trainer, first = fit(stop, tmp_path / f"first{stop}")
        trainer.save_checkpoint(tmp_path / f"step{stop}.ckpt")
        _, second = fit(8, tmp_path / f"second{stop}", ckpt_path=tmp_path / f"step{stop}.ckpt")
        assert first.seen + second.seen == full.seen, (stop, first.seen, second.seen, full.seen)
