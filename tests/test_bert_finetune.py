"""Fine-tuning (BertClassificationModule): TP=2 under the MegatronStrategy equals plain single-process Lightning
per step, and so do the validation metrics (torchmetrics, synchronised over the data-parallel group).
``finetune predict``'s input: checked before launch, texts only (its CLI runs: tests/test_docs_finetune.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

MODEL = dict(config=dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=200,
                         max_sequence_length=16, hidden_dropout=0.0, attention_dropout=0.0,
                         spec="bert_layer_post_norm_spec"),
             classifier_dropout=0.0, num_classes=3, lr=1e-3)
STEPS = 4


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(5, 200, (8, 16), generator=g)
        mask = torch.ones(8, 16, dtype=torch.long)
        mask[::3, 12:] = 0
        out.append({"tokens": tokens * mask, "attention_mask": mask, "labels": tokens[:, 1] % 3})
    return out


def _fit(strategy, devices: int) -> tuple[list[float], dict[str, float]]:
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_megatron.models.bert.classification import BertClassificationModule

    class Recorder(Callback):
        losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    rec = Recorder()
    rec.losses = []
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[rec])
    module = BertClassificationModule(**MODEL)
    trainer.fit(module, train_dataloaders=DataLoader(_batches(), batch_size=None))
    [metrics] = trainer.validate(module, dataloaders=DataLoader(_batches(), batch_size=None), verbose=False)
    return rec.losses, {k: float(v) for k, v in metrics.items()}


def _tp2_worker() -> tuple[list[float], dict[str, float]]:
    from lightning_megatron.strategy import MegatronStrategy

    return _fit(MegatronStrategy(tensor_model_parallel_size=2, micro_batch_size=4), 2)


def test_finetune_tp2_equals_single_process_per_step():
    tp2 = run_distributed(_tp2_worker, 2, timeout=240)
    plain, plain_metrics = _fit("auto", 1)  # plain Lightning, no MegatronStrategy: the module's own training_step
    assert len(plain) == STEPS and tp2[0] == tp2[1]
    torch.testing.assert_close(torch.tensor(tp2[0][0]), torch.tensor(plain), rtol=1e-5, atol=0)
    assert set(plain_metrics) == {"val_loss", "val_accuracy", "val_f1", "val_matthews_corrcoef"}
    for key, value in plain_metrics.items():
        assert tp2[0][1][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


SST2 = str(Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny_sst2.yaml")


@pytest.mark.parametrize("case", ["predict_file_missing", "predict_file_column", "no_rows_to_predict",
                                  "test_file_missing", "held_out_without_training_file"])
def test_finetune_predict_input_refused_before_launch(case, tmp_path, monkeypatch):
    """`finetune predict` checks what it will read, and only that, before any process starts (the training
    file of the recipe, data/sst2/train.jsonl, is absent here), naming the option to set."""
    from lightning_megatron.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])
    (tmp_path / "texts.csv").write_text("sentence\nfine\n")
    args, wanted = {
        "predict_file_missing": (["--data.predict_file", "nope.txt"],
                                 "data.predict_file 'nope.txt' does not exist (relative paths start at"),
        "predict_file_column": (["--data.predict_file", "texts.csv", "--data.text_key", "review"],
                                "data.predict_file 'texts.csv' row 1 has no column 'review': its columns are "
                                "['sentence']; set --data.text_key"),
        "no_rows_to_predict": (["--data.validation", "null"],
                               "predict has no rows to read: give --data.predict_file FILE"),
        "test_file_missing": (["--data.test", "test.jsonl"], "data.test 'test.jsonl' does not exist"),
        "held_out_without_training_file": (["--data.validation", "null", "--data.val_fraction", "0.1"],
                                           "data.train 'data/sst2/train.jsonl' does not exist"),
    }[case]
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        main(["finetune", "predict", "--config", SST2, *args, "--trainer.default_root_dir", str(run)])
    message = str(exited.value.code)
    assert "found before launching any process" in message and wanted in message, message
    # only the input of predict is read (the recipe's files are absent), and no --ckpt_path is given (refused too)
    assert message.count("\n  - ") == 2, message
    assert "predict without --ckpt_path or --model.init_from would evaluate the model's random" in message, message
    assert not dist.is_initialized() and not run.exists()


def test_rows_to_predict_read_texts_only(tmp_path):
    """The test split's texts without its labels (GLUE's unlabelled -1, or no label column), never the
    training file; a predict_file of texts (.txt one per line, .csv/.jsonl by the text columns); pairs."""
    from lightning_megatron.datamodules.finetune import LabelledTextDataModule

    test = tmp_path / "test.jsonl"
    test.write_text('{"premise": "a dog runs", "hypothesis": "an animal moves", "label": -1}\n'
                    '{"premise": "it rains", "hypothesis": "the sun shines"}\n')
    pairs = dict(text_key="premise", text_pair_key="hypothesis", labels=["entailment", "neutral", "contradiction"],
                 max_seq_length=16)
    dm = LabelledTextDataModule(str(tmp_path / "absent.jsonl"), test=str(test), **pairs)
    dm.setup("predict")
    assert dm.predict_rows == [("a dog runs", "an animal moves", None), ("it rains", "the sun shines", None)]
    sample = dm.predict_dataset[0]
    assert "labels" not in sample and sample["token_types"].sum() > 0  # the pair: token types 1 after [SEP]
    assert dm.label_names == ["entailment", "neutral", "contradiction"]
    texts = tmp_path / "texts.txt"
    texts.write_text("first text\n\nsecond text\n")
    single = LabelledTextDataModule(predict_file=str(texts), num_classes=2, max_seq_length=16)
    assert single.read_predict_rows() == [("first text", None, None), ("second text", None, None)]
    with pytest.raises(ValueError, match="a .txt file holds one text per line, and this data has text pairs"):
        LabelledTextDataModule(predict_file=str(texts), **pairs).read_predict_rows()
    with pytest.raises(ValueError, match="no training split: give data.train"):
        single.read_splits()


def test_regression_pairs_predicted_in_one_process_by_the_writer(tmp_path):
    """Plain Lightning (no MegatronStrategy): the PredictionWriter writes a regression model's value per row,
    with both texts, in order; the values are predict_step's."""
    from lightning.pytorch import Trainer
    from torch.utils.data import default_collate

    from lightning_megatron.callbacks import PredictionWriter
    from lightning_megatron.datamodules.finetune import LabelledTextDataModule
    from lightning_megatron.models.bert.classification import BertClassificationModule

    rows = [{"s1": f"the cat sat on mat {i}", "s2": f"a dog ran {i}"} for i in range(11)]
    texts = tmp_path / "pairs.jsonl"
    texts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = LabelledTextDataModule(predict_file=str(texts), text_key="s1", text_pair_key="s2", task="regression",
                                max_seq_length=16, global_batch_size=4, micro_batch_size=4)
    model = BertClassificationModule(**{**MODEL, "num_classes": 1, "config": {**MODEL["config"], "vocab_size": None}})
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[PredictionWriter(str(tmp_path / "out"))])
    trainer.predict(model, datamodule=dm, return_predictions=False)  # 11 rows: 3 batches of 4, the last padded
    written = [json.loads(line) for line in (tmp_path / "out" / "predictions.jsonl").open()]
    assert [(w["index"], w["text"], w["text_pair"]) for w in written] == [
        (i, r["s1"], r["s2"]) for i, r in enumerate(rows)]
    assert all(set(w) == {"index", "text", "text_pair", "value"} for w in written)
    batch = default_collate([dm.predict_dataset[i] for i in range(len(rows))])
    with torch.no_grad():
        values = model.predict_step(batch, 0)
    torch.testing.assert_close(torch.tensor([w["value"] for w in written]), values, rtol=0, atol=1e-6)


