"""A progress bar that counts the optimizer steps of a ``max_steps`` run, on a terminal or in a log file.

Lightning's bar counts the batches of an epoch: a ``max_steps`` run (``max_epochs=-1``) shows
``Epoch 0/-2``, and a resumed one ``40/10`` (the batch index continues, the total is what is left).
:class:`MegatronProgressBar` is Lightning's :class:`~lightning.pytorch.callbacks.RichProgressBar`
whose training bar reads ``Step 40/600``: the trainer's ``global_step`` out of ``max_steps``. Runs
bounded by epochs keep Lightning's bar. It shows a short set of metrics, so that the bar fits on one
line of an 80-column terminal: ``loss`` and ``val_loss`` (a ``*lm_loss`` equal to them, as a decoder's
is, is left out), ``tok/s`` and ``mfu`` of :class:`~lightning_megatron.callbacks.ThroughputCallback`
(an MFU above 100% is marked ``!``: see there), and any other metric a module logs with
``prog_bar=True``; not the logger's version.

When the output is not a terminal (``nohup``, SLURM, a pipe; Rich's ``Console.is_terminal``, which
``FORCE_COLOR`` / ``TTY_COMPATIBLE=1`` override), a live bar would write nothing until the end: the bar
prints a plain line instead at the first optimizer step, every ``trainer.log_every_n_steps`` steps (when
the loggers write a row) and at the last, ``Step 40/600 loss 6.4121 lr 9.38e-04 tok/s 1.66k mfu 3.9%
0:01:02 elapsed, 0:14:30 left``, and one line per validation during ``fit``.
"""

from __future__ import annotations

import math
import sys
import time
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import BatchesProcessedColumn, ProcessingSpeedColumn
from rich.progress import BarColumn
from typing_extensions import override

__all__ = ["MegatronProgressBar", "format_metrics"]


def _compact(value: float) -> str:
    """``1663.2`` -> ``"1.66k"``, ``2.1e6`` -> ``"2.1M"``: three significant digits and an SI suffix."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def format_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics a progress display shows, short: ``tokens_per_sec`` as ``tok/s`` (``1.66k``), ``mfu``
    as a percentage (``3.9%``; above 100%, impossible, marked ``108%!``), a ``*lm_loss`` equal to the
    ``*loss`` beside it left out (a decoder's total loss is its LM loss), the logger's ``v_num`` left out;
    other values as given (tensors as floats)."""
    values = {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in metrics.items()}
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key == "v_num":
            continue
        if key.endswith("lm_loss"):  # lm_loss, train_lm_loss, val_lm_loss: beside loss, train_loss, val_loss
            prefix = key[: -len("lm_loss")]
            totals = [f"{prefix}loss"] + (["loss"] if prefix == "train_" else [])
            if any(t in values and values[t] == value for t in totals):
                continue
        if key == "tokens_per_sec" and isinstance(value, (int, float)):
            out["tok/s"] = _compact(float(value))
        elif key == "mfu" and isinstance(value, (int, float)):
            out["mfu"] = f"{value:.1%}" + ("!" if value > 1.0 else "")
        else:
            out[key] = value
    return out


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=int(seconds))) if math.isfinite(seconds) else "-:--:--"


class MegatronProgressBar(RichProgressBar):
    """``Step <global_step>/<max_steps>`` for the training bar of a ``max_steps`` run (else Lightning's),
    a short set of metrics, and plain lines when the output is not a terminal (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plain = False
        self._start: tuple[float, int] | None = None  # (time, global step) when this process started training

    @property
    def plain(self) -> bool:
        """Whether this bar writes plain lines (the output is not a terminal) instead of a live bar."""
        return self._plain

    @property
    @override
    def is_enabled(self) -> bool:
        return super().is_enabled and not self._plain

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        from rich.console import Console

        console = Console(**self._console_kwargs)
        self._plain = not (console.is_terminal or console.is_jupyter)

    @override
    def configure_columns(self, trainer: pl.Trainer) -> list:
        """Lightning's columns; for a ``max_steps`` run without the batch count (``Step 40/600`` says it) and the
        steps per second (``tok/s`` says it), and a bar of 12 characters: on 80 columns the metrics keep 36."""
        columns = super().configure_columns(trainer)
        if (trainer.max_steps or 0) > 0:
            columns = [c for c in columns if not isinstance(c, (BatchesProcessedColumn, ProcessingSpeedColumn))]
            for column in columns:
                if isinstance(column, BarColumn):
                    column.bar_width = 12
        return columns

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return format_metrics(super().get_metrics(trainer, pl_module))

    def _show_steps(self, trainer: pl.Trainer) -> None:
        if self.progress is None or self.train_progress_bar_id is None or not (trainer.max_steps or 0) > 0:
            return
        description = f"Step {trainer.global_step}/{trainer.max_steps}"
        if self.theme.description:
            description = f"[{self.theme.description}]{description}"
        self.progress.update(self.train_progress_bar_id, total=trainer.max_steps, completed=trainer.global_step,
                             description=description)
        self.refresh()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start = (time.perf_counter(), trainer.global_step)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._show_steps(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._show_steps(trainer)
        if self._plain and self._enabled:
            self._print_step(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._plain and self._enabled and trainer.state.fn == "fit" and not trainer.sanity_checking:
            metrics = format_metrics({k: v for k, v in trainer.callback_metrics.items()
                                      if k.startswith("val_") and not k.startswith("val_num_")})  # not counts
            _print(f"Validation at step {trainer.global_step}: " + _joined(metrics))

    def _print_step(self, trainer: pl.Trainer) -> None:
        """One plain line at the first step, every ``log_every_n_steps`` and at the last."""
        step, total = trainer.global_step, trainer.max_steps or 0
        every = max(1, int(trainer.log_every_n_steps or 1))
        start_time, start_step = self._start or (time.perf_counter(), 0)
        if not (step == start_step + 1 or step % every == 0 or (total > 0 and step >= total)):
            return
        logged = trainer.callback_metrics
        metrics: dict[str, Any] = {k: logged[k] for k in ("loss",) if k in logged}
        lr = logged.get("lr")
        if lr is None and trainer.optimizers and trainer.optimizers[0].param_groups:
            lr = trainer.optimizers[0].param_groups[0].get("lr")
        if lr is not None:
            metrics["lr"] = f"{float(lr):.2e}"
        metrics.update({k: logged[k] for k in ("tokens_per_sec", "mfu") if k in logged})
        metrics.update({k: v for k, v in trainer.progress_bar_metrics.items() if k not in metrics and k != "v_num"
                        and not k.startswith("val_")})  # a module's own prog_bar metrics
        elapsed = time.perf_counter() - start_time
        where = f"Step {step}/{total}" if total > 0 else f"Epoch {trainer.current_epoch} step {step}"
        timing = f"{_duration(elapsed)} elapsed"
        if total > 0 and step > start_step:
            timing += f", {_duration(elapsed / (step - start_step) * (total - step))} left"
        _print(f"{where} {_joined(format_metrics(metrics))} {timing}")


def _joined(metrics: dict[str, Any]) -> str:
    return " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())


def _print(line: str) -> None:
    print(line, file=sys.stdout, flush=True)
