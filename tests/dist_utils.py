"""Run a function on N ranks in spawned processes, with a timeout, for tests.

Every multi-process test goes through :func:`run_distributed`:
- each rank is a fresh process (:func:`lightning_megatron.check.spawn.run_distributed`: forked from a
  server that imported torch, with the caller's environment) with ``torch.set_num_threads(1)``;
- the default process group is initialized with a collective timeout: gloo on CPU; with the test
  device cuda (``pytest --device cuda`` / ``LM_TEST_DEVICE=cuda``) NCCL, one GPU per rank
  (``torch.set_default_device``), and the test is skipped, saying why, with fewer GPUs than ranks;
- as soon as one rank fails, every rank is killed and that rank's traceback is raised in pytest;
- the whole run is bounded by ``timeout`` seconds, after which every rank is killed.

Rank results are sent back with ``torch.save`` so tensors survive the process exit.

``python ARGS`` runs start from the same server (:func:`start_python`, :func:`run_python`), and so can the
commands of a shell's line (:func:`commands_from_forkserver`): no new interpreter imports torch and Lightning.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from lightning_megatron.check.spawn import DistributedTestFailure
from lightning_megatron.check.spawn import run_distributed as _run_distributed

__all__ = ["run_distributed", "run_python", "start_python", "commands_from_forkserver", "ForkedPython",
           "DistributedTestFailure", "test_device", "accelerator", "DEVICE_ENV"]

DEVICE_ENV = "LM_TEST_DEVICE"


def test_device() -> str:
    """"cpu" or "cuda": the device the tests run on."""
    device = os.environ.get(DEVICE_ENV, "cpu") or "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={device!r}: expected cpu or cuda")
    return device


test_device.__test__ = False  # not a test (pytest collects test_* functions from imported modules)


def accelerator() -> str:
    """The Lightning accelerator for the test device ("cpu" or "gpu")."""
    return "gpu" if test_device() == "cuda" else "cpu"


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
                    backend: str | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results in rank order.

    :func:`lightning_megatron.check.spawn.run_distributed` (the one spawn helper) with the test
    device's backend (gloo on cpu, nccl on cuda) and any picklable result (tests only).
    """
    import torch

    if backend is None:
        backend = "nccl" if test_device() == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        import pytest

        pytest.skip(f"{world_size} ranks on NCCL need {world_size} GPUs; this machine has "
                    f"{torch.cuda.device_count()}")
    return _run_distributed(fn, world_size, *args, timeout=timeout, backend=backend, weights_only=False, **kwargs)


class ForkedPython:
    """A ``python ARGS`` process forked from the server of :func:`run_distributed` (:func:`start_python`);
    waited for as :class:`subprocess.Popen` is, its output read from files."""

    def __init__(self, args: list[str], process: Any, scratch: Any, outs: list[str]) -> None:
        self.args, self._process, self._scratch, self._outs = args, process, scratch, outs

    @property
    def pid(self) -> int:
        return self._process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """Its exit code, stdout and stderr; past ``timeout`` seconds it is killed and
        :class:`subprocess.TimeoutExpired` raised with what it wrote, as ``subprocess.run`` does."""
        self._process.join(timeout)
        expired = self._process.exitcode is None
        if expired:
            self._process.kill()
            self._process.join()
        stdout, stderr = (Path(out).read_text(errors="replace") for out in self._outs)
        self._scratch.cleanup()
        if expired:
            raise subprocess.TimeoutExpired(self.args, timeout, stdout, stderr)
        return subprocess.CompletedProcess(self.args, self._process.exitcode, stdout, stderr)


def start_python(args: list[str], cwd: str | os.PathLike, env: dict[str, str],
                 start_new_session: bool = False) -> ForkedPython:
    """Start ``python *args`` (``[script, ...]``, ``["-m", module, ...]`` or ``["-c", code, ...]``), stdout and
    stderr captured, from the forkserver of :func:`run_distributed` instead of a new interpreter: the process
    skips importing torch and Lightning (~10 s of CPU on a 2-core host) and is otherwise what ``python *args``
    starts: ``__main__`` is the script or module (``if __name__ == "__main__"`` runs; launchers that re-run
    ``sys.argv[0]`` or ``-m __main__.__spec__.name``, and spawned ranks that re-import ``__main__``, find
    it), ``sys.argv`` and ``sys.path`` as the interpreter sets them for ``env`` (the script's folder, the
    working folder for ``-m``, ``''`` for ``-c``, first), the working folder ``cwd``, a session of its own with
    ``start_new_session`` (as ``subprocess.Popen``'s: what a terminal's Ctrl-C reaches); and it exits as the
    interpreter does: an uncaught exception's traceback on stderr and status 1, ``SystemExit``'s status, then the
    non-daemon threads joined, the ``atexit`` handlers run (W&B's among them) and the streams flushed.
    The other local ranks a ``lightning-megatron`` command starts early are forks of it too (not new
    interpreters: :func:`_fork_waiting_ranks`). What differs: warnings that importing torch or Lightning prints
    are printed by the server, not here."""
    import tempfile

    from lightning_megatron.check.spawn import _context

    fresh_path = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                                env=env, cwd=cwd, capture_output=True, text=True, check=True, timeout=60).stdout
    scratch = tempfile.TemporaryDirectory()
    outs = [os.path.join(scratch.name, name) for name in ("stdout", "stderr")]  # paths: the forked process is
    for out in outs:                                                            # not this one's child
        open(out, "w").close()
    process = _context().Process(target=_python_main,
                                  args=(list(args), os.fspath(cwd), env, fresh_path, outs, start_new_session))
    process.start()
    return ForkedPython([sys.executable, *args], process, scratch, outs)


