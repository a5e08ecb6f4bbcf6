"""SIGTERM (preemption, ``scancel``, a time limit) and Ctrl-C (SIGINT): save a checkpoint, exit non-zero.

Lightning's own SIGTERM handling exits 0 (its ``SIGTERMException`` is a ``SystemExit`` without a
code), so a job scheduler takes a preempted run as finished; and with several ranks it lets rank 0
stop at the end of a step while the others stop at the start of the next one after an extra
broadcast and barrier, so a collective checkpoint save on the way out pairs the wrong collectives
and fails. Ctrl-C (SIGINT) was worse: Python's ``KeyboardInterrupt`` ends the run where it is
(Lightning exits 1), and everything since the last checkpoint is lost. The MegatronStrategy therefore
handles both itself, through public hooks only, the same way:

- ``on_train_start`` installs :class:`PreemptionHandler` as the SIGTERM and SIGINT handler of each
  rank (after Lightning's signal connector registered its own, which Lightning restores at teardown).
  The handler only sets a flag (the signal's number), and on the launching rank forwards a SIGTERM
  once to the ranks it started (``launcher.kill``), as Lightning does; it runs no collective. A
  SIGINT is not forwarded: Ctrl-C in a terminal reaches every process of the job itself (a second
  SIGINT to the other ranks would abort them), and one rank's flag is enough (next point). On the
  first SIGINT the handler gives SIGINT back its default action, so a second Ctrl-C ends the process
  at once, even inside a collective, without saving (the last complete checkpoint stays intact:
  saves are atomic). (Python runs a handler between bytecodes: a process blocked in a collective
  when the first Ctrl-C comes handles it once the collective returns, as it would a KeyboardInterrupt.)
- ``on_train_batch_start`` takes the max of the flag over all ranks (one all-reduce of one integer
  per step, like Lightning's own per-step SIGTERM broadcast), so every rank stops before the same
  step, by raising Lightning's ``SIGTERMException`` (:func:`stop_before_this_batch`: with the batch it
  fetched uncounted, so a resumed run logs and validates at the steps an uninterrupted one does).
- ``on_exception`` (called on every rank with that exception) calls :func:`on_stop_signal`: it saves
  a checkpoint when checkpointing is configured (a ``ModelCheckpoint`` callback) as this run's
  ``last`` checkpoint (:func:`stop_checkpoint_path`: never another run's), which ``--ckpt_path last``
  resumes from, with every completed step in it (no step lost), and sets the exit status to 128 + the
  signal: :data:`SIGTERM_EXIT_CODE` (143) or :data:`SIGINT_EXIT_CODE` (130, the shell's status for a
  process ended by Ctrl-C). If both arrived, SIGTERM's.
- ``teardown`` then calls :meth:`PreemptionHandler.leave`: the ranks meet once more and destroy their
  process groups, and the launching rank waits for the ranks it started, before any interpreter
  exits. Left to interpreter shut-down instead, the launching rank (which hosts the rendezvous
  store) was once seen aborting on the way out ("terminate called without an active exception",
  status -6 instead of 143); and Lightning's child-process observer SIGKILLs the launching rank
  when a child exits non-zero first, which every child now does.

A SIGTERM during validation takes effect at the next training step. SLURM's requeue (``#SBATCH
--signal=USR1@90`` with ``SLURMEnvironment(auto_requeue=True)``, Lightning's default under SLURM) takes
the same path: the environment's ``requeue_signal`` (SIGUSR1) is a stop signal too, and once every rank
has stopped before the same step and the ``last`` checkpoint is saved, rank 0 requeues the job
(``scontrol requeue``, as Lightning does) and the ranks exit with 128 + the signal (138); the requeued
job's command resumes with ``--ckpt_path last``. Lightning's own handler saved ``hpc_ckpt_<n>.ckpt``
from inside the signal handler, on each rank wherever its step was: a collective save entered at
different points of the ranks' collectives, and a file ``--ckpt_path last`` does not read.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
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

from lightning_megatron.launch import sigint_handler_after_start

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["SIGINT_EXIT_CODE", "SIGTERM_EXIT_CODE", "STOP_SIGNALS", "PreemptionHandler", "count_steps_as_taken",
           "WorkerIgnoresStopSignals", "leave_stop_signals_to_the_trainer", "on_stop_signal", "requeue_job",
           "say_ctrl_c_in_start_up",
           "requeue_signal", "save_the_final_step", "stop_before_this_batch", "stop_checkpoint_path"]

SIGTERM_EXIT_CODE = 128 + int(signal.SIGTERM)
"""Exit status after a SIGTERM: 143, non-zero so that schedulers see an unfinished run."""
SIGINT_EXIT_CODE = 128 + int(signal.SIGINT)
"""Exit status after a first Ctrl-C (SIGINT) that stopped and saved the run: 130, what a shell reports
for a process ended by Ctrl-C. (A second Ctrl-C ends the processes by the signal itself: 130 in a
shell as well, -2 for Python's ``subprocess``.)"""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run at the next step boundary with a checkpoint."""


class PreemptionHandler:
    """A stop-signal flag per process (SIGTERM, or a first SIGINT), agreed on by every rank at step
    boundaries. ``received``: the signal's number (0: none; after :meth:`should_stop`, the largest of
    every rank's, so SIGTERM wins over SIGINT)."""

    def __init__(self) -> None:
        self.received = 0
        self._launcher: Any = None
        self._previous: dict[int, Any] = {}
        self._installed = False
        self._agreeing = False  # an evaluation stage's ranks agree at each batch (install_for)
        self._pid: int | None = None
        self._announce = False
        self._announcement = b""
        self.exiting = False  # set when the SIGTERMException is being handled: teardown calls leave()
        self._sigint_after_leave: Any = None  # SIGINT's handler, given back once leave() has waited
        self.leave_follows = False  # the command calls leave() once its subcommand has run: SIGINT ours till then
        self.requeue_signal: int | None = None
        self.requeue = False  # the requeue signal came (to any rank, after should_stop): requeue after the save
        self.failed = False  # the fit ended by an exception other than a stop signal's

    def install(self, launcher: Any = None, announce: bool = False, requeue_signal: int | None = None,
                saves: bool = True) -> None:
        """Become this process's SIGTERM and SIGINT handler (main thread only; elsewhere signals cannot be
        handled). ``announce``: say on stderr what a first Ctrl-C does (the job's rank 0). ``requeue_signal``:
        SLURM's requeue signal (``SLURMEnvironment.requeue_signal`` with ``auto_requeue``), handled the same way,
        the job requeued after the save (:func:`on_stop_signal`). ``saves``: a fit (a stop saves a checkpoint); an
        evaluation or predict only stops."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._launcher = launcher
        self._announce = announce
        self._announcement = (b"\nlightning-megatron: Ctrl-C: every rank stops after the current step and saves a "
                              b"checkpoint (exit status 130); press Ctrl-C again to abort at once without saving\n"
                              if saves else
                              b"\nlightning-megatron: Ctrl-C: every rank stops before its next batch (exit status "
                              b"130); press Ctrl-C again to abort at once\n")
        self.requeue_signal = None if requeue_signal is None else int(requeue_signal)
        self.requeue = False
        self._pid = os.getpid()
        self.received = 0
        self.exiting = self.failed = False
        stops = (*STOP_SIGNALS, *(() if self.requeue_signal in (None, *STOP_SIGNALS) else (self.requeue_signal,)))
        self._previous = {int(s): signal.signal(s, self._handle) for s in stops}
        self._previous[int(signal.SIGINT)] = sigint_handler_after_start(self._previous[int(signal.SIGINT)])
        self._installed = True

    def install_for(self, trainer: pl.Trainer, launcher: Any, environment: Any, device: torch.device) -> None:
        """:meth:`install` for this stage of ``trainer``: a fit (from its sanity check on) saves on the way out;
        validate, test and predict (from their start) only stop. Lightning's own handlers, registered before, would
        save inside the signal handler (SLURM's requeue), and its SIGTERM handler broadcasts from inside the
        handler: a SIGTERM to one rank during ``validate`` left it waiting there while the others waited in the
        model's next collective, both until the collective timeout. An evaluation whose ranks read different numbers
        of batches (a plain loader under Lightning's unrepeated sampler, for predict) cannot agree at each batch: there
        Lightning's handlers stay (collective: every rank compares its batch counts once)."""
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not fitting:  # the same decision on every rank (from the gathered counts), whatever each one installs
            self._agreeing = _same_batches_everywhere(trainer, device)
            if not self._agreeing:
                return
        self.install(launcher, announce=trainer.global_rank == 0, requeue_signal=requeue_signal(environment),
                     saves=fitting)

    def stop_before_evaluation_batch(self, trainer: pl.Trainer, device: torch.device) -> None:
        """validate / test / predict: every rank stops before the same batch once any rank had a stop signal
        (collective; a fit decides before its training steps, and its validation runs to its end)."""
        if trainer.state.fn != TrainerFn.FITTING and self._agreeing and self.should_stop(device):
            raise SIGTERMException()

    def say_if_after_the_end(self, trainer: pl.Trainer) -> None:
        """A stop signal that came after the last step's agreement (during the final save or the teardown): the run
        had finished, its ``last`` checkpoint holds the final step, and the process exits 0 as a finished run does
        (no requeue). Said by global rank 0 when it received one: Ctrl-C's announcement had promised status 130,
        and a SIGTERM there was silent."""
        if (not self.received or self.exiting or self.failed or not trainer.is_global_zero
                or trainer.state.fn != TrainerFn.FITTING):
            return
        name = signal.Signals(self.received).name
        print(f"lightning-megatron: {name} after the last step ({trainer.global_step}): the run had finished (its "
              f"checkpoints are complete): it ends as a finished run, status 0", file=sys.stderr, flush=True)

    def uninstall(self, lightning_signals: Any = None) -> None:
        """Give the signals their handlers back; SIGINT's only once :meth:`leave` has waited, on the way out after a
        stop or where the command leaves next (:attr:`leave_follows`). ``lightning_signals``: the trainer's signal
        connector, which gives every signal the handler it had at the stage's start when it tears down, after this:
        SIGINT's is made this handler there too."""
        if self._installed and threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                if signum == signal.SIGINT and ((self.exiting and self.received) or self.leave_follows):
                    # A second Ctrl-C still ends the process at once while leave() waits for the other ranks. A first
                    # one after the end raised KeyboardInterrupt in one rank while the others waited in leave()'s
                    # barrier: "another rank died", status 130 or -2, for a finished run.
                    self._sigint_after_leave = previous
                    originals = getattr(lightning_signals, "_original_handlers", None)
                    if isinstance(originals, dict) and signum in originals:
                        originals[signum] = self._handle
                    if not self.exiting:
                        self._announcement = (b"\nlightning-megatron: Ctrl-C after the run finished: the ranks "
                                              b"leave in order and it ends as a finished run; press Ctrl-C again to "
                                              b"abort at once\n")
                    continue
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._installed = self._agreeing = False

    @property
    def exit_code(self) -> int:
        """128 + the agreed signal (143 for SIGTERM, 130 for SIGINT)."""
        return 128 + (self.received or int(signal.SIGTERM))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            return  # a process forked after install (a DataLoader worker): the training process decides
        first_sigterm = signum == signal.SIGTERM and self.received != signal.SIGTERM
        self.received = max(self.received, int(signum))
        if signum == self.requeue_signal:
            self.requeue = True
        if signum == signal.SIGINT:
            # A second Ctrl-C takes SIGINT's default action: the process ends at once, even while it
            # waits inside a collective (a Python handler would only run once the collective returned).
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if self._announce:  # os.write: safe inside a signal handler (print is not)
                os.write(2, self._announcement)
        elif first_sigterm and self._launcher is not None:
            self._launcher.kill(signum)  # the ranks this process started (Lightning's subprocess launcher)

    def should_stop(self, device: torch.device) -> bool:
        """Whether any rank received a stop signal; collective over the default group when there is one (a
        single process decides from its own flag: no tensor, no device read that would wait for the
        accelerator at every step)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([self.received, int(self.requeue)], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            received, requeue = flag.tolist()
            # the agreed decision; a signal handled while the collective ran (its flag set since) stays for the next
            self.received, self.requeue = max(self.received, int(received)), self.requeue or bool(requeue)
            return received != 0
        return self.received != 0

    def leave(self, launcher: Any = None, wait_s: float = 120.0) -> None:
        """Shut distributed state down in order before this process exits with status 143 (or 130).

        Collective: every rank calls it (from ``teardown``, after the stop checkpoint). The
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
                warnings.warn(f"stopping: rank process {child.pid} did not exit within {wait_s:.0f} s; killing it",
                              stacklevel=2)  # every node's launching rank, not only global rank 0
                child.kill()
                child.wait()
        if initialized:
            dist.destroy_process_group()
        if self._sigint_after_leave is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._sigint_after_leave)
            self._sigint_after_leave = None


class WorkerIgnoresStopSignals:
    """A DataLoader's ``worker_init_fn`` that first leaves the stop signals to the training process (SIGTERM, SIGINT,
    SIGUSR1 and the environment's requeue signal: ignored in the worker), then runs ``then`` (the loader's own, if
    any). SLURM's time limit, ``scancel`` and its requeue signal reach every process of the job, and a Ctrl-C every
    process of the terminal's group: a worker ended by one made PyTorch raise "DataLoader worker (pid ...) is killed
    by signal: Terminated" in its rank at once, before the stop checkpoint (exit 1, the steps since the last save
    lost). A worker still ends with its training process (PyTorch's workers watch it)."""

    def __init__(self, then: Callable[[int], Any] | None = None, requeue_signal: int | None = None) -> None:
        self.then = then
        self.signals = sorted({int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGUSR1),
                               *(() if requeue_signal is None else (int(requeue_signal),))})

    def __call__(self, worker_id: int) -> None:
        for signum in self.signals:
            signal.signal(signum, signal.SIG_IGN)
        if self.then is not None:
            self.then(worker_id)


def leave_stop_signals_to_the_trainer(dataloader: Any, environment: Any = None) -> Any:
    """``dataloader`` with workers that ignore the stop signals (:class:`WorkerIgnoresStopSignals`; SLURM's requeue
    signal of ``environment`` too), its own ``worker_init_fn`` kept; anything else unchanged (the strategy's
    ``process_dataloader``)."""
    from torch.utils.data import DataLoader

    if (isinstance(dataloader, DataLoader) and dataloader.num_workers > 0
            and not isinstance(dataloader.worker_init_fn, WorkerIgnoresStopSignals)):
        dataloader.worker_init_fn = WorkerIgnoresStopSignals(dataloader.worker_init_fn, requeue_signal(environment))
    return dataloader


def _same_batches_everywhere(trainer: pl.Trainer, device: torch.device) -> bool:
    """Whether every rank reads the same number of batches of each dataloader in this evaluation stage (collective:
    one all-gather; an unknown length counts as a difference)."""
    counts = {TrainerFn.VALIDATING: trainer.num_val_batches, TrainerFn.TESTING: trainer.num_test_batches,
              TrainerFn.PREDICTING: trainer.num_predict_batches}.get(trainer.state.fn, [])
    known = [int(n) if n != float("inf") else -1 for n in counts]
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return True
    mine = torch.tensor([len(known), sum(known), min(known, default=0), max(known, default=0)], dtype=torch.int64,
                        device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return min(known, default=0) >= 0 and all(torch.equal(t, every[0]) for t in every)


def stop_checkpoint_path(trainer: pl.Trainer, run_id: str | None) -> Path | None:
    """Where a stop signal saves: this run's ``last`` checkpoint in ``ModelCheckpoint.dirpath``, never
    another run's (None when checkpointing is not configured).

    The callback's ``last_model_path`` (this run's last save, restored on resume) when it is in the
    folder and still this run's; else the first of ``last.ckpt``, ``last-v1.ckpt``, ... (the callback's
    names) that is free or holds a checkpoint of run ``run_id``
    (:func:`~lightning_megatron.checkpoint_verify.checkpoint_identity`).
    """
    from lightning_megatron.checkpoint_verify import checkpoint_identity

    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None)
    if not isinstance(callback, ModelCheckpoint) or dirpath is None:
        return None
    folder = Path(dirpath)

    def owner(path: Path) -> str | None:
        return checkpoint_identity(path)[0]

    own = Path(callback.last_model_path) if callback.last_model_path else None
    if own is not None and own.parent == folder and (not own.exists() or owner(own) in (run_id, None)):
        return own  # an unknown owner there: a checkpoint of before run ids, which this run resumed
    for version in range(0, 10_000):
        name = callback.CHECKPOINT_NAME_LAST + ("" if version == 0 else f"{callback.CHECKPOINT_JOIN_CHAR}v{version}")
        path = folder / f"{name}{callback.FILE_EXTENSION}"
        if not path.exists() or (run_id is not None and owner(path) == run_id):
            return path
    raise RuntimeError(f"no free name for a last checkpoint in {folder}")


def stop_before_this_batch(trainer: pl.Trainer) -> None:
    """Raise Lightning's ``SIGTERMException`` from ``on_train_batch_start`` (every rank at the same batch).

    Lightning's training loop has counted the batch it fetched as ready, not started: saved so, a resumed run
    takes the checkpoint for one saved in the middle of a step and counts that batch, so the step its loggers
    write and the batch index that schedules validation ran one ahead of the optimizer steps (step 8 logged as
    9, validation one step early). The count is rolled back first: every checkpoint saved on the way out (the
    stop's, or ``ModelCheckpoint(save_on_exception=True)``'s) reads as one saved after the last completed step.
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for counts in (progress.current, progress.total):
        if counts.ready == counts.started + 1 == counts.processed + 1 == counts.completed + 1:
            counts.ready -= 1
    raise SIGTERMException()


def save_the_final_step(trainer: pl.Trainer) -> None:
    """At the end of a ``fit`` that ran to its end, the ``ModelCheckpoint(save_last=True)``'s ``last`` checkpoint
    is saved again when it holds an earlier step, as Megatron-LM saves at the end of training: a run of 250
    steps saving every 200 ended with ``last`` at step 200, and ``validate`` / ``export`` of ``last`` took that
    model without a word (Lightning saves ``last`` at the end only when the run saved none before).

    Collective (a checkpoint save): every rank calls it, from the strategy's ``on_train_end``."""
    callback = trainer.checkpoint_callback
    if (not isinstance(callback, ModelCheckpoint) or not callback.save_last or trainer.fast_dev_run
            or trainer.state.fn != TrainerFn.FITTING or trainer.interrupted or trainer.global_step == 0
            or callback._last_global_step_saved >= trainer.global_step):
        return
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))  # its names, its bookkeeping


