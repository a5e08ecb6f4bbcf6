"""A/B of each piece of the opt-in CPU tuning (lightning_megatron.cpu.CPUTuning) on a BERT step.

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_tuning_ab.py [--size base] [--tp 2] [--dtype bf16] [--rounds 2]

Runs ours (bert_step.bert_rank, fresh spawned gloo ranks per run) with: every piece on; each piece
off in turn (shared-memory collectives, the glibc allocator setting, the CPU kernels); no tuning at
all (the library's default path). Rounds alternate the order; the fastest round of each variant is
kept. Prints one markdown table: median step seconds, tokens/s and the ratio to "all on".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import SIZES, median  # noqa: E402

VARIANTS = {
    "all on": {},
    "no shared-memory collectives": {"shared_memory_collectives": False},
    "no allocator setting": {"keep_freed_memory": False},
    "no CPU kernels": {"kernels": False},
    "no tuning (library default)": None,
}


def main() -> None:
    from bert_step import bert_rank
    from run import _measured  # fresh spawned ranks, and the cores other processes used meanwhile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="base", choices=sorted(SIZES))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    size = SIZES[args.size]
    best: dict[str, float] = {}
    background: dict[str, float] = {}
    for r in range(args.rounds):
        names = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
        for name in names:
            spec = dict(framework="ours", precision=args.dtype, tp=args.tp, pp=1, size=size.as_dict(), seq=args.seq,
                        batch=args.batch, micro_batch=args.batch, warmup=1, steps=args.steps, profile=False,
                        cpu_tuning=VARIANTS[name])
            t0 = time.perf_counter()
            ranks, bg, _ = _measured(bert_rank, args.tp, spec, timeout=1200)
            step = median([max(ts) for ts in zip(*(rk["step_times"] for rk in ranks))])
            if step < best.get(name, float("inf")):
                best[name], background[name] = step, bg
            print(f"[round {r}] {name}: {step:.3f} s/step, background {bg:.2f} cores "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    tokens = args.seq * args.batch
    ref = best["all on"]
    print(f"\nbert-{args.size} {args.dtype}, TP={args.tp}, batch {args.batch} x {args.seq}, {args.rounds} round(s):\n")
    print("| variant | s/step | tokens/s | step time / all on | background (cores) |\n|---|---|---|---|---|")
    for name in VARIANTS:
        print(f"| {name} | {best[name]:.3f} | {tokens / best[name]:.0f} | {best[name] / ref:.2f} | "
              f"{background[name]:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "step_s": best, "background": background}, fh, indent=1)


if __name__ == "__main__":
    main()
