"""SIGTERM or Ctrl-C (SIGINT) mid-run: a checkpoint is written, the exit status is non-zero (143, 130), and
resuming continues there; a second Ctrl-C aborts at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_python

from lightning_megatron.preemption import SIGINT_EXIT_CODE, SIGTERM_EXIT_CODE, PreemptionHandler

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "reliability_run.py"


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return run_python([str(SCRIPT), str(root), "--devices", "2", "--prewarm", *args], root, env, timeout=400)


def _steps(root: Path, rank: int) -> list[int]:
    return [int(line.split()[0]) for line in (root / f"progress-{rank}.txt").read_text().split("\n") if line]


def test_sigterm_saves_exits_nonzero_and_resumes(tmp_path):
    # 2 ranks (TP=2, rank 0 is Lightning's launcher, rank 1 started early as the command starts it), logging to W&B
    # (offline) as the recipes do, 2 data workers each; rank 0 gets SIGTERM at the end of step 3 of 20, and so do
    # W&B's service process and the data workers, as a signal to every process of the job (SLURM's time limit,
    # scancel) reaches them. Rank 0's next log to W&B raised ConnectionResetError there, and a worker ended by the
    # signal made PyTorch raise "DataLoader worker ... is killed by signal: Terminated": either way the rank died
    # before saving (exit 1, no checkpoint).
    first = _run(tmp_path, "--max-steps", "20", "--fault", "sigterm-job", "--fault-step", "3", "--every", "100",
                 "--wandb", "--workers", "2")
    out = first.stdout + first.stderr
    assert first.returncode == SIGTERM_EXIT_CODE, out[-3000:]
    assert "SIGTERM at step 3: saved" in out, out[-3000:]
    assert out.count("W&B: the W&B service stopped answering (ConnectionResetError") == 1, out[-3000:]
    assert (tmp_path / "ckpt" / "last.ckpt").is_dir(), out[-3000:]
    assert _steps(tmp_path, 0) == [1, 2, 3] and _steps(tmp_path, 1) == [1, 2, 3]  # stopped, both ranks together

    # resumed to step 5, with a SIGTERM at the end of step 5 (after the last step's agreement): the run had
    # finished, and says so (a Ctrl-C there was announced as "exit status 130", then exited 0, unsaid). Then
    # `trainer.validate`, with a SIGTERM to rank 1 alone at its first batch: every rank stops before the same batch,
    # exit 143. Lightning's SIGTERM handler broadcast from inside the handler there, and rank 1 waited in it while
    # rank 0 waited in the model's next collective, both until the collective timeout (60 s here), then exit 1.
    second = _run(tmp_path, "--max-steps", "5", "--ckpt-path", "last", "--every", "100", "--fault", "sigterm",
                  "--fault-step", "5", "--then-validate", "--timeout", "60")
    out = second.stdout + second.stderr
    assert second.returncode == SIGTERM_EXIT_CODE, out[-3000:]
    assert ("lightning-megatron: SIGTERM after the last step (5): the run had finished (its checkpoints are complete): "
            "it ends as a finished run, status 0") in second.stderr, out[-3000:]
    assert ("SIGTERM: every rank stopped before the same validate batch (nothing to save). Exiting with status 143"
            in out), out[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"start-{rank}.txt").read_text() == "3"  # no step lost, none repeated
        assert _steps(tmp_path, rank) == [1, 2, 3, 4, 5]
        # Lightning's batch counts go on as uninterrupted: the step its loggers write and the batch index that
        # schedules validation are step - 1 at a step's end (the stop checkpoint had counted the batch it did not
        # start: the resumed run logged step k as k + 1 and validated one step early)
        lines = [line.split() for line in (tmp_path / f"progress-{rank}.txt").read_text().splitlines() if line]
        assert [(int(x[2]), int(x[3])) for x in lines] == [(s - 1, s - 1) for s in [1, 2, 3, 4, 5]], lines
    # the resumed run's final save is its last.ckpt, the one the stop wrote: the stop's save left the callback's
    # last_model_path out of what it saved, so the resumed callback took last.ckpt for another's and wrote
    # last-v1.ckpt beside it (a script reading last.ckpt got step 3)
    from lightning_megatron.checkpoint import checkpoint_identity

    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt"]
    assert checkpoint_identity(tmp_path / "ckpt" / "last.ckpt")[1] == 5


def test_handler_flags_and_exit_code():
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_megatron.preemption import on_stop_signal

    for signum, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        handler = PreemptionHandler()
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        handler.install()
        try:
            assert not handler.should_stop(torch.device("cpu"))
            os.kill(os.getpid(), signum)  # handled: the test process keeps running
            assert handler.should_stop(torch.device("cpu")) and handler.received == signum
            assert handler.exit_code == code
            # after a first Ctrl-C, a second one takes SIGINT's default action (ends the process at once)
            assert (signal.getsignal(signal.SIGINT) == signal.SIG_DFL) == (signum == signal.SIGINT)
        finally:
            handler.uninstall()
        assert {s: signal.getsignal(s) for s in previous} == previous
    # on the way out after a Ctrl-C (the checkpoint saved, the ranks waited for) a second one still ends the process
    # at once: teardown gave SIGINT back Python's KeyboardInterrupt, and a second press while rank 0 waited for the
    # others printed a traceback and exited 1, not 130
    handler = PreemptionHandler()
    previous = signal.getsignal(signal.SIGINT)
    handler.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        handler.exiting = True  # the stop's checkpoint is saved: teardown, then leave
        handler.uninstall()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL and signal.getsignal(signal.SIGTERM) != handler._handle
        handler.leave()  # the ranks waited for: the process exits next, and the handler is given back
        assert signal.getsignal(signal.SIGINT) == previous
    finally:
        signal.signal(signal.SIGINT, previous)
    assert handler.received == signal.SIGINT

    class _Trainer:  # not fitting: nothing to save, only the exit status
        global_step = 0
        state = type("S", (), {"fn": None})()

    for signum, code in ((signal.SIGTERM, SIGTERM_EXIT_CODE), (signal.SIGINT, SIGINT_EXIT_CODE)):
        exc = SIGTERMException()
        on_stop_signal(_Trainer(), exc, signum)
        assert exc.code == code
        with pytest.raises(SystemExit) as info:
            raise exc
        assert info.value.code == code
    assert (SIGTERM_EXIT_CODE, SIGINT_EXIT_CODE) == (143, 130)
    other = RuntimeError("x")
    on_stop_signal(_Trainer(), other)  # other exceptions are left alone


_SECOND_SIGINT = """
import os, signal, sys, time
from lightning_megatron.preemption import PreemptionHandler

