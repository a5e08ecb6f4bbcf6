"""Faults injected into a real ``lightning-megatron fit`` by callbacks the command line adds (not a test
module): ``--trainer.callbacks+=cli_faults.SignalAt --trainer.callbacks.step=3`` (``tests/`` on the
PYTHONPATH, which the ranks Lightning starts inherit)."""

from __future__ import annotations

import os
import signal

from lightning.pytorch import Callback


class SignalAt(Callback):
    """At the end of training step ``step``, rank 0 sends ``signal``: ``SIGTERM`` to its own process (as
    a scheduler does), ``SIGINT`` to the job's process group (as Ctrl-C in a terminal does: every rank
    gets it; start the job in a session of its own). ``times``: how often (a second Ctrl-C). Step 0: at the set-up
    (the ranks connected, before the sanity check and the first step); -1: at the fit's end (after the strategy's
    teardown, before the command's ordered way out)."""

    def __init__(self, step: int, signal: str = "SIGTERM", times: int = 1) -> None:
        self.step, self.signal, self.times = step, signal, times

    def setup(self, trainer, pl_module, stage) -> None:
        if self.step == 0:
            self._send(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self._send(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.step == -1:
            self._send(trainer)

    def _send(self, trainer) -> None:
        if trainer.global_rank != 0:
            return
        signum = signal.Signals[self.signal]
        for _ in range(self.times):
            if signum == signal.SIGINT:
                os.killpg(os.getpgid(0), signum)
            else:
                os.kill(os.getpid(), signum)


class NaNGradientAt(Callback):
    """In training step ``step`` (``global_step`` before it), the gradient of the parameter ``name`` (its
    checkpoint name, ``sharded_named_parameters``) becomes NaN on every rank that holds it (a tensor hook on the parameter; its layer must leave its
    weight gradient to autograd: no deferred weight gradients, no CPU tuning)."""

    def __init__(self, step: int, name: str) -> None:
        self.step, self.name = step, name

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            [param] = [p for n, p in pl_module.sharded_named_parameters() if n == self.name]
            param.register_hook(lambda grad: grad * float("nan"))
