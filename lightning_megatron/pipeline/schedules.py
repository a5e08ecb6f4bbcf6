"""Microbatch schedules: no pipelining, 1F1B, and interleaved 1F1B over virtual model chunks.

These are the ``run`` of the named schedules ``no_pipelining``, ``1f1b`` and ``interleaved``
(:mod:`lightning_megatron.pipeline.registry`, which also answers what each holds in memory and idles).
One call runs the forward and backward passes of all ``m = num_microbatches`` microbatches of one
optimizer step on this rank's model chunks and returns the logged losses (last stage only).
Gradients accumulate in ``.grad``; their data-parallel and tied-embedding reductions are left to the
caller, as in Megatron. The loss of each microbatch is divided by ``m`` before backward, so the
accumulated gradient is the gradient of the mean loss over the step's microbatches.

1F1B (``p`` stages, stage ``r``, ``w = min(p - r - 1, m)``)::

    warm-up     w forwards                       (stage r runs ahead of stage r+1 by one microbatch)
    steady      m - w times: one forward, one backward
    cool-down   w backwards

Interleaved 1F1B (``v`` chunks per stage, ``m % p == 0``): the ``m * v`` (microbatch, chunk) pairs
run in groups of ``p`` microbatches per chunk: forward virtual microbatch ``k`` runs chunk
``(k mod p v) // p`` on microbatch ``(k // p v) * p + k mod p``; backward ``k`` runs the chunks in
reverse. Warm-up ``w = min(2 (p - r - 1) + (v - 1) p, m v)``. The bubble shrinks from
``(p - 1) / (m + p - 1)`` to ``(p - 1) / (v m + p - 1)``.

``trace``: pass a list to receive one :class:`ScheduleEvent` per forward or backward pass, in the
order this rank ran them, with ``time.perf_counter()`` start/end stamps (CLOCK_MONOTONIC on Linux,
so stamps of processes on one machine share a time axis). The time outside those events is this
rank's idle time: waiting for a neighbour (the pipeline bubble) or moving tensors.

``weight_grads``: the step's :class:`~lightning_megatron.tensor_parallel.backward.WeightGradPolicy`;
every backward pass goes through its ``backward_input`` (None: plain autograd).
:class:`MicrobatchRunner` is the forward and backward of one microbatch on one chunk that every
schedule here is written with: a new schedule (docs/pipeline.md) uses it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.pipeline.p2p import P2PCommunicator, P2PWork
from lightning_megatron.tensor_parallel.backward import WeightGradPolicy, custom_backward

__all__ = [
    "ScheduleEvent",
    "ForwardStepFunc",
    "MicrobatchRunner",
    "device_of",
    "num_microbatches_problem",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
    "deallocate_output_tensor",
    "custom_backward",
]

LossFunc = Callable[[Tensor], tuple[Tensor, dict[str, Any]]]
ForwardStepFunc = Callable[[Any, nn.Module], tuple[Tensor, LossFunc]]
"""``forward_step_func(microbatch, chunk) -> (output_tensor, loss_func)``."""


@dataclass(frozen=True, slots=True)
class ScheduleEvent:
    """One forward (``F``) or backward (``B``) pass of one microbatch through one model chunk."""

    kind: Literal["F", "B"]
    microbatch: int
    """Index into ``microbatches``."""
    chunk: int
    """Model chunk (``vp_rank``); 0 without interleaving."""
    phase: Literal["warmup", "steady", "cooldown"]
    start: float
    end: float


def num_microbatches_problem(num_microbatches: int, pp_size: int, vp_size: int | None) -> str | None:
    """Megatron's rules on the microbatch count, as a message (None when they hold): at least one
    microbatch; the interleaved schedule needs ``m % pp == 0``. Pure arithmetic: the named schedules
    answer it at set-up and ``config_checks`` before launch; every schedule checks it again before
    any communication."""
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        return f"num_microbatches={num_microbatches!r} must be a positive integer"
    if pp_size > 1 and vp_size is not None and vp_size > 1 and num_microbatches % pp_size != 0:
        return (f"num_microbatches={num_microbatches} is not divisible by pipeline_model_parallel_size="
                f"{pp_size}, which the interleaved schedule (virtual_pipeline_model_parallel_size={vp_size}) "
                f"requires; use a multiple of {pp_size} (global_batch = micro_batch * num_microbatches * dp)")
    return None


def _validate_num_microbatches(num_microbatches: int, pp_size: int, vp_size: int | None) -> None:
    problem = num_microbatches_problem(num_microbatches, pp_size, vp_size)
    if problem:
        raise ValueError(problem)


# -- forward and backward of one microbatch on one chunk ---------------------------------------------


def deallocate_output_tensor(out: Tensor | None) -> None:
    """Free the data of an output that was sent to the next stage, keeping its ``grad_fn``.

    After the send, backward needs only the graph behind the output (ops that need the output's
    value, like tanh, hold their own reference to its storage). Replacing ``.data`` by a 1-element
    tensor releases ``[s, b, h]`` per in-flight microbatch. Skipped where unsafe: a view (would
    alias its base), or a tensor without ``grad_fn`` (a leaf: a parameter or the received input).
    """
    if out is None or out.grad_fn is None or out._base is not None:
        return
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


class MicrobatchRunner:
    """The forward and the backward pass of one microbatch on one chunk, and what a schedule call
    shares between them (the logged values, the trace, the options): what schedules are written with."""

    def __init__(self, *, forward_step_func: ForwardStepFunc, microbatches: list, model: list[nn.Module],
                 num_microbatches: int, forward_only: bool,
                 grad_scale_func: Callable[[Tensor], Tensor] | None, trace: list | None,
                 weight_grads: WeightGradPolicy | None = None) -> None:
        if len(microbatches) != num_microbatches:
            raise ValueError(f"got {len(microbatches)} microbatches but num_microbatches={num_microbatches}")
        self.forward_step_func = forward_step_func
        self.microbatches = microbatches
        self.model = model
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.grad_scale_func = grad_scale_func
        self.trace = trace
        self.weight_grads = weight_grads
        self.logged: list[dict[str, Any]] = []
        """One dict per microbatch on the last piece, detached: what the schedule returns."""

    def forward(self, microbatch: int, chunk: int, input_tensor: Tensor | None, *, last_piece: bool,
                phase: str) -> Tensor:
        """Run one chunk; on the last piece return ``loss / m`` (the tensor backward starts from)."""
        start = time.perf_counter()
        module = self.model[chunk]
        set_input_tensor = getattr(module, "set_input_tensor", None)
        if set_input_tensor is not None:
            set_input_tensor(input_tensor)
        elif input_tensor is not None:
            raise ValueError(f"{type(module).__name__} receives activations from the previous pipeline stage "
                             f"but has no set_input_tensor(tensor) method (see docs/strategy.md)")
        output_tensor, loss_func = self.forward_step_func(self.microbatches[microbatch], module)
        if last_piece:
            if loss_func is None:
                raise TypeError(f"forward_step returned no loss_func on the last pipeline piece "
                                f"({type(module).__name__}, the chunk with post_process): return (output, loss_func) "
                                f"there, loss_func(output) -> (loss, dict of values to log)")
            result = loss_func(output_tensor)
            if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Tensor)
                    and isinstance(result[1], Mapping)):
                raise TypeError(f"loss_func must return (loss, dict of values to log), e.g. (loss, {{'loss': "
                                f"loss.detach()}}); got a {type(result).__name__}")
            loss, logged = result
            if loss.dim() != 0:
                raise ValueError(f"loss_func must return a scalar loss (the mean over the microbatch), "
                                 f"got shape {tuple(loss.shape)}")
            output_tensor = loss / self.num_microbatches
            self.logged.append({k: v.detach() if isinstance(v, Tensor) else v for k, v in logged.items()})
        self._record("F", microbatch, chunk, phase, start)
        return output_tensor

    def backward(self, microbatch: int, chunk: int, input_tensor: Tensor | None, output_tensor: Tensor,
                 output_tensor_grad: Tensor | None, *, phase: str) -> Tensor | None:
        """Backpropagate one chunk; return the gradient of its input (``None`` on the first piece)."""
        start = time.perf_counter()
        if output_tensor_grad is None and self.grad_scale_func is not None:
            output_tensor = self.grad_scale_func(output_tensor)  # loss scaling, last piece only
        if self.weight_grads is None:
            custom_backward(output_tensor, output_tensor_grad)
        else:
            self.weight_grads.backward_input(output_tensor, output_tensor_grad, microbatch=microbatch)
        input_tensor_grad = None
        if input_tensor is not None:
            # A chunk that ignores its input still owes its predecessor a gradient: zero.
            input_tensor_grad = input_tensor.grad if input_tensor.grad is not None else torch.zeros_like(input_tensor)
        self._record("B", microbatch, chunk, phase, start)
        return input_tensor_grad

    def _record(self, kind: str, microbatch: int, chunk: int, phase: str, start: float) -> None:
        if self.trace is not None:
            self.trace.append(ScheduleEvent(kind, microbatch, chunk, phase, start, time.perf_counter()))


def device_of(model: list[nn.Module]) -> torch.device:
    """The device of the chunks' parameters (CPU without any): where received tensors are allocated."""
    for chunk in model:
        for p in chunk.parameters():
            return p.device
    return torch.device("cpu")


