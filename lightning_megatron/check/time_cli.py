"""The ``--estimate-time`` part of ``lightning-megatron check``: device rates from the flags, and the
predicted step time of given layouts (from :mod:`lightning_megatron.check.timing`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.check.host_ops import count_host_ops, host_line
from lightning_megatron.check.memory_cli import model_shape
from lightning_megatron.check.timing import MEASURED, Device, Efficiency, Framework, estimate_time
from lightning_megatron.cost.protocols import StepCost

if TYPE_CHECKING:
    from lightning_megatron.cpu import CPUTuning

__all__ = ["timing_inputs", "time_table"]


def timing_inputs(recipe: Any, args: Any) -> tuple[Device, Efficiency, Framework]:
    """(device, efficiencies, framework) from the CLI flags; ``--device this`` measures this machine."""
    on_cpu = args.device == "this"
    if args.host_op_us is not None and (on_cpu or args.host_op_us < 0):
        raise ValueError(f"--host-op-us {args.host_op_us:g}: a GPU's host microseconds per op, >= 0 (0: the device "
                         f"alone); --device this runs the kernels on its host, whose dispatch its measured rates hold")
    tuning = _tuning(recipe, on_cpu)
    m = model_shape(recipe, on_cpu=tuning.kernels, training=True)
    if not isinstance(m, StepCost):
        raise ValueError(f"--estimate-time models transformer layers: {recipe.model_class}.estimate_shape returned a "
                         f"{type(m).__name__}, which lacks members of lightning_megatron.cost.StepCost (a "
                         f"lightning_megatron.cost.TransformerCost is one); --estimate-memory takes it as it is")
    if on_cpu:  # timed as the recipe's run would run: with the pieces of the CPU tuning it switches on, or none
        from lightning_megatron.check.devices import measure_this_machine

        dev = measure_this_machine(m.seq_length * m.micro_batch_size, m.ffn, m.hidden_size, m.param_bytes == 2,
                                   shared_memory=tuning.shared_memory_collectives,
                                   keep_freed=tuning.keep_freed_memory, kernels=tuning.kernels, shape=m)
        base = MEASURED
    else:
        from lightning_megatron.check.devices import device

        dev = device(args.device)
        base = Efficiency()
    if args.devices_per_node is not None:
        dev = dataclasses.replace(dev, devices_per_node=args.devices_per_node)
    if args.host_op_us is not None:
        dev = dataclasses.replace(dev, host_op=args.host_op_us * 1e-6 or None)
    host_ops = None
    if dev.host_op is not None:
        try:
            host_ops = count_host_ops(m)
        except Exception as e:  # a model the small copy cannot stand for: say so, with the way round
            raise ValueError(f"--estimate-time counts the host's ops on a small copy of the model ({m.describe()}), "
                             f"which failed: {type(e).__name__}: {e}; --host-op-us 0 predicts the device's time "
                             f"alone") from e
    given = lambda value, default: default if value is None else value  # noqa: E731  (0 is refused by the parser)
    eff = Efficiency(gemm=given(args.gemm_efficiency, base.gemm), memory=given(args.memory_efficiency, base.memory),
                     link=given(args.link_efficiency, base.link))
    # MegatronStrategy(overlap_grad_reduce=None) overlaps, except with the CPU tuning's synchronous
    # shared-memory collectives, which also expose sequence parallelism's gathers (a tuning acts on a CPU only)
    synchronous = tuning.synchronous_collectives(torch.device("cpu"))
    overlap = (not synchronous) if args.overlap_grad_reduce is None else args.overlap_grad_reduce == "on"
    fw = Framework(overlap_grad_reduce=overlap, overlap_param_gather=args.overlap_param_gather == "on",
                   overlap_sp_gather=not synchronous, fused_attention=not m.unfused_attention, host_ops=host_ops,
                   weight_grads_per_step=tuning.weight_grads_per_step)
    return dev, eff, fw


def _tuning(recipe: Any, on_cpu: bool) -> CPUTuning:
    """The pieces of the CPU tuning the recipe's run switches on where the tuning acts (a CPU: ``--device this``);
    none off a CPU, or without the tuning."""
    from lightning_megatron.cpu import CPUTuning

    none = CPUTuning(shared_memory_collectives=False, keep_freed_memory=False, kernels=False)
    return (recipe.cpu_tuning or none) if on_cpu else none


def _tuning_line(tuning: CPUTuning) -> str:
    """What the table's first line says of the CPU tuning its measured rates and model take."""
    pieces = [name for name, on in (("shared-memory collectives", tuning.shared_memory_collectives),
                                    ("freed memory kept", tuning.keep_freed_memory),
                                    ("CPU kernels", tuning.kernels),
                                    ("weight gradients once a step", tuning.weight_grads_per_step)) if on]
    if not pieces:
        return ("; without the CPU tuning (the recipe switches none of its pieces on): gloo collectives, torch's "
                "allocator and kernels")
    return f"; the recipe's CPU tuning: {', '.join(pieces)}"


def time_table(recipe: Any, layouts: list[ParallelDims], timing: tuple[Device, Efficiency, Framework]) -> str:
    """Predicted seconds per step, by part, tokens/s and MFU of each layout."""
    dev, eff, fw = timing
    on_cpu = dev.cores is not None
    tuning = _tuning(recipe, on_cpu)
    m = model_shape(recipe, on_cpu=tuning.kernels, training=True)
    lines = [f"predicted step time on {dev.name} ({dev.source}); achievable fractions: GEMM {eff.gemm:g}, "
             f"memory {eff.memory:g}, links {eff.link:g}" + host_line(dev, fw)
             + (_tuning_line(tuning) if on_cpu else ""),
             f"{'layout':<14} {'step s':>9} {'compute':>9} {'TP':>8} {'CP':>8} {'EP':>8} {'PP':>8} {'bubble':>8} "
             f"{'DP':>8} {'optim.':>8} {'host':>8} {'tokens/s':>10} {'MFU':>6}"]
    for layout in layouts:
        st = estimate_time(m, layout, dev, eff, fw)
        lines.append(f"{layout.name:<14} {st.total:9.4g} {st.compute:9.3g} {st.tp_comm:8.3g} {st.cp_comm:8.3g} "
                     f"{st.ep_comm:8.3g} {st.pp_comm:8.3g} {st.bubble:8.3g} {st.dp_comm:8.3g} {st.optimizer:8.3g} "
                     f"{st.host:8.3g} {st.tokens_per_s:10.4g} {st.mfu:6.1%}")
    crowded = [layout.name for layout in layouts if dev.cores is not None and layout.world_size > dev.cores]
    if crowded:  # a fraction of a core each; what time slicing adds is not modelled
        lines.append(f"{', '.join(crowded)}: more ranks than this machine's {dev.cores} cores, each predicted on its "
                     f"share of a core; the time a rank waits at a collective for a partner the scheduler is not "
                     f"running is not modelled (on 2 cores benchmarks/estimate_time.py measured tp2dp2zero1 at 1.44x "
                     f"its prediction, tp2pp2 at 1.05x: docs/check.md)")
    return "\n".join(lines)
