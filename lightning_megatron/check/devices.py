"""Device rates for ``check --estimate-time``: datasheet figures, and this machine measured.

Datasheet figures (sources in docs/check.md, "Device rates"): dense (no sparsity) bf16 and fp32
FLOP/s, HBM bandwidth, NVLink bandwidth per GPU in one direction (half the bidirectional figure
NVIDIA quotes), and InfiniBand per node divided by its 8 GPUs (one 200 Gb/s HDR NIC per GPU in a
DGX A100, one 400 Gb/s NDR NIC per GPU in a DGX H100/H200). What a kernel reaches of them is
:class:`~lightning_megatron.check.timing.Efficiency`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from lightning_megatron.check.records import Device
from lightning_megatron.cost.protocols import StepCost

__all__ = ["DEVICES", "HOST_OP", "device", "interleaved_best", "isolated_rng",
           "measure_this_machine", "probe_times"]

_GB = 1e9
HOST_OP = 30e-6
"""Seconds of host time per op of the training step on a GPU host (:attr:`~lightning_megatron.check.timing.Device.
host_op`): one H200 host's, bert-base's host-bound step over the ops it dispatches (docs/check.md, "Host");
hosts differ, ``check --host-op-us`` sets another."""
DEVICES: dict[str, Device] = {
    "a100": Device(name="A100 80GB SXM", flops_16=312e12, flops_32=19.5e12, hbm=2039 * _GB, link_intra=300 * _GB,
                   link_inter=25 * _GB, host_op=HOST_OP, source="NVIDIA A100 datasheet; DGX A100: 8x HDR 200 Gb/s"),
    "h100": Device(name="H100 SXM", flops_16=989e12, flops_32=67e12, hbm=3350 * _GB, link_intra=450 * _GB,
                   link_inter=50 * _GB, host_op=HOST_OP, source="NVIDIA H100 datasheet; DGX H100: 8x NDR 400 Gb/s"),
    "h200": Device(name="H200 SXM", flops_16=989e12, flops_32=67e12, hbm=4800 * _GB, link_intra=450 * _GB,
                   link_inter=50 * _GB, host_op=HOST_OP, source="NVIDIA H200 datasheet; DGX H200: 8x NDR 400 Gb/s"),
}


def device(name: str) -> Device:
    """A device of :data:`DEVICES` by name (``a100``, ``h100``, ``h200``); raises naming the choices."""
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)} or 'this'") from None


def _machine_times(rank: int, world: int, port: int, sizes: list[int], probes: dict[str, Any],
                   keep_freed: bool, shared_memory: bool, out) -> None:  # pragma: no cover (child)
    """A spawned rank of :func:`measure_this_machine`: with the CPU tuning's allocator setting when ``keep_freed``
    (as a tuned run's ranks have it, :func:`~lightning_megatron.cpu.allocator.keep_freed_memory`; set in this child,
    never in the caller's process), best of 5 all-reduces of each size through gloo and, with ``shared_memory`` where
    the host allows, through the CPU tuning's shared-memory collectives (:mod:`lightning_megatron.cpu.shared_memory`);
    then, with the other rank gone, rank 0 alone times ``probes`` (:func:`probe_times`'s arguments), the model's
    layer on every core among them. Rank 0 puts the results on ``out``."""
    import datetime

    import torch
    import torch.distributed as dist

    from lightning_megatron.cpu.allocator import keep_freed_memory
    from lightning_megatron.cpu.shared_memory import enable_shared_memory_collectives

    kept = keep_freed_memory() if keep_freed else False
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout)
    try:
        def best(all_reduce) -> list[float]:
            times = []
            for n in sizes:
                x = torch.ones(n // 4)
                all_reduce(x)
                fastest = float("inf")
                for _ in range(5):
                    dist.barrier()
                    start = time.perf_counter()
                    all_reduce(x)
                    fastest = min(fastest, time.perf_counter() - start)
                times.append(fastest)
            return times

        result: dict[str, Any] = {"gloo": best(dist.all_reduce), "shared_memory": None, "kept_freed": kept}
        comm = enable_shared_memory_collectives(dist.group.WORLD, timeout=timeout) if shared_memory else None
        if comm is not None:
            try:
                result["shared_memory"] = best(comm.all_reduce)
            finally:
                comm.close()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        result["probes"] = probe_times(**probes, cores=os.cpu_count() or 1)
        out.put(result)


@contextlib.contextmanager
def isolated_rng(threads: int = 1) -> Iterator[None]:
    """``threads`` intra-op threads (one by default), the CPU's global RNG seeded (0) and the model-parallel
    tracker's stream added when missing, and the thread count and RNG states put back afterwards: a step built and
    run inside draws the same weights and inputs whatever ran before (a mixture's routing, and so the ops its
    experts dispatch, follows them) and changes no later result."""
    import torch

    from lightning_megatron.tensor_parallel.random import MODEL_PARALLEL_RNG_TRACKER_NAME, get_rng_tracker

    tracker = get_rng_tracker()
    saved_states, saved_seeds = tracker.get_states(), set(tracker.seeds)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(0)  # the CPU's alone: an accelerator's generators are not forked
            if MODEL_PARALLEL_RNG_TRACKER_NAME not in tracker.states:
                tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME, max(saved_seeds, default=0) + 1)
            yield
    finally:
        torch.set_num_threads(saved_threads)
        tracker.set_states(saved_states)
        tracker.seeds = saved_seeds


def interleaved_best(steps: dict[str, Callable[[], Any]], rounds: int,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Each step's fastest of ``rounds`` timed runs, the steps taking turns (one run of each a round). The rates of
    :func:`measure_this_machine` are differences and ratios of these times (a layer's time beyond its GEMMs at the
    GEMM probe's rate), so a slow spell of the machine must not fall on one of them alone: taking turns spreads each
    step's runs over the whole measurement, and a spell shorter than it leaves each step a run outside it."""
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for name, step in steps.items():
            start = clock()
            step()
            best[name] = min(best[name], clock() - start)
    return best


def _step_of(build, cpu_kernels: bool) -> Callable[[], Any]:
    """The step of a model's ``build()`` (``(module, step)``), with ``cpu_kernels`` the CPU tuning's kernels on the
    module (what a run with ``cpu_tuning`` executes; else the library's, what an untuned run executes)."""
    module, step = build()
    if cpu_kernels:
        from lightning_megatron.cpu.kernels import CPUKernels
        from lightning_megatron.transformer.kernels import set_kernels

        set_kernels(module, CPUKernels())
    return step


def _on_threads(step: Callable[[], Any], threads: int) -> Callable[[], Any]:
    """``step`` run on ``threads`` intra-op threads, the thread count put back after it."""
    import torch

    def run() -> Any:
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return step()
        finally:
            torch.set_num_threads(saved)

    return run


def probe_times(rows: int, cols: int, inner: int, bf16: bool, shape: StepCost | None = None,
                rounds: int = 4, cores: int = 1, kernels: bool = True) -> dict[str, float]:
    """Seconds of each probe of :func:`measure_this_machine` on one thread, the fastest of ``rounds`` runs after an
    untimed one, the probes taking turns (:func:`interleaved_best`): ``gemm`` ([rows, inner] x [inner, cols] in the
    model's dtype), ``copy`` (64 MiB), and with ``shape`` ``layer`` (one of its layers, ``m.build_layer_step()``: its
    family's spec, dtype, dropout and attention backend on its micro batch, forward and backward writing fresh
    gradients, with the CPU tuning's kernels unless ``kernels`` is False) and ``model`` (its one-layer model with its
    loss, ``m.build_model_step()``: embeddings, the layer, heads and loss as a microbatch of a training step runs
    them; absent when its family builds none), with the weights, inputs and dropout masks drawn inside
    :func:`isolated_rng`; with ``cores`` > 1 also ``layer_on_cores``, the same layer on that many threads in its turn
    with the others (the threads' speed-up is the ratio of the two layer times, so they are timed together)."""
    import torch

    with isolated_rng(1):
        dtype = torch.bfloat16 if bf16 else torch.float32
        a, w = torch.randn(rows, inner).to(dtype), torch.randn(inner, cols).to(dtype)
        x, y = torch.empty(2**24), torch.ones(2**24)
        steps: dict[str, Callable[[], Any]] = {"gemm": lambda: torch.matmul(a, w), "copy": lambda: x.copy_(y)}
        if shape is not None:
            steps["layer"] = _step_of(shape.build_layer_step, kernels)
            with contextlib.suppress(NotImplementedError):
                steps["model"] = _step_of(shape.build_model_step, kernels)
            if cores > 1:
                steps["layer_on_cores"] = _on_threads(steps["layer"], cores)
        for step in steps.values():
            step()
        return interleaved_best(steps, rounds)


def measure_this_machine(rows: int, cols: int, inner: int, bf16: bool, shared_memory: bool = True,
                         timeout: float = 120.0, shape: StepCost | None = None, keep_freed: bool = True,
                         kernels: bool = True) -> Device:
    """Rates of one core of this host measured now (one thread): a GEMM of the model's shape
    ([rows, inner] x [inner, cols], its dtype), a 64 MiB copy (memory bandwidth), and 2-process
    all-reduces of 4 KiB (latency) and 16 MiB (bandwidth): through the CPU tuning's shared-memory
    collectives when ``shared_memory`` (what ``CPUTuning`` installs for TP and DP) and through gloo
    (pipeline sends, and collectives without the tuning). The estimate gives each rank
    ``cores / world_size`` cores (:attr:`~lightning_megatron.check.timing.Device.cores`), as threads at the
    speed-up the layer shows on all of them against one (:attr:`~lightning_megatron.check.timing.Device.
    thread_speedup`) when a rank has more than one.

    With ``shape`` (the model's :class:`~lightning_megatron.cost.protocols.StepCost`), also one of its
    layers (:func:`probe_times`' ``layer``): what its forward and
    backward take beyond their GEMMs at the measured GEMM rate is the time of its memory-bound
    kernels, whose bytes (:func:`~lightning_megatron.check.timing.elementwise_bytes`) over that time
    give :attr:`~lightning_megatron.check.timing.Device.elementwise` (else the copy rate stands in);
    and a one-layer model of it (:func:`probe_times`' ``model``): what its embeddings, heads and loss take
    beyond the layer and the head's GEMMs, over their vocabulary passes
    (:func:`~lightning_megatron.check.timing.vocab_bytes`), gives
    :attr:`~lightning_megatron.check.timing.Device.vocab` (else the copy rate).

    Everything is timed in two spawned processes, as a run's ranks (:func:`_machine_times`): the caller's process
    is left as it was, and with ``keep_freed`` (the CPU tuning's allocator setting, on in a tuned run) they keep
    freed memory as the run does; without it a one-layer BERT-base step took 400 ms instead of 320 (~400 k page
    faults a step), which read the vocabulary rate 1.6x low. ``shared_memory``, ``keep_freed`` and ``kernels``
    (the layer and model probes with the tuning's :class:`~lightning_megatron.cpu.kernels.CPUKernels`) are the CPU
    tuning's pieces: ``check --estimate-time --device this`` passes those the recipe's run switches on, and times
    a recipe without the tuning with gloo, torch's allocator and the library's kernels, as it runs. The one-thread
    probes take turns (:func:`probe_times`), as the rates are differences of their times. ``timeout``: seconds the
    all-reduces may take; the probes take as long as the model's layer needs (a child that dies is noticed)."""
    import multiprocessing as mp
    import queue as queues
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    sizes = [4096, 2**24]
    probes = {"rows": rows, "cols": cols, "inner": inner, "bf16": bf16, "shape": shape, "kernels": kernels}
    procs = [ctx.Process(target=_machine_times, args=(r, 2, port, sizes, probes, keep_freed, shared_memory, out))
             for r in range(2)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            with contextlib.suppress(queues.Empty):
                times = out.get(timeout=1.0)
                break
            # rank 0 reports; a rank 1 that dies leaves rank 0 at a collective until gloo's timeout ends it too
            if procs[0].exitcode is not None or (procs[1].is_alive() and time.monotonic() > deadline):
                if procs[0].exitcode == 0:  # what it put before it ended may still be on its way
                    with contextlib.suppress(queues.Empty):
                        times = out.get(timeout=5.0)
                        break
                raise RuntimeError(f"measuring this machine: its processes ended with {[p.exitcode for p in procs]} "
                                   f"(None: still running {timeout:g} s after the start) before reporting; run it "
                                   f"again, or name a device (--device h100)")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    def rate(small_large: list[float]) -> tuple[float, float]:
        small, large = small_large  # a 2-rank ring all-reduce moves n bytes per rank: 2 (k-1)/k n
        return sizes[1] / max(large - small, 1e-9), small

    p2p, p2p_latency = rate(times["gloo"])
    shm = shared_memory and times["shared_memory"] is not None
    link, latency = rate(times["shared_memory"]) if shm else (p2p, p2p_latency)
    cores = os.cpu_count() or 1
    probed = times["probes"]
    gemm = 2.0 * rows * cols * inner / probed["gemm"]
    hbm = 2 * 2**24 * 4 / probed["copy"]
    elementwise = vocab = speedup = None
    if shape is not None:
        elementwise = _elementwise_rate(shape, probed["layer"], gemm)
        if "model" in probed:
            vocab = _vocab_rate(shape, probed["model"] - probed["layer"], gemm)
        if "layer_on_cores" in probed:  # the same layer on every core, as one rank's intra-op threads
            speedup = min(max(probed["layer"] / probed["layer_on_cores"], 1.0), float(cores))
    timed = "" if shape is None else (", the model's own layer" + ("" if vocab is None else " and one-layer model")
                                      + (" with the CPU tuning's kernels" if kernels else " with torch's kernels"))
    kept = ", freed memory kept (the CPU tuning's allocator)" if times["kept_freed"] else ""
    if speedup is not None:
        timed += f", the layer on {cores} threads {speedup:.2f}x one"
    return Device(name="this machine (measured)", flops_16=gemm, flops_32=gemm, hbm=hbm, elementwise=elementwise,
                  vocab=vocab, thread_speedup=speedup,
                  link_intra=link,
                  link_inter=link, devices_per_node=cores, latency_intra=latency, latency_inter=latency, p2p=p2p,
                  p2p_latency=p2p_latency, cores=cores,
                  source=f"measured per core: {rows}x{inner}x{cols} GEMM, 64 MiB copy, "
                         f"{'shared-memory' if shm else 'gloo'} all-reduce, gloo sends"
                         f"{timed}{kept}")


def _elementwise_rate(m: StepCost, layer_s: float, gemm_rate: float) -> float:
    """Bytes/s of the memory-bound kernels of a layer that took ``layer_s`` (forward + backward) whose
    GEMMs (:func:`~lightning_megatron.cost.flops.layer_flops`: the layer's own shape, LoRA's frozen weights
    and adapters) run at ``gemm_rate``: their counted bytes (forward + twice that backward, and the LoRA
    adapters' :func:`~lightning_megatron.check.timing.adapter_bytes`) over the rest."""
    from lightning_megatron.parallel_dims import ParallelDims
    from lightning_megatron.check.timing import Framework, adapter_bytes, elementwise_bytes, layer_flops, padding_flops

    tokens = m.seq_length * m.micro_batch_size
    one = ParallelDims(dp=1)
    # the timed layer does not recompute; experts padded to their capacity run the padding's GEMMs too
    flops = (layer_flops(m, 1, tokens, recompute=False, replay_attention=False)
             + padding_flops(m, 1, tokens, recompute=False))
    counted = tokens * (3 * elementwise_bytes(m, one, Framework(fused_attention=not m.unfused_attention))
                        + adapter_bytes(m, one))
    rest = max(layer_s - flops / gemm_rate, 0.05 * layer_s)  # the GEMMs at their best-case rate: a floor
    return counted / rest


def _vocab_rate(m: StepCost, vocab_s: float, gemm_rate: float) -> float:
    """Bytes/s of the vocabulary passes of a model whose embeddings, heads and loss took ``vocab_s``
    (forward + backward, one microbatch, no pipelining) with GEMMs at ``gemm_rate``: their counted
    bytes (:func:`~lightning_megatron.check.timing.vocab_bytes`) over what the time leaves beyond the
    heads' GEMMs (the embedding's norm and dropout, the binary head: small, and timed at this rate)."""
    from lightning_megatron.parallel_dims import ParallelDims
    from lightning_megatron.check.timing import stage_flops, vocab_bytes

    layout = ParallelDims(dp=1)
    head = stage_flops(m, layout, 0) - stage_flops(m, layout, 0, head=False)
    rest = max(vocab_s - head / gemm_rate, 0.05 * vocab_s)  # the GEMMs at their best-case rate: a floor
    return vocab_bytes(m, layout, 0) / rest
