"""Layout parity: does a parallel layout train exactly like one process?

:func:`check_layouts` fits the reference layout (one process by default) and every other layout for
N steps, each in its own spawned gloo ranks (layouts of the same world size share the ranks, one
``Trainer.fit`` after the other), with dropout off, a fixed seed, and the same global batch cut into
the same microbatches in every layout (:func:`~lightning_megatron.check.worker.global_batch_loader`),
so a data-order difference cannot appear: any difference is the layout's. It compares per step the
loss and the global gradient norm, and, at the chosen steps, every parameter's gradient as a global
tensor (TP shards put together, vocab padding dropped, PP stages by global names), and reports the
parameter whose gradient differs most. Where a layout fails it names the first module that diverges:
the first, in the reference's forward order, whose forward output on step 1's first microbatch
differs (TP pieces put together), else the first, in backward order, whose gradients differ.
:class:`CheckReport` prints the table and says PASS or FAIL.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.check.spawn import run_distributed
from lightning_megatron.check.worker import CheckRun, run_layouts

__all__ = ["CheckReport", "LayoutResult", "LayoutRun", "Tolerances", "check_layouts", "compare_runs",
           "first_divergence", "gather_runs", "grad_error", "join_pieces", "judge_against_truth", "update_error"]


@dataclass(frozen=True, kw_only=True)
class Tolerances:
    """What "equal" means. fp32 defaults: the Trainer-level parity tests' (1e-5 on losses and grad
    norms, 1e-4 on gradients, 2e-3 of the update on final parameters); bf16 runs use :meth:`bf16`."""

    loss_rtol: float = 1e-5
    """|loss - loss_ref| / |loss_ref| per step."""
    grad_norm_rtol: float = 1e-5
    """|norm - norm_ref| / norm_ref per step."""
    grad_rtol: float = 1e-4
    """Per parameter: max |g - g_ref| / scale, scale = max(max |g_ref|, grad_floor x the largest max |g_ref|)."""
    grad_floor: float = 1e-3
    """Gradients far below the model's largest (e.g. the attention key bias, zero up to rounding:
    softmax is shift-invariant) are compared at this fraction of the largest gradient."""
    param_rtol: float = 2e-3
    """Final parameters (when recorded), per tensor: ``rms(p - p_ref) / rms(p_ref - p_init)``
    (:func:`update_error`: why not element by element). One element of ``n`` moved the wrong way is
    about ``2 / sqrt(n)``."""
    param_floor: float = 1e-3
    """Tensors whose update is far below the model's largest (rms) are measured against this fraction
    of the largest."""
    output_rtol: float = 1e-4
    """Per module: max |y - y_ref| / max |y_ref| of its forward output (naming the first divergence)."""

    @classmethod
    def bf16(cls) -> Tolerances:
        """bf16/fp16 runs: the model parameters (what is recorded) are rounded to 8 significant bits, a
        step of 2^-8 of a weight however small its update."""
        return cls(loss_rtol=1e-2, grad_norm_rtol=2e-2, grad_rtol=5e-2, param_rtol=5e-2, output_rtol=5e-2)


@dataclass(kw_only=True)
class LayoutRun:
    """One layout's records, put together from its ranks."""

    layout: str
    losses: list[float]
    grad_norms: list[float]
    grads: dict[int, dict[str, torch.Tensor]]
    params: dict[str, torch.Tensor]
    """Final parameters (``record_params``), else empty."""
    memory: list[dict[str, int]]
    """Per global rank: bytes of ``params``, ``grads``, ``optimizer``, ``activations_peak``."""
    collectives: list[dict[str, bool]]
    """Per global rank: which groups ran on shared memory."""
    traffic: list[dict[str, float]] = field(default_factory=list)
    """Per global rank: bytes it sent in step 1 by part (``measure_traffic``), else empty."""
    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Module name -> its step-1 forward output pieces, by TP rank (DP rank 0)."""
    output_order: list[str] = field(default_factory=list)
    """Module names in forward order (model chunk, pipeline stage, then call order)."""
    output_params: dict[str, int] = field(default_factory=dict)
    """Module name -> the parameter tensors it holds on its rank (fewer than one process's: split over stages)."""
    init_params: dict[str, torch.Tensor] = field(default_factory=dict)
    """Parameters before the first step (``record_params``), else empty."""


@dataclass(kw_only=True)
class StepRow:
    step: int
    loss_ref: float
    loss: float
    loss_rel: float
    norm_ref: float
    norm: float
    norm_rel: float
    worst_param: str | None = None
    worst_grad_err: float | None = None


@dataclass(kw_only=True)
class LayoutResult:
    """The comparison of one layout with the reference."""

    layout: str
    rows: list[StepRow]
    failures: list[str] = field(default_factory=list)
    param_failures: list[str] = field(default_factory=list)
    first_divergence: str | None = None
    """Where the layout first departs from the reference: ``"forward output of NAME (...)"`` or
    ``"gradients of NAME (...)"``; None when no module's output or gradients differ."""
    truth: str | None = None
    """How its gradients stand against the fp32 truth (:func:`judge_against_truth`), when they were judged so."""

    @property
    def passed(self) -> bool:
        return not self.failures and not self.param_failures

    @property
    def worst_param(self) -> str | None:
        graded = [r for r in self.rows if r.worst_grad_err is not None]
        return max(graded, key=lambda r: r.worst_grad_err).worst_param if graded else None


@dataclass(kw_only=True)
class CheckReport:
    """Every layout against the reference; ``passed`` when all are within ``tolerances``."""

    reference: LayoutRun
    runs: dict[str, LayoutRun]
    results: list[LayoutResult]
    tolerances: Tolerances

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def table(self) -> str:
        t = self.tolerances
        lines = [f"reference: {self.reference.layout}   tolerances: loss {t.loss_rtol:g} rel, grad norm "
                 f"{t.grad_norm_rtol:g} rel, grads {t.grad_rtol:g} (max abs diff / max abs ref)",
                 f"{'layout':<14} {'step':>4} {'loss':>12} {'loss rel':>9} {'grad norm':>11} {'norm rel':>9} "
                 f"{'grad err':>9}  worst parameter"]
        for res in self.results:
            for r in res.rows:
                err = "" if r.worst_grad_err is None else f"{r.worst_grad_err:9.2e}"
                lines.append(f"{res.layout:<14} {r.step:>4} {r.loss:>12.6f} {r.loss_rel:>9.2e} {r.norm:>11.6f} "
                             f"{r.norm_rel:>9.2e} {err:>9}  {r.worst_param or ''}")
            first = [f"first divergence: {res.first_divergence}"] if res.first_divergence else []
            status = "PASS" if res.passed else "FAIL: " + "; ".join(first + res.failures + res.param_failures[:3])
            lines.append(f"{res.layout:<14} {status}")
            if res.truth:
                lines.append(f"{'':<14} {res.truth}")
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _assemble(per_rank: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for pieces in per_rank:
        for key, (piece, offsets, shape) in pieces.items():
            name = key.partition("#")[0]  # "name#i": piece i of a strided shard (worker.global_pieces)
            if offsets is None:
                full.setdefault(name, piece)
                continue
            t = full.get(name)
            if t is None:
                t = full[name] = torch.zeros(shape, dtype=piece.dtype, device=piece.device)
            t[tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))] = piece
    return full