def count_steps_as_taken(trainer: pl.Trainer) -> None:
    """Before a training batch: the loop's count of batches that stepped (the step its loggers write) is the
    optimizer steps taken. A run resumed from a checkpoint saved at the end of training (Lightning's ``last`` at
    ``on_train_end``, or :func:`save_the_final_step`'s) counted its last batch twice, and logged every step one
    late (3, 4, 5 as 4, 5, 6). Only where a batch is one step (automatic optimization, no accumulation)."""
    loop = trainer.fit_loop.epoch_loop
    if (loop._batches_that_stepped != trainer.global_step and trainer.accumulate_grad_batches == 1
            and trainer.lightning_module.automatic_optimization):
        loop._batches_that_stepped = trainer.global_step


def on_stop_signal(trainer: pl.Trainer, exception: BaseException, signum: int = signal.SIGTERM,
                   run_id: str | None = None, requeue: bool = False) -> None:
    """On the ``SIGTERMException`` a stop signal raised: save a checkpoint if configured
    (:func:`stop_checkpoint_path`), make the exit status 128 + ``signum`` (143, 130, 138), and with ``requeue``
    (SLURM's requeue signal came) requeue the job from rank 0 once the save is done (:func:`requeue_job`).

    Collective (the checkpoint save): every rank calls it, which the strategy guarantees by raising
    the exception on every rank at the same batch boundary.
    """
    if not isinstance(exception, SIGTERMException):
        return
    step, name, code = trainer.global_step, signal.Signals(signum).name, 128 + int(signum)
    if trainer.state.fn == TrainerFn.FITTING:
        path = stop_checkpoint_path(trainer, run_id)
        if path is None:
            rank_zero_warn(f"{name} at step {step}: no checkpoint saved (no ModelCheckpoint callback); "
                           f"exiting with status {code}")
        elif getattr(trainer.checkpoint_callback, "save_on_exception", False):
            rank_zero_info(f"{name} at step {step}: ModelCheckpoint(save_on_exception=True) saves the checkpoint")
        else:
            # What the ModelCheckpoint itself saves: the full state (model, optimizer, loops) unless it
            # is set to save_weights_only. Explicit, or Lightning logs that it picked a default.
            callback = trainer.checkpoint_callback
            if isinstance(callback, ModelCheckpoint) and path.name.startswith(callback.CHECKPOINT_NAME_LAST):
                # the callback's own last, recorded in the state it saves: resumed, it saves there again (it
                # took the file for another's and wrote last-v1.ckpt beside it, last.ckpt left at the stop)
                callback.last_model_path = str(path)
            trainer.save_checkpoint(path, weights_only=isinstance(callback, ModelCheckpoint)
                                    and callback.save_weights_only)
            rank_zero_info(f"{name} at step {step}: saved {path}; resume with --ckpt_path last. "
                           f"Exiting with status {code}")
    else:
        stage = getattr(trainer.state.fn, "value", "evaluation")
        rank_zero_info(f"{name}: every rank stopped before the same {stage} batch (nothing to save). Exiting with "
                       f"status {code}")
    if requeue and trainer.is_global_zero:
        requeue_job()
    exception.code = code


