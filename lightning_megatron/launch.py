"""Local ranks started before they are needed: they import while rank 0 reads the recipe.

Lightning's subprocess launcher starts local ranks 1..N-1 when rank 0 reaches ``trainer.fit``; each
then imports torch, Lightning and ours (~4 s on 2 cores) while rank 0 waits for it at the
rendezvous, so a 2-process command paid its imports twice, one after the other. The
``lightning-megatron`` command starts those ranks as soon as it has read the recipe
(:func:`prewarm`): each imports what every rank imports, then waits on a pipe. Lightning still
launches: ``MegatronStrategy``'s launcher is Lightning's own (:func:`hand_to_waiting` around it), and where
it would start local rank k with ``subprocess.Popen(command, env=..., cwd=...)``, the waiting
process k receives that command line, environment and folder and runs the command as Python would
(a script, or ``-m module``), so it is the process Lightning would have started, begun earlier.

While it waits, it also imports the classes the command names (:func:`named_classes`: the recipe's and
the command line's class paths, and the command's default model and data classes) and reads their
signatures as LightningCLI's parse will, which imports the modules their annotations name (W&B's for
the ``WandbLogger``): work of the rank's parse that came after its order, while rank 0 waited
(docs/benchmarks.md, "Start-up").

A command's start-up imports thousands of modules; CPython's full garbage collections during them walk the
growing heap again and again. The command (``lightning-megatron``, and a waiting rank) pauses the
collector for its imports (:func:`pause_collection`) and then freezes what they made out of every
later collection (:func:`resume_collection`, ``gc.freeze``): modules, classes and functions, which
live as long as the process. Only the command's own process does this: the library called from a
user's program leaves the collector alone.

The command that will start W&B also imports, before torch and Lightning, what ``wandb.init`` imports last
(:func:`import_wandb_ahead`): that import scans ``sys.modules`` once per stack frame, so it costs a few times
less while few modules are loaded than on rank 0's W&B thread later.

A guess that was wrong (another device count, another strategy, a command it cannot run) costs
only the imports: Lightning starts what is missing itself, and a waiting process that is not used
is ended by rank 0 (:func:`release`: after a refusal, an error, or at its exit) or exits when its pipe
closes (rank 0's death).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["prewarm", "import_wandb_ahead", "release", "local_processes", "named_classes", "hand_to_waiting",
           "pause_collection", "resume_collection", "exit_when_parent_dies", "leave_ctrl_c_to_rank_0",
           "sigint_handler_after_start", "started_by_rank_0", "PREWARM_ENV", "CLASSES_ENV", "CHILD_ENV"]

PREWARM_ENV = "LIGHTNING_MEGATRON_PREWARM_FD"
"""Set in a waiting rank's environment: the file descriptor of the pipe its order arrives on."""

CHILD_ENV = "LIGHTNING_MEGATRON_LAUNCHED_BY_RANK_0"
"""Set in the environment of a local rank that rank 0 started (Lightning's launcher through the strategy's, a waiting
rank among them): its parent is rank 0, whose death ends it while it connects (:func:`exit_when_parent_dies`), and
it leaves Ctrl-C to rank 0 until its stop handler is in place (:func:`leave_ctrl_c_to_rank_0`)."""

CLASSES_ENV = "LIGHTNING_MEGATRON_PREWARM_CLASSES"
"""Set in a waiting rank's environment: the class paths it imports while it waits, comma-separated."""

_CLASS_PATH_OPTIONS = ("--model", "--data", "--optimizer", "--lr_scheduler", "--trainer.strategy",
                       "--trainer.logger", "--trainer.callbacks", "--trainer.plugins")
"""Command-line options whose value LightningCLI reads as a class path (also ``--X.class_path``, and ``+=``)."""

_STARTED_ELSEWHERE = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "LSB_JOBID", "OMPI_COMM_WORLD_SIZE",
                      "PMI_SIZE")
"""Environment variables of a rank, or of a cluster that starts the ranks itself: no prewarming there."""

_IMPORTS = ("lightning.pytorch.cli", "lightning_megatron.strategy", "lightning_megatron.callbacks",
            "lightning_megatron.loggers", "lightning_megatron.module")
"""What every rank of the command imports before it parses anything."""


@dataclass
class _Waiting:
    local_rank: int
    proc: subprocess.Popen
    pipe: int  # the write end of its order pipe


_FIRST_PARENT = os.getppid()
"""This process's parent when it started (imported this module, or was forked): a local rank's launcher."""


def _forked() -> None:
    global _FIRST_PARENT
    _FIRST_PARENT = os.getppid()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forked)
_waiting: list[_Waiting] = []
_collection_paused = False
_started_by_rank_0 = False


