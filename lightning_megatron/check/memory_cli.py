"""The ``--estimate-memory`` part of ``lightning-megatron check``: predicted next to measured bytes,
and the layouts of N GPUs that fit (from :mod:`lightning_megatron.cost.memory`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.cost.memory import estimate_memory, estimate_stage, search_layouts
from lightning_megatron.cost.protocols import EstimatesCost, MemoryCost

__all__ = ["fitting_layouts", "memory_table", "model_shape"]

_MIB = 2**20


def model_shape(recipe: Any, on_cpu: bool = False, training: bool = False, cpu_run: bool = False) -> MemoryCost:
    """The model's costs, declared by the recipe's module class (``estimate_shape``,
    :class:`~lightning_megatron.cost.protocols.EstimatesCost`; ``--model.*`` / ``--data.*`` overrides
    applied); ``on_cpu``: the CPU tuning's kernels (a cost record with an ``on_cpu`` field, for comparing with
    what they run on this machine); ``cpu_run``: torch's kernels on a CPU, the composite RMSNorm (a record's
    ``composite_rmsnorm``: what a check run measures); ``training``: with the recipe's dropout and its
    schedule-only options, the output layer's deferred weight gradient (a check run turns them off)."""
    from lightning_megatron.check.recipe import as_trained
    from lightning_megatron.recipes import import_class

    cls = import_class(recipe.model_class)
    if not isinstance(cls, EstimatesCost):
        raise ValueError(f"{recipe.model_class} declares no estimate_shape(model, data, *, micro_batch_size, "
                         f"global_batch_size) (lightning_megatron.cost.EstimatesCost): --estimate-memory and "
                         f"--estimate-time need its sizes; layout parity (check without them) works for any module")
    model = as_trained(recipe) if training else recipe.model
    shape = cls.estimate_shape(model, recipe.data, micro_batch_size=recipe.micro_batch_size,
                               global_batch_size=recipe.global_batch_size)
    fields = {f.name for f in dataclasses.fields(shape)} if dataclasses.is_dataclass(shape) else set()
    if "on_cpu" in fields:
        shape = dataclasses.replace(shape, on_cpu=on_cpu)
    if "composite_rmsnorm" in fields:
        shape = dataclasses.replace(shape, composite_rmsnorm=cpu_run)
    if "optimizer" in fields and getattr(recipe, "optimizer", None) is not None:  # the recipe's optimizer: section
        name = recipe.optimizer[0].rsplit(".", 1)[-1].lower()  # Adam / AdamW: two moments; another: one
        shape = dataclasses.replace(shape, optimizer=name if name in ("adam", "adamw") else "sgd")
    if not isinstance(shape, MemoryCost):
        raise ValueError(f"{recipe.model_class}.estimate_shape returned a {type(shape).__name__}, which lacks members of "
                         f"lightning_megatron.cost.MemoryCost (stage_parameters, layer_activation_bytes, ...)")
    return shape


def _recipe_layout_for(recipe: Any, gpus: int) -> ParallelDims | None:
    """The recipe's own layout (:attr:`~lightning_megatron.check.recipe.RecipeCheck.layout`) on ``gpus`` ranks
    (its data-parallel size follows); None when it has none or its sizes do not divide ``gpus``."""
    layout = getattr(recipe, "layout", None)
    if layout is None:
        return None
    try:
        return dataclasses.replace(layout, dp=None).for_world_size(gpus)
    except ValueError:
        return None


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _recipe_row(mine: ParallelDims, rows: list[tuple], timed: bool) -> str:
    """Where the recipe's own layout stands among ``rows`` (ok, memory estimate, layout, step time or None)."""
    found = [i for i, r in enumerate(rows) if r[2].name == mine.name]
    if not found:
        return f"the recipe's layout {mine.name} is not among these (the search leaves it out; see below)"
    ok, est, _, step = rows[found[0]]
    text = f"the recipe's layout {mine.name}: {est.total_bytes / 2**30:.2f} GiB on its fullest rank"
    if not ok:
        return text + ", which does not fit"
    if not timed:
        return text
    fitting = [r for r in rows if r[0]]
    rank = fitting.index(rows[found[0]]) + 1
    best = fitting[0]
    text += f"; {_ordinal(rank)} of {len(fitting)} that fit by predicted tokens/s ({step.tokens_per_s:.4g})"
    if rank == 1:
        return text + ": the fastest"
    return (text + f"; the fastest, {best[2].name}, is predicted {best[3].tokens_per_s / step.tokens_per_s:.2f}x "
            f"as fast with {best[1].total_bytes / 2**30:.2f} GiB: a recipe keeps a slower layout only for what "
            f"the estimate does not see (its comment says why)")


def _mib(x: float) -> str:
    return f"{x / _MIB:9.2f}"