def _outputs(records: list[dict[str, Any]]) -> tuple[dict[str, list[torch.Tensor]], list[str], dict[str, int]]:
    """Module outputs of a layout's ranks -> name -> pieces by TP rank, the names in forward order (by model
    chunk, then stage: chunk ``v`` of stage ``p`` is the model's piece ``v x pp + p``, then the call order on the
    rank), and name -> the parameter tensors its module holds."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    order: dict[str, tuple[int, int, int]] = {}
    params: dict[str, int] = {}
    for r in records:
        tp, _, pp = r["coords"]
        for name, ((chunk, i), t) in r.get("outputs", {}).items():
            pieces.setdefault(name, []).append((tp, t))
            order[name] = (chunk, pp, i)
        params.update(r.get("output_params", {}))
    return ({n: [t for _, t in sorted(p, key=lambda x: x[0])] for n, p in pieces.items()},
            sorted(order, key=order.__getitem__), params)


def join_pieces(pieces: list[torch.Tensor], shape: torch.Size) -> torch.Tensor | None:
    """TP pieces of one output as the reference's tensor: a replicated output as it is; a split one
    concatenated along the dimension it is split on (vocab padding cut); None: not comparable."""
    first = pieces[0]
    if first.shape == shape:
        return first
    for d in range(first.dim() if first.dim() == len(shape) else 0):
        same = all(p.shape[:d] == shape[:d] and p.shape[d + 1:] == shape[d + 1:] for p in pieces)
        if same and sum(p.shape[d] for p in pieces) >= shape[d]:
            return torch.cat(pieces, d).narrow(d, 0, shape[d])
    return None


def gather_runs(per_rank: list[list[dict[str, Any]]]) -> dict[str, LayoutRun]:
    """Per-rank records of :func:`~lightning_megatron.check.worker.run_layouts` -> one LayoutRun per layout."""
    runs = {}
    for i in range(len(per_rank[0])):
        records = [r[i] for r in per_rank]
        first = records[0]
        steps = sorted({s for r in records for s in r["grads"]})
        runs[first["layout"]] = LayoutRun(
            layout=first["layout"], losses=first["losses"], grad_norms=first["grad_norms"],
            grads={s: _assemble([r["grads"].get(s, {}) for r in records]) for s in steps},
            params=_assemble([r["params"] for r in records]),
            init_params=_assemble([r.get("init_params", {}) for r in records]),
            memory=[r["memory"] for r in records], collectives=[r["collectives"] for r in records],
            traffic=[r.get("traffic", {}) for r in records],
            **dict(zip(("outputs", "output_order", "output_params"), _outputs(records))))
    return runs


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / abs(b) if b != 0 else math.inf


def grad_error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], floor: float) -> dict[str, float]:
    """Per parameter: max |g - g_ref| / max(max |g_ref|, floor x the largest max |g_ref|)."""
    top = max((float(g.abs().max()) for g in ref.values() if g.numel()), default=0.0)
    out = {}
    for name, r in ref.items():
        g = grads[name]
        if g.shape != r.shape:
            out[name] = math.inf
            continue
        scale = max(float(r.abs().max()) if r.numel() else 0.0, floor * top) or 1.0
        out[name] = float((g - r).abs().max()) / scale if r.numel() else 0.0
    return out


def compare_runs(run: LayoutRun, ref: LayoutRun, tol: Tolerances) -> LayoutResult:
    """One layout against the reference, step by step."""
    res = LayoutResult(layout=run.layout, rows=[])
    if len(run.losses) != len(ref.losses):
        res.failures.append(f"ran {len(run.losses)} steps, the reference {len(ref.losses)}")
    overflowed = [i + 1 for i, norm in enumerate(ref.grad_norms) if not math.isfinite(norm)]
    if overflowed:  # the reference's own step: no layout to blame
        res.failures.append(
            f"step {overflowed[0]}: the reference's gradients are not finite (an fp16 loss scale that overflowed: the "
            f"optimizer skipped the step), nothing compared; start from a loss scale the gradients fit "
            f"(--megatron_optimizer.initial_loss_scale 1024, say) or check in fp32 (--fp32)")
        return res
    for i, (loss, loss_ref) in enumerate(zip(run.losses, ref.losses)):
        norm, norm_ref = run.grad_norms[i], ref.grad_norms[i]
        row = StepRow(step=i + 1, loss_ref=loss_ref, loss=loss, loss_rel=_rel(loss, loss_ref), norm_ref=norm_ref,
                      norm=norm, norm_rel=_rel(norm, norm_ref))
        if not row.loss_rel <= tol.loss_rtol:
            res.failures.append(f"step {row.step}: loss {loss:.8g} vs {loss_ref:.8g} ({row.loss_rel:.2e} rel)")
        if not row.norm_rel <= tol.grad_norm_rtol:
            res.failures.append(f"step {row.step}: grad norm {norm:.8g} vs {norm_ref:.8g} ({row.norm_rel:.2e} rel)")
        grads, grads_ref = run.grads.get(row.step), ref.grads.get(row.step)
        if grads is not None and grads_ref is not None:
            missing = sorted(set(grads_ref) ^ set(grads))
            if missing:
                res.failures.append(f"step {row.step}: parameters not in both runs: {missing[:5]}")
            errs = grad_error(grads, {k: v for k, v in grads_ref.items() if k in grads}, tol.grad_floor)
            if errs:
                row.worst_param, row.worst_grad_err = max(errs.items(), key=lambda kv: kv[1])
                if not row.worst_grad_err <= tol.grad_rtol:
                    res.failures.append(_grad_failure(row.step, row.worst_param, row.worst_grad_err))
        res.rows.append(row)
    res.first_divergence = first_divergence(run, ref, tol)
    if ref.params:
        if run.params.keys() != ref.params.keys():
            res.param_failures.append(f"final parameters: names differ: {sorted(run.params.keys() ^ ref.params.keys())[:5]}")
        names = sorted(ref.params.keys() & run.params.keys())
        for name in names:
            if run.init_params and not torch.equal(run.init_params[name], ref.init_params[name]):
                res.param_failures.append(f"initial parameter {name} differs from the reference's")
        errs = update_error({n: run.params[n] for n in names}, ref.params, ref.init_params, tol.param_floor)
        res.param_failures += [f"final parameter {name}: {e:.2e} of the reference's update (rms)"
                               for name, e in errs.items() if not e <= tol.param_rtol]
    return res


def _grad_failure(step: int, param: str, err: float) -> str:
    return f"step {step}: gradient of {param} differs by {err:.2e}"


def judge_against_truth(report: CheckReport, truth: LayoutRun, factor: float = 2.0) -> CheckReport:
    """A 16-bit check's gradients judged against ``truth``: the reference layout run in fp32 from the same 16-bit
    weights (``check_layouts(..., round_params_to=...)``), the exact gradients up to fp32 rounding.

    Two 16-bit runs round differently (TP's partial sums, each layout's order of additions), and a gradient whose
    terms cancel (BERT's pooler bias over a few samples) can land beyond the 16-bit bounds from the reference with
    both as near the truth as 16 bits allow. So a gradient that differs from the 16-bit reference's beyond
    ``grad_rtol`` passes when its distance from the truth is within ``max(grad_rtol, factor x e_ref)``, ``e_ref``
    the 16-bit reference's own distance from it (both :func:`grad_error` against the truth): the layout is as near
    the exact gradient as one 16-bit process. A wrong gradient (a missing reduction, a wrong shard) is of order one
    from the truth however near the reference is. Losses and grad norms are judged as before. Returns the report
    with each layout's gradient failures judged so, and a line saying where its worst gradient stands."""
    tol = report.tolerances
    results = []
    for res in report.results:
        run, kept, worst = report.runs[res.layout], list(res.failures), (-1.0, None)
        for step in sorted(set(run.grads) & set(report.reference.grads) & set(truth.grads)):
            grads, ref, exact = run.grads[step], report.reference.grads[step], truth.grads[step]
            names = sorted(set(grads) & set(ref) & set(exact))
            direct = grad_error({n: grads[n] for n in names}, {n: ref[n] for n in names}, tol.grad_floor)
            mine = grad_error({n: grads[n] for n in names}, {n: exact[n] for n in names}, tol.grad_floor)
            theirs = grad_error({n: ref[n] for n in names}, {n: exact[n] for n in names}, tol.grad_floor)
            beyond = [n for n in names if not direct[n] <= tol.grad_rtol]
            if not beyond:
                continue
            prefix = f"step {step}: gradient of "
            kept = [f for f in kept if not f.startswith(prefix)]
            wrong = {n: mine[n] for n in beyond if not mine[n] <= max(tol.grad_rtol, factor * theirs[n])}
            if wrong:
                name = max(wrong, key=wrong.__getitem__)
                kept.append(f"{_grad_failure(step, name, direct[name])}, {mine[name]:.2e} from the fp32 truth "
                            f"(one 16-bit process {theirs[name]:.2e}, bound {factor:g}x)")
            ratio, name = max((mine[n] / max(tol.grad_rtol, factor * theirs[n]), n) for n in beyond)
            if ratio > worst[0]:  # the step and gradient nearest its bound
                worst = (ratio, f"step {step}: against the fp32 truth {name} is {mine[name]:.2e} from it, the 16-bit "
                                f"reference {theirs[name]:.2e} (bound max({tol.grad_rtol:g}, {factor:g}x))")
        results.append(replace(res, failures=kept, truth=worst[1]))
    return replace(report, results=results)


def update_error(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], init: dict[str, torch.Tensor],
                 floor: float = 1e-3) -> dict[str, float]:
    """Per parameter: how far the final ``params`` are from the reference's, relative to how far the
    reference moved from ``init`` (both runs start from ``init``)::

        rms(p - p_ref) / max(rms(p_ref - p_init), floor x the largest rms(p_ref - p_init))

    Why not element by element: Adam's step of an element is ``lr x m / (sqrt(v) + eps)`` whatever the
    gradient's size. Where the gradient is rounding noise (the attention key bias, zero up to rounding;
    an element whose terms cancel), another summation order (another layout, or the same one on another
    CPU's kernels) changes that step by a fraction of ``lr``: a fixed absolute tolerance passes on one
    machine and fails on another. Such elements are few, and over the tensor their effect stays small
    relative to the update; one element moved the wrong way is about ``2 / sqrt(n)`` of it in a tensor of
    ``n`` elements, a learning rate 1% off is 1e-2, a missing step or a wrong shard of order one. ``inf``
    for a shape mismatch.
    """
    updates = {n: _rms(ref[n].double() - init[n].double()) for n in params}
    top = max(updates.values(), default=0.0)
    out = {}
    for name, p in params.items():
        if p.shape != ref[name].shape:
            out[name] = math.inf
            continue
        diff = _rms(p.double() - ref[name].double())
        scale = max(updates[name], floor * top)
        out[name] = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    return out


