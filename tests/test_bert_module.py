"""BertLightningModule details, and a plain LightningModule under the MegatronStrategy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dist_utils import accelerator, run_distributed
from megatron_testing import SEQ, TINY_MODEL, SyntheticBertDataset


def _loss_and_grads(masked_only: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict]:
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.tensor_parallel import model_parallel_seed

    model_parallel_seed(1234, 0)
    module = BertLightningModule(**{**TINY_MODEL, "lm_head_on_masked_only": masked_only})
    module.configure_model()
    ds = SyntheticBertDataset(4)
    batch = {k: torch.stack([ds[i][k] for i in range(4)]).to(torch.get_default_device()) for k in ds[0]}
    loss, loss_func = module.forward_step(batch, module.model_chunks[0])
    loss.backward()
    _, stats = loss_func(loss)
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}, stats


def test_lm_head_on_masked_tokens_only_gives_the_same_loss_and_grads():
    full_loss, full_grads, full_stats = _loss_and_grads(False)
    sel_loss, sel_grads, sel_stats = _loss_and_grads(True)
    torch.testing.assert_close(sel_loss, full_loss, rtol=1e-6, atol=1e-6)
    for name in full_grads:
        torch.testing.assert_close(sel_grads[name], full_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert sel_stats["mlm_accuracy"] == full_stats["mlm_accuracy"]
    assert sel_stats["num_masked_tokens"] == full_stats["num_masked_tokens"] == 12


def _plain_module_worker() -> list[float]:
    """The docs' example: a LightningModule with only training_step, TP=2 layers, no forward_step."""
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_megatron.strategy import MegatronStrategy
    from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    class TPRegressor(LightningModule):
        def configure_model(self):
            tp_group = self.trainer.strategy.parallel_state.tp_group
            torch.manual_seed(0)
            self.fc1 = ColumnParallelLinear(32, 128, tp_group=tp_group)
            self.fc2 = RowParallelLinear(128, 1, tp_group=tp_group, input_is_parallel=True)

        def training_step(self, batch, batch_idx):
            x, y = batch
            h, _ = self.fc1(x)
            out, _ = self.fc2(F.gelu(h))
            loss = F.mse_loss(out.squeeze(-1), y)
            self.log("loss", loss)  # as any Lightning user does: the strategy must not log it too
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Losses(Callback):
        losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))
            self.logged = float(trainer.callback_metrics["loss"])  # the module's own self.log("loss")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g, device="cpu")
    data = TensorDataset(x, x[:, :4].sum(-1))
    rec = Losses()
    trainer = Trainer(accelerator=accelerator(), devices=2, max_steps=30, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[rec],
                      strategy=MegatronStrategy(tensor_model_parallel_size=2, micro_batch_size=4))
    trainer.fit(TPRegressor(), DataLoader(data, batch_size=16))
    return rec.losses + [rec.logged]


def test_plain_lightning_module_trains_with_tensor_parallel_layers():
    r0, r1 = run_distributed(_plain_module_worker, 2, timeout=180)
    (r0, logged0), (r1, _) = (r0[:-1], r0[-1]), (r1[:-1], r1[-1])
    assert r0 == r1, "every rank logs the same loss"
    # The module's self.log("loss", ...) is its own (the last microbatch's loss here), not the strategy's
    assert logged0 > 0 and abs(logged0 - r0[-1]) < 0.5 * r0[0], (logged0, r0)
    assert len(r0) == 30
    assert sum(r0[-5:]) / 5 < 0.5 * sum(r0[:5]) / 5, f"the regressor must learn: {r0}"


def test_training_flops_is_megatrons_count():
    """BertLightningModule declares CountsFlops: Megatron's count with the LM head on the masked tokens."""
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.protocols import CountsFlops

    module = BertLightningModule(**TINY_MODEL)
    module.configure_model()
    ds = SyntheticBertDataset(4)
    batch = {k: torch.stack([ds[i][k] for i in range(4)]) for k in ds[0]}
    assert isinstance(module, CountsFlops) and not isinstance(torch.nn.Linear(2, 2), CountsFlops)
    cfg, V = module.config, module.vocab_size
    L, h, f = cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size
    b, s = batch["tokens"].shape
    dp = 2
    T, masked = b * s * dp, int((batch["loss_mask"] > 0).sum()) * dp
    expected = 6 * T * L * (4 * h * h + 2 * h * f) + 12 * T * L * s * h + 6 * masked * (h * V + h * h)
    assert float(module.training_flops(batch, dp)) == expected


def test_a_sequence_longer_than_the_positions_is_refused_by_its_length():
    """From Python (``from_pretrained`` of a folder, then the model on a long text) a sequence beyond the learned
    positions ended in torch's ``IndexError: index out of range in self``; the decoders said it, BERT now too."""
    import pytest

    from lightning_megatron.models.bert.module import BertLightningModule

    module = BertLightningModule(**TINY_MODEL)
    module.configure_model()
    chunk = module.model_chunks[0]
    positions = chunk.max_sequence_length
    tokens = torch.full((1, positions + 1), 5, dtype=torch.long, device=torch.get_default_device())
    with pytest.raises(ValueError, match=rf"a sequence of {positions + 1} tokens exceeds max_sequence_length="
                                         rf"{positions} \(the learned positions\)"):
        chunk(tokens, torch.ones_like(tokens))
    chunk(tokens[:, :positions], torch.ones_like(tokens[:, :positions]))  # as many as it has: fine


def test_a_python_fit_refuses_sentence_pairs_the_model_does_not_match(tmp_path):
    """The CLI refused data and model that disagree on sentence pairs before launch; from Python,
    ``BertDataModule(binary_head=None)`` with the model's head on trained the pooler and head on a constant label 0,
    and pairs with no head swapped half the samples' sentences for nothing. A fit refuses both before a step."""
    import pytest
    from lightning.pytorch import Trainer
    from test_custom_module import hermetic

    from lightning_megatron.datamodules.pretraining import BertDataModule
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    cases = ((None, True, r"data binary_head=None builds samples without sentence pairs .* add_binary_head=True .*"
                          r"set BertConfig\(add_binary_head=False, num_tokentypes=0\)"),
             ("sop", False, r"data binary_head='sop' builds sentence pairs .* the model has none"))
    for pairs, head, message in cases:
        config = {**TINY_MODEL["config"], "vocab_size": None, "add_binary_head": head,
                  "num_tokentypes": 2 if head else 0}
        model = BertLightningModule(**{**TINY_MODEL, "config": config})
        data = BertDataModule(binary_head=pairs, max_seq_length=SEQ, global_batch_size=2, micro_batch_size=2,
                              num_workers=0)
        with hermetic(), pytest.raises(ValueError, match=message):
            Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(), max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, use_distributed_sampler=False,
                    default_root_dir=tmp_path).fit(model, datamodule=data)