def _check_chunks(model: list[nn.Module], expected: int, schedule: str) -> None:
    if len(model) != expected:
        raise ValueError(f"{schedule} expects {expected} model chunk(s) on this rank, got len(model)={len(model)}")


# -- schedules ---------------------------------------------------------------------------------------


def forward_backward_no_pipelining(
    *, forward_step_func: ForwardStepFunc, microbatches: list, model: list[nn.Module], num_microbatches: int,
    parallel_state: ParallelState, tensor_shape: tuple[int, ...], dtype: torch.dtype, forward_only: bool = False,
    grad_scale_func: Callable[[Tensor], Tensor] | None = None, trace: list | None = None,
    overlap_p2p_comm: bool = False, weight_grads: WeightGradPolicy | None = None,
) -> list[dict[str, Any]]:
    """PP=1: forward and backward each microbatch in turn (gradient accumulation); no communication.

    ``overlap_p2p_comm`` is accepted for a uniform signature and has nothing to overlap."""
    _validate_num_microbatches(num_microbatches, 1, None)
    _check_chunks(model, 1, "forward_backward_no_pipelining")
    run = MicrobatchRunner(forward_step_func=forward_step_func, microbatches=microbatches, model=model,
                           num_microbatches=num_microbatches, forward_only=forward_only,
                           grad_scale_func=grad_scale_func, trace=trace, weight_grads=weight_grads)
    with torch.no_grad() if forward_only else torch.enable_grad():
        for i in range(num_microbatches):
            output_tensor = run.forward(i, 0, None, last_piece=True, phase="steady")
            if not forward_only:
                run.backward(i, 0, None, output_tensor, None, phase="steady")
    return run.logged