def _rms(t: torch.Tensor) -> float:
    return float(t.pow(2).mean().sqrt()) if t.numel() else 0.0


def _splits_sequence(layout: str) -> bool:
    """Whether ``layout`` is context-parallel: each rank's module outputs are its tokens, in the split's order."""
    try:
        return ParallelDims.parse(layout).cp > 1
    except ValueError:  # a name of the caller's own (the tests')
        return False


def first_divergence(run: LayoutRun, ref: LayoutRun, tol: Tolerances) -> str | None:
    """The first module, in the reference's forward order, whose step-1 output differs beyond ``output_rtol`` (of
    the modules holding as many parameter tensors as the reference's: not a stage's part of the layer stack; and
    none under context parallelism, whose outputs are each rank's tokens in the split's order); else the first, in
    backward order, with a parameter whose step-1 gradient differs beyond ``grad_rtol``; else None."""
    for name in [] if _splits_sequence(run.layout) or _splits_sequence(ref.layout) else ref.output_order:
        if name not in run.outputs or run.output_params.get(name) != ref.output_params.get(name):
            continue  # not run here, or a part of it (a stage's share of the layers): not the whole's output
        want = ref.outputs[name][0]
        got = join_pieces(run.outputs[name], want.shape)
        if got is None:
            continue
        err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30) if want.numel() else 0.0
        if not err <= tol.output_rtol:
            return f"forward output of {name} ({err:.2e} rel)"
    grads, grads_ref = run.grads.get(1), ref.grads.get(1)
    if grads is None or grads_ref is None:
        return None
    errs = grad_error(grads, {k: v for k, v in grads_ref.items() if k in grads}, tol.grad_floor)
    modules = sorted(ref.output_order, key=len, reverse=True)  # the innermost module owning a parameter
    owner = {p: next((m for m in modules if p.startswith(m + ".")), p) for p in errs}
    for name in reversed(ref.output_order):
        bad = {p: e for p, e in errs.items() if owner[p] == name and not e <= tol.grad_rtol}
        if bad:
            p, e = max(bad.items(), key=lambda kv: kv[1])
            return f"gradients of {name} ({p}: {e:.2e})"
    bad = {p: e for p, e in errs.items() if owner[p] == p and not e <= tol.grad_rtol}
    return f"gradients of {max(bad, key=bad.__getitem__)}" if bad else None


