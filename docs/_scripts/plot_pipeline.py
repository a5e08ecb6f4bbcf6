"""Draw docs/img/pipeline_schedule.png from a real run of the schedules (PP=4, m=8).

Runs :func:`benchmarks.pipeline_bubble.collect` (4 gloo processes, sleep-emulated stage work,
backward = 2 x forward) for 1F1B and interleaved v=2, and draws each rank's traced forward (F) and
backward (B) events on their measured time axis. White space is the bubble.

Run: ``.venv/bin/python docs/_scripts/plot_pipeline.py``
"""

from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

from pipeline_bubble import bubble, collect, theory_bubble  # noqa: E402

P, M, T_FORWARD = 4, 8, 0.02
F_COLORS = ["#c6dbef", "#6baed6"]  # forward, chunk 0 / chunk 1
B_COLORS = ["#fdd0a2", "#fd8d3c"]  # backward, chunk 0 / chunk 1


def main() -> None:
    # Three steps each; draw the fastest (the least disturbed by other processes on the machine).
    results = [(cfg, min(runs, key=lambda step: bubble(step)[0]))
               for cfg, runs in collect([(P, 1, M), (P, 2, M)], t_forward=T_FORWARD, steps=3)]
    longest = max(bubble(step)[0] for _, step in results) * 1e3
    fig, axes = plt.subplots(2, 1, figsize=(13, 5.6), sharex=True)
    for ax, ((p, v, m), step) in zip(axes, results):
        t0 = min(r[0] for r in step)
        makespan, mean_bubble, _ = bubble(step)
        for rank, (_, _, trace) in enumerate(step):
            for e in trace:
                color = (F_COLORS if e.kind == "F" else B_COLORS)[e.chunk]
                x, w = (e.start - t0) * 1e3, (e.end - e.start) * 1e3
                ax.add_patch(Rectangle((x, rank - 0.4), w, 0.8, facecolor=color, edgecolor="black", linewidth=0.5))
                ax.text(x + w / 2, rank, str(e.microbatch), ha="center", va="center", fontsize=7)
        name = "1F1B" if v == 1 else f"interleaved 1F1B, v={v} chunks per rank"
        ax.set_title(f"{name}: PP={p}, m={m}; step {makespan * 1e3:.0f} ms, measured bubble {mean_bubble:.2f} "
                     f"(theory {theory_bubble(p, m, v):.2f})", fontsize=10)
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_yticks(range(p), [f"stage {r}" for r in range(p)])
        ax.set_xlim(0, longest * 1.01)
    axes[-1].set_xlabel("time since the step started (ms); number = microbatch")
    fig.legend(handles=[Patch(facecolor=F_COLORS[0], edgecolor="black", label="forward, chunk 0"),
                            Patch(facecolor=F_COLORS[1], edgecolor="black", label="forward, chunk 1"),
                            Patch(facecolor=B_COLORS[0], edgecolor="black", label="backward, chunk 0"),
                            Patch(facecolor=B_COLORS[1], edgecolor="black", label="backward, chunk 1")],
               loc="lower center", fontsize=8, ncols=4, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    out = os.path.join(ROOT, "docs", "img", "pipeline_schedule.png")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {os.path.normpath(out)}")


if __name__ == "__main__":
    main()