def forward_backward_pipelining_without_interleaving(
    *, forward_step_func: ForwardStepFunc, microbatches: list, model: list[nn.Module], num_microbatches: int,
    parallel_state: ParallelState, tensor_shape: tuple[int, ...], dtype: torch.dtype, forward_only: bool = False,
    grad_scale_func: Callable[[Tensor], Tensor] | None = None, trace: list | None = None,
    overlap_p2p_comm: bool = False, weight_grads: WeightGradPolicy | None = None,
) -> list[dict[str, Any]]:
    """1F1B: ``min(p - r - 1, m)`` warm-up forwards, then one forward one backward, then cool-down.

    At most ``p - r`` microbatches are in flight on stage ``r`` (their activations are kept for
    backward), against ``m`` for all-forward-then-all-backward (GPipe). Each step's sends and
    receives go in one batch; ``overlap_p2p_comm`` has no effect here (as in megatron-core: every
    exchange feeds the very next compute).
    """
    ps = parallel_state
    m = num_microbatches
    _validate_num_microbatches(m, ps.pp_size, None)
    _check_chunks(model, 1, "forward_backward_pipelining_without_interleaving")
    run = MicrobatchRunner(forward_step_func=forward_step_func, microbatches=microbatches, model=model,
                           num_microbatches=m, forward_only=forward_only, grad_scale_func=grad_scale_func,
                           trace=trace, weight_grads=weight_grads)
    comm = P2PCommunicator(ps, tensor_shape, dtype, device_of(model), requires_grad=not forward_only)
    last = ps.is_pipeline_last_stage()
    num_warmup = min(ps.pp_size - ps.pp_rank - 1, m)
    num_remaining = m - num_warmup
    # FIFO of (microbatch, input, output) awaiting backward; length <= num_warmup + 1.
    in_flight: list[tuple[int, Tensor | None, Tensor]] = []

    def keep(i: int, input_tensor: Tensor | None, output_tensor: Tensor) -> None:
        if not forward_only:
            in_flight.append((i, input_tensor, output_tensor))
            if not last:
                deallocate_output_tensor(output_tensor)  # sent already; only its graph is needed

    with torch.no_grad() if forward_only else torch.enable_grad():
        for i in range(num_warmup):
            input_tensor = comm.recv_forward()
            output_tensor = run.forward(i, 0, input_tensor, last_piece=last, phase="warmup")
            comm.send_forward(output_tensor)
            keep(i, input_tensor, output_tensor)

        input_tensor = comm.recv_forward() if num_remaining > 0 else None
        for j in range(num_remaining):
            i = num_warmup + j
            last_iteration = j == num_remaining - 1
            output_tensor = run.forward(i, 0, input_tensor, last_piece=last, phase="steady")
            if forward_only:
                comm.send_forward(output_tensor)
                if not last_iteration:
                    input_tensor = comm.recv_forward()
                continue
            output_tensor_grad = comm.send_forward_recv_backward(output_tensor)
            keep(i, input_tensor, output_tensor)
            b, input_tensor, output_tensor = in_flight.pop(0)
            input_tensor_grad = run.backward(b, 0, input_tensor, output_tensor, output_tensor_grad, phase="steady")
            if last_iteration:
                comm.send_backward(input_tensor_grad)
            else:
                input_tensor = comm.send_backward_recv_forward(input_tensor_grad)

        if not forward_only:
            for _ in range(num_warmup):
                b, input_tensor, output_tensor = in_flight.pop(0)
                output_tensor_grad = comm.recv_backward()
                input_tensor_grad = run.backward(b, 0, input_tensor, output_tensor, output_tensor_grad,
                                                 phase="cooldown")
                comm.send_backward(input_tensor_grad)
    return run.logged


