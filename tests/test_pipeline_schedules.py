"""Pipeline schedules vs one process: losses, every gradient, forward-only, warm-up counts.

The model is a stack of ``L`` layers ``h <- tanh(W_i h + b_i)`` on ``[s, b, h]`` activations, layer
``i`` seeded by its global index so that whichever stage builds it gets the same numbers; the last
piece computes ``MSE(h, y)``. The reference runs all layers in one process, microbatch after
microbatch, with the loss divided by ``m``: the gradient of the mean loss. The schedules do the same
arithmetic in the same order (per chunk, backward in microbatch order), so fp32 agreement is
expected to rounding; the stated tolerance is 1e-6 absolute (values are O(1)).

All layouts run in ONE spawned world of 4 gloo ranks (process start costs seconds here):
PP=1 (no pipelining, DP=4), PP=2 (DP=2), PP=4, PP=2 x VP=2 (DP=2), PP=4 x VP=2, the interleaved ones
also with ``overlap_p2p_comm``, and a user's schedule registered from a file of its own (GPipe,
tests/gpipe_schedule.py) at PP=2. The traces of the runs also check each named schedule's
``in_flight`` (the peak of forwards awaiting their backward) and ``bubble`` (the idle fraction of the
recorded execution orders replayed with a forward taking 1 and a backward 2 per stage, transfers free).
"""

from __future__ import annotations

import datetime
import math
from fractions import Fraction
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed
from gpipe_schedule import GPipe
from torch import nn

from lightning_megatron.parallel_state import initialize_model_parallel
from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.pipeline import ScheduleEvent, get_schedule, stage_chunks

H, S, B = 8, 3, 2  # hidden, sequence, micro-batch size: activations are [S, B, H]
LR = 0.2
TOL = 1e-6


# -- toy model and reference -------------------------------------------------------------------------


def make_layer(index: int) -> nn.Linear:
    """Layer ``index`` built from a seed of its own: identical on whichever stage builds it."""
    g = torch.Generator().manual_seed(1000 + index)
    layer = nn.Linear(H, H)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(H, H, generator=g) * (1.5 / math.sqrt(H)))
        layer.bias.copy_(torch.randn(H, generator=g) * 0.1)
    return layer


class ToyChunk(nn.Module):
    """Layers ``layer_ids`` of the stack; the first piece reads ``x`` from the batch."""

    def __init__(self, layer_ids: range, pre_process: bool) -> None:
        super().__init__()
        self.layer_ids = list(layer_ids)
        self.layers = nn.ModuleList(make_layer(i) for i in layer_ids)
        self.pre_process = pre_process
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.pre_process else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def mse_loss_func(output: torch.Tensor, target: torch.Tensor):
    loss = F.mse_loss(output, target)
    return loss, {"loss": loss.detach()}


def forward_step(microbatch: dict, chunk: ToyChunk):
    return chunk(microbatch["x"]), partial(mse_loss_func, target=microbatch["y"])


def make_microbatches(m: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(S, B, H, generator=g), "y": torch.randn(S, B, H, generator=g)} for _ in range(m)]


def reference(num_layers: int, m: int, steps: int, scale: float) -> dict:
    """One process, all layers: per-step mean loss and grads (by global layer index), then eval losses."""
    model = ToyChunk(range(num_layers), pre_process=True)
    losses, grads = [], []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        step_losses = []
        for mb in make_microbatches(m, seed=step):
            loss, _ = mse_loss_func(model(mb["x"]), mb["y"])
            (loss / m * scale).backward()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / m)
        grads.append({i: (l.weight.grad.clone(), l.bias.grad.clone()) for i, l in zip(model.layer_ids, model.layers)})
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad / scale
    with torch.no_grad():
        eval_losses = [mse_loss_func(model(mb["x"]), mb["y"])[0].item() for mb in make_microbatches(m, seed=99)]
    return {"losses": losses, "grads": grads, "eval": eval_losses}


# -- the distributed run -----------------------------------------------------------------------------

# (id, num_layers, pp, vp, num_microbatches, grad scale)
CASES = [
    ("pp1-dp4-m3", 4, 1, None, 3, 1.0),
    ("pp2-dp2-m3", 5, 2, None, 3, 1.0),
    ("pp4-m2", 4, 4, None, 2, 1.0),  # m < p: warm-up capped at m
    ("pp4-m6-uneven", 10, 4, None, 6, 1.0),
    ("pp2-vp2-dp2-m2", 6, 2, 2, 2, 1.0),  # m == p, uneven pieces 2,2,1,1
    ("pp2-vp2-dp2-m6-scaled", 8, 2, 2, 6, 8.0),  # grad_scale_func multiplies the loss by 8
    ("pp4-vp2-m4", 8, 4, 2, 4, 1.0),  # m == p: stage 0 runs all 8 forwards in warm-up
    ("pp4-vp2-m8", 8, 4, 2, 8, 1.0),
    # overlap_p2p_comm: the same cases with the steady state's exchanges posted before and waited
    # after the other pass's compute; bitwise equal to the cases above (test_overlap_p2p_comm_is_bitwise)
    ("pp2-vp2-dp2-m6-scaled-overlap", 8, 2, 2, 6, 8.0),
    ("pp4-vp2-m8-overlap", 8, 4, 2, 8, 1.0),
    # a schedule registered by the user (MegatronStrategy(pipeline_schedule="gpipe")): all forwards first
    ("pp2-dp2-m3-gpipe", 5, 2, None, 3, 1.0),
]
STEPS = 2