def started_by_rank_0() -> bool:
    """Whether this process is a local rank that rank 0 started (:data:`CHILD_ENV` in its environment when the
    package was first imported, or when its order came: :func:`leave_ctrl_c_to_rank_0`)."""
    return _started_by_rank_0


def _ctrl_c_during_start_up(signum: int, frame: Any) -> None:
    """SIGINT's handler in a rank that rank 0 started, until its stop handler is in place: nothing (rank 0 decides)."""


def leave_ctrl_c_to_rank_0() -> None:
    """In a local rank that rank 0 started (:data:`CHILD_ENV`): Ctrl-C does nothing until the stop handler is in place.
    Ctrl-C in a terminal reaches every process of the job. In this rank's start-up (its imports, the parse, the
    rendezvous, the model's build) Python's KeyboardInterrupt ended it with a traceback and status 1, and
    Lightning's child observer then SIGKILLed rank 0 (status 137). Rank 0 ends the command alone now: Lightning's
    KeyboardInterrupt path there kills the ranks it started, and the command exits 130. Once the ranks' stop handlers
    are in place (``PreemptionHandler.install``), a Ctrl-C is agreed by every rank as before; the handler gives
    Python's default back when it leaves (:func:`sigint_handler_after_start`). A handler that does nothing, not
    ``SIG_IGN``: a program this rank starts begins with Ctrl-C's default action (an ignored signal stays ignored
    across ``exec``), and the variable leaves the environment (:func:`started_by_rank_0` keeps it), so that what this
    rank starts is not taken for a rank."""
    import signal
    import threading

    global _started_by_rank_0
    if os.environ.pop(CHILD_ENV, None) != "1":
        return
    _started_by_rank_0 = True
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, _ctrl_c_during_start_up)


def sigint_handler_after_start(handler: Any) -> Any:
    """SIGINT's handler for a stop handler to give back when it leaves, ``handler`` being the one it replaced:
    Python's default where :func:`leave_ctrl_c_to_rank_0` left Ctrl-C to rank 0 for the start-up only."""
    import signal

    return signal.default_int_handler if handler is _ctrl_c_during_start_up else handler


def pause_collection() -> None:
    """No cyclic garbage collection until :func:`resume_collection` (a command, before its imports)."""
    global _collection_paused
    if gc.isenabled():
        gc.disable()
        _collection_paused = True


def resume_collection() -> None:
    """The imports are done: everything alive now is frozen out of later collections (``gc.freeze``:
    reference counting still frees it) and collection resumes. Nothing unless :func:`pause_collection`
    paused it: called from a user's program, the library leaves the collector as it is. The cycles the
    imports left as garbage are frozen with them: collecting them first would cost a full walk of the
    heap, for a few MB (docs/benchmarks.md, "Start-up: the garbage collector during the imports")."""
    global _collection_paused
    if _collection_paused:
        _collection_paused = False
        gc.freeze()
        gc.enable()


def local_processes(argv: list[str]) -> int:
    """The processes per node ``argv`` asks for when it says so as a number (``--trainer.devices 2``
    on the command line, last one winning, else the last ``--config`` recipe's ``trainer.devices``);
    1 for anything else (``auto``, a list of devices, none given): only a guess that saves time."""
    from lightning_megatron.recipes import config_recipes

    value: Any = None
    for recipe in config_recipes(argv):
        trainer = recipe.get("trainer")
        if isinstance(trainer, dict) and "devices" in trainer:
            value = trainer["devices"]
    for i, arg in enumerate(argv):
        option, eq, given = arg.partition("=")
        if option == "--trainer.devices":
            value = given if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    if isinstance(value, bool):
        return 1
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return value if isinstance(value, int) and value > 1 else 1


def named_classes(argv: list[str]) -> list[str]:
    """The class paths the command ``argv`` names, where LightningCLI reads one: every ``class_path``
    of its ``--config`` recipes (nested ones too), and the values of the command line's class-path
    options (``--model X``, ``--trainer.logger+=X``, ``--data.class_path X`` ...), in order, once each."""
    from lightning_megatron.recipes import config_recipes

    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if isinstance(value.get("class_path"), str):
                found.append(value["class_path"])
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for recipe in config_recipes(argv):
        walk(recipe)
    for i, arg in enumerate(argv):
        option, eq, given = arg.partition("=")
        option = option.removesuffix("+")
        if option in _CLASS_PATH_OPTIONS or (option.startswith("--") and option.endswith(".class_path")):
            value = given if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if value.replace(".", "").replace("_", "").isalnum() and "." in value:  # a dotted name, not YAML
                found.append(value)
    return list(dict.fromkeys(found))