def forward_backward_pipelining_with_interleaving(
    *, forward_step_func: ForwardStepFunc, microbatches: list, model: list[nn.Module], num_microbatches: int,
    parallel_state: ParallelState, tensor_shape: tuple[int, ...], dtype: torch.dtype, forward_only: bool = False,
    grad_scale_func: Callable[[Tensor], Tensor] | None = None, trace: list | None = None,
    overlap_p2p_comm: bool = False, weight_grads: WeightGradPolicy | None = None,
) -> list[dict[str, Any]]:
    """Interleaved 1F1B over ``v = len(model)`` chunks (Megatron's schedule).

    Virtual microbatch ``k`` in ``[0, m v)``: forward chunk ``(k mod p v) // p``, backward chunk
    ``v - 1 - (k mod p v) // p``, microbatch ``(k // p v) p + k mod p``. Warm-up
    ``min(2 (p - r - 1) + (v - 1) p, m v)`` forwards (all of them when forward-only), steady 1F1B,
    cool-down. Tensors are received one step ahead into per-chunk FIFOs; the first stage never
    receives for chunk 0 (it reads the batch) and the last stage never receives gradients for
    chunk ``v - 1`` (it starts backward from the loss).

    ``overlap_p2p_comm`` (megatron-core's name): in the steady state the forward pass's send and the
    next input's receive are posted right after the forward and waited for only before the next
    forward, so they run under this step's backward; the backward pass's send and the next gradient's
    receive run under the next forward. The same messages in the same order per peer and kind:
    bitwise equal to the exchanges that wait at once.
    """
    ps = parallel_state
    p, r, v, m = ps.pp_size, ps.pp_rank, len(model), num_microbatches
    _validate_num_microbatches(m, p, v)
    if p < 2 or v < 2:
        raise ValueError(f"the interleaved schedule needs pp_size >= 2 and len(model) >= 2, got pp_size={p}, "
                         f"len(model)={v}; pipeline_schedule='auto' picks the schedule of a layout")
    if ps.vp_size is not None and ps.vp_size != v:
        raise ValueError(f"len(model)={v} differs from virtual_pipeline_model_parallel_size={ps.vp_size}")
    run = MicrobatchRunner(forward_step_func=forward_step_func, microbatches=microbatches, model=model,
                           num_microbatches=m, forward_only=forward_only, grad_scale_func=grad_scale_func,
                           trace=trace, weight_grads=weight_grads)
    comm = P2PCommunicator(ps, tensor_shape, dtype, device_of(model), requires_grad=not forward_only)
    first_stage, last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()

    total = m * v
    all_warmup = False
    if forward_only:
        num_warmup = total
    else:
        num_warmup = 2 * (p - r - 1) + (v - 1) * p
        if num_warmup >= total:
            num_warmup, all_warmup = total, True
    num_remaining = total - num_warmup

    def chunk_id(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def microbatch_id(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def is_first_piece(c: int) -> bool:
        return first_stage and c == 0

    def is_last_piece(c: int) -> bool:
        return last_stage and c == v - 1

    input_tensors: list[list[Tensor | None]] = [[] for _ in range(v)]
    output_tensors: list[list[Tensor]] = [[] for _ in range(v)]
    output_tensor_grads: list[list[Tensor | None]] = [[] for _ in range(v)]

    def forward_helper(k: int, phase: str) -> Tensor | None:
        """Forward virtual microbatch ``k``; return what to send forward (``None`` on the last piece)."""
        c = chunk_id(k, forward=True)
        if is_first_piece(c) and len(input_tensors[c]) == len(output_tensors[c]):
            input_tensors[c].append(None)  # the first piece reads the batch
        input_tensor = input_tensors[c][-1]
        output_tensor = run.forward(microbatch_id(k), c, input_tensor, last_piece=is_last_piece(c), phase=phase)
        output_tensors[c].append(output_tensor)
        if forward_only:  # nothing is kept for backward
            input_tensors[c].pop()
            output_tensors[c].pop()
        return None if is_last_piece(c) else output_tensor

    def backward_helper(k: int, phase: str) -> Tensor | None:
        """Backward virtual microbatch ``k``; return what to send back (``None`` on the first piece)."""
        c = chunk_id(k, forward=False)
        if is_last_piece(c) and not output_tensor_grads[c]:
            output_tensor_grads[c].append(None)  # backward starts from the loss
        input_tensor = input_tensors[c].pop(0)
        output_tensor = output_tensors[c].pop(0)
        output_tensor_grad = output_tensor_grads[c].pop(0)
        input_tensor_grad = run.backward(microbatch_id(k), c, input_tensor, output_tensor, output_tensor_grad,
                                         phase=phase)
        return None if is_first_piece(c) else input_tensor_grad

    def free(output_tensor: Tensor | None) -> None:
        if not forward_only:
            deallocate_output_tensor(output_tensor)

    with torch.no_grad() if forward_only else torch.enable_grad():
        input_tensors[0].append(comm.recv_forward())  # None on stage 0: chunk 0 there is the first piece

        for k in range(num_warmup):
            output_tensor = forward_helper(k, "warmup")
            next_chunk = chunk_id(k + 1, forward=True)
            # Stage 0 receives nothing for chunk 0 (the batch feeds it); nothing after the last one.
            recv_prev = not (first_stage and next_chunk == 0) and k != total - 1
            if k == num_warmup - 1 and not forward_only and not all_warmup:
                # Last warm-up step: also receive the first gradient the steady state needs.
                input_tensor, output_tensor_grad = comm.send_forward_backward_recv_forward_backward(
                    output_tensor, None, recv_prev=recv_prev, recv_next=not last_stage)
                output_tensor_grads[v - 1].append(output_tensor_grad)
            else:
                input_tensor = comm.send_forward_recv_forward(output_tensor, recv_prev=recv_prev)
            free(output_tensor)
            input_tensors[next_chunk].append(input_tensor)

        # overlap_p2p_comm: the posted exchanges and the chunk whose FIFO the received tensor joins.
        fwd_work: tuple[P2PWork, int] | None = None
        bwd_work: tuple[P2PWork, int] | None = None
        for j in range(num_remaining):
            forward_k, backward_k = j + num_warmup, j
            if fwd_work is not None:
                input_tensor = fwd_work[0].wait()[0]
                if input_tensor is not None:
                    input_tensors[fwd_work[1]].append(input_tensor)
            output_tensor = forward_helper(forward_k, "steady")

            # Which chunk the tensors received now belong to. Stage 0 is p - 1 virtual microbatches
            # ahead of the last stage it receives from (and the last stage ahead of stage 0 for
            # gradients), so its next input belongs to the chunk after the one the sender runs.
            if first_stage:
                sender_chunk = chunk_id(forward_k - (p - 1), forward=True)
                recv_prev, next_forward_chunk = sender_chunk != v - 1, sender_chunk + 1
            else:
                recv_prev, next_forward_chunk = True, chunk_id(forward_k + 1, forward=True)
            if j == num_remaining - 1:
                recv_prev = False  # every forward input has arrived
            if overlap_p2p_comm:
                fwd_work = (comm.post_forward(output_tensor, recv_prev), next_forward_chunk)
                free(output_tensor)  # the send holds its own reference to the data
                if bwd_work is not None:
                    output_tensor_grad = bwd_work[0].wait()[1]
                    if output_tensor_grad is not None:
                        output_tensor_grads[bwd_work[1]].append(output_tensor_grad)

            input_tensor_grad = backward_helper(backward_k, "steady")
            if last_stage:
                sender_chunk = chunk_id(backward_k - (p - 1), forward=False)
                recv_next, next_backward_chunk = sender_chunk != 0, sender_chunk - 1
            else:
                recv_next, next_backward_chunk = True, chunk_id(backward_k + 1, forward=False)
            if overlap_p2p_comm:
                bwd_work = (comm.post_backward(input_tensor_grad, recv_next), next_backward_chunk)
                continue

            input_tensor, output_tensor_grad = comm.send_forward_backward_recv_forward_backward(
                output_tensor, input_tensor_grad, recv_prev=recv_prev, recv_next=recv_next)
            free(output_tensor)
            if recv_prev:
                input_tensors[next_forward_chunk].append(input_tensor)
            if recv_next:
                output_tensor_grads[next_backward_chunk].append(output_tensor_grad)
        if fwd_work is not None:
            fwd_work[0].wait()  # receives nothing: the last steady step has every input
        if bwd_work is not None:
            output_tensor_grad = bwd_work[0].wait()[1]
            if output_tensor_grad is not None:
                output_tensor_grads[bwd_work[1]].append(output_tensor_grad)

        if not forward_only:
            if all_warmup:
                output_tensor_grads[v - 1].append(comm.recv_backward())
            for k in range(num_remaining, total):
                input_tensor_grad = backward_helper(k, "cooldown")
                next_backward_chunk = chunk_id(k + 1, forward=False)
                recv_next = not (last_stage and next_backward_chunk == v - 1) and k != total - 1
                output_tensor_grads[next_backward_chunk].append(
                    comm.send_backward_recv_backward(input_tensor_grad, recv_next=recv_next))
    return run.logged