def _run_cases(cases: list[tuple]) -> dict:
    out = {}
    for case_id, num_layers, pp, vp, m, scale in cases:
        ps = initialize_model_parallel(ParallelDims(tp=1, pp=pp, vp=vp), timeout=datetime.timedelta(seconds=30))
        chunks = [ToyChunk(c.layers, c.pre_process) for c in stage_chunks(num_layers, pp, ps.pp_rank, vp)]
        params = [p for c in chunks for p in c.parameters()]
        schedule = get_schedule(_schedule_name(case_id), pp, vp).run
        common = dict(forward_step_func=forward_step, model=chunks, num_microbatches=m, parallel_state=ps,
                      tensor_shape=(S, B, H), dtype=torch.float32, overlap_p2p_comm=case_id.endswith("-overlap"))
        losses, grads, traces = [], [], []
        for step in range(STEPS):
            for p in params:
                p.grad = None
            trace: list[ScheduleEvent] = []
            logged = schedule(microbatches=make_microbatches(m, seed=step), trace=trace,
                              grad_scale_func=(lambda loss, s=scale: loss * s) if scale != 1.0 else None, **common)
            losses.append([d["loss"].item() for d in logged])
            grads.append({i: (l.weight.grad.clone(), l.bias.grad.clone())
                          for c in chunks for i, l in zip(c.layer_ids, c.layers)})
            traces.append(trace)
            with torch.no_grad():
                for p in params:
                    p -= LR * p.grad / scale
        for p in params:
            p.grad = None
        eval_trace: list[ScheduleEvent] = []
        eval_logged = schedule(microbatches=make_microbatches(m, seed=99), forward_only=True, trace=eval_trace,
                               **common)
        out[case_id] = {
            "pp_rank": ps.pp_rank, "last": ps.is_pipeline_last_stage(), "losses": losses, "grads": grads,
            "traces": traces, "eval": [d["loss"].item() for d in eval_logged], "eval_trace": eval_trace,
            "grads_after_eval": [p.grad for p in params],
            "requires_grad_eval": torch.is_grad_enabled(),
        }
        dist.barrier()
    return out


def _schedule_name(case_id: str) -> str:
    return "gpipe" if case_id.endswith("-gpipe") else "auto"


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_run_cases, 4, CASES, timeout=150)


def _expected_warmup(pp: int, vp: int | None, m: int, rank: int, case_id: str) -> int:
    if case_id.endswith("-gpipe"):
        return m  # every forward before the first backward
    if vp is None:
        return min(pp - rank - 1, m)
    return min(2 * (pp - rank - 1) + (vp - 1) * pp, m * vp)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_parity_with_one_process(results, case):
    case_id, num_layers, pp, vp, m, scale = case
    ref = reference(num_layers, m, STEPS, scale)
    assert abs(ref["losses"][1] - ref["losses"][0]) > 1e-3, "the optimizer step must change the loss"
    seen_layers = set()
    for rank, res in enumerate(r[case_id] for r in results):
        for step in range(STEPS):
            if res["last"]:
                assert len(res["losses"][step]) == m
                assert abs(sum(res["losses"][step]) / m - ref["losses"][step]) < TOL, (rank, step)
            else:
                assert res["losses"][step] == [], "only the last stage returns logged losses"
            for i, (wg, bg) in res["grads"][step].items():
                rwg, rbg = ref["grads"][step][i]
                assert torch.allclose(wg, rwg, rtol=0, atol=TOL * scale), (rank, step, i, (wg - rwg).abs().max())
                assert torch.allclose(bg, rbg, rtol=0, atol=TOL * scale), (rank, step, i)
                seen_layers.add(i)
    assert seen_layers == set(range(num_layers)), "every layer is owned by some stage"


