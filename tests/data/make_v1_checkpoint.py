"""Writes tests/data/ckpt_v1_tp2: a format_version 1 checkpoint made by the release before format 2
(commit 2a5eeb1, ShardedTensor writes), TP=2, 3 steps of AdamW, and the validation loss it gives.

Run from a checkout of that release:  PYTHONPATH=. python tests/data/make_v1_checkpoint.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_utils import run_distributed  # noqa: E402

MODEL = dict(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=1000,
             max_sequence_length=16, hidden_dropout=0.0, attention_dropout=0.0, lr=1e-3, weight_decay=0.01,
             make_vocab_size_divisible_by=8)


def _worker(out: str) -> float:
    import torch

    from megatron_testing import make_trainer, synthetic_datamodule
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    strategy = MegatronStrategy(tensor_model_parallel_size=2)
    trainer = make_trainer(strategy, 2, 3, limit_val_batches=2)
    dm = synthetic_datamodule(8, 2, 1, 0)
    module = BertLightningModule(**MODEL)
    trainer.fit(module, datamodule=dm)
    trainer.save_checkpoint(out)
    [metrics] = trainer.validate(module, datamodule=dm, verbose=False)
    return float(metrics["val_loss"])


if __name__ == "__main__":
    out = Path(sys.argv[1])
    val = run_distributed(_worker, 2, str(out), timeout=600)[0]
    (out.parent / (out.name + ".json")).write_text(json.dumps({"val_loss": val, "model": MODEL}, indent=1))
    print(val)
