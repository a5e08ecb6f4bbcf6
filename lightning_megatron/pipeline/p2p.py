"""Point-to-point transfers of activations and their gradients between adjacent pipeline stages.

Every transfer carries one tensor of the fixed ``tensor_shape`` (``[s, b, h]``) and ``dtype``:
activations travel *forward* (stage r -> r+1, the last stage wrapping to stage 0 for the next
model chunk under interleaving), gradients w.r.t. activations travel *backward* (r -> r-1).

All ops of one call are posted together with ``torch.distributed.batch_isend_irecv`` on the
pipeline group, then waited on. A stage that sends to its neighbour and receives from it in the same
step (``send_forward_recv_backward``, ``send_backward_recv_forward``) therefore never waits for the
neighbour to finish a send first: both sides have posted both ops, so no order of stages deadlocks.

Two stages can exchange both kinds of message in the same direction (PP=2: the next and the previous
stage are the same rank). The kinds are kept apart by the P2P ``tag`` (forward 1, backward 2; gloo
matches on it) and by posting ops in one fixed order (forward-direction ops first), so that a
backend which ignores tags and matches in order (NCCL) pairs the same messages.

Waits are bounded by the pipeline group's timeout (``initialize_model_parallel(timeout=...)``):
a stage whose peer died does not hang (gloo raises from the wait; NCCL's wait returns at once, the device
waits, and its watchdog ends the process when the timeout passes).

``post_forward`` / ``post_backward`` (the interleaved schedule's ``overlap_p2p_comm``, megatron-core's
name) post a batch and return a :class:`P2PWork` instead of waiting: the schedule computes meanwhile
and calls ``wait()`` (the same bounded waits) before it uses what was received.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.parallel_state import ParallelState

__all__ = ["P2PCommunicator", "P2PWork", "FORWARD_TAG", "BACKWARD_TAG"]

FORWARD_TAG = 1
"""P2P tag of activations (stage r -> r+1)."""
BACKWARD_TAG = 2
"""P2P tag of activation gradients (stage r -> r-1)."""


class P2PWork:
    """Posted sends and receives of one batch; :meth:`wait` returns ``(tensor_recv_prev, tensor_recv_next)``."""

    def __init__(self, works: list, sent: list[Tensor], recv_prev: Tensor | None, recv_next: Tensor | None,
                 requires_grad: bool) -> None:
        self._works = works
        self._sent = sent  # the send buffers stay alive until the sends are done
        self._recv = (recv_prev, recv_next)
        self._requires_grad = requires_grad

    def wait(self) -> tuple[Tensor | None, Tensor | None]:
        for work in self._works:
            work.wait()  # bounded by the pipeline group's timeout
        self._works, self._sent = [], []
        recv_prev = self._recv[0]
        if recv_prev is not None and self._requires_grad and not recv_prev.requires_grad:
            recv_prev.requires_grad_(True)
        return self._recv


class P2PCommunicator:
    """Sends and receives ``[s, b, h]`` tensors to the previous / next stage of this rank's pipeline.

    Method names are Megatron's (``megatron.core.pipeline_parallel.p2p_communication``). The
    one-way helpers know the pipeline ends (``recv_forward`` on stage 0 returns ``None``,
    ``send_forward`` on the last stage does nothing); the combined helpers used by the interleaved
    schedule take explicit ``recv_prev`` / ``recv_next`` flags and ``None`` tensors instead, because
    there the last stage still sends forward (to stage 0's next chunk).

    Received activations require grad (the stage backpropagates into them); received gradients do
    not. With ``requires_grad=False`` (forward-only schedules) nothing received requires grad.
    """

    def __init__(self, parallel_state: ParallelState, tensor_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device, *, requires_grad: bool = True) -> None:
        self.parallel_state = parallel_state
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = device
        self.requires_grad = requires_grad

    # -- the one primitive -------------------------------------------------------------------------

    def _check_send(self, tensor: Tensor, what: str) -> None:
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"pipeline stage {self.parallel_state.pp_rank} tried to send {what} of shape "
                f"{tuple(tensor.shape)} and dtype {tensor.dtype}, but the schedule was given "
                f"tensor_shape={self.tensor_shape} and dtype={self.dtype}; every stage must exchange "
                f"[s, b, h] tensors of that shape"
            )

    def _communicate(self, *, tensor_send_next: Tensor | None, tensor_send_prev: Tensor | None,
                     recv_prev: bool, recv_next: bool) -> tuple[Tensor | None, Tensor | None]:
        """Post every requested send and receive in one batch and wait for all of them.

        Returns ``(tensor_recv_prev, tensor_recv_next)``: the activation from the previous stage and
        the gradient from the next stage (``None`` where not requested).
        """
        return self._post(tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                          recv_prev=recv_prev, recv_next=recv_next).wait()

    def _post(self, *, tensor_send_next: Tensor | None, tensor_send_prev: Tensor | None,
              recv_prev: bool, recv_next: bool) -> P2PWork:
        """Post every requested send and receive in one batch (``batch_isend_irecv``), without waiting."""
        ps = self.parallel_state
        group = ps.pp_group
        ops: list[dist.P2POp] = []
        sent: list[Tensor] = []
        tensor_recv_prev = tensor_recv_next = None
        # Forward-direction ops first, then backward-direction ops: see the module docstring.
        if tensor_send_next is not None:
            self._check_send(tensor_send_next, "an activation")
            sent.append(tensor_send_next.detach().contiguous())
            ops.append(dist.P2POp(dist.isend, sent[-1], ps.next_rank, group, FORWARD_TAG))
        if recv_prev:
            tensor_recv_prev = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, tensor_recv_prev, ps.prev_rank, group, FORWARD_TAG))
        if tensor_send_prev is not None:
            self._check_send(tensor_send_prev, "an activation gradient")
            sent.append(tensor_send_prev.detach().contiguous())
            ops.append(dist.P2POp(dist.isend, sent[-1], ps.prev_rank, group, BACKWARD_TAG))
        if recv_next:
            tensor_recv_next = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, tensor_recv_next, ps.next_rank, group, BACKWARD_TAG))
        return P2PWork(dist.batch_isend_irecv(ops) if ops else [], sent, tensor_recv_prev, tensor_recv_next,
                       self.requires_grad)

    # -- one-way helpers (aware of the pipeline ends) -----------------------------------------------

    def recv_forward(self) -> Tensor | None:
        """Activation from the previous stage; ``None`` on the first stage."""
        if self.parallel_state.is_pipeline_first_stage():
            return None
        return self._communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=True, recv_next=False)[0]

    def recv_backward(self) -> Tensor | None:
        """Gradient of this stage's output from the next stage; ``None`` on the last stage."""
        if self.parallel_state.is_pipeline_last_stage():
            return None
        return self._communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=True)[1]

    def send_forward(self, output_tensor: Tensor | None) -> None:
        """Send this stage's output to the next stage (nothing on the last stage)."""
        if not self.parallel_state.is_pipeline_last_stage():
            self._communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False, recv_next=False)

    def send_backward(self, input_tensor_grad: Tensor | None) -> None:
        """Send the gradient of this stage's input to the previous stage (nothing on the first stage)."""
        if not self.parallel_state.is_pipeline_first_stage():
            self._communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False,
                              recv_next=False)

    def send_forward_recv_backward(self, output_tensor: Tensor | None) -> Tensor | None:
        """Send the output forward and receive its gradient, in one batch (1F1B steady state)."""
        if self.parallel_state.is_pipeline_last_stage():
            return None
        return self._communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False,
                                 recv_next=True)[1]

    def send_backward_recv_forward(self, input_tensor_grad: Tensor | None) -> Tensor | None:
        """Send the input gradient backward and receive the next activation, in one batch."""
        if self.parallel_state.is_pipeline_first_stage():
            return None
        return self._communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=True,
                                 recv_next=False)[0]

    # -- combined helpers for the interleaved schedule (explicit flags) -----------------------------

    def send_forward_recv_forward(self, output_tensor: Tensor | None, recv_prev: bool) -> Tensor | None:
        """Send an activation to the next stage and receive one from the previous stage."""
        return self._communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=recv_prev,
                                 recv_next=False)[0]

    def send_backward_recv_backward(self, input_tensor_grad: Tensor | None, recv_next: bool) -> Tensor | None:
        """Send a gradient to the previous stage and receive one from the next stage."""
        return self._communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False,
                                 recv_next=recv_next)[1]

    def post_forward(self, output_tensor: Tensor | None, recv_prev: bool) -> P2PWork:
        """:meth:`send_forward_recv_forward` without waiting (``wait()[0]`` is the received activation)."""
        return self._post(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=recv_prev, recv_next=False)

    def post_backward(self, input_tensor_grad: Tensor | None, recv_next: bool) -> P2PWork:
        """:meth:`send_backward_recv_backward` without waiting (``wait()[1]`` is the received gradient)."""
        return self._post(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False,
                          recv_next=recv_next)

    def send_forward_backward_recv_forward_backward(
        self, output_tensor: Tensor | None, input_tensor_grad: Tensor | None, recv_prev: bool, recv_next: bool,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Both directions at once: returns ``(input_tensor, output_tensor_grad)``."""
        return self._communicate(tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad,
                                 recv_prev=recv_prev, recv_next=recv_next)
