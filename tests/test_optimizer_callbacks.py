"""The optimizer callbacks in a real single-process Trainer.fit: wrapping, logging, resume, torch schedulers."""

from __future__ import annotations

import copy
import math

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron.callbacks import MegatronOptimizerCallback, OptimizerParamSchedulerCallback
from lightning_megatron.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer, OptimizerConfig, get_param_groups
from dist_utils import accelerator


class TinyModule(pl.LightningModule):
    """8 -> 16 -> 1 MLP on a fixed regression set of 4 batches of 8 (an epoch is 4 steps)."""

    def __init__(self, make_optimizer=None, make_scheduler=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.LayerNorm(16),
                                       torch.nn.Linear(16, 1))
        self.make_optimizer = make_optimizer
        self.make_scheduler = make_scheduler

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        if self.make_optimizer is None:
            opt = torch.optim.AdamW(get_param_groups(self, lr=1e-3, weight_decay=0.01), lr=1e-3)
        else:
            opt = self.make_optimizer(self.parameters())
        if self.make_scheduler is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.make_scheduler(opt), "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(32, 8, generator=g, device="cpu")  # on the host, as a DataLoader's (any test device)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8, shuffle=False)


class ScaledBackwardModule(TinyModule):
    """fp16 on plain Lightning: the module multiplies the loss by the scale before backward."""

    def backward(self, loss, *args, **kwargs):
        self.trainer.strategy.optimizers[0].scale_loss(loss).backward()


class LrRecorder(pl.Callback):
    def __init__(self):
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def _trainer(max_steps: int, callbacks: list, precision: str = "32-true", **kw) -> pl.Trainer:
    return pl.Trainer(accelerator=accelerator(), devices=1, max_steps=max_steps, callbacks=callbacks, precision=precision,
                      max_epochs=kw.pop("max_epochs", None),
                      enable_progress_bar=False, logger=False, enable_checkpointing=False,
                      enable_model_summary=False, **kw)


def _sched_cb(**kw) -> OptimizerParamSchedulerCallback:
    args = dict(init_lr=1e-4, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2, lr_decay_steps=10,
                lr_decay_style="cosine", start_wd=0.0, end_wd=0.1, wd_incr_steps=10, wd_incr_style="linear")
    args.update(kw)
    return OptimizerParamSchedulerCallback(**args)


def test_bf16_fit_wraps_logs_and_schedules():
    opt_cb, sched_cb = MegatronOptimizerCallback(OptimizerConfig(clip_grad=0.5, log_num_zeros_in_grad=True)), _sched_cb()
    module = TinyModule()
    trainer = _trainer(6, [opt_cb, sched_cb], precision="bf16-true")
    trainer.fit(module)
    opt = trainer.optimizers[0]
    assert isinstance(opt, Float16OptimizerWithFloat16Params) and opt.num_skipped_steps == 0
    assert module.net[0].weight.dtype == torch.bfloat16
    main = opt.fp32_from_float16_groups[0][0]
    assert main.dtype == torch.float32 and torch.equal(main.bfloat16().cpu(), module.net[0].weight.data.cpu())
    m = trainer.callback_metrics
    assert {"lr", "wd", "grad_norm", "loss_scale", "skipped_steps", "num_zeros"} <= set(m)
    assert float(m["loss_scale"]) == 1.0 and float(m["skipped_steps"]) == 0.0 and float(m["grad_norm"]) > 0
    # Six optimizer steps -> the schedule at n = 6: cosine between warm-up 2 and decay 10.
    assert sched_cb.scheduler.num_steps == 6
    def cosine(n):
        return 1e-3 + 0.5 * (1 + math.cos(math.pi * (n - 2) / 8)) * (1e-2 - 1e-3)

    lr6 = cosine(6)
    decayed, undecayed = opt.param_groups
    assert decayed["lr"] == pytest.approx(lr6)
    # The logged lr is the one the 6th step used (the schedule at n = 5), as LearningRateMonitor logs it.
    assert float(m["lr"]) == pytest.approx(cosine(5))
    assert decayed["weight_decay"] == pytest.approx(0.06) and undecayed["weight_decay"] == 0.0
    # Callback state both ways round: loaded after the scheduler exists (strategies that restore after
    # setup) it applies at once; loaded before (the usual order) it waits for on_fit_start.
    state = sched_cb.state_dict()
    assert state["opt_param_scheduler"]["num_steps"] == 6
    sched_cb.load_state_dict({"opt_param_scheduler": {**state["opt_param_scheduler"], "num_steps": 2}})
    assert sched_cb.scheduler.num_steps == 2 and decayed["lr"] == pytest.approx(1e-2)
    fresh = _sched_cb()
    fresh.load_state_dict(state)
    assert fresh.scheduler is None and fresh.state_dict() == state


