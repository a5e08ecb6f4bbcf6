"""Collectives through shared memory for CPU ranks on one host.

gloo moves CPU tensors between processes over TCP, also when every rank of a group runs on the
same machine (a training step at TP=2 runs about 50 all-reduces of an activation; their cost on
loopback is in docs/benchmarks.md). Ranks on one host can instead exchange through one shared
mapping::

    all_reduce(x):      copy x into my slot | barrier | out = slot_0 + slot_1 + ... + slot_{W-1}
    all_gather(x):      copy x into my slot | barrier | out[k] = slot_k             (k = 0..W-1)
    reduce_scatter(x):  copy x into my slot | barrier | out = sum_k slot_k[my chunk]

Every rank adds the slots in the same order (0, 1, ..., W-1), so the W results are the same bits
(as with gloo). A rank reads all W slots, so the work per rank grows with W; TP groups on one
host are small (2-8). Messages larger than a slot go through in pieces.

The barrier: each rank owns one 64-bit counter (its own cache line) in the mapping; it stores
the barrier's number there and polls the others' until they reach it. Single-writer counters
need no atomic read-modify-write; x86-64's ordering (stores seen in program order, loads not
reordered with loads) makes the data written before the counter visible to whoever has seen the
counter, so the shared-memory path is used on x86-64 only. Two sets of slots are used
alternately: a rank writes into a set only after every rank has passed the barrier of the
collective that followed its last use, so nobody still reads it.

A rank that waits longer than ``timeout`` raises, naming the peers that did not arrive. A rank
that has waited more than a second also checks, every half second, that the late peers are alive
(``os.kill(pid, 0)`` and not a zombie in ``/proc/<pid>/stat``) and that its parent process is the
one it started with: a dead peer or parent ends the wait within about a second with a
``RuntimeError`` naming it (issue: SIGKILL of the launcher left the other ranks spinning for the
whole timeout). A group whose ranks are not all on one host (or where the mapping cannot be
created) keeps using gloo.

This module is part of the opt-in CPU tuning (:class:`lightning_megatron.cpu.CPUTuning`): it is
installed as the communicator of a group through ``ParallelState.set_communicator``.
"""

from __future__ import annotations

import datetime
import mmap
import os
import platform
import socket
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import record_function

from lightning_megatron.communicator import TorchCommunicator
from lightning_megatron.parallel_state import Group, process_group

__all__ = ["SharedMemoryCollectives", "enable_shared_memory_collectives"]

_FLAG_STRIDE = 64  # bytes: one counter per cache line
_ALIGN = 64
_SPIN_POLLS = 2000  # tight polls before yielding the core (a peer may need it)
_YIELD_SECONDS = 0.05  # then sched_yield for this long, then short sleeps
_LIVENESS_AFTER = 1.0  # seconds of waiting before checking that the late peers and the parent live
_LIVENESS_EVERY = 0.5  # seconds between those checks

_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _process_alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed child stays a zombie until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)
    return state not in ("Z", "X")


