"""What the step-time model takes (:mod:`lightning_megatron.check.timing`): an accelerator's rates and how much
of them a step reaches (:class:`Device`, :class:`Efficiency`), what the training code does (:class:`Framework`,
:class:`HostOps`), and a ring collective's time on a link (:func:`collective_time`, :func:`link_rate`). Pure
records and arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Device", "Efficiency", "Framework", "HostOps", "MEASURED", "STEP_OPS", "collective_time", "link_rate"]


@dataclass(frozen=True, kw_only=True)
class Device:
    """Rates of one accelerator and its links (datasheet figures or measured: see ``devices``)."""

    name: str
    flops_16: float
    """Dense bf16/fp16 FLOP/s (no sparsity)."""
    flops_32: float
    """Dense fp32 FLOP/s (what fp32 matmuls get without TF32)."""
    hbm: float
    """Memory bandwidth, bytes/s."""
    link_intra: float
    """Bandwidth per device within a node, one direction, bytes/s (NVLink)."""
    link_inter: float
    """Bandwidth per device between nodes, bytes/s (the node's InfiniBand / devices per node)."""
    devices_per_node: int = 8
    latency_intra: float = 10e-6
    """Seconds per collective or send within a node."""
    latency_inter: float = 20e-6
    """Seconds per collective or send between nodes."""
    p2p: float | None = None
    """Bandwidth of pipeline sends when they take another path than the collectives (a host whose
    collectives go through shared memory and sends through gloo); None: the group's link."""
    p2p_latency: float = 0.0
    """Seconds per send on that path."""
    elementwise: float | None = None
    """Bytes/s the model's memory-bound kernels reach, as counted by :func:`elementwise_bytes` (None:
    ``hbm``). A CPU's norms, GELU, softmax and dropout run far below its copy bandwidth: measured on
    this machine from one transformer layer (``devices.measure_this_machine``)."""
    vocab: float | None = None
    """Bytes/s of the passes over vocabulary-sized tensors, as counted by :func:`vocab_bytes` (None:
    ``hbm``). On a CPU the LM head's GEMMs with few rows (the masked tokens) against the [V, h]
    weight run far below the GEMM rate and the dense embedding gradient is written into fresh memory:
    measured on this machine from the model's embedding, heads and loss (``devices.measure_this_machine``)."""
    host_op: float | None = None
    """Seconds of host time per aten op the training step dispatches (Python, autograd, the kernel's launch):
    an accelerator runs its kernels while the host queues the next ones, so a step takes at least its ops times
    this (:class:`HostOps`). None: the host runs the kernels itself (a CPU; their dispatch is inside the measured
    rates)."""
    cores: int | None = None
    """A host without accelerators: the rates are per core, and each of a layout's ranks gets
    ``cores / world_size`` cores (threads when fewer ranks than cores, time slices when more)."""
    thread_speedup: float | None = None
    """A host without accelerators: how many times faster the model's layer runs on ``cores`` intra-op threads
    than on one (measured; each op's dispatch stays on one thread and small ops split poorly: 1.76-1.86 on 2
    cores of an Intel AMX host). A rank with ``n`` cores runs its GEMMs, memory-bound kernels and vocabulary
    passes ``1 + (thread_speedup - 1)(n - 1)/(cores - 1)`` times one core's rate (:meth:`kernel_cores`); None:
    ``n`` times."""
    source: str = ""

    def __post_init__(self) -> None:
        if self.thread_speedup is not None and (self.cores is None or not 1 <= self.thread_speedup <= self.cores):
            raise ValueError(f"Device {self.name!r}: thread_speedup={self.thread_speedup:g} must be between 1 and the "
                             f"host's cores ({self.cores}): the layer on all cores against one core")

    def kernel_cores(self, cores: float) -> float:
        """How many cores' worth of one core's kernel rates a rank given ``cores`` cores gets: ``cores`` up to
        one (time slices), then the measured :attr:`thread_speedup` interpolated (threads)."""
        if self.thread_speedup is None or self.cores is None or cores <= 1 or self.cores <= 1:
            return cores
        return 1 + (self.thread_speedup - 1) * (min(cores, self.cores) - 1) / (self.cores - 1)


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Achievable fractions of the datasheet rates (1.0 for measured rates)."""

    gemm: float = 0.7
    """Of the dense peak, for the model's GEMMs (large cuBLAS GEMMs reach ~0.75-0.85; attention less)."""
    memory: float = 0.8
    """Of the HBM bandwidth, for elementwise kernels."""
    link: float = 0.8
    """Of the link bandwidth, for NCCL collectives (bus bandwidth over link bandwidth)."""

    def __post_init__(self) -> None:
        for name, value in (("gemm", self.gemm), ("memory", self.memory), ("link", self.link)):
            if not 0 < value <= 1:
                raise ValueError(f"efficiency {name}={value} must be in (0, 1] (a fraction of the device's rate)")


MEASURED = Efficiency(gemm=1.0, memory=1.0, link=1.0)

STEP_OPS = 350
"""Host work once an optimizer step, in ops at the training step's host time per op: the wrapper's flat step,
zero-grad, Lightning's loop and its logging (``benchmarks/host_step.py``'s phases; docs/check.md, "Host")."""


@dataclass(frozen=True, kw_only=True)
class HostOps:
    """The aten ops (views included) one rank's host dispatches for a step of the model, counted on a small copy
    of it (:func:`lightning_megatron.check.host_ops.count_host_ops`: its two-layer model's ops less its one-layer
    model's): they do not depend on the width, the sequence or the batch. Not counted: the TP, CP and EP
    collectives' few ops per layer."""

    layer: int
    """One layer's forward and backward of one microbatch, and the GradBuffer hook's op per trained parameter."""
    ends: int
    """The embeddings, heads and loss of one microbatch, their hook ops included (counted on the last stage)."""
    step: int = STEP_OPS
    """Once a step: :data:`STEP_OPS`."""


@dataclass(frozen=True, kw_only=True)
class Framework:
    """What the training code does that changes the time (defaults: this library's)."""

    grad_reduce_bytes: int = 4
    """Bytes per gradient element in the DP reduction (fp32 ``main_grad`` here)."""
    overlap_grad_reduce: bool = True
    """DP reduction started during the last microbatch's backward (``MegatronStrategy(overlap_grad_reduce)``,
    on by default except with the CPU tuning's synchronous shared-memory collectives)."""
    overlap_param_gather: bool = False
    """ZeRO-1 parameter all-gather hidden behind the next forward."""
    overlap_sp_gather: bool = True
    """Under sequence parallelism the backward gathers the qkv and fc1 layers' inputs again
    (:mod:`~lightning_megatron.tensor_parallel.layers`) while their input gradients' GEMMs run: hidden with
    asynchronous collectives (NCCL, gloo), exposed with the CPU tuning's synchronous shared-memory ones."""
    p2p_scatter_gather: bool = False
    """Megatron's scatter/gather of pipeline sends between nodes: each TP rank sends 1/t."""
    fused_attention: bool = True
    """Attention without [b, a, s, s] tensors in memory (flash / memory-efficient sdpa)."""
    optimizer_bytes: int | None = None
    """Bytes read + written per trained parameter by the optimizer step; None: this library's wrappers
    (:meth:`optimizer_bytes_per_param`)."""
    fused_grad_accumulation: bool = False
    """The weight-gradient GEMMs add into the fp32 ``main_grad`` themselves (megatron-core's
    ``gradient_accumulation_fusion``). Off here: each microbatch's backward writes ``param.grad`` and
    the GradBuffer's hook adds it into ``main_grad`` (:func:`grad_accumulation_bytes`)."""
    host_ops: HostOps | None = None
    """What the host dispatches per step, for a device with a :attr:`Device.host_op` (None: not modelled)."""
    weight_grads_per_step: bool = False
    """The CPU tuning's ``weight_grads_per_step`` (:class:`lightning_megatron.cpu.CPUTuning`; it acts on a CPU only):
    the column- and row-parallel layers' weight gradients computed once per step after each rank's last backward,
    one GEMM over the step's microbatches added into ``main_grad`` once (:func:`~lightning_megatron.check.timing.
    step_weight_parameters`)."""

    def optimizer_bytes_per_param(self, param_bytes: int) -> int:
        """``optimizer_bytes``, or what the wrappers move per parameter of ``param_bytes``-byte params: Adam over
        the fp32 (main) params reads the param, its grad and both moments and writes the param and the moments
        (28), the norm reads the grads (4), and with 16-bit params the fp32 main params are copied back into them
        (read 4, write ``param_bytes``): 32 in fp32, 38 in bf16."""
        if self.optimizer_bytes is not None:
            return self.optimizer_bytes
        return 32 + (4 + param_bytes if param_bytes < 4 else 0)


def collective_time(kind: str, nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring collective of ``nbytes`` (the full tensor) over ``ranks`` ranks:
    all_reduce ``2(k-1)/k n / bw``, all_gather / reduce_scatter / all_to_all ``(k-1)/k n / bw`` (an
    all-to-all's ``n``: what one rank sends, itself included), send ``n / bw``; plus ``latency``; 0 on
    one rank."""
    if kind == "send":
        return nbytes / bandwidth + latency
    if ranks == 1:
        return 0.0
    factor = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}[kind]
    return factor * (ranks - 1) / ranks * nbytes / bandwidth + latency


def link_rate(dev: Device, eff: Efficiency, crosses_nodes: bool) -> tuple[float, float]:
    """(bytes/s, seconds of latency) of ``dev``'s link within a node, or between nodes (``crosses_nodes``)."""
    if crosses_nodes:
        return dev.link_inter * eff.link, dev.latency_inter
    return dev.link_intra * eff.link, dev.latency_intra