def _fp16_run(tmp_path, epochs: int, ckpt_in=None, ckpt_out=None):
    opt_cb = MegatronOptimizerCallback(OptimizerConfig(clip_grad=1.0, initial_loss_scale=2.0**14, loss_scale_window=3, hysteresis=2))
    sched_cb = _sched_cb()
    module = ScaledBackwardModule()
    # Stop on epoch boundaries: Lightning replays a plain DataLoader from its start when resuming mid-epoch.
    trainer = _trainer(-1, [opt_cb, sched_cb], precision="16-true", max_epochs=epochs)
    trainer.fit(module, ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    return module, trainer.optimizers[0], sched_cb


def test_fp16_checkpoint_resume_is_exact(tmp_path):
    """2 epochs straight == 1 epoch, checkpoint, fit(ckpt_path=...) to 2: model, main params, scaler, schedule."""
    straight_module, straight_opt, straight_sched = _fp16_run(tmp_path, 2)
    assert straight_module.net[0].weight.dtype == torch.float16
    assert float(straight_opt.get_loss_scale().item()) != 2.0**14  # the scaler did move
    ckpt = str(tmp_path / "half.ckpt")
    _fp16_run(tmp_path, 1, ckpt_out=ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert set(saved["optimizer_states"][0]) == {"optimizer", "grad_scaler", "fp32_from_fp16_params"}
    resumed_module, resumed_opt, resumed_sched = _fp16_run(tmp_path, 2, ckpt_in=ckpt)
    assert isinstance(resumed_opt, Float16OptimizerWithFloat16Params)
    for a, b in zip(straight_module.state_dict().values(), resumed_module.state_dict().values()):
        assert torch.equal(a, b)
    sa, sb = straight_opt.state_dict(), resumed_opt.state_dict()
    assert torch.equal(sa["grad_scaler"]["scale"], sb["grad_scaler"]["scale"])
    for key in ("growth_tracker", "hysteresis_tracker"):
        assert sa["grad_scaler"][key] == sb["grad_scaler"][key]
    for a, b in zip(sa["fp32_from_fp16_params"][0], sb["fp32_from_fp16_params"][0]):
        assert torch.equal(a, b)
    for k, st in sa["optimizer"]["state"].items():
        for name, value in st.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["optimizer"]["state"][k][name]))
    assert straight_sched.scheduler.state_dict() == resumed_sched.scheduler.state_dict()
    assert resumed_sched.scheduler.num_steps == 8 - straight_opt.num_skipped_steps


TORCH_SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[1, 4], gamma=0.1),
    "ExponentialLR": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=1e-3),
    "CosineAnnealingWarmRestarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3),
    "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=4),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
            torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4)], milestones=[3]),
}


@pytest.mark.parametrize("name", list(TORCH_SCHEDULERS))
def test_torch_lr_schedulers_drive_the_wrapper(name):
    make_opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)  # noqa: E731
    steps = 7
    recorder = LrRecorder()
    module = TinyModule(make_opt, TORCH_SCHEDULERS[name])
    before = copy.deepcopy(module.net[0].weight.detach())
    trainer = _trainer(steps, [MegatronOptimizerCallback(OptimizerConfig(clip_grad=1.0)), recorder])
    trainer.fit(module)
    assert isinstance(trainer.optimizers[0], FP32Optimizer)
    assert not torch.equal(before.cpu(), module.net[0].weight.cpu())  # Lightning returns the module on the host
    # The same scheduler on a bare optimizer gives the lr of each of the 7 steps.
    ref_opt = make_opt([torch.nn.Parameter(torch.zeros(1))])
    ref_sched = TORCH_SCHEDULERS[name](ref_opt)
    expected = []
    for _ in range(steps):
        expected.append(ref_opt.param_groups[0]["lr"])
        ref_opt.step()
        ref_sched.step()
    assert recorder.lrs == pytest.approx(expected, rel=1e-12)
    assert len(set(expected)) > 1  # the schedule changes the lr in this window


