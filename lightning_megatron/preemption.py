"""SIGTERM (preemption, ``scancel``, a scheduler's time limit): save a checkpoint, exit non-zero.

Lightning's own SIGTERM handling exits 0 (its ``SIGTERMException`` is a ``SystemExit`` without a
code), so a job scheduler takes a preempted run as finished; and with several ranks it lets rank 0
stop at the end of a step while the others stop at the start of the next one after an extra
broadcast and barrier, so a collective checkpoint save on the way out pairs the wrong collectives
and fails. The MegatronStrategy therefore handles SIGTERM itself, through public hooks only:

- ``on_train_start`` installs :class:`PreemptionHandler` as the SIGTERM handler of each rank (after
  Lightning's signal connector registered its own, which Lightning restores at teardown). The handler
  only sets a flag, and on the launching rank forwards the signal once to the ranks it started
  (``launcher.kill``), as Lightning does; it runs no collective.
- ``on_train_batch_start`` takes the max of the flag over all ranks (one all-reduce of one integer
  per step, like Lightning's own per-step SIGTERM broadcast), so every rank stops before the same
  step, by raising Lightning's ``SIGTERMException``.
- ``on_exception`` (called on every rank with that exception) calls :func:`on_sigterm`: it saves a
  checkpoint when checkpointing is configured (a ``ModelCheckpoint`` callback) as
  ``<dirpath>/last.ckpt``, which ``--ckpt_path last`` resumes from, with every completed step in it
  (no step lost), and sets the exit status to :data:`SIGTERM_EXIT_CODE` (143 = 128 + SIGTERM).
- ``teardown`` then calls :meth:`PreemptionHandler.leave`: the ranks meet once more and destroy their
  process groups, and the launching rank waits for the ranks it started, before any interpreter
  exits. Left to interpreter shut-down instead, the launching rank (which hosts the rendezvous
  store) was once seen aborting on the way out ("terminate called without an active exception",
  status -6 instead of 143); and Lightning's child-process observer SIGKILLs the launching rank
  when a child exits non-zero first, which every child now does.

A SIGTERM during validation takes effect at the next training step. SLURM's requeue works as in
Lightning: with ``#SBATCH --signal=USR1@90`` and ``SLURMEnvironment(auto_requeue=True)`` (the
default), SIGUSR1 makes Lightning save ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir`` and requeue the
job, which resumes from it by itself; the SIGTERM that follows, or a plain one, takes the path above.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import warnings
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["SIGTERM_EXIT_CODE", "PreemptionHandler", "on_sigterm", "sigterm_checkpoint_path"]

SIGTERM_EXIT_CODE = 128 + int(signal.SIGTERM)
"""Exit status after a SIGTERM: 143, non-zero so that schedulers see an unfinished run."""


class PreemptionHandler:
    """A SIGTERM flag per process, agreed on by every rank at step boundaries."""

    def __init__(self) -> None:
        self.received = False
        self._launcher: Any = None
        self._previous: Any = None
        self._installed = False
        self.exiting = False  # set when the SIGTERMException is being handled: teardown calls leave()

    def install(self, launcher: Any = None) -> None:
        """Become this process's SIGTERM handler (main thread only; elsewhere signals cannot be handled)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._launcher = launcher
        self.received = self.exiting = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = not self.received
        self.received = True
        if first and self._launcher is not None:
            self._launcher.kill(signum)  # the ranks this process started (Lightning's subprocess launcher)

    def should_stop(self, device: torch.device) -> bool:
        """Whether any rank received SIGTERM; collective over the default group when there is one."""
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.received = bool(flag.item())
        return self.received

    def leave(self, launcher: Any = None, wait_s: float = 120.0) -> None:
        """Shut distributed state down in order before this process exits with status 143.

        Collective: every rank calls it (from ``teardown``, after the SIGTERM checkpoint). The
        ranks meet at a barrier; the launching rank (Lightning's subprocess launcher) then waits
        up to ``wait_s`` for the ranks it started, which destroy their process groups and exit
        first, and destroys its own (with the rendezvous store it hosts) last.
        """
        # The ranks this process started: only Lightning's subprocess launcher starts any (Lightning's
        # own KeyboardInterrupt path tests for it the same way).
        children = list(launcher.procs) if isinstance(launcher, _SubprocessScriptLauncher) else []
        if children:
            # Lightning's observer thread polls this same list and SIGKILLs this process as soon as
            # a child exits non-zero; emptied, it stops at its next poll. We wait for them below.
            launcher.procs.clear()
        initialized = dist.is_available() and dist.is_initialized()
        if initialized and dist.get_world_size() > 1:
            dist.barrier()
        for child in children:  # none on the ranks that were started
            try:
                child.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                warnings.warn(f"SIGTERM: rank process {child.pid} did not exit within {wait_s:.0f} s; killing it",
                              stacklevel=2)  # every node's launching rank, not only global rank 0
                child.kill()
                child.wait()
        if initialized:
            dist.destroy_process_group()


def sigterm_checkpoint_path(trainer: pl.Trainer) -> Path | None:
    """``<ModelCheckpoint.dirpath>/last.ckpt``, or None when checkpointing is not configured."""
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None)
    if callback is None or dirpath is None:
        return None
    return Path(dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"


def on_sigterm(trainer: pl.Trainer, exception: BaseException) -> None:
    """On a SIGTERMException: save a checkpoint if configured, and make the exit status non-zero.

    Collective (the checkpoint save): every rank calls it, which Lightning guarantees by raising
    the exception on every rank at the same batch boundary.
    """
    if not isinstance(exception, SIGTERMException):
        return
    step = trainer.global_step
    if trainer.state.fn == TrainerFn.FITTING:
        path = sigterm_checkpoint_path(trainer)
        if path is None:
            rank_zero_warn(f"SIGTERM at step {step}: no checkpoint saved (no ModelCheckpoint callback); "
                           f"exiting with status {SIGTERM_EXIT_CODE}")
        elif getattr(trainer.checkpoint_callback, "save_on_exception", False):
            rank_zero_info(f"SIGTERM at step {step}: ModelCheckpoint(save_on_exception=True) saves the checkpoint")
        else:
            # What the ModelCheckpoint itself saves: the full state (model, optimizer, loops) unless it
            # is set to save_weights_only. Explicit, or Lightning logs that it picked a default.
            callback = trainer.checkpoint_callback
            trainer.save_checkpoint(path, weights_only=isinstance(callback, ModelCheckpoint)
                                    and callback.save_weights_only)
            rank_zero_info(f"SIGTERM at step {step}: saved {path}; resume with --ckpt_path last. "
                           f"Exiting with status {SIGTERM_EXIT_CODE}")
    exception.code = SIGTERM_EXIT_CODE
