"""PP=2 against TP=1 on bert-base in bf16, with the bubble and the exposed p2p time of each stage.

The layouts of benchmarks/run.py's PP=2 row (seq 128, batch 8; PP as 4 microbatches of 2; bf16 params,
fp32 main params, the opt-in CPU tuning), each in fresh spawned gloo ranks, one after another in an
order that alternates between rounds:

- ``tp1``: one process, one microbatch of 8 (the reference);
- ``pp2``: 1F1B over 2 stages;
- ``pp2-vp2`` / ``pp2-vp2-overlap``: interleaved over 2 chunks per stage, ``overlap_p2p_comm`` off / on;
- ``pp2-last4`` / ``pp2-vp2-overlap-last4``: the same with 8 + 4 layers
  (``num_layers_in_last_pipeline_stage=4``: the last stage also runs the LM head and the loss);
- ``pp2-last5``: 1F1B with 7 + 5 layers; ``pp2-m8`` / ``pp2-m8-last5``: 8 microbatches of 1 (6 + 6 / 7 + 5);
- ``pp2-vp2-overlap-last5``: interleaved, ``overlap_p2p_comm``, 7 + 5 layers (chunks of 4 and 3 layers on
  stage 0, 3 and 2 on stage 1);
- ``pp2-vp3-overlap``: 3 chunks of 2 layers per stage;
- ``pp2-defer``, ``pp2-last5-defer``, ``pp2-vp2-overlap-defer``, ``pp2-vp3-overlap-defer``,
  ``pp2-vp2-overlap-last5-defer``: those layouts with the LM head's weight
  gradient computed at the pipeline flush (``defer_embedding_wgrad_compute=True``);
- ``pp2-stepw``, ``pp2-last5-stepw``, ``pp2-vp2-overlap-stepw``, ``pp2-vp2-overlap-last5-stepw``: those
  layouts with every linear layer's weight gradient computed once per step at the flush, one GEMM over
  the microbatches (``CPUTuning(weight_grads_per_step=True)``).

Per layout: the median step time and its ratio to ``tp1`` of the same round (the speed ratio is
``tp1 / layout``); per stage, from the schedule trace of the last timed step, the *idle* share of the
step (1 - forward/backward time / step time: the bubble, waiting on the other stage, and the
optimizer), and the share of the same step this stage was blocked in pipeline p2p (posting and
waiting: ``P2PCommunicator._post`` and ``P2PWork.wait``, timed by wrapping them in this process):
the exposed p2p time, which includes waiting for the other stage's compute; the share in
``finalize_model_grads`` (the tied embedding's all-reduce between the stages), the share inside the
step but outside the passes, p2p and finalize, and the share outside the strategy's step (optimizer,
Lightning).

Run: ``python benchmarks/pipeline_step.py [--rounds 2] [--steps 3] [--size base]`` (``PYTHONPATH`` =
the checkout). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from _common import SIZES, launch, median

__all__ = ["run_pipeline_step", "LAYOUTS"]

# name: (tp, pp, vp, overlap_p2p_comm, num_layers_in_last_pipeline_stage, micro batch under PP)
LAYOUTS = {"tp1": (1, 1, None, True, None, None), "pp2": (1, 2, None, True, None, 2),
           "pp2-vp2": (1, 2, 2, False, None, 2), "pp2-vp2-overlap": (1, 2, 2, True, None, 2),
           "pp2-last4": (1, 2, None, True, 4, 2), "pp2-vp2-overlap-last4": (1, 2, 2, True, 4, 2),
           "pp2-last5": (1, 2, None, True, 5, 2), "pp2-m8-last5": (1, 2, None, True, 5, 1),
           "pp2-m8": (1, 2, None, True, None, 1), "pp2-vp2-overlap-last5": (1, 2, 2, True, 5, 2)}
# ... and with the output layer's weight gradient deferred to the pipeline flush (defer_embedding_wgrad_compute)
LAYOUTS["pp2-vp3-overlap"] = (1, 2, 3, True, None, 2)
DEFERRED = {"pp2-defer": "pp2", "pp2-last5-defer": "pp2-last5", "pp2-vp2-overlap-defer": "pp2-vp2-overlap",
            "pp2-vp3-overlap-defer": "pp2-vp3-overlap", "pp2-vp2-overlap-last5-defer": "pp2-vp2-overlap-last5"}
LAYOUTS.update({name: LAYOUTS[base] for name, base in DEFERRED.items()})
# ... and with every linear layer's weight gradient computed once per step at the flush (the CPU
# tuning's weight_grads_per_step; the output layer's included)
PER_STEP = {"pp2-stepw": "pp2", "pp2-last5-stepw": "pp2-last5", "pp2-vp2-overlap-stepw": "pp2-vp2-overlap",
            "pp2-vp2-overlap-last5-stepw": "pp2-vp2-overlap-last5"}
LAYOUTS.update({name: LAYOUTS[base] for name, base in PER_STEP.items()})
SEQ, BATCH = 128, 8


def p2p_timed_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`bert_step.bert_rank` with parts of the step timed (seconds of the traced step in each):
    ``p2p_s`` the pipeline's p2p posts and waits, ``finalize_s`` the gradient reductions after the
    schedule (``finalize_model_grads``: DP, and the tied embedding's all-reduce between the first and
    last stage), ``run_s`` the whole microbatch step (schedule + finalize + the logged losses'
    reduction); the rest of the step (optimizer, Lightning) is ``trace_step_s - run_s``."""
    import time

    from bert_step import bert_rank
    from lightning_megatron import step
    from lightning_megatron.pipeline import p2p

    spans: dict[str, list[tuple[float, float]]] = {"p2p": [], "finalize": [], "run": []}

    def timed(fn: Any, kind: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spans[kind].append((t0, time.perf_counter()))
        return wrapper

    # This spawned process only: measurement probes.
    p2p.P2PWork.wait = timed(p2p.P2PWork.wait, "p2p")
    p2p.P2PCommunicator._post = timed(p2p.P2PCommunicator._post, "p2p")
    step.finalize_model_grads = timed(step.finalize_model_grads, "finalize")
    step.StepRunner.run = timed(step.StepRunner.run, "run")
    result = bert_rank(spec)
    if "trace_window" in result:
        lo, hi = result["trace_window"]
        for kind, kind_spans in spans.items():
            result[f"{kind}_s"] = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in kind_spans)
    return result


