"""Resuming with another schedule horizon follows Megatron's rule and never does so silently."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron.callbacks import OptimizerParamSchedulerCallback

MAX_LR, MIN_LR, WARMUP = 1e-2, 1e-4, 1


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=MAX_LR)

    def train_dataloader(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class _Lrs(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def _fit(max_steps: int, ckpt_in=None, save_to=None, **sched) -> list[float]:
    lrs = _Lrs()
    sched.setdefault("lr_decay_steps", None)
    callback = OptimizerParamSchedulerCallback(init_lr=0.0, max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP,
                                               lr_decay_style="linear", **sched)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[callback, lrs], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_Module(), ckpt_path=ckpt_in)
    if save_to:
        trainer.save_checkpoint(save_to)
    return lrs.lrs


def _linear(step: int, decay: int) -> float:
    return MIN_LR + (MAX_LR - MIN_LR) * (1 - (step - WARMUP) / (decay - WARMUP))


def test_resume_with_larger_max_steps_warns_and_follows_the_flags(tmp_path, recwarn):
    ckpt = str(tmp_path / "four.ckpt")
    _fit(4, save_to=ckpt)
    assert not [w for w in recwarn if "schedule differs" in str(w.message)]

    # Default (use the checkpoint's schedule): the old horizon of 4 steps continues, with a warning.
    with pytest.warns(UserWarning) as record:
        kept = _fit(8, ckpt_in=ckpt)
    msg = " ".join(str(w.message) for w in record if "schedule differs" in str(w.message))
    assert "lr_decay_steps: configured 8, checkpoint 4" in msg, msg
    # the weight decay is constant (the callback's default): its horizon changes no value and is not named
    assert "wd_incr_steps" not in msg, msg
    assert "using the checkpoint's values" in msg and "override_opt_param_scheduler=True" in msg, msg
    assert "lr_decay_steps=null resolved to trainer.max_steps=8" in msg, msg
    assert kept == pytest.approx([MIN_LR] * 4)  # past the old horizon: min_lr

    # Override: the configured horizon (8) from step 4 on, again with a warning naming the values.
    with pytest.warns(UserWarning) as record:
        extended = _fit(8, ckpt_in=ckpt, override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
    msg = " ".join(str(w.message) for w in record if "schedule differs" in str(w.message))
    assert "lr_decay_steps: configured 8, checkpoint 4" in msg and "using the configured values" in msg, msg
    assert extended == pytest.approx([_linear(s, 8) for s in range(4, 8)])

    # Neither flag (Megatron's default): a difference is an error naming every differing field (a CheckpointError:
    # one line from the CLI, not a traceback per rank).
    from lightning_megatron.checkpoint_verify import CheckpointError

    with pytest.raises(CheckpointError) as info:
        _fit(8, ckpt_in=ckpt, use_checkpoint_opt_param_scheduler=False)
    assert "lr_decay_steps: configured 8, checkpoint 4" in str(info.value), info.value
    assert "wd_incr_steps" not in str(info.value), info.value
    # a run extended with its lr horizon named: a constant weight decay's horizon (null: max_steps) is no difference,
    # so neither a warning nor, with neither flag, an error (it refused the resume)
    _fit(4, save_to=str(tmp_path / "named.ckpt"), lr_decay_steps=8)
    assert _fit(8, ckpt_in=str(tmp_path / "named.ckpt"), lr_decay_steps=8, use_checkpoint_opt_param_scheduler=False
                ) == pytest.approx([_linear(s, 8) for s in range(4, 8)])
    # a weight decay that grows over its horizon: another horizon is a difference, named
    _fit(4, save_to=str(tmp_path / "wd.ckpt"), lr_decay_steps=8, start_wd=0.0, end_wd=0.1, wd_incr_style="linear")
    with pytest.raises(CheckpointError, match="wd_incr_steps: configured 8, checkpoint 4"):
        _fit(8, ckpt_in=str(tmp_path / "wd.ckpt"), lr_decay_steps=8, start_wd=0.0, end_wd=0.1, wd_incr_style="linear",
             use_checkpoint_opt_param_scheduler=False)


def test_resume_with_the_same_schedule_is_silent(tmp_path, recwarn):
    ckpt = str(tmp_path / "four.ckpt")
    first = _fit(4, save_to=ckpt, lr_decay_steps=8, wd_incr_steps=8)
    resumed = _fit(8, ckpt_in=ckpt, lr_decay_steps=8, wd_incr_steps=8)
    assert not [w for w in recwarn if "schedule differs" in str(w.message)]
    assert first + resumed == pytest.approx([0.0] + [_linear(s, 8) for s in range(1, 8)])


def test_resume_from_a_checkpoint_without_this_schedule_is_refused_or_starts_at_its_step(tmp_path):
    """A run trained without this schedule (a torch LR scheduler, or a constant lr) and resumed with it warmed up
    again from step 0 at the checkpoint's step, its decay horizon shifted past the run's end, without a word.
    Refused, naming the ways on; with ``override_opt_param_scheduler=True`` (and
    ``use_checkpoint_opt_param_scheduler=False``, Megatron's pair) the schedule starts at the checkpoint's
    step, as if it had run from the first step."""
    ckpt = str(tmp_path / "constant.ckpt")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_Module())
    trainer.save_checkpoint(ckpt)
    from lightning_megatron.checkpoint_verify import CheckpointError

    with pytest.raises(CheckpointError) as info:
        _fit(8, ckpt_in=ckpt, lr_decay_steps=8)
    message = str(info.value)
    assert "resumes at step 4 from a checkpoint that holds no state of this schedule" in message, message
    assert "--lr_schedule.override_opt_param_scheduler true" in message and "--lr_scheduler" in message, message
    with pytest.warns(UserWarning, match="starts at step 4"):
        resumed = _fit(8, ckpt_in=ckpt, lr_decay_steps=8, override_opt_param_scheduler=True,
                       use_checkpoint_opt_param_scheduler=False)
    assert resumed == pytest.approx([_linear(s, 8) for s in range(4, 8)])