class _Done:
    """The handle of a collective that completed before returning (``async_op=True``)."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class SharedMemoryCollectives:
    """All-reduce (sum, max, min), all-gather and reduce-scatter for the CPU ranks of one group on one host.

    Build it with :func:`enable_shared_memory_collectives` (collective over ``group``). Tensors of
    any dtype and shape; ``slot_bytes`` bounds one piece of a message, not the message. It is a
    :class:`~lightning_megatron.communicator.Communicator`: tensors on another
    device, and other reduce ops, go to ``torch.distributed`` on the group.
    """

    def __init__(self, group: dist.ProcessGroup, mapping: mmap.mmap, *, slot_bytes: int,
                 timeout: datetime.timedelta, pids: list[int] | None = None) -> None:
        self._torch = TorchCommunicator(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = dist.get_process_group_ranks(group)
        self.slot_bytes = slot_bytes
        self.timeout = timeout.total_seconds()
        self._mapping = mapping
        flags_bytes = _align(self.world_size * _FLAG_STRIDE)
        self._flags = np.frombuffer(mapping, dtype=np.int64, count=flags_bytes // 8)
        self._flag_index = [r * (_FLAG_STRIDE // 8) for r in range(self.world_size)]
        data = torch.frombuffer(mapping, dtype=torch.uint8, offset=flags_bytes,
                                count=2 * self.world_size * slot_bytes)
        # slots[set][rank]: raw bytes, viewed as the message's dtype per collective
        self._slots = data.view(2, self.world_size, slot_bytes)
        self._epoch = 0
        self._set = 0
        self.pids = pids  # per group rank; None when the ranks do not share a pid namespace
        self._parent = os.getppid()

    # -----------------------------------------------------------------------------------------
    @staticmethod
    def bytes_needed(world_size: int, slot_bytes: int) -> int:
        return _align(world_size * _FLAG_STRIDE) + 2 * world_size * slot_bytes

    def _barrier(self) -> None:
        self._epoch += 1
        epoch, flags = self._epoch, self._flags
        flags[self._flag_index[self.rank]] = epoch
        polls, start, check = 0, None, 0.0
        for peer in range(self.world_size):
            index = self._flag_index[peer]
            while flags[index] < epoch:
                polls += 1
                if polls < _SPIN_POLLS:
                    continue
                now = time.monotonic()
                if start is None:
                    start, check = now, now + _LIVENESS_AFTER
                elif now >= check:
                    check = now + _LIVENESS_EVERY
                    self._check_alive(epoch)
                if now - start > self.timeout:
                    late = [self.global_ranks[p] for p in range(self.world_size)
                            if flags[self._flag_index[p]] < epoch]
                    raise RuntimeError(
                        f"shared-memory collective timed out after {self.timeout:.0f} s: global rank(s) "
                        f"{late} of the group {self.global_ranks} did not arrive (did a rank fail or take "
                        f"another code path?)")
                if now - start < _YIELD_SECONDS:
                    os.sched_yield()
                else:
                    time.sleep(0.0002)

    def _check_alive(self, epoch: int) -> None:
        """Raise naming the late peer, or else the parent process, that died while this rank waits."""
        if self.pids is not None:
            for p in range(self.world_size):
                if self._flags[self._flag_index[p]] < epoch and not _process_alive(self.pids[p]):
                    raise RuntimeError(
                        f"shared-memory collective: global rank {self.global_ranks[p]} (pid {self.pids[p]}) of the "
                        f"group {self.global_ranks} died before arriving; exiting instead of waiting for the timeout")
        if os.getppid() != self._parent:
            raise RuntimeError(
                f"shared-memory collective: the parent process (pid {self._parent}) of global rank "
                f"{self.global_ranks[self.rank]} died while it waited for the group {self.global_ranks}; "
                f"exiting instead of waiting for the timeout")

    def _slots_of(self, dtype: torch.dtype) -> torch.Tensor:
        """This collective's slot set viewed as ``dtype``: ``[world, slot_bytes / itemsize]``."""
        slots = self._slots[self._set]
        self._set ^= 1
        return slots.view(dtype)

    def _piece(self, dtype: torch.dtype, parts: int = 1) -> int:
        return max(1, self.slot_bytes // dtype.itemsize // parts)

    # -----------------------------------------------------------------------------------------
    # ------------------------------------------------------------- Communicator interface
    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp | str = dist.ReduceOp.SUM, *,
                   out: torch.Tensor | None = None, async_op: bool = False):
        """``out = op over ranks of tensor`` (sum, max or min; ``out`` defaults to ``tensor``).

        Other ops and non-CPU tensors go to ``torch.distributed`` (in place, ``out`` unused).
        """
        name = op if isinstance(op, str) else _OPS.get(op)
        if name is None or tensor.device.type != "cpu":
            if out is not None:
                raise ValueError("out= is only supported for sum/max/min of CPU tensors")
            return self._torch.all_reduce(tensor, op, async_op=async_op)
        result = self._all_reduce(tensor, out, name)
        return _Done() if async_op else result

    def all_gather_into_tensor(self, out: torch.Tensor, tensor: torch.Tensor, *, async_op: bool = False):
        if tensor.device.type != "cpu":
            return self._torch.all_gather_into_tensor(out, tensor, async_op=async_op)
        self.all_gather(out, tensor)
        return _Done() if async_op else None

    def reduce_scatter_tensor(self, out: torch.Tensor, tensor: torch.Tensor, *, async_op: bool = False):
        if tensor.device.type != "cpu":
            return self._torch.reduce_scatter_tensor(out, tensor, async_op=async_op)
        self.reduce_scatter(out, tensor)
        return _Done() if async_op else None

    # -------------------------------------------------------------------- the shared-memory kernels
    def _all_reduce(self, tensor: torch.Tensor, out: torch.Tensor | None, op: str) -> torch.Tensor:
        combine = _COMBINE[op]
        out = tensor if out is None else out
        src, dst = tensor.reshape(-1), out.view(-1)  # ``out`` must be contiguous
        n, piece = src.numel(), self._piece(tensor.dtype)
        with record_function("shm:all_reduce"):
            for lo in range(0, max(n, 1), piece):
                hi = min(n, lo + piece)
                slots = self._slots_of(tensor.dtype)
                slots[self.rank, :hi - lo].copy_(src[lo:hi])
                self._barrier()
                _reduce_slots(slots[:, :hi - lo], dst[lo:hi], combine)
        return out

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """``out`` (``world * numel`` elements) = every rank's ``tensor``, concatenated in rank order."""
        src = tensor.reshape(-1)
        n, piece = src.numel(), self._piece(tensor.dtype)
        dst = out.view(self.world_size, n)
        with record_function("shm:all_gather"):
            for lo in range(0, max(n, 1), piece):
                hi = min(n, lo + piece)
                slots = self._slots_of(tensor.dtype)
                slots[self.rank, :hi - lo].copy_(src[lo:hi])
                self._barrier()
                dst[:, lo:hi].copy_(slots[:, :hi - lo])
        return out

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """``out`` = this rank's chunk (``numel / world``) of the sum over ranks of ``tensor``."""
        n = out.numel()
        src, dst = tensor.reshape(self.world_size, n), out.view(-1)
        piece = self._piece(tensor.dtype, parts=self.world_size)
        with record_function("shm:reduce_scatter"):
            for lo in range(0, max(n, 1), piece):
                hi = min(n, lo + piece)
                slots = self._slots_of(tensor.dtype)
                mine = slots[self.rank, :self.world_size * (hi - lo)].view(self.world_size, hi - lo)
                mine.copy_(src[:, lo:hi])
                self._barrier()
                chunks = slots[:, :self.world_size * (hi - lo)].view(self.world_size, self.world_size, hi - lo)
                _reduce_slots(chunks[:, self.rank], dst[lo:hi], torch.add)
        return out

    def close(self) -> None:
        """Release the mapping (``ParallelState.set_communicator`` calls it when replaced)."""
        if self._slots is None:
            return
        self._slots = self._flags = None  # type: ignore[assignment]
        try:
            self._mapping.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass


_COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def _reduce_slots(slots: torch.Tensor, out: torch.Tensor, combine) -> None:
    """``out = slots[0] (+) slots[1] (+) ...``, in this order on every rank (same bits everywhere)."""
    combine(slots[0], slots[1], out=out)
    for k in range(2, slots.size(0)):
        combine(out, slots[k], out=out)


def enable_shared_memory_collectives(group: Group, *, slot_bytes: int = 8 << 20,
                                     timeout: datetime.timedelta | None = None,
                                     directory: str = "/dev/shm") -> SharedMemoryCollectives | None:
    """Shared-memory collectives for ``group``'s CPU ranks (install with ``ParallelState.set_communicator``).

    Collective over ``group`` (every member calls it). Returns ``None``, and the group keeps using
    its backend, when the group has one rank, its ranks are not all on this host, the machine is not
    x86-64, or any rank cannot map ``directory``; the decision is the same on every rank.
    ``timeout`` bounds a wait for the other ranks (``None``: 30 minutes, torch's default for gloo).
    """
    if slot_bytes < 16 or slot_bytes % 16:
        raise ValueError(f"slot_bytes={slot_bytes} must be a positive multiple of 16 (the largest element size)")
    group = process_group(group)
    if group is None or dist.get_world_size(group) == 1:
        return None
    if dist.get_backend(group) != "gloo":
        return None
    world = dist.get_world_size(group)
    size = SharedMemoryCollectives.bytes_needed(world, slot_bytes)
    # One rank names the file; everyone checks that the group shares a host and an architecture.
    path = os.path.join(directory, f"lightning_megatron_{uuid.uuid4().hex}")
    info = [None] * world
    dist.all_gather_object(info, (_host_id(), platform.machine(), os.path.isdir(directory), path, os.getpid(),
                                  _pid_namespace()), group=group)
    if len({i[0] for i in info}) != 1 or {i[1] for i in info} != {"x86_64"} or not all(i[2] for i in info):
        return None
    path = info[0][3]
    rank = dist.get_rank(group)
    mapping = None
    ok = torch.zeros(1)
    if rank == 0:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # reserve the pages now: a full /dev/shm fails here, not with SIGBUS later
                mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except OSError:
            ok.fill_(1)
    dist.all_reduce(ok, group=group)  # 0: rank 0 created it
    if ok.item() == 0 and rank != 0:
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except OSError:
            ok.fill_(1)
    failed = ok.clone()
    dist.all_reduce(failed, group=group)  # every rank mapped it (or knows that one did not)
    if rank == 0 and os.path.exists(path):
        os.unlink(path)  # the mappings keep the memory; nothing is left in /dev/shm after a crash
    if failed.item() != 0:
        if mapping is not None:
            mapping.close()
        return None
    same_pids = len({i[5] for i in info}) == 1 and info[0][5] != ""
    return SharedMemoryCollectives(group, mapping, slot_bytes=slot_bytes,
                                   timeout=timeout or datetime.timedelta(minutes=30),
                                   pids=[i[4] for i in info] if same_pids else None)