def run_python(args: list[str], cwd: str | os.PathLike, env: dict[str, str], timeout: float,
               start_new_session: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout, start_new_session=start_new_session)``, the process started by :func:`start_python`."""
    return start_python(args, cwd, env, start_new_session).wait(timeout)


@contextlib.contextmanager
def commands_from_forkserver(commands: dict[str, list[str]], timeout: float) -> Iterator[str]:
    """A folder of executables, for the front of ``PATH``: ``NAME ARGS`` (a shell's command line) runs
    ``python *commands[NAME] ARGS`` by :func:`start_python`, in the caller's working folder and environment,
    prints what it printed (stdout, then stderr, once it has ended) and exits with its status; at most
    ``timeout`` seconds each. The executable itself is a small stdlib-only interpreter (``-IS``); what it
    runs skips importing torch and Lightning, as a ``run_python`` process does."""
    import json
    import socket
    import tempfile

    folder = tempfile.TemporaryDirectory()
    address = os.path.join(folder.name, "commands.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen()

    def answer(connection: socket.socket) -> None:
        with connection:
            order = json.loads(_read_all(connection))
            try:
                proc = start_python(order["args"], order["cwd"], order["env"]).wait(timeout)
                reply = {"status": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
            except subprocess.TimeoutExpired as e:
                reply = {"status": 124, "stdout": e.stdout or "", "stderr": f"{e.stderr or ''}\n{e}\n"}
            except Exception:  # noqa: BLE001 - the command's caller reads why, not a broken reply
                import traceback

                reply = {"status": 1, "stdout": "", "stderr": traceback.format_exc()}
            connection.sendall(json.dumps(reply).encode())

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed: the block has ended
                return
            threading.Thread(target=answer, args=(connection,), daemon=True).start()

    for name, prefix in commands.items():
        executable = Path(folder.name) / name
        executable.write_text(_COMMAND_CLIENT.format(python=sys.executable, address=address, prefix=prefix))
        executable.chmod(0o755)
    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield folder.name
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        server.join(timeout=10)
        folder.cleanup()


def _read_all(connection: Any) -> bytes:
    chunks = []
    while chunk := connection.recv(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


_COMMAND_CLIENT = """#!{python} -IS
import json, os, socket, sys

connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
connection.connect({address!r})
order = {{"args": {prefix!r} + sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}
connection.sendall(json.dumps(order).encode())
connection.shutdown(socket.SHUT_WR)
chunks = []
while chunk := connection.recv(1 << 20):
    chunks.append(chunk)
reply = json.loads(b"".join(chunks))
sys.stdout.buffer.write(reply["stdout"].encode())
sys.stdout.flush()
sys.stderr.buffer.write(reply["stderr"].encode())
sys.exit(reply["status"])
"""


def _python_main(args: list[str], cwd: str, env: dict[str, str], fresh_path: str, outs: list[str],
                 start_new_session: bool) -> None:
    import json
    import runpy
    import types

    if start_new_session:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if args[0] == "-m":  # run_module puts the module's file in sys.argv[0]
        sys.argv, first = args[1:], os.getcwd()
    elif args[0] == "-c":
        sys.argv, first = ["-c", *args[2:]], ""
    else:
        sys.argv, first = list(args), os.path.dirname(os.path.abspath(args[0]))
    sys.path[:] = [first, *json.loads(fresh_path)]
    sys.stdout.flush()
    sys.stderr.flush()
    for stream, out in enumerate(outs, start=1):
        fd = os.open(out, os.O_WRONLY | os.O_TRUNC)
        os.dup2(fd, stream)
        os.close(fd)
    _fork_waiting_ranks()

    def run() -> None:
        if args[0] == "-m":
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(args[0], run_name="__main__")

    _exit_as_python(run)


def _exit_as_python(run: Callable[[], Any]) -> NoReturn:
    """``run()``, then this process exits as the interpreter does at the end of ``__main__``."""
    import atexit

    try:
        run()
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, then status 1
        sys.excepthook(*sys.exc_info())
        status = 1
    threading._shutdown()  # the interpreter's exit, in its order: threads, atexit, streams
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _fork_waiting_ranks() -> None:
    """The other local ranks a ``lightning-megatron`` command starts early (lightning_megatron.launch) are forks of
    this process, which has imported what they import, instead of new interpreters: a waiting rank as
    ``launch._start_waiting`` starts it (its environment, the order pipe, ``launch._wait``), holding no other
    rank's pipe, exiting as the interpreter does; Lightning's launcher hands it its command as to a new one."""
    from lightning_megatron import launch

    def start_waiting(local_rank: int, classes: list[str]) -> Any:
        read, write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(write)
            for rank in launch._waiting:  # the pipes of the ranks started before: the command's, not this rank's
                os.close(rank.pipe)
            launch._waiting.clear()
            os.environ.update({"LOCAL_RANK": str(local_rank), launch.PREWARM_ENV: str(read),
                               launch.CLASSES_ENV: ",".join(classes)})
            _exit_as_python(launch._wait)
        os.close(read)
        return launch._Waiting(local_rank, _ForkedChild(pid), write)

    launch._start_waiting = start_waiting


class _ForkedChild:
    """``subprocess.Popen``'s ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate`` and ``kill``
    over a child of ``os.fork``."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None
        self._reaping = threading.Lock()  # Lightning's observer thread polls too: the child is reaped once

    def poll(self) -> int | None:
        with self._reaping:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
