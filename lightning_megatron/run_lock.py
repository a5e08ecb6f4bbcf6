"""One ``fit`` at a time in a run folder: the lock the process that starts every rank holds there while it runs.

Two runs started at once into one run folder (``trainer.default_root_dir``: its logs' versions, its W&B files, its
checkpoints) wrote one ``csv/version_0/metrics.csv`` together and the second's ``hparams.yaml`` replaced the first's.
:func:`one_run_at_a_time` takes an exclusive ``flock`` of :data:`RUN_LOCK` there once the command's configuration
passed every check; the kernel releases it when the process ends, however it ends.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["RUN_LOCK", "RunFolderBusy", "claim_at_setup", "command_line", "holder", "one_run_at_a_time",
           "release_run_locks"]

RUN_LOCK = ".lightning-megatron.lock"
"""The file in a run folder whose lock the process of global rank 0 of a ``fit`` holds while it runs."""
_run_locks: dict[str, int] = {}
_deferred: list[str] = []
"""The run folder of a ``fit`` whose ranks a launcher started: locked by global rank 0 at set-up."""


class RunFolderBusy(RuntimeError):
    """Raised on every rank of a job a launcher started (torchrun, srun) whose global rank 0 found the run folder's
    lock held by another run, once the ranks are connected and before any group, model or file is made."""


def one_run_at_a_time(config, fitting: bool) -> None:
    """``fit``, once its configuration passed every check (a refused command writes nothing): one run at a time in a
    run folder (``trainer.default_root_dir``: its logs' versions, its W&B files, its checkpoints). Two runs started
    at once there wrote one ``csv/version_0/metrics.csv`` together and the second's ``hparams.yaml`` replaced the
    first's. The process that will be global rank 0 takes an exclusive ``flock`` of :data:`RUN_LOCK` there, held
    until it exits however it ends (the kernel releases it), with who holds it written in the file; a lock held by
    another process is refused before launch, naming it. Where a launcher starts the ranks (torchrun, srun: a
    refusal here would leave the others waiting in the rendezvous), the folder is noted and global rank 0 takes the
    lock once the ranks are connected (:func:`claim_at_setup`); every rank then refuses together. Where the file
    system has no locks (or no ``fcntl``), nothing is checked."""
    trainer = config.get("trainer") if hasattr(config, "get") else None
    if not fitting or not trainer:
        return
    given = os.fspath(trainer.get("default_root_dir") or os.getcwd())
    if "://" in given:  # an object store: no lock there
        return
    root = os.path.abspath(given)
    if not _launches_every_rank(trainer):
        _deferred[:] = [root]
        return
    refusal = _take(root)
    if refusal is not None:
        raise SystemExit(f"lightning-megatron: {refusal}") from None


def claim_at_setup(global_rank: int) -> str | None:
    """For a ``fit`` whose ranks a launcher started (:func:`one_run_at_a_time` noted its run folder): global rank 0
    takes the folder's lock now that the ranks are connected. Returns why the run must not go on (another run holds
    the lock, named), for the strategy to say on every rank at once; None otherwise (and on every other rank)."""
    if not _deferred:
        return None
    root = _deferred.pop()
    return _take(root) if global_rank == 0 else None


def _take(root: str) -> str | None:
    """Take the exclusive lock of the run folder ``root`` for this process's life; why not, when another process
    holds it (None: taken, or not checkable here)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None
    if root in _run_locks:  # this process's own run (a program calling main twice)
        return None
    path = os.path.join(root, RUN_LOCK)
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None  # a folder that cannot be written: the configuration check says so
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        said = _who(os.read(fd, 4096))
        os.close(fd)
        return (f"another run is training in {root} now ({said}); two runs there would write one metrics file "
                f"and mix their logs and checkpoints. Wait for it to end (then --ckpt_path last continues it), or "
                f"start this one in another folder: --trainer.default_root_dir {os.path.normpath(root)}-2 (no such "
                f"run: a network file system keeps a crashed host's lock; remove {path})")
    except OSError:  # a file system without locks
        os.close(fd)
        return None
    import socket
    import time

    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": command_line(sys.argv[1:])[:300]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    _run_locks[root] = fd  # held while this process lives
    return None


def holder(root: str | os.PathLike[str]) -> str | None:
    """Who trains in the run folder ``root`` now (``pid ... on ..., started ...: command``): another process holds
    its lock; None when none does, or where this process does, or the file system has no locks."""
    try:
        import fcntl
    except ImportError:
        return None
    folder = os.path.abspath(os.fspath(root))
    path = os.path.join(folder, RUN_LOCK)
    if folder in _run_locks or not os.path.isfile(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a moment's shared lock: free unless a run holds it
    except BlockingIOError:
        return _who(os.read(fd, 4096))
    except OSError:
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _who(record: bytes) -> str:
    try:
        who = json.loads(record.decode("utf-8", "replace"))
        return f"pid {who['pid']} on {who['host']}, started {who['started']}: {who['command']}"
    except (ValueError, KeyError, TypeError):
        return "its process holds the lock"


def command_line(argv: list[str]) -> str:
    """``lightning-megatron ARGS`` as it was typed (a recipe merged with its bases named by its file), quoted as a
    shell would take it."""
    import shlex

    from lightning_megatron.recipes import typed_arguments

    return shlex.join(["lightning-megatron", *typed_arguments(argv)])


def _launches_every_rank(trainer) -> bool:
    """Whether this process starts every rank of the run itself (one node, no launcher of a cluster's: torchrun,
    srun, mpirun): its refusal then ends the run whole. Where other processes start ranks too, they would wait for it
    in the rendezvous until the timeout: the lock is taken at set-up there (:func:`claim_at_setup`)."""
    started_elsewhere = ("LOCAL_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                         "TORCHELASTIC_RUN_ID", "NODE_RANK", "GROUP_RANK")
    nodes = trainer.get("num_nodes", 1)
    return not any(name in os.environ for name in started_elsewhere) and (nodes in (None, 1) or str(nodes) == "1")


def release_run_locks() -> None:
    """Release the run folders' locks this process holds (:func:`one_run_at_a_time`): a program that called the
    command's ``main`` goes on without holding them (the command itself releases them by exiting)."""
    _deferred.clear()  # a folder noted for a set-up that never came is not the next fit's
    while _run_locks:
        os.close(_run_locks.popitem()[1])
