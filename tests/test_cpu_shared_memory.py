"""Shared-memory collectives (opt-in CPU tuning) for CPU ranks on one host equal gloo's, on 2 and 3 ranks;
a dead peer or parent ends a wait within seconds, naming it."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from lightning_megatron.cpu import CPUTuning, shared_memory
from lightning_megatron.cpu.shared_memory import enable_shared_memory_collectives
from lightning_megatron.communicator import TorchCommunicator, _all_gather_fn, _reduce_scatter_fn
from lightning_megatron.parallel_state import initialize_model_parallel
from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.tensor_parallel.mappings import (
    all_reduce,
    all_gather_into_tensor,
    _reduce,
    reduce_scatter_tensor,
    all_reduce_coalesced,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
ULP8 = {torch.float32: 8 * 2.0**-23, torch.bfloat16: 8 * 2.0**-7, torch.float16: 8 * 2.0**-10}


def _data(rank: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def _same_on_every_rank(t: torch.Tensor, group) -> None:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    for p in parts:
        assert torch.equal(p, t), "ranks hold different bits"


def _collectives_worker(world: int) -> int:
    ps = initialize_model_parallel(ParallelDims(tp=world))  # the TP group holds every rank
    tp, group = ps.group("tp"), ps.tp_group
    rank = dist.get_rank()
    # 96-byte slots: every message below but the smallest goes through in several pieces
    # timeout=None as MegatronStrategy(timeout=None) passes it: the 30-minute default
    comm = enable_shared_memory_collectives(tp, slot_bytes=96, timeout=None)
    assert comm is not None and isinstance(tp.communicator, TorchCommunicator)
    ps.set_communicator("tp", comm)  # installed explicitly, as CPUTuning does: the group object carries it
    assert tp.communicator is comm
    checked = 0
    for salt, numel in enumerate([0, 1, 7, 24, 1000, 4099]):
        for dtype in DTYPES:
            # a + b is the same bits in any order; with 3 ranks gloo may add in another order:
            # one rounding of a partial sum (|.| < 8) apart
            exact = not dtype.is_floating_point or world == 2
            tol = dict(atol=0, rtol=0) if exact else dict(atol=ULP8[dtype], rtol=0)
            x = _data(rank, numel * world, dtype, salt)

            # all-reduce, out of place and in place, against gloo (a + b: same bits at W=2)
            expected = x.clone()
            dist.all_reduce(expected, group=group)
            out = comm.all_reduce(x, out=torch.empty_like(x))
            torch.testing.assert_close(out, expected, **tol)
            _same_on_every_rank(out, group)
            inplace = x.clone()
            assert comm.all_reduce(inplace) is inplace and torch.equal(inplace, out)
            for op, name in ((dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min")):  # exact in any order
                expected = x.clone()
                dist.all_reduce(expected, op=op, group=group)
                assert torch.equal(comm.all_reduce(x, out=torch.empty_like(x), op=name), expected)

            # reduce-scatter of world * numel -> numel
            expected = torch.empty(numel, dtype=dtype)
            _reduce_scatter_fn(expected, x, group=group)
            got = torch.full((numel,), 7, dtype=dtype)
            comm.reduce_scatter(got, x)
            torch.testing.assert_close(got, expected, **tol)
            torch.testing.assert_close(got, out[rank * numel:(rank + 1) * numel], atol=0, rtol=0)

            # all-gather of numel -> world * numel (exact)
            mine = x[:numel]
            expected = torch.empty(world * numel, dtype=dtype)
            _all_gather_fn(expected, mine, group=group)
            got = torch.zeros(world * numel, dtype=dtype)
            comm.all_gather(got, mine)
            assert torch.equal(got, expected)
            checked += 1
    # a non-contiguous input through the mappings' raw collectives (which dispatch here)
    x = _data(rank, 6 * 8, torch.float32, 99).view(6, 8).t()
    expected = x.contiguous()
    dist.all_reduce(expected, group=group)
    torch.testing.assert_close(_reduce(x, tp), expected, atol=0 if world == 2 else ULP8[torch.float32], rtol=0)
    # the package's one all-reduce: sum, max, min through shared memory; other ops through gloo
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        y = _data(rank, 10, torch.float32, 7)
        expected = y.clone()
        dist.all_reduce(expected, op=op, group=group)
        assert all_reduce(y, tp, op) is y
        torch.testing.assert_close(y, expected, atol=0 if world == 2 else ULP8[torch.float32], rtol=0)
    flat = [torch.full((3,), float(rank)), torch.full((2, 2), float(rank + 1))]
    all_reduce_coalesced(flat, tp)
    assert torch.equal(flat[0], torch.full((3,), float(sum(range(world)))))
    assert torch.equal(flat[1], torch.full((2, 2), float(sum(r + 1 for r in range(world)))))
    out = torch.empty(world * 4, 3)
    all_gather_into_tensor(out, torch.full((4, 3), float(rank)), tp)
    assert torch.equal(out, torch.arange(world).repeat_interleave(4).float().unsqueeze(1).expand(-1, 3))
    rs = torch.empty(2, 3)
    reduce_scatter_tensor(rs, torch.arange(world * 2 * 3, dtype=torch.float32).view(world * 2, 3), tp)
    assert torch.equal(rs, world * torch.arange(rank * 6, rank * 6 + 6, dtype=torch.float32).view(2, 3))
    # async_op: a completed handle
    handle = comm.all_reduce(torch.ones(2), async_op=True)
    assert handle.wait() and handle.is_completed()
    ps.close_communicators()
    assert isinstance(tp.communicator, TorchCommunicator) and comm._slots is None
    # the tuning on a DP group of the same ranks: installed, so the DP reduction runs synchronously (no overlap)
    dp, cpu = initialize_model_parallel(ParallelDims(dp=world)), torch.device("cpu")
    tuning = CPUTuning(keep_freed_memory=False)
    assert not tuning.synchronous_collectives(cpu, dp)  # before set-up: nothing installed yet
    assert tuning.setup(dp, device=cpu)["dp_cp"] and tuning.synchronous_collectives(cpu, dp)
    assert not tuning.synchronous_collectives(torch.device("meta"), dp)  # acts on CPU tensors only
    dp.close_communicators()
    return checked


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"world{w}")
def test_shared_memory_collectives_equal_gloo(world):
    counts = run_distributed(_collectives_worker, world, world, timeout=180)
    assert counts == [6 * len(DTYPES)] * world


def _timeout_worker() -> str:
    group = dist.new_group([0, 1])
    comm = enable_shared_memory_collectives(group, timeout=datetime.timedelta(seconds=1))
    assert comm is not None
    if dist.get_rank() == 0:
        try:
            comm.all_reduce(torch.ones(4))
        except RuntimeError as err:
            message = str(err)
        else:
            raise AssertionError("a collective without its peer returned")
    else:
        message = ""
    dist.barrier()  # rank 1 never joined the shared-memory all-reduce
    return message


def test_missing_peer_times_out_naming_it():
    message, _ = run_distributed(_timeout_worker, 2, timeout=60)
    assert "timed out after 1 s" in message and "[1]" in message, message


def _fallback_worker(kind: str) -> bool:
    if kind == "single":
        return enable_shared_memory_collectives(dist.new_group([dist.get_rank()])) is None
    group = dist.new_group([0, 1])
    if kind == "hosts":  # ranks report different hosts: gloo stays in charge, on every rank
        shared_memory._host_id = lambda: f"host{dist.get_rank()}"
        # the strategy's overlap of the DP reduction follows what the tuning installed, not what it asked for:
        # a DP group left on gloo (asynchronous) keeps the overlap
        ps, tuning, cpu = initialize_model_parallel(ParallelDims(dp=2)), CPUTuning(), torch.device("cpu")
        assert tuning.synchronous_collectives(cpu)  # the prediction for ranks on one host
        assert not tuning.setup(ps, device=cpu)["dp_cp"] and not tuning.synchronous_collectives(cpu, ps)
    elif kind == "no-directory":
        return enable_shared_memory_collectives(group, directory="/nonexistent-dir") is None
    comm = enable_shared_memory_collectives(group)
    out = _reduce(torch.ones(3), group)
    assert torch.equal(out, torch.full((3,), 2.0))
    return comm is None


@pytest.mark.parametrize("kind", ["hosts", "no-directory"])
def test_groups_across_hosts_keep_gloo(kind):
    assert run_distributed(_fallback_worker, 2, kind, timeout=60) == [True, True]


def test_one_rank_group_needs_nothing():
    assert run_distributed(_fallback_worker, 1, "single", timeout=60) == [True]


def test_bad_slot_size_names_the_fix():
    with pytest.raises(ValueError, match="slot_bytes=100 must be a positive multiple of 16"):
        enable_shared_memory_collectives(None, slot_bytes=100)


def _dead_peer_worker(case: str) -> tuple[str, float]:
    import subprocess
    import time

    group = dist.new_group([0, 1])
    comm = enable_shared_memory_collectives(group, timeout=datetime.timedelta(seconds=60))
    assert comm is not None and comm.pids is not None and comm.pids[dist.get_rank()] == os.getpid()
    message, seconds = "", 0.0
    exited = None  # held until the end: a dropped Popen may be reaped by its finaliser at any time
    if dist.get_rank() == 1:
        if case == "dead":  # rank 0's recorded pid is a process that exited and was reaped
            exited = subprocess.Popen(["true"])
            exited.wait()
            comm.pids[0] = exited.pid
        elif case == "zombie":  # exited, not reaped by its parent (this rank): still dead
            exited = subprocess.Popen(["true"])
            comm.pids[0] = exited.pid
            time.sleep(0.2)
        else:  # the parent process changed (it died and this rank was re-parented)
            comm._parent = -1
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(4))
        except RuntimeError as err:
            message, seconds = str(err), time.monotonic() - start
        else:
            raise AssertionError("a collective without its peer returned")
    dist.barrier()  # rank 0 never joined the shared-memory all-reduce
    return message, seconds


@pytest.mark.parametrize("case", ["dead", "zombie", "parent"])
def test_dead_peer_or_parent_ends_the_wait_naming_it(case):
    """Issue 14: SIGKILL of the launcher left rank 1 in the shared-memory barrier for the whole
    timeout (30 min). A dead peer (reaped or zombie) or a dead parent ends it within seconds."""
    _, (message, seconds) = run_distributed(_dead_peer_worker, 2, case, timeout=90)
    if case == "parent":
        assert "parent process" in message and "died" in message, message
    else:
        assert "global rank 0 (pid" in message and "died before arriving" in message, message
    assert seconds < 10, seconds  # the liveness check starts after 1 s of waiting, then every 0.5 s


_KILL_SCRIPT = r'''
import datetime, os, signal, subprocess, sys, time
import torch, torch.distributed as dist
from lightning_megatron.cpu.shared_memory import enable_shared_memory_collectives

role, port, report = sys.argv[1], sys.argv[2], sys.argv[3]
rank = 0 if role == "launcher" else 1
if rank == 0:  # the launcher is rank 0 and the parent of rank 1, as with Lightning's popen launcher
    child = subprocess.Popen([sys.executable, os.environ["LM_KILL_SCRIPT"], "worker", port, report])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(minutes=30))
comm = enable_shared_memory_collectives(dist.group.WORLD, timeout=datetime.timedelta(minutes=30))
assert comm is not None
x = torch.ones(1024)
for _ in range(20):
    comm.all_reduce(x)
if rank == 0:
    with open(report + ".child", "w") as f:
        f.write(str(child.pid))
    os.kill(os.getpid(), signal.SIGKILL)  # SIGKILL of the launcher, while rank 1 waits in the next collective
try:
    while True:
        comm.all_reduce(x)
except RuntimeError as err:
    with open(report, "w") as f:
        f.write(f"{time.time()}\n{err}")
    sys.exit(3)
'''


def test_sigkill_of_the_launcher_ends_rank_1_naming_it(tmp_path):
    """The scenario of issue 14, for real: rank 0 (the launcher, parent of rank 1) is SIGKILLed while
    rank 1 waits in a shared-memory collective; rank 1 exits non-zero within seconds, naming rank 0."""
    import socket
    import subprocess
    import sys
    import time

    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT)
    report = tmp_path / "report.txt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, LM_KILL_SCRIPT=str(script),
               PYTHONPATH=os.pathsep.join([str(__import__("pathlib").Path(__file__).parent.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.run([sys.executable, str(script), "launcher", str(port), str(report)], env=env,
                              timeout=180, capture_output=True, text=True)
    killed_at = time.time()
    assert launcher.returncode == -9, launcher.stderr[-2000:]
    child = int((tmp_path / "report.txt.child").read_text())
    deadline = time.monotonic() + 60
    while not report.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert report.exists(), "rank 1 was still waiting 60 s after the launcher died"
    ended_at, message = report.read_text().split("\n", 1)
    assert "global rank 0 (pid" in message and "died" in message, message
    assert float(ended_at) - killed_at < 30
    while time.monotonic() < deadline:  # and the process is gone (exit 3 after the report)
        if not shared_memory._process_alive(child):  # gone, or a zombie nobody reaps
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"rank 1 (pid {child}) did not exit")