@pytest.mark.parametrize("case", [c for c in CASES if c[0].endswith("-overlap")], ids=lambda c: c[0])
def test_overlap_p2p_comm_is_bitwise(results, case):
    """Posting the exchanges early and waiting late moves the same messages: bit for bit the same
    losses and gradients as the schedule that waits at once (and both match one process, above)."""
    for res in results:
        got, off = res[case[0]], res[case[0].removesuffix("-overlap")]
        assert got["losses"] == off["losses"]
        assert got["eval"] == off["eval"]
        for step in range(STEPS):
            assert got["grads"][step].keys() == off["grads"][step].keys()
            for i, (wg, bg) in got["grads"][step].items():
                assert torch.equal(wg, off["grads"][step][i][0]) and torch.equal(bg, off["grads"][step][i][1])
        assert [(e.kind, e.microbatch, e.chunk, e.phase) for e in got["traces"][0]] == \
            [(e.kind, e.microbatch, e.chunk, e.phase) for e in off["traces"][0]]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_only_equals_one_process(results, case):
    case_id, num_layers, pp, vp, m, scale = case
    ref = reference(num_layers, m, STEPS, scale)
    for res in (r[case_id] for r in results):
        if res["last"]:
            assert len(res["eval"]) == m
            for got, want in zip(res["eval"], ref["eval"]):
                assert abs(got - want) < TOL
        else:
            assert res["eval"] == []
        assert all(e.kind == "F" for e in res["eval_trace"]) and len(res["eval_trace"]) == m * (vp or 1)
        assert all(g is None for g in res["grads_after_eval"]), "forward-only must not accumulate grads"
        assert res["requires_grad_eval"], "the schedule must restore grad mode"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_warmup_count_and_order(results, case):
    case_id, num_layers, pp, vp, m, scale = case
    v = vp or 1
    for res in (r[case_id] for r in results):
        rank = res["pp_rank"]
        trace = res["traces"][0]
        assert len(trace) == 2 * m * v
        if pp == 1:
            assert [e.kind for e in trace] == ["F", "B"] * m
            continue
        warmup = _expected_warmup(pp, vp, m, rank, case_id)
        assert sum(e.phase == "warmup" for e in trace) == warmup, (rank, [e.phase for e in trace])
        # From the execution order itself: the steady state starts with a forward, so a rank runs
        # warm-up + 1 forwards before its first backward (all of them when warm-up covers everything).
        first_b = next(i for i, e in enumerate(trace) if e.kind == "B")
        assert first_b == min(warmup + 1, m * v), (rank, [e.kind for e in trace])
        # Every (microbatch, chunk) runs forward once and backward once, backward after forward.
        fwd = [(e.microbatch, e.chunk) for e in trace if e.kind == "F"]
        bwd = [(e.microbatch, e.chunk) for e in trace if e.kind == "B"]
        assert sorted(fwd) == sorted(bwd) == sorted((i, c) for i in range(m) for c in range(v))
        # Per chunk, microbatches go forward and backward in order (FIFO), as Megatron.
        for c in range(v):
            assert [i for i, cc in fwd if cc == c] == list(range(m))
            assert [i for i, cc in bwd if cc == c] == list(range(m))
        if vp is not None:
            # Megatron's chunk order: groups of pp microbatches per chunk, backward in reverse chunks.
            assert [c for _, c in fwd[:pp * v]] == [c for c in range(v) for _ in range(pp)]
            assert [c for _, c in bwd[:pp * v]] == [c for c in reversed(range(v)) for _ in range(pp)]


def _replayed_bubble(orders: dict[int, list[tuple[str, int, int]]], pp: int, vp: int) -> list[Fraction]:
    """Each stage's idle fraction when the recorded orders run with a forward taking 1 and a backward 2
    per stage (``1/v`` and ``2/v`` per chunk) and transfers free: every pass starts when its stage is
    free and its inputs exist (the previous piece's forward; the next piece's backward)."""
    t = {"F": Fraction(1, vp), "B": Fraction(2, vp)}
    done: dict[tuple[str, int, int], Fraction] = {}
    free, position = {r: Fraction(0) for r in orders}, {r: 0 for r in orders}
    while any(position[r] < len(orders[r]) for r in orders):
        progressed = False
        for r, order in orders.items():
            if position[r] == len(order):
                continue
            kind, i, chunk = order[position[r]]
            piece = chunk * pp + r
            if kind == "F":
                needs = [("F", i, piece - 1)] if piece > 0 else []
            else:
                needs = [("F", i, piece)] + ([("B", i, piece + 1)] if piece < pp * vp - 1 else [])
            if all(n in done for n in needs):
                free[r] = done[(kind, i, piece)] = max([free[r]] + [done[n] for n in needs]) + t[kind]
                position[r] += 1
                progressed = True
        assert progressed, "the recorded orders deadlock"
    makespan = max(done.values())
    return [1 - sum(t[kind] for kind, _, _ in orders[r]) / makespan for r in sorted(orders)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_in_flight_and_bubble_of_the_named_schedule_match_the_trace(results, case):
    """The schedule's ``in_flight`` is the peak of forwards awaiting their backward in the real run on
    every stage, and its ``bubble`` (the closed forms of docs/pipeline.md) the idle fraction of the real
    run's execution orders replayed on the ideal pipeline."""
    case_id, num_layers, pp, vp, m, scale = case
    schedule = get_schedule(_schedule_name(case_id), pp, vp)
    assert isinstance(schedule, GPipe) == case_id.endswith("-gpipe")
    orders = {}
    for res in (r[case_id] for r in results):
        alive = peak = 0
        for e in res["traces"][0]:
            alive += 1 if e.kind == "F" else -1
            peak = max(peak, alive)
        assert peak == schedule.in_flight(pp, vp, res["pp_rank"], m), (res["pp_rank"], peak)
        orders.setdefault(res["pp_rank"], [(e.kind, e.microbatch, e.chunk) for e in res["traces"][0]])
    replayed = _replayed_bubble(orders, pp, vp or 1)
    assert all(float(b) == pytest.approx(schedule.bubble(pp, vp, m), rel=1e-12) for b in replayed), replayed