def prewarm(argv: list[str], also: list[str] | tuple[str, ...] = ()) -> None:
    """Start local ranks 1..N-1 of the command ``argv`` now, waiting for their order (N from
    :func:`local_processes`); nothing inside a rank, under a cluster that starts ranks itself,
    for a help or print-config call, or when N is 1. While they wait they import the classes
    ``argv`` names (:func:`named_classes`) and those in ``also`` (the command's defaults)."""
    if _waiting or any(k in os.environ for k in (PREWARM_ENV, *_STARTED_ELSEWHERE)):
        return
    if any(a in ("-h", "--help", "--print_config") or a.startswith("--print_config=") for a in argv):
        return
    processes = local_processes(argv)
    classes = list(dict.fromkeys([*named_classes(argv), *also])) if processes > 1 else []
    for local_rank in range(1, processes):
        _waiting.append(_start_waiting(local_rank, classes))
    if _waiting:
        atexit.register(release)


def import_wandb_ahead(argv: list[str]) -> None:
    """Import W&B, and the part of it ``wandb.init`` imports last, now, while few modules are loaded, when the
    command ``argv`` names a ``WandbLogger`` and this process is the one that starts the command's ranks.

    ``wandb.init`` imports ``wandb.sdk.launch`` (W&B Launch's staged inputs) once the run is ready. Its pydantic
    models read their docstrings by walking the stack with ``inspect.getmodule``, which scans ``sys.modules``
    for each frame: 0.35-0.7 s on rank 0's W&B thread with the ~4,000 modules of a command loaded, against
    ~0.13 s before torch and Lightning are (docs/benchmarks.md, "Start-up"). Nothing else changes: the
    same modules, imported earlier. (On a node other than the first, whose rank 0 starts no W&B run, it is
    ~0.13 s spent for nothing: the parse imports ``wandb`` itself.)"""
    if "torch" in sys.modules or os.environ.get("WANDB_MODE") == "disabled":
        return  # no longer cheaper; no W&B run
    if any(k in os.environ for k in (PREWARM_ENV, *_STARTED_ELSEWHERE)):
        return  # a rank, not the process that starts them
    if not any(path.rpartition(".")[2] == "WandbLogger" for path in named_classes(argv)):
        return
    try:
        import wandb.sdk.launch.inputs.internal  # noqa: F401 - what wandb.init imports once the run is ready
    except Exception:  # noqa: BLE001,S110 - another W&B version: wandb.init imports what it needs itself
        pass


def _start_waiting(local_rank: int, classes: list[str]) -> _Waiting:
    """Local rank ``local_rank`` started as a new interpreter that imports (``classes`` too) and waits
    for its order (:func:`_wait`) on a pipe whose write end is returned (tests/dist_utils.py forks it
    instead)."""
    read, write = os.pipe()
    env = dict(os.environ, LOCAL_RANK=str(local_rank), **{PREWARM_ENV: str(read), CLASSES_ENV: ",".join(classes),
                                                           CHILD_ENV: "1"})
    # LOCAL_RANK: as Lightning's rank k has it at import (rank_zero_only.rank is read from it then); CHILD_ENV: it
    # leaves Ctrl-C to rank 0 from its first import of the package (leave_ctrl_c_to_rank_0)
    proc = subprocess.Popen([sys.executable, "-c", "from lightning_megatron.launch import _wait; _wait()"],
                            env=env, pass_fds=(read,))
    os.close(read)
    return _Waiting(local_rank, proc, write)


def release() -> None:
    """End the waiting ranks no launcher took, now: they have run nothing but imports, so they are
    killed rather than left to finish importing (seconds of CPU taken from this process, on every
    refused command) and reaped before this returns."""
    while _waiting:
        rank = _waiting.pop()
        os.close(rank.pipe)
        rank.proc.kill()
        rank.proc.wait()