def test_refusals():
    with pytest.raises(ValueError, match="clip_grad"):
        _trainer(1, [MegatronOptimizerCallback()], gradient_clip_val=1.0).fit(TinyModule())
    with pytest.raises(ValueError, match="scale"):
        _trainer(1, [MegatronOptimizerCallback()], precision="16-true").fit(TinyModule())
    with pytest.raises(ValueError, match="lr scheduler"):
        _trainer(1, [_sched_cb()]).fit(TinyModule(lambda p: torch.optim.SGD(p, lr=0.1), TORCH_SCHEDULERS["StepLR"]))
    with pytest.raises(ValueError, match="loss_scale"):
        MegatronOptimizerCallback(OptimizerConfig(loss_scale=0.0))
    with pytest.raises(ValueError, match="hysteresis"):
        MegatronOptimizerCallback(OptimizerConfig(hysteresis=0))


def test_logged_lr_equals_lr_monitor_at_every_step(tmp_path):
    """Our `lr` is the lr the optimizer step of that logged step used: Lightning's LearningRateMonitor
    logs the same value at the same step (a warm-up then cosine, so an off-by-one step differs)."""
    import csv

    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    trainer = pl.Trainer(accelerator=accelerator(), devices=1, max_steps=8, max_epochs=None, log_every_n_steps=1,
                         callbacks=[_sched_cb(), LearningRateMonitor(logging_interval="step")],
                         logger=CSVLogger(tmp_path, name="csv"), enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(TinyModule())
    ours, monitor = {}, {}
    with open(trainer.logger.log_dir + "/metrics.csv") as fh:
        for row in csv.DictReader(fh):
            if row.get("lr"):
                ours[int(row["step"])] = float(row["lr"])
            if row.get("lr-AdamW/pg1"):
                monitor[int(row["step"])] = float(row["lr-AdamW/pg1"])
    assert sorted(ours) == sorted(monitor) == list(range(8))
    # self.log stores a float32 tensor; the monitor logs the Python float (one float32 rounding apart).
    assert ours == pytest.approx(monitor, rel=1e-7)
    assert ours[0] == pytest.approx(1e-4, rel=1e-7) and len(set(ours.values())) == 8  # init_lr, then a new lr every step


def test_without_the_schedule_the_optimizer_callback_logs_the_lr_of_each_step(tmp_path):
    """A run with a torch LR scheduler (the CLI's --lr_scheduler) or a constant lr has no
    OptimizerParamSchedulerCallback, which logged ``lr`` and ``wd``: such a run logged neither (no lr in the bar, the
    CSV or W&B). MegatronOptimizerCallback logs them then, the values of each step's optimizer step: Lightning's
    LearningRateMonitor logs the same lr at the same step."""
    import csv

    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    trainer = pl.Trainer(accelerator=accelerator(), devices=1, max_steps=6, max_epochs=None, log_every_n_steps=1,
                         callbacks=[MegatronOptimizerCallback(), LearningRateMonitor(logging_interval="step")],
                         logger=CSVLogger(tmp_path, name="csv"), enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(TinyModule(lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01), TORCH_SCHEDULERS["StepLR"]))
    ours, wd, monitor = {}, {}, {}
    with open(trainer.logger.log_dir + "/metrics.csv") as fh:
        for row in csv.DictReader(fh):
            if row.get("lr"):
                ours[int(row["step"])], wd[int(row["step"])] = float(row["lr"]), float(row["wd"])
            if row.get("lr-SGD"):
                monitor[int(row["step"])] = float(row["lr-SGD"])
    assert sorted(ours) == sorted(monitor) == list(range(6))
    assert ours == pytest.approx(monitor, rel=1e-7)
    assert ours[0] == pytest.approx(0.1) and ours[5] == pytest.approx(0.025)  # StepLR: halved every 2 steps
    assert list(wd.values()) == pytest.approx([0.01] * 6)


class InjectModule(ScaledBackwardModule):
    """At optimizer step ``at``: the gradient of the first layer's output times ``grad`` (inf: an fp16
    overflow the dynamic scaler skips), or the loss times ``loss`` (nan: a non-finite loss)."""

    def __init__(self, at: int, grad: float = 1.0, loss: float = 1.0):
        super().__init__()
        self.at, self.grad_factor, self.loss_factor = at, grad, loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        hit = self.trainer.global_step == self.at
        h = self.net[0](x)
        if hit and self.grad_factor != 1.0:
            h.register_hook(lambda g: g * self.grad_factor)
        loss = torch.nn.functional.mse_loss(self.net[1:](h).float(), y.float())
        return loss * self.loss_factor if hit else loss


def _lr_at(n: int) -> float:
    """_sched_cb's schedule at step n (Megatron's get_lr: linear warm-up from init_lr over 2, cosine to 10)."""
    if n <= 2:
        return 1e-4 + (1e-2 - 1e-4) * n / 2
    return 1e-3 + 0.5 * (1 + math.cos(math.pi * (n - 2) / 8)) * (1e-2 - 1e-3)


def test_fp16_overflow_skipped_step_keeps_the_lr_schedule_and_the_logged_lr(tmp_path):
    """An injected fp16 overflow at step 2 is skipped and, as in Megatron-LM's training loop (the
    scheduler steps only when the update succeeded), the schedule does not advance: steps 2 and 3
    log the same lr, and after 6 steps the schedule stands at 5."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    opt_cb = MegatronOptimizerCallback(OptimizerConfig(initial_loss_scale=2.0**8, hysteresis=2))
    sched_cb = _sched_cb()
    trainer = pl.Trainer(accelerator=accelerator(), devices=1, max_steps=6, max_epochs=None, log_every_n_steps=1,
                         callbacks=[opt_cb, sched_cb], precision="16-true", logger=CSVLogger(tmp_path, name="csv"),
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(InjectModule(at=2, grad=float("inf")))
    logged: dict[int, dict[str, float]] = {}
    with open(trainer.logger.log_dir + "/metrics.csv") as fh:
        for row in csv.DictReader(fh):
            for key in ("lr", "skipped_steps", "grad_norm"):
                if row.get(key):
                    logged.setdefault(int(row["step"]), {})[key] = float(row[key])
    assert [logged[s]["skipped_steps"] for s in range(6)] == [0, 0, 1, 1, 1, 1]
    # the skipped step has no norm: nan, not the step before's repeated (Lightning re-logs a step metric not
    # logged again)
    norms = [logged[s]["grad_norm"] for s in range(6)]
    assert math.isnan(norms[2]) and all(n > 0 for i, n in enumerate(norms) if i != 2) and norms[3] != norms[1], norms
    schedule = [0, 1, 2, 2, 3, 4]  # the step of the schedule each optimizer step used
    assert [logged[s]["lr"] for s in range(6)] == pytest.approx([_lr_at(n) for n in schedule], rel=1e-6)
    assert sched_cb.scheduler.num_steps == 5
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(_lr_at(5))


def _fused_adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


@pytest.mark.parametrize("precision, inject, optimizer", [
    ("32-true", "grad", "plain"), ("32-true", "grad", "FP32Optimizer"), ("bf16-true", "grad", "Float16"),
    ("16-true", "loss", "Float16"), ("bf16-true", "grad", "DistributedOptimizer"), ("16-true", "overflow", "Float16"),
    ("32-true", "grad", "FP32Optimizer fused"), ("bf16-true", "grad", "Float16 fused"),
    ("bf16-true", "loss", "Float16 fused"), ("16-true", "loss", "Float16 fused")])
def test_non_finite_loss_or_grad_stops_the_step_whatever_the_optimizer(precision, inject, optimizer):
    """The guard is the MegatronStrategy's (on by default), whatever the optimizer: a NaN gradient (fp32 with a
    plain torch optimizer or a wrapper, bf16, ZeRO-1) or a NaN loss (fp16: not an overflow the scaler may skip)
    at step 2 raises before the optimizer updates anything, naming the step and the first parameter; an fp16
    overflow with a finite loss is the dynamic scaler's to skip, not an error. With our wrappers the gradients'
    check is the wrapper's own pass over them (its norm), which raises the guard's error; with a plain
    optimizer it is the training step's. With a fused torch optimizer ("fused") the wrapper queues the update
    with the found-inf flag on the device (the kernel skips it) and reads the flag and the loss's check once,
    after (not with fp16's dynamic scaler): the same error, and neither the parameters nor the optimizer's state
    moved."""
    from lightning_megatron.step import NonFiniteLossOrGradError

    factor = {"grad": {"grad": float("nan")}, "loss": {"loss": float("nan")}, "overflow": {"grad": float("inf")}}
    dtype = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "16-true": torch.float16}[precision]
    module = InjectModule(at=2, **factor[inject]).to(dtype)  # the strategy takes the parameters as built
    fused = optimizer.endswith(" fused")
    optimizer = optimizer.removesuffix(" fused")
    if fused:
        module.make_optimizer = _fused_adamw
    config = OptimizerConfig(initial_loss_scale=2.0**8, use_distributed_optimizer=optimizer == "DistributedOptimizer")
    callbacks = [] if optimizer == "plain" else [MegatronOptimizerCallback(config)]
    trainer = _megatron_trainer(callbacks, max_steps=4, precision=precision)
    before = {}

    class Snapshot(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            before.update({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    trainer.callbacks.append(Snapshot())
    if inject == "overflow":
        trainer.fit(module)
        assert trainer.global_step == 4 and trainer.optimizers[0].num_skipped_steps == 1
        return
    with pytest.raises(NonFiniteLossOrGradError, match="at step 2") as info:
        trainer.fit(module)
    message = str(info.value)
    assert "first parameter with a non-finite gradient on rank 0: net.0.weight" in message, message
    assert ("the loss is nan" in message) == (inject == "loss") and "\n" not in message, message
    assert type(trainer.optimizers[0]).__name__.startswith(optimizer) or optimizer == "plain"
    on_device = fused and precision != "16-true"  # fp16's dynamic scaler needs the flag on the host first
    raised_by = ("non_finite_loss" if on_device and inject == "loss" else
                 "non_finite_grads" if optimizer != "plain" and inject == "grad" else "_check_finite")
    assert raised_by in [entry.name for entry in info.traceback], [entry.name for entry in info.traceback]
    assert trainer.global_step == 2
    for k, v in module.state_dict().items():  # the step was not taken
        assert torch.equal(v.cpu(), before[k].cpu()), k
    if fused:  # the optimizer's state too: two updates counted, its moments as they were
        inner = trainer.optimizers[0].optimizer
        assert inner.defaults["fused"] and all(float(st["step"]) == 2 for st in inner.state.values())
    # Off (the strategy's switch): the step of the scaler (bf16: skipped) as before the check existed.
    if precision == "bf16-true" and optimizer == "Float16" and inject == "grad":
        from lightning_megatron.strategy import MegatronStrategy

        trainer = _megatron_trainer([MegatronOptimizerCallback()], max_steps=4, precision=precision,
                                    strategy=MegatronStrategy(check_for_nan_in_loss_and_grad=False))
        skipped = InjectModule(at=2, grad=float("nan")).to(dtype)
        if fused:
            skipped.make_optimizer = _fused_adamw
        trainer.fit(skipped)
        assert trainer.optimizers[0].num_skipped_steps == 1 and trainer.global_step == 4
        assert all(torch.isfinite(p).all() for p in skipped.parameters())


def test_a_gradient_no_optimizer_reads_is_still_checked():
    """With our wrapper the gradients' check is the wrapper's pass over what it reads: a trainable parameter
    left out of every optimizer (here the first layer) is checked by the training step instead."""
    from lightning_megatron.step import NonFiniteLossOrGradError

    module = InjectModule(at=2, grad=float("nan"))
    module.make_optimizer = lambda params: torch.optim.AdamW(list(params)[2:], lr=1e-3)  # not net.0
    trainer = _megatron_trainer([MegatronOptimizerCallback()], max_steps=4, precision="32-true")
    with pytest.raises(NonFiniteLossOrGradError, match="first parameter with a non-finite gradient on rank 0: "
                                                       "net.0.weight") as info:
        trainer.fit(module)
    assert "_check_finite" in [entry.name for entry in info.traceback]


class _SeesOptimizers(pl.Callback):
    """Listed BEFORE the optimizer callback: records what its on_fit_start sees."""

    def on_fit_start(self, trainer, pl_module):
        self.types = [type(o).__name__ for o in trainer.optimizers]


def _megatron_trainer(callbacks: list, **kw) -> pl.Trainer:
    from lightning_megatron.strategy import MegatronStrategy

    return pl.Trainer(accelerator=accelerator(), devices=1, strategy=kw.pop("strategy", None) or MegatronStrategy(),
                      max_steps=kw.pop("max_steps", 2), callbacks=callbacks, enable_progress_bar=False, logger=False,
                      enable_checkpointing=False, enable_model_summary=False, **kw)


def test_the_strategy_wraps_right_after_configure_optimizers():
    """The callback hands its OptimizerConfig to the strategy (setup); the strategy wraps in its own setup,
    so every on_fit_start, whatever the callback order, already sees the Megatron wrapper."""
    seen = _SeesOptimizers()
    trainer = _megatron_trainer([seen, MegatronOptimizerCallback(OptimizerConfig(clip_grad=0.5))])
    trainer.fit(TinyModule())
    assert seen.types == ["FP32Optimizer"]
    assert isinstance(trainer.optimizers[0], FP32Optimizer) and trainer.optimizers[0].clip_grad == 0.5
    assert "grad_norm" in trainer.callback_metrics
    with pytest.raises(ValueError, match="two optimizer configs"):
        _megatron_trainer([MegatronOptimizerCallback(OptimizerConfig(clip_grad=0.5)),
                           MegatronOptimizerCallback(OptimizerConfig(clip_grad=1.0))]).fit(TinyModule())
    with pytest.raises(TypeError, match="takes an OptimizerConfig"):
        MegatronOptimizerCallback(1.0)  # the config dataclass, not its fields one by one


def test_gradient_clip_val_is_one_rule_with_lightnings_meaning():
    """None and 0 mean "no clipping" in Lightning: accepted everywhere; any other value is refused with one
    message before launch (config_checks), at set-up (strategy) and by the callback on plain Lightning."""
    import re

    from lightning_megatron.config_checks import check_config
    from lightning_megatron.optimizer.config import gradient_clip_val_problem

    assert gradient_clip_val_problem(None) is None and gradient_clip_val_problem(0.0) is None
    message = gradient_clip_val_problem(0.5)
    assert message is not None and "--megatron_optimizer.clip_grad 0.5" in message
    _trainer(1, [MegatronOptimizerCallback()], gradient_clip_val=0.0).fit(TinyModule())  # was refused (is not None)
    _megatron_trainer([MegatronOptimizerCallback()], gradient_clip_val=0.0).fit(TinyModule())
    with pytest.raises(ValueError, match=re.escape(message)):
        _trainer(1, [MegatronOptimizerCallback()], gradient_clip_val=0.5).fit(TinyModule())
    with pytest.raises(ValueError, match=re.escape(message)):
        _megatron_trainer([MegatronOptimizerCallback()], gradient_clip_val=0.5).fit(TinyModule())
    assert message in check_config(trainer_args={"gradient_clip_val": 0.5})
    assert not any("gradient_clip_val" in p for p in check_config(trainer_args={"gradient_clip_val": 0.0}))