handler = PreemptionHandler()
handler.install(announce=True)
os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: only a flag
time.sleep(0.2)
print("alive", handler.received, flush=True)
os.kill(os.getpid(), signal.SIGINT)  # the second: the process ends at once
time.sleep(5)
print("not aborted", flush=True)
"""


def test_a_second_ctrl_c_aborts_at_once():
    proc = run_python(["-c", _SECOND_SIGINT], REPO, {**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert proc.stdout == f"alive {int(signal.SIGINT)}\n", proc.stdout
    assert proc.stderr.count("press Ctrl-C again to abort at once") == 1, proc.stderr


def _ctrl_c_run(tmp_path, step: int):
    """A 2-rank `lightning-megatron fit` (TP=2) whose rank 0 sends Ctrl-C to the job at ``step`` (0: at set-up)."""
    cmd = [sys.executable, "-m", "lightning_megatron.cli", "fit", "--config", str(REPO / "recipes" / "bert_tiny.yaml"),
           "--trainer.devices", "2", "--trainer.strategy.tensor_model_parallel_size", "2",
           "--trainer.strategy.cpu_tuning", "false", "--trainer.default_root_dir", str(tmp_path / "run"),
           "--trainer.enable_progress_bar", "false", "--model.config.num_layers", "1",
           "--model.config.hidden_size", "32", "--model.config.num_attention_heads", "2",
           "--model.config.ffn_hidden_size", "64", "--data.global_batch_size", "2",
           "--data.micro_batch_size", "2", "--data.max_seq_length", "32", "--model.config.max_sequence_length", "32",
           "--trainer.max_steps", "20", "--trainer.limit_val_batches", "0", "--trainer.log_every_n_steps", "1",
           "--trainer.callbacks+=cli_faults.SignalAt", f"--trainer.callbacks.step={step}",
           "--trainer.callbacks.signal=SIGINT"]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH") or str(REPO)])}
    # A session of its own: the job's process group is what a terminal's Ctrl-C reaches (not pytest)
    return run_python(cmd[1:], tmp_path, env, timeout=400, start_new_session=True)


def test_ctrl_c_of_a_two_rank_cli_run_saves_and_exits_130(tmp_path):
    """Ctrl-C in a terminal (SIGINT to every process of the job) at the end of step 3 of 20 of a 2-rank
    `lightning-megatron fit` (TP=2): both ranks stop after step 3, last.ckpt holds step 3, the CSV log
    has every step, and the exit status is 130. Before: exit 1, nothing saved, the CSV empty."""
    import csv

    from lightning_megatron.checkpoint import checkpoint_identity

    proc = _ctrl_c_run(tmp_path, 3)
    out = proc.stdout + proc.stderr
    assert proc.returncode == SIGINT_EXIT_CODE, out[-4000:]
    assert out.count("press Ctrl-C again to abort at once") == 1, out[-4000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert f"SIGINT at step 3: saved {last}" in out, out[-4000:]
    assert checkpoint_identity(last)[1] == 3
    [metrics] = (tmp_path / "run").rglob("metrics.csv")
    assert len([r for r in csv.DictReader(metrics.open()) if r.get("loss")]) == 3, metrics.read_text()


def test_ctrl_c_in_start_up_ends_every_rank_with_130_and_no_traceback(tmp_path):
    """Ctrl-C while the ranks start (at set-up: connected, the stop handlers not yet in place). Rank 1, which rank 0
    started, raised KeyboardInterrupt with a traceback; its exit made Lightning's observer SIGKILL rank 0 (status
    137, or 1). It leaves Ctrl-C to rank 0 now: rank 0 ends the ranks it started, says so once, and exits 130."""
    proc = _ctrl_c_run(tmp_path, 0)
    out = proc.stdout + proc.stderr
    assert proc.returncode == SIGINT_EXIT_CODE, out[-4000:]
    assert "Traceback" not in out and "Forcefully terminating" not in out, out[-4000:]
    assert out.count("lightning-megatron: Ctrl-C during start-up (before the first step): every rank stops") == 1, out
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_ctrl_c_after_the_fit_ends_leaves_in_order_and_exits_0(tmp_path):
    """Ctrl-C once the fit has ended (its last checkpoint saved, the strategy torn down), before the command's ordered
    way out: rank 0 raised KeyboardInterrupt while rank 1 waited in leave()'s barrier, which said "another rank died"
    with status 130 (or rank 0 died of the signal, -2) for a finished run. The stop handler keeps SIGINT until the ranks
    have left: the command says so and exits 0, as a finished run."""
    proc = _ctrl_c_run(tmp_path, -1)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out and "another rank died" not in out, out[-4000:]
    assert out.count("lightning-megatron: Ctrl-C after the run finished: the ranks leave in order") == 1, out[-4000:]


_LEAVE_SCRIPT = """
import subprocess, sys, time
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning_megatron.preemption import PreemptionHandler

launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)  # Lightning's own
launcher.procs.append(subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(1.0); sys.exit(143)"]))
observer = _ChildProcessObserver(0, launcher.procs, sleep_period=0.2)  # Lightning's own, polling fast
observer._main_pid = __import__("os").getpid()
observer.start()
child = launcher.procs[0]
PreemptionHandler().leave(launcher, wait_s=30)  # no process group here: only the children part
assert child.returncode == 143, child.returncode
time.sleep(1.0)  # the observer has polled several times since the child exited with 143
print("left")
"""


def test_leave_waits_for_children_without_being_killed_by_lightnings_observer():
    # Lightning's child observer SIGKILLs the launching rank when a child exits non-zero, which every
    # child does after a SIGTERM (143): leave() waits for the children with the observer disarmed.
    proc = run_python(["-c", _LEAVE_SCRIPT], REPO, {**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0 and "left" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr[-2000:])


def test_slurms_requeue_signal_stops_every_rank_saves_last_and_requeues(tmp_path):
    """SLURM's requeue (``#SBATCH --signal=USR1@90``, Lightning's ``SLURMEnvironment(auto_requeue=True)``): SIGUSR1
    reaches every task at the end of step 3 of 20 of a 2-rank (TP=2) run started as SLURM tasks. Both ranks stop
    before the same step, this run's ``last`` checkpoint holds step 3, rank 0 runs ``scontrol requeue <job>`` once
    (a stand-in on PATH records it), and the ranks exit 138 (128 + SIGUSR1). Lightning's handler saved
    ``hpc_ckpt_1.ckpt`` from inside the signal handler on each rank, wherever its step was (a collective save at
    different points of the ranks' collectives), which ``--ckpt_path last`` does not read, and trained on."""
    from dist_utils import start_python
    from launch_lines import free_port, slurm_job_id

    from lightning_megatron.checkpoint import checkpoint_identity

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.txt'}\n")
    (bindir / "scontrol").chmod(0o755)
    job = slurm_job_id()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
           "MASTER_PORT": str(free_port()), "SLURM_JOB_ID": job, "SLURM_JOB_NAME": "bert", "SLURM_NNODES": "1",
           "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}
    args = [str(SCRIPT), str(tmp_path), "--devices", "2", "--max-steps", "20", "--fault", "usr1", "--fault-step", "3",
            "--every", "100", "--timeout", "120"]
    ranks = [start_python(args, tmp_path, {**env, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}) for i in (0, 1)]
    done = [rank.wait(timeout=300) for rank in ranks]
    out = "".join(d.stdout + d.stderr for d in done)
    assert [d.returncode for d in done] == [128 + signal.SIGUSR1] * 2, out[-4000:]
    assert _steps(tmp_path, 0) == [1, 2, 3] and _steps(tmp_path, 1) == [1, 2, 3], out[-3000:]
    assert checkpoint_identity(tmp_path / "ckpt" / "last.ckpt")[1] == 3
    assert (tmp_path / "scontrol.txt").read_text() == f"requeue {job}\n"
    assert "SIGUSR1 at step 3: saved" in out and f"requeued SLURM job {job}" in out, out[-3000:]
    assert not list(tmp_path.rglob("hpc_ckpt*")), out[-3000:]


def test_a_signal_handled_during_the_agreement_stops_the_next_step(monkeypatch):
    """A signal whose handler ran while the ranks' all-reduce of the flags was in flight (on a GPU, while the host
    waited for the device) was overwritten by the reduced value: SLURM's requeue signal, sent once, was lost."""
    import torch.distributed as dist

    handler = PreemptionHandler()
    handler.requeue_signal, handler._pid = int(signal.SIGUSR1), os.getpid()  # as install() sets them

    def all_reduce(flag, op=None):  # the others had no signal; this rank's handler runs meanwhile
        handler._handle(signal.SIGUSR1, None)

    with monkeypatch.context() as m:  # undone before the fixtures' teardown looks for a process group
        m.setattr(dist, "is_initialized", lambda: True)
        m.setattr(dist, "get_world_size", lambda group=None: 2)
        m.setattr(dist, "all_reduce", all_reduce)
        assert not handler.should_stop(torch.device("cpu"))  # the agreed decision of this step: go on
    assert handler.received == signal.SIGUSR1 and handler.requeue  # kept for the next agreement


class _WorkerSignals(torch.utils.data.Dataset):
    """Each item: what the worker reading it does on SIGTERM, SIGUSR2 and SIGHUP, and what its own init set."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i):
        return [int(signal.getsignal(s)) if isinstance(signal.getsignal(s), int) else -1
                for s in (signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP)] + [int(os.environ.get("INIT_RAN", "0"))]


def _own_init(worker_id: int) -> None:
    os.environ["INIT_RAN"] = "1"


def test_data_workers_leave_the_stop_signals_to_the_training_process():
    """A signal to every process of the job reaches the data workers too; ended by it, PyTorch raised "DataLoader
    worker ... is killed by signal: Terminated" in the rank before its stop save (the 2-rank run above signals them).
    The workers ignore the stop signals and the environment's requeue signal (SIGUSR2 here), the loader's own
    ``worker_init_fn`` still runs, and other signals keep their action."""
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from torch.utils.data import DataLoader

    from lightning_megatron.preemption import WorkerIgnoresStopSignals, leave_stop_signals_to_the_trainer

    loader = DataLoader(_WorkerSignals(), batch_size=None, num_workers=1, worker_init_fn=_own_init)
    assert leave_stop_signals_to_the_trainer(loader, SLURMEnvironment(requeue_signal=signal.SIGUSR2)) is loader
    assert isinstance(loader.worker_init_fn, WorkerIgnoresStopSignals)
    [[term, usr2, hup, init_ran]] = [list(x) for x in loader]
    assert (term, usr2, init_ran) == (int(signal.SIG_IGN), int(signal.SIG_IGN), 1)
    assert hup == int(signal.getsignal(signal.SIGHUP))  # not a stop signal: left alone
    in_process = DataLoader(_WorkerSignals(), batch_size=None)
    assert leave_stop_signals_to_the_trainer(in_process).worker_init_fn is None  # no workers: nothing to do