@contextlib.contextmanager
def exit_when_parent_dies(who: str, doing: str, poll_s: float = 0.2) -> Iterator[None]:
    """While the block runs, end this process when its parent dies. For a local rank > 0 while it connects to the
    other ranks through the rendezvous store that rank 0, its parent, hosts: rank 0 killed before it hosted the store
    left the rank in the connect for the whole timeout (retried once: 30-60 minutes at the default), saying only that
    a client socket timed out. The connect is a C call that keeps the GIL (torch's TCPStore constructor), so no
    Python thread can watch meanwhile: on Linux the kernel kills the process when the parent dies
    (``PR_SET_PDEATHSIG``, SIGKILL, set for the block only). Elsewhere a thread watches the parent's pid, ends the
    process with status 1 and says why (``who``, ``doing``), when the block lets it run."""
    if _parent_death_signal(9):
        if os.getppid() != _FIRST_PARENT:  # died before the signal was set: the kernel will not send it
            os.write(2, f"lightning-megatron: {who}: its launcher (pid {_FIRST_PARENT}) died before it was {doing}; "
                        f"exiting\n".encode())
            os._exit(1)
        try:
            yield
        finally:
            _parent_death_signal(0)
        return
    import threading

    parent, done = _FIRST_PARENT, threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            if os.getppid() != parent:
                os.write(2, f"lightning-megatron: {who}: its launcher (pid {parent}) died while it was {doing}; "
                            f"exiting instead of waiting for the timeout\n".encode())
                os._exit(1)

    threading.Thread(target=watch, name="lightning-megatron parent watch", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _parent_death_signal(signum: int) -> bool:
    """Linux's ``prctl(PR_SET_PDEATHSIG, signum)`` (0: none); False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(1, signum, 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def _runnable(command: list[str]) -> bool:
    """Whether a waiting rank can run ``command`` as this interpreter would: ``python script args``
    or ``python -m module args`` (Lightning's command for a rank), with this interpreter."""
    if len(command) < 2 or os.path.realpath(command[0]) != os.path.realpath(sys.executable):
        return False
    return (command[1] == "-m" and len(command) >= 3) or not command[1].startswith("-")


class _PopenFromWaiting:
    """Lightning's launcher module's ``subprocess``, whose ``Popen`` hands the command to the waiting
    rank of its ``LOCAL_RANK`` (or starts it, when none waits or it cannot run it)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, command: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
              **kwargs: Any) -> subprocess.Popen:  # noqa: N802 - subprocess's name
        env = dict(os.environ if env is None else env)
        rank = next((w for w in _waiting if str(w.local_rank) == env.get("LOCAL_RANK")), None)
        if rank is None or kwargs or not _runnable(list(command)) or rank.proc.poll() is not None:
            return subprocess.Popen(command, env=env, cwd=cwd, **kwargs)
        _waiting.remove(rank)
        order = json.dumps({"command": list(command), "env": env, "cwd": cwd}).encode()
        try:
            view = memoryview(order)
            while view:
                view = view[os.write(rank.pipe, view):]
        finally:
            os.close(rank.pipe)
        return rank.proc


@contextlib.contextmanager
def hand_to_waiting(launcher_module: Any) -> Iterator[None]:
    """While Lightning's launcher (in ``launcher_module``) starts the local ranks: each ``Popen`` of
    it is handed to the waiting rank of its ``LOCAL_RANK``; after, the ranks not taken are released."""
    if not _waiting:
        yield
        return
    launcher_module.subprocess = _PopenFromWaiting()
    try:
        yield
    finally:
        launcher_module.subprocess = subprocess
        release()


def _warm(classes: list[str]) -> None:
    """Import each of ``classes`` (class paths) and read its signature as LightningCLI's parse does
    (jsonargparse's ``add_class_arguments``, which imports what the annotations name, even under
    ``TYPE_CHECKING``); one that fails is left to the command's own parse to report, so nothing is said
    here (its warnings neither: they are the parse's to give)."""
    import warnings

    from lightning.pytorch.cli import LightningArgumentParser

    from lightning_megatron.recipes import import_class

    for path in classes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                parser = LightningArgumentParser(exit_on_error=False)
                parser.add_class_arguments(import_class(path), "warm", fail_untyped=False)
            except Exception:  # noqa: BLE001,S112 - the command's parse reports it, with its context
                continue


def _wait() -> None:
    """A waiting rank: import, wait for the order (none: exit quietly), become the command."""
    import importlib
    import runpy

    fd = int(os.environ.pop(PREWARM_ENV))
    os.environ[CHILD_ENV] = "1"  # started by rank 0 (a fork too), which ends it when it is not needed (release)
    leave_ctrl_c_to_rank_0()
    classes = [c for c in os.environ.pop(CLASSES_ENV, "").split(",") if c]
    pause_collection()
    try:
        for name in _IMPORTS:
            importlib.import_module(name)
        _warm(classes)
        resume_collection()
        with os.fdopen(fd, "rb") as pipe:
            order = pipe.read()
    except KeyboardInterrupt:  # Ctrl-C of the command before this rank left it to rank 0 (its interpreter's start)
        raise SystemExit(130) from None
    if not order:
        raise SystemExit(0)  # not needed (rank 0 launched otherwise, failed, or exited)
    order = json.loads(order)
    os.environ.clear()
    os.environ.update(order["env"])
    leave_ctrl_c_to_rank_0()  # its variable, back with the order's environment, leaves it again
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    rank_zero_only.rank = _get_rank() or 0  # as read at import by a process started with this environment
    if order["cwd"]:
        os.chdir(order["cwd"])
    command = order["command"]
    if command[1] == "-m":
        sys.argv = [command[2], *command[3:]]  # runpy puts the module's file in argv[0]
        sys.path[0] = os.getcwd()  # as `python -m` has it
        runpy.run_module(command[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = command[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(command[1]))  # as `python script` has it
        runpy.run_path(command[1], run_name="__main__")