def memory_table(recipe: Any, layouts: list[ParallelDims], report: Any) -> str:
    """Predicted vs measured MiB per rank, a row for each pipeline stage (measured: max over its ranks). A check run
    takes the library's kernels (no CPU tuning) on the CPU, so they are what is predicted."""
    m = model_shape(recipe, cpu_run=True)
    lines = ["memory per rank, MiB: predicted / measured (measured: tensors held at step 1 on this machine; "
             "activations: peak bytes saved for backward)",
             f"{'layout':<14} {'stage':>5} {'params':>19} {'grads':>19} {'optimizer':>19} {'activations':>19}"]
    for layout in layouts:
        ranks = report.runs[layout.name].memory
        # a head that runs on the tokens the data picks (BERT's masked ones): the most a microbatch of the step had
        tokens = [r["head_tokens"] for r in ranks if "head_tokens" in r]
        shape = m.with_head_tokens(max(tokens)) if tokens and hasattr(m, "with_head_tokens") else m
        for stage in range(layout.pp):
            est = estimate_stage(shape, layout, stage)
            mine = [r for i, r in enumerate(ranks) if layout.coordinates(i)["pp"] == stage]
            meas = {k: max(r.get(k, 0) for r in mine) for k in ("params", "grads", "optimizer", "activations_peak")}
            cells = [(est.param_bytes, meas["params"]), (est.grad_bytes, meas["grads"]),
                     (est.optimizer_bytes, meas["optimizer"]), (est.activation_bytes, meas["activations_peak"])]
            lines.append(f"{layout.name:<14} {stage:>5} " + " ".join(f"{_mib(p)}/{_mib(q).strip():<9}"
                                                                      for p, q in cells))
    return "\n".join(lines)


def fitting_layouts(recipe: Any, gpus: int, gpu_memory: int | None, timing: tuple | None = None, *,
                    top: int = 0) -> int:
    """Print every layout of ``gpus`` ranks with its predicted bytes (and, with ``timing`` =
    ``(Device, Efficiency, Framework)``, its predicted step time, tokens/s and MFU, the layouts that
    fit ranked by tokens/s), then the combinations left out and why; exit status 1 when none fits.
    ``top`` > 0 lists the first ``top`` rows only, and the recipe's own layout where it is further down."""
    from lightning_megatron.module import context_parallel_problem
    from lightning_megatron.recipes import import_class

    m = model_shape(recipe, training=True)
    search = search_layouts(m, gpus, context_parallel=context_parallel_problem(import_class(recipe.model_class), 2)
                            is None)
    rows = []
    for layout in search.layouts:
        est = estimate_memory(m, layout)
        ok = gpu_memory is None or est.total_bytes <= gpu_memory
        step = None
        if timing is not None:
            from lightning_megatron.check.timing import estimate_time

            step = estimate_time(m, layout, *timing)
        rows.append((ok, est, layout, step))
    if timing is not None:  # fitting first, fastest first
        rows.sort(key=lambda r: (not r[0], -r[3].tokens_per_s))
    else:
        rows.sort(key=lambda r: r[1].total_bytes)
    print(f"{m.describe()}: {estimate_stage(m, ParallelDims(dp=1), 0).params / 1e6:.1f} M parameters; {gpus} GPUs"
          + (f" of {gpu_memory / 1e9:.0f} GB" if gpu_memory else ""))
    if timing is not None:
        from lightning_megatron.check.host_ops import host_line

        dev, eff, fw = timing
        print(f"step time on {dev.name} ({dev.source}; {dev.devices_per_node} per node), achievable fractions: "
              f"GEMM {eff.gemm:g}, memory {eff.memory:g}, links {eff.link:g}" + host_line(dev, fw))
    head = f"{'layout':<22} {'params':>7} {'grads':>7} {'optim.':>7} {'activ.':>7} {'GiB':>7}  fits"
    if timing is not None:
        head += f" {'step s':>9} {'tokens/s':>10} {'MFU':>5}  (compute/TP/CP/EP/PP/bubble/DP/optimizer/host s)"
    print(head)
    g = 2**30
    mine = _recipe_layout_for(recipe, gpus)
    shown = rows if top <= 0 else rows[:top] + [r for r in rows[top:] if mine is not None and r[2].name == mine.name]
    for ok, est, layout, step in shown:
        sizes = (est.param_bytes, est.grad_bytes, est.optimizer_bytes, est.activation_bytes, est.total_bytes)
        line = f"{layout.name:<22} " + " ".join(f"{x / g:7.2f}" for x in sizes) + f"  {'yes' if ok else 'no ':<3}"
        if step is not None:
            parts = (step.compute, step.tp_comm, step.cp_comm, step.ep_comm, step.pp_comm, step.bubble, step.dp_comm,
                     step.optimizer, step.host)
            line += (f" {step.total:9.4g} {step.tokens_per_s:10.4g} {step.mfu:5.1%}  "
                     + "/".join(f"{x:.3g}" for x in parts))
        print(line + ("   <- the recipe's" if mine is not None and layout.name == mine.name else ""))
    if len(shown) < len(rows):
        print(f"  ... {len(rows) - len(shown)} more layouts (--top 0 lists every one)")
    fits = sum(r[0] for r in rows)
    if gpu_memory is not None:
        print(f"{fits} of {len(rows)} layouts fit (activations: {m.micro_batch_size} samples per microbatch; "
              f"not counted: framework workspace, allocator fragmentation, communication buffers)")
    if mine is not None:
        print(_recipe_row(mine, rows, timing is not None))
    if search.skipped:
        print(f"not tried ({sum(search.skipped.values())} combinations of sizes):")
        for reason, n in search.skipped.items():
            print(f"  {reason}: skipped {n}")
    return 0 if fits else 1
