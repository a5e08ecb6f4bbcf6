"""Fine-tuning (BertClassificationModule): TP=2 under the MegatronStrategy equals plain single-process Lightning
per step, and so do the validation metrics (torchmetrics, synchronised over the data-parallel group)."""

from __future__ import annotations

import pytest
import torch

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
