"""A progress bar that counts the optimizer steps of a ``max_steps`` run.

Lightning's bar counts the batches of an epoch: a ``max_steps`` run (``max_epochs=-1``) shows
``Epoch 0/-2``, and a resumed one ``40/10`` (the batch index continues, the total is what is left).
:class:`MegatronProgressBar` is Lightning's :class:`~lightning.pytorch.callbacks.RichProgressBar`
whose training bar reads ``Step 40/600``: the trainer's ``global_step`` out of ``max_steps``. Runs
bounded by epochs keep Lightning's bar. The metrics shown are those logged with ``prog_bar=True``:
the loss, and ``tokens_per_sec`` and ``mfu`` of :class:`~lightning_megatron.callbacks.ThroughputCallback`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

__all__ = ["MegatronProgressBar"]


class MegatronProgressBar(RichProgressBar):
    """``Step <global_step>/<max_steps>`` for the training bar of a ``max_steps`` run (else Lightning's)."""

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
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._show_steps(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._show_steps(trainer)