def say_ctrl_c_in_start_up(module: Any) -> None:
    """Ctrl-C before the ranks' stop handlers were in place: Lightning's KeyboardInterrupt path, which ends the ranks
    that rank 0 started (those left Ctrl-C to it: ``lightning_megatron.launch.leave_ctrl_c_to_rank_0``); the command
    exits 130 (``lightning_megatron.cli``). Said by global rank 0, with the step: no stop checkpoint is written
    there."""
    trainer = getattr(module, "_trainer", None)
    step, fn = getattr(trainer, "global_step", 0), getattr(getattr(trainer, "state", None), "fn", None)
    when = ("during start-up (before the first step)" if not step else f"at step {step}, outside the training steps")
    if fn is not None and fn != TrainerFn.FITTING:  # an evaluation whose ranks read different batch counts has none
        when = f"during {fn.value}"
    rank_zero_info(f"lightning-megatron: Ctrl-C {when}: every rank stops; no checkpoint is saved for it")


def requeue_signal(environment: Any) -> int | None:
    """The signal after which a job requeues itself: SLURM's (``SLURMEnvironment.requeue_signal``, SIGUSR1) when
    its ``auto_requeue`` is on (Lightning's default under SLURM), else None."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return int(environment.requeue_signal or signal.SIGUSR1)
    return None


def requeue_job() -> bool:
    """``scontrol requeue`` this SLURM job (an array job's task by its array id), as Lightning's SIGUSR1 handler
    does; says what happened. True when scontrol succeeded."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = (f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array_job
           else os.environ.get("SLURM_JOB_ID", ""))
    if not job or not all(c.isdigit() or c in "_-" for c in job):
        rank_zero_warn(f"the job is not requeued: no SLURM job id in the environment ({job!r}); resubmit it with "
                       f"--ckpt_path last")
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        rank_zero_warn(f"scontrol requeue {job} failed ({e}); resubmit the job with --ckpt_path last")
        return False
    if result.returncode != 0:
        rank_zero_warn(f"scontrol requeue {job} failed (status {result.returncode}: {result.stderr.strip()[-500:]}); "
                       f"resubmit the job with --ckpt_path last")
        return False
    rank_zero_info(f"requeued SLURM job {job}: its next start resumes with --ckpt_path last")
    return True
