"""Opt-in tuning for CPU runs: shared-memory collectives, the glibc allocator setting, CPU kernels.

The library's defaults take one code path on every device (``torch.distributed`` collectives,
torch's allocator, ``F.dropout`` and SDPA). On a CPU box three things measurably help, and a run
switches them on explicitly, in one place::

    from lightning_megatron.cpu import CPUTuning
    MegatronStrategy(..., cpu_tuning=CPUTuning())      # or cpu_tuning=True; in YAML: cpu_tuning: true

- ``shared_memory_collectives``: the TP, DP, model-parallel and embedding groups of ranks on one host exchange
  CPU tensors through one shared mapping instead of gloo's TCP loopback
  (:mod:`lightning_megatron.cpu.shared_memory`), installed as the groups' communicators with
  ``ParallelState.set_communicator``;
- ``keep_freed_memory``: glibc ``mallopt`` so that freed memory stays in the process and steps stop
  page-faulting (:mod:`lightning_megatron.cpu.allocator`). This changes the whole process's
  allocator: that is why it is never on by default;
- ``kernels``: the CPU dropout kernel and the CPU choice of attention path
  (:class:`lightning_megatron.cpu.kernels.CPUKernels`), the gradient buffer's accumulation of a
  16-bit microbatch gradient into fp32 (:mod:`lightning_megatron.cpu.accumulate`), the grad norm's fp64
  squares in cache-sized pieces (:meth:`CPUTuning.norm_piece`), and on a pipeline's first stage the word
  embedding's gradient as rows (:mod:`lightning_megatron.cpu.embedding_grad`);
- ``weight_grads_per_step`` (off unless asked for: other bits): each linear layer's weight gradient
  computed once per step, after the schedule's last backward (:meth:`CPUTuning.configure_grads`).

Each piece acts on CPU only; on an accelerator the tuning does nothing. ``docs/strategy.md``
(CPU tuning) lists what each piece measured.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_megatron.parallel_state import ParallelState

if TYPE_CHECKING:
    from lightning_megatron.tensor_parallel.backward import WeightGradPolicy

__all__ = ["CPUTuning"]

NORM_PIECE_PER_THREAD = 1 << 17
"""The grad norm's fp64 squares on a CPU, per intra-op thread, with at least ``NORM_PIECE_MIN`` in all: each
thread's 1 MiB of fp64 stays in its core's cache between the conversion and the dot product."""

NORM_PIECE_MIN = 1 << 18
"""The smallest piece (2 MiB of fp64): smaller ones pay the two ops' fixed cost per call too often (docs/optimizer.md,
"The pieces": bert-base's gradients on one Zen 4 core in 45-46 ms in pieces of 256 Ki elements, 70 ms in pieces of
64 Ki; on two, 31-40 ms against 40-55 ms in pieces of 64 Ki per thread, and 27-78 ms from one run to the next in
pieces of 512 Ki or more)."""


@dataclass(frozen=True, kw_only=True)
class CPUTuning:
    """Which CPU tunings a run switches on (all by default once a ``CPUTuning`` is given)."""

    shared_memory_collectives: bool = True
    """TP/DP/model-parallel/embedding-group collectives of same-host CPU ranks through shared memory."""
    keep_freed_memory: bool = True
    """glibc ``mallopt``: keep freed memory in the process (process-wide, until exit)."""
    kernels: bool = True
    """CPU dropout kernel and CPU attention path choice (:class:`~lightning_megatron.cpu.kernels.CPUKernels`);
    16-bit gradients added into fp32 main grads a cache-sized piece at a time (:mod:`lightning_megatron.cpu.accumulate`);
    the grad norm's fp64 squares in cache-sized pieces (:meth:`norm_piece`); a pipeline first stage's word-embedding
    gradient as rows (:mod:`lightning_megatron.cpu.embedding_grad`)."""
    weight_grads_per_step: bool = False
    """Every linear layer's weight gradient computed once per step, after the schedule's last backward
    (the pipeline flush), one GEMM over all the microbatches
    (:mod:`lightning_megatron.tensor_parallel.deferred_wgrad`). Not the bits of the per-microbatch
    path, so off unless asked for; see :meth:`configure_grads`."""
    tp_slot_bytes: int = 8 << 20
    """Bytes per rank slot in the TP, DP and embedding shared mappings (larger messages go in pieces)."""
    mp_slot_bytes: int = 64 << 10
    """Bytes per rank slot of the model-parallel group (only grad norms and overflow flags)."""

    @classmethod
    def from_argument(cls, value: CPUTuning | bool | None) -> CPUTuning | None:
        """``MegatronStrategy(cpu_tuning=...)``: ``True`` -> ``CPUTuning()``, ``False``/``None`` -> off."""
        if value is True:
            return cls()
        if value is False or value is None:
            return None
        if not isinstance(value, cls):
            raise TypeError(f"MegatronStrategy: cpu_tuning={value!r} must be a lightning_megatron.cpu.CPUTuning, "
                            f"True, False or None")
        return value

    def setup(self, parallel_state: ParallelState, *, device: torch.device,
              timeout: datetime.timedelta | None = None) -> dict[str, bool]:
        """After the process groups exist (collective over every group): apply the process-level pieces.

        Returns what was applied: ``{"keep_freed_memory": ..., "tp": ..., "dp": ..., "dp_cp": ..., "mp": ..., "embedding": ...}``
        (a group stays on ``torch.distributed`` when it has one rank or spans hosts).
        """
        applied = {"keep_freed_memory": False, "tp": False, "dp": False, "dp_cp": False, "mp": False, "embedding": False}
        if device.type != "cpu":
            return applied
        if self.keep_freed_memory:
            from lightning_megatron.cpu.allocator import keep_freed_memory

            applied["keep_freed_memory"] = keep_freed_memory()
        if self.shared_memory_collectives:
            from lightning_megatron.cpu.shared_memory import enable_shared_memory_collectives

            # Every rank, in this order: each call is collective over its group.
            # The embedding group (first and last pipeline stage) sums the tied word embedding's fp32
            # gradient once per step: 94 MB at bert-base, between the last backward and the optimizer.
            # Groups that span the same ranks with the same slot size (dp and dp_cp without context
            # parallelism) share one communicator: the same decision on every rank (it follows the layout).
            made: dict[tuple[tuple[int, ...], int], object] = {}
            for name, slot in (("tp", self.tp_slot_bytes), ("dp", self.tp_slot_bytes), ("dp_cp", self.tp_slot_bytes),
                               ("mp", self.mp_slot_bytes), ("embedding", self.tp_slot_bytes)):
                key = (tuple(parallel_state.members.get(name, ())), slot)
                if key in made:
                    comm = made[key]
                else:
                    comm = made[key] = enable_shared_memory_collectives(parallel_state.group(name), slot_bytes=slot,
                                                                        timeout=timeout)
                if comm is not None:
                    parallel_state.set_communicator(name, comm)
                    applied[name] = True
        return applied

    def synchronous_collectives(self, device: torch.device, parallel_state: ParallelState | None = None) -> bool:
        """Whether the DP gradient reduction of ``device`` tensors runs synchronously (shared memory): then
        overlapping it with backward only makes each bucket wait inside backward.

        With ``parallel_state`` (after :meth:`setup`): whether its ``dp_cp`` group, the one the gradient buffer
        reduces over, got the shared-memory communicator; a group that stays on gloo (ranks on several hosts, a
        machine that is not x86-64) reduces asynchronously. Without it: the prediction for ranks on one host
        (``check --estimate-time``)."""
        if not self.shared_memory_collectives or device.type != "cpu":
            return False
        if parallel_state is None:
            return True
        from lightning_megatron.cpu.shared_memory import SharedMemoryCollectives

        group = parallel_state.group("dp_cp")
        return group is not None and isinstance(group.communicator, SharedMemoryCollectives)

    def configure_model(self, model: nn.Module, device: torch.device) -> int:
        """Install the CPU kernels on a built model (on CPU); returns the number of modules changed."""
        if not self.kernels or device.type != "cpu":
            return 0
        from lightning_megatron.cpu.kernels import CPUKernels
        from lightning_megatron.transformer.kernels import set_kernels

        return set_kernels(model, CPUKernels())

    def grad_accumulation(self, device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """The GradBuffer's ``main_grad += grad`` of later microbatches: on CPU with ``kernels``, the
        cache-sized conversion of :func:`lightning_megatron.cpu.accumulate.accumulate_grad` (same bits)."""
        if not self.kernels or device.type != "cpu":
            return None
        from lightning_megatron.cpu.accumulate import accumulate_grad

        return accumulate_grad

    def grad_buffer_options(self, device: torch.device) -> dict[str, Any]:
        """What the tuning hands the strategy's :class:`~lightning_megatron.grads.GradBuffer` on ``device``: its
        microbatch accumulation (:meth:`grad_accumulation`), the pieces of the optimizers' norm
        (:meth:`norm_piece`), each None where the tuning does nothing, and on CPU with ``kernels`` that the
        optimizers decide their step on the host (``decide_on_host``: a read of a CPU value waits for nothing,
        and leaving the decision to the device costs a pass over the gradients when clipping)."""
        return {"accumulate": self.grad_accumulation(device), "norm_piece": self.norm_piece(device),
                "decide_on_host": self.kernels and device.type == "cpu"}

    def norm_piece(self, device: torch.device) -> int | None:
        """Elements of a gradient squared in fp64 at a time by the optimizers' norm
        (:func:`~lightning_megatron.optimizer.clip_grads.sum_of_squares_fp64`), handed to them with the grad
        buffer: on CPU with ``kernels``, ``NORM_PIECE_PER_THREAD`` per intra-op thread and at least
        ``NORM_PIECE_MIN`` (cache-sized); None elsewhere (the library's default: one fused fp64 norm)."""
        if not self.kernels or device.type != "cpu":
            return None
        return max(NORM_PIECE_MIN, NORM_PIECE_PER_THREAD * torch.get_num_threads())

    def configure_grads(self, weight_grads: WeightGradPolicy, chunks: Sequence[nn.Module],
                        parallel_state: ParallelState, device: torch.device) -> dict[str, int]:
        """How this rank's gradients reach the gradient buffer, set on the step's ``weight_grads``
        policy (:mod:`lightning_megatron.tensor_parallel.backward`; CPU only, at set-up). Returns the
        number of modules changed per piece.

        - ``kernels``, on a pipeline's first stage: the word embeddings' gradients go in as rows
          (:meth:`~lightning_megatron.tensor_parallel.WeightGradPolicy.route_embedding_grad` with
          :mod:`lightning_megatron.cpu.embedding_grad`; the same bits);
        - ``weight_grads_per_step``: every column- and row-parallel linear layer of a chunk (the output
          layer included, unless its weight is the word embedding of the same chunk: without pipeline
          parallelism autograd sums the two) defers its weight gradient to the end of the schedule, one
          GEMM per weight over the step's microbatches
          (:meth:`~lightning_megatron.tensor_parallel.WeightGradPolicy.defer` with ``per_step=True``, one
          deferral per chunk). With a 16-bit model each microbatch's gradient is no longer rounded to 16
          bits and added into the fp32 ``main_grad`` ``m - 1`` times: the result is the weight gradient
          of one microbatch of all the step's tokens (with one microbatch, the same bits as without).
          Memory: every linear layer's input and output gradient of every microbatch stays until the
          end of the schedule (the activations of the whole step), which is why this is a CPU piece:
          on a GPU megatron-core's gradient-accumulation fusion removes the additions without it.
        """
        changed = {"embedding_grad_rows": 0, "weight_grads_per_step": 0}
        if device.type != "cpu":
            return changed
        from lightning_megatron.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

        if self.kernels and parallel_state.pp_size > 1:
            from lightning_megatron.cpu.embedding_grad import RowSparseEmbeddingGrad

            for chunk in chunks:
                for m in chunk.modules():
                    if isinstance(m, VocabParallelEmbedding):
                        weight_grads.route_embedding_grad(m, RowSparseEmbeddingGrad())
                        changed["embedding_grad_rows"] += 1
        if self.weight_grads_per_step:
            for chunk in chunks:
                embedding = any(isinstance(m, VocabParallelEmbedding) for m in chunk.modules())
                layers = [m for m in chunk.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                          and not (isinstance(m, ColumnParallelLinear) and m.weight is None and embedding)]
                changed["weight_grads_per_step"] += weight_grads.defer(layers, per_step=True)
        return changed

    def teardown(self, parallel_state: ParallelState | None) -> None:
        """Close the shared-memory communicators (the allocator setting lasts until the process exits)."""
        if parallel_state is not None:
            parallel_state.close_communicators()