def check_layouts(
    module_factory: Callable[[], Any],
    dataset_factory: Callable[[], Any],
    *,
    layouts: Sequence[str | ParallelDims],
    global_batch_size: int,
    micro_batch_size: int,
    steps: int = 3,
    reference: str | ParallelDims = "tp1",
    tolerances: Tolerances | None = None,
    callbacks_factory: Callable[[ParallelDims], list] | None = None,
    strategy_kwargs: dict | None = None,
    trainer_kwargs: dict | None = None,
    grad_steps: Sequence[int] = (1,),
    record_params: bool = False,
    measure_memory: bool = False,
    measure_traffic: bool = False,
    round_params_to: str | None = None,
    seed: int = 1234,
    timeout: float = 900.0,
    reference_run: LayoutRun | None = None,
) -> CheckReport:
    """Fit ``reference`` and every layout in ``layouts`` for ``steps`` steps and compare them.

    Args:
        module_factory: builds a fresh LightningModule (any module following the strategy's protocol:
            ``configure_model`` building ``model_chunks``, ``forward_step``, ``pipeline_tensor_shape``
            and ``sharded_named_parameters`` for PP; any registered ModuleSpec). Dropout must be off.
            It and the other factories must be picklable: module-level functions or ``functools.partial``.
        dataset_factory: builds the map-style dataset; step ``s`` uses samples ``[s*G, (s+1)*G)``.
        layouts: e.g. ``["tp2", "pp2", "dp2", "tp2pp2", "pp2vp2", "tp2sp", "dp2zero1"]``.
        global_batch_size, micro_batch_size: the same in every layout (same samples, same microbatches).
        reference: the layout everything is compared with (default: one process).
        grad_steps: steps after which every gradient is compared as a global tensor.
        record_params: also compare the final parameters, relative to the reference's update
            (:func:`update_error`, ``param_rtol``), and check that every layout starts from the
            reference's initial parameters.
        measure_memory: record per-rank bytes (see :class:`LayoutRun.memory`).
        measure_traffic: count the bytes each rank sends in step 1 (see :class:`LayoutRun.traffic`).
        round_params_to: round every parameter to this dtype (e.g. ``"bfloat16"``) before the first step.
        timeout: seconds per group of layouts sharing a world size.
        reference_run: the reference's records from an earlier report (``report.reference``) of the
            same model, data, steps and options: it is not run again.
    """
    tol = tolerances or Tolerances()
    ref_layout = ParallelDims.parse(reference)
    parsed = [ParallelDims.parse(x) for x in layouts]
    run = CheckRun(module_factory=module_factory, dataset_factory=dataset_factory,
                   global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, steps=steps, seed=seed,
                   callbacks_factory=callbacks_factory, strategy_kwargs=dict(strategy_kwargs or {}),
                   trainer_kwargs=dict(trainer_kwargs or {}), grad_steps=tuple(grad_steps),
                   record_params=record_params, measure_memory=measure_memory,
                   measure_traffic=measure_traffic, round_params_to=round_params_to)
    for layout in [ref_layout] + parsed:
        if global_batch_size % (micro_batch_size * layout.dp):
            raise ValueError(f"layout {layout}: global_batch_size={global_batch_size} is not divisible by "
                             f"micro_batch_size={micro_batch_size} x dp={layout.dp}; choose a global batch that is")
    groups: dict[int, list[ParallelDims]] = {}
    runs: dict[str, LayoutRun] = {}
    if reference_run is not None:
        if reference_run.layout != ref_layout.name or len(reference_run.losses) != steps:
            raise ValueError(f"reference_run is layout {reference_run.layout} over {len(reference_run.losses)} "
                             f"steps; this check needs {ref_layout.name} over {steps}")
        runs[ref_layout.name] = reference_run
    for layout in ([] if reference_run is not None else [ref_layout]) + [x for x in parsed if x != ref_layout]:
        groups.setdefault(layout.world_size, []).append(layout)
    for world, members in groups.items():
        runs.update(gather_runs(run_distributed(run_layouts, world, run, members, timeout=timeout)))
    ref = runs[ref_layout.name]
    results = [compare_runs(runs[x.name], ref, tol) for x in parsed if x != ref_layout]
    return CheckReport(reference=ref, runs=runs, results=results, tolerances=tol)