def _run_one(name: str, size: str, warmup: int, steps: int) -> list[dict[str, Any]]:
    tp, pp, vp, overlap, last, micro = LAYOUTS[name]
    model_kwargs: dict[str, Any] = {} if last is None else {"num_layers_in_last_pipeline_stage": last}
    if name in DEFERRED:
        model_kwargs["defer_embedding_wgrad_compute"] = True
    spec = dict(framework="ours", precision="bf16", tp=tp, pp=pp, vp=vp, overlap_p2p_comm=overlap,
                model_kwargs=model_kwargs,
                size=SIZES[size].as_dict(), seq=SEQ, batch=BATCH, micro_batch=micro or BATCH,
                warmup=warmup, steps=steps, trace=pp > 1)
    if name in PER_STEP:
        spec["cpu_tuning"] = {"weight_grads_per_step": True}
    return launch(p2p_timed_rank, tp * pp, spec, timeout=1800)


def run_pipeline_step(*, rounds: int = 2, steps: int = 3, warmup: int = 1, size: str = "base",
                      layouts: list[str] | None = None) -> dict[str, Any]:
    names = layouts or list(LAYOUTS)
    per_round: list[dict[str, Any]] = []
    for r in range(rounds):
        row: dict[str, Any] = {}
        for name in (names if r % 2 == 0 else names[::-1]):
            ranks = _run_one(name, size, warmup, steps)
            step = median([max(rk["step_times"][i] for rk in ranks) for i in range(len(ranks[0]["step_times"]))])
            row[name] = {"step_s": step}
            if LAYOUTS[name][1] > 1:
                row[name]["stages"] = [{
                    "idle_share": 1 - rk["busy_s"] / rk["trace_step_s"],
                    "p2p_share": rk["p2p_s"] / rk["trace_step_s"],
                    "finalize_share": rk["finalize_s"] / rk["trace_step_s"],
                    "other_in_schedule_share": (rk["run_s"] - rk["finalize_s"] - rk["busy_s"] - rk["p2p_s"])
                    / rk["trace_step_s"],
                    "outside_step_share": 1 - rk["run_s"] / rk["trace_step_s"]} for rk in ranks]
        if "tp1" in row:
            for name in row:
                row[name]["speed_vs_tp1"] = row["tp1"]["step_s"] / row[name]["step_s"]
        per_round.append(row)
    return {"spec": {"size": size, "seq": SEQ, "batch": BATCH, "micro_batch": {n: LAYOUTS[n][5] or BATCH for n in names},
                     "steps": steps, "rounds": rounds}, "rounds": per_round}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--size", default="base", choices=sorted(SIZES))
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of " + ",".join(LAYOUTS))
    args = parser.parse_args(argv)
    print(json.dumps(run_pipeline_step(rounds=args.rounds, steps=args.steps, size=args.size,
                                       layouts=args.layouts.split(",")), indent=1))


if __name__ == "__main__":
    main()