def _labels_worker(root: str) -> dict[str, str]:
    from lightning_megatron.datamodules.finetune import LabelledTextDataModule
    from lightning_megatron.models.bert.classification import BertClassificationModule
    from lightning_megatron.strategy import MegatronStrategy
    from megatron_testing import error_of, make_trainer

    rows = [{"sentence": f"text number {i} is {'good' if i % 2 else 'bad'}", "label": "pos" if i % 2 else "neg"}
            for i in range(16)]
    (Path(root) / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(labels: list[str], max_steps: int, **more):
        trainer = make_trainer(MegatronStrategy(micro_batch_size=4), 1, max_steps, limit_val_batches=1)
        data = LabelledTextDataModule(f"{root}/rows.jsonl", f"{root}/rows.jsonl", labels=labels, max_seq_length=16,
                                      global_batch_size=4, micro_batch_size=4)
        model = BertClassificationModule(**{**MODEL, "num_classes": 2,
                                            "config": {**MODEL["config"], "vocab_size": None,
                                                       "max_sequence_length": 32}}, **more)
        return trainer, data, model

    def head_warnings(call) -> list[str]:
        import warnings

        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            call()
        return [str(w.message) for w in said if "fine-tuned head" in str(w.message)]

    trainer, data, model = run(["neg", "pos"], 1)
    trainer.fit(model, datamodule=data)
    trainer.save_checkpoint(f"{root}/cls.ckpt")
    out = {}
    for name, labels in (("same", ["neg", "pos"]), ("swapped", ["pos", "neg"])):
        trainer, data, model = run(labels, 0)
        out[name] = error_of(lambda: trainer.validate(model, datamodule=data, ckpt_path=f"{root}/cls.ckpt",
                                                      verbose=False))
    # a fine-tune from the classifier starts a head of its own, said once it starts; evaluating that run's checkpoint
    # (its init_from loaded again, then replaced) says nothing
    trainer, data, model = run(["neg", "pos"], 1, init_from=f"{root}/cls.ckpt")
    out["from_classifier"] = head_warnings(lambda: trainer.fit(model, datamodule=data))
    trainer.save_checkpoint(f"{root}/second.ckpt")
    trainer, data, model = run(["neg", "pos"], 0, init_from=f"{root}/cls.ckpt")
    out["second_validated"] = head_warnings(lambda: trainer.validate(model, datamodule=data,
                                                                     ckpt_path=f"{root}/second.ckpt", verbose=False))
    return out


def test_a_classifier_evaluated_with_its_labels_in_another_order_is_refused_at_set_up(tmp_path):
    """The Python path of the class-name record (the CLI's refusal before launch: tests/test_docs_finetune.py):
    ``Trainer.validate`` of a classifier's checkpoint with ``labels`` in another order named every class by the
    other one (accuracy 1 - accuracy)."""
    [out] = run_distributed(_labels_worker, 1, str(tmp_path), timeout=300)
    assert out["same"] == "no error", out
    assert len(out["from_classifier"]) == 1 and "pass --ckpt_path" in out["from_classifier"][0], out
    assert out["second_validated"] == [], out
    assert out["swapped"].startswith("CheckpointError: checkpoint ") and (
        "was trained with the classes ['neg', 'pos'] (in class-id order); this run's data names ['pos', 'neg']"
        in out["swapped"]), out
    # export hf writes transformers' sequence classifier (until 2026-12-07 the encoder only, with a warning): its
    # logits on token pairs with padding are the checkpoint's in one plain process, its labels the run's class names
    import warnings

    import transformers

    from lightning_megatron.export import export_hf
    from lightning_megatron.models.bert.classification import BertClassificationModule
    from lightning_megatron.saved_model import read_model_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_hf(tmp_path / "cls.ckpt", tmp_path / "hf")
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "BertForSequenceClassification"
    assert theirs.config.id2label == {0: "neg", 1: "pos"}
    assert theirs.config.problem_type == "single_label_classification"
    # its tokenizer truncates where the run's data did (max_seq_length 16), so a pipeline's longer texts are cut as
    # `finetune predict` cuts them (it was the model's positions, 32 here: 2.2e-3 apart on texts past the run's length)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").model_max_length == 16
    saved = read_model_checkpoint(tmp_path / "cls.ckpt")
    ours = BertClassificationModule(**BertClassificationModule.checkpoint_arguments(saved, {}))
    ours.configure_model()
    ours.load_pretrained(saved, everything=True)
    ours.eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(5, saved.state_dict["embedding.word_embeddings.weight"].size(0), (4, 16), generator=g)
    mask = torch.ones_like(tokens)
    mask[1, 9:] = 0
    types = torch.zeros_like(tokens)
    types[:, 6:] = 1
    batch = {"tokens": tokens * mask, "attention_mask": mask, "token_types": types * mask}
    with torch.no_grad():
        got = ours.predict_step(batch, 0)
        logits = theirs(input_ids=batch["tokens"], attention_mask=mask, token_type_ids=batch["token_types"]).logits
    assert logits.abs().max() > 1e-2  # a classifier that computes something
    torch.testing.assert_close(logits.softmax(-1), got, rtol=0, atol=1e-6)
    # init_from a fine-tuned classifier of ours starts a head of its own (the documented rule): it was unsaid (a
    # Hugging Face classifier's folder said it)
    fresh = BertClassificationModule(**BertClassificationModule.checkpoint_arguments(saved, {}))
    fresh.configure_model()
    with pytest.warns(UserWarning, match=r"init_from='.*cls\.ckpt' holds a fine-tuned head \(classifier\.bias, "
                                         r"classifier\.weight\), which init_from does not read: this run starts its "
                                         r"own head .*pass --ckpt_path"):
        fresh.load_pretrained(str(tmp_path / "cls.ckpt"))


def test_the_docstring_task_records_its_packages_as_the_class_names():
    """The built-in task (``recipes/bert_tiny_finetune.yaml``) named no classes: its checkpoint recorded none, so
    ``finetune validate`` with two packages swapped ran (val_accuracy 0.16 -> 0.07, each class id another package),
    ``export hf`` wrote ``LABEL_0``.. and ``predict`` ids. Its packages are its class names, in class-id order."""
    from lightning_megatron.checkpoint_data import LABEL_NAMES, data_problems, record_data
    from lightning_megatron.models.bert.docstring_task import StdlibDocstringDataModule

    trained = StdlibDocstringDataModule(packages=["asyncio", "email", "json"])
    assert trained.label_names == ["asyncio", "email", "json"]
    checkpoint: dict = {}
    record_data(checkpoint, trained)
    assert checkpoint[LABEL_NAMES] == ["asyncio", "email", "json"]
    swapped = StdlibDocstringDataModule(packages=["email", "asyncio", "json"])
    [problem] = data_problems(checkpoint, swapped, "run/last.ckpt")
    assert ("was trained with the classes ['asyncio', 'email', 'json'] (in class-id order); this run's data names "
            "['email', 'asyncio', 'json']") in problem, problem
    assert "--data.packages '[asyncio, email, json]'" in problem, problem  # the task's own argument
    assert data_problems(checkpoint, StdlibDocstringDataModule(packages=["asyncio", "email", "json"]), "x") == []
