"""``lightning-megatron plot``: the curves of one or more run folders, one panel per quantity.

A run folder (``trainer.default_root_dir``) holds one ``csv/version_N/metrics.csv`` per start of the
run: a resumed run adds a version that continues the steps of the one before. Each run is drawn as
one line per quantity: its versions joined by step (where two overlap, the later one's rows win: a
resume repeats the steps after its checkpoint). A quantity ``q`` is a panel: the training curve
(``loss`` for ``q="loss"``, else ``train_<q>``) as a line and its validation (``val_<q>``) as markers
of the same colour, so that a single validation point is visible. The legend names each run by its
folder (with as many parent folders as it takes to tell two runs apart).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

__all__ = ["QUANTITIES", "plot_runs", "read_run"]

QUANTITIES = ("loss", "lm_loss", "binary_loss", "mlm_accuracy")
"""The panels drawn when present: total loss, masked-LM loss, SOP/NSP loss, masked-LM accuracy."""
_TITLES = {"loss": "total loss", "lm_loss": "masked-LM loss", "binary_loss": "SOP/NSP loss",
           "mlm_accuracy": "masked-LM accuracy"}


def read_run(run_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every metric of a run folder: ``name -> [(step, value), ...]`` sorted by step, its
    ``metrics.csv`` files joined in version order (a later version wins where steps repeat)."""

    def version(path: Path) -> tuple[int, str]:
        name = path.parent.name
        return (int(name.split("_")[-1]) if name.split("_")[-1].isdigit() else -1, str(path))

    files = sorted(Path(run_dir).rglob("metrics.csv"), key=version)
    if not files:
        raise FileNotFoundError(f"no metrics.csv under {os.fspath(run_dir)!r}: is it a run directory with a CSVLogger?")
    series: dict[str, dict[int, float]] = {}
    for path in files:
        with path.open() as fh:
            rows = list(csv.DictReader(fh))
        first = min((int(r["step"]) for r in rows if r.get("step") not in (None, "")), default=None)
        for name in series:  # a resume repeats the steps after its checkpoint: the later rows win
            if first is not None:
                series[name] = {s: v for s, v in series[name].items() if s < first}
        for row in rows:
            if row.get("step") in (None, ""):
                continue
            for name, value in row.items():
                if name in ("step", "epoch") or value in (None, ""):
                    continue
                series.setdefault(name, {})[int(row["step"])] = float(value)
    return {name: sorted(points.items()) for name, points in series.items() if points}


def _labels(run_dirs: list[str | os.PathLike[str]]) -> list[str]:
    """The shortest trailing parts of the run paths that tell the runs apart (``bert_tiny``, ``a/run``)."""
    parts = [Path(os.path.abspath(r)).parts for r in run_dirs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [os.fspath(r) for r in run_dirs]


def plot_runs(run_dirs: list[str | os.PathLike[str]], output: str | os.PathLike[str],
              quantities: tuple[str, ...] = QUANTITIES) -> Path:
    """Write a PNG with one panel per quantity present in the runs and one line per run (see the module)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_run(r) for r in run_dirs]
    labels = _labels(run_dirs)

    def names(q: str) -> tuple[str, str]:
        return ("loss" if q == "loss" else f"train_{q}"), f"val_{q}"

    panels = [q for q in quantities if any(n in run for run in runs for n in names(q))]
    if not panels:
        found = sorted({n for run in runs for n in run})
        raise ValueError(f"none of the quantities {list(quantities)} (train_<q>/val_<q>, or loss/val_loss) is in the "
                         f"runs {[os.fspath(r) for r in run_dirs]}; their metrics are {found}")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels) + 0.6), sharex=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, q in zip(axes[:, 0], panels):
        train, val = names(q)
        for i, (run, label) in enumerate(zip(runs, labels)):
            color = colors[i % len(colors)]
            if run.get(train):
                steps, values = zip(*run[train])
                ax.plot(steps, values, color=color, linewidth=1.2, marker="." if len(steps) < 3 else None)
            if run.get(val):
                steps, values = zip(*run[val])
                ax.plot(steps, values, color=color, linestyle="none", marker="o", markersize=5,
                        markeredgecolor="black", markeredgewidth=0.6, zorder=3)
        ax.set_ylabel(_TITLES.get(q, q.replace("_", " ")))
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    # One legend for the figure: a colour per run, then what a line and a marker are.
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colors[i % len(colors)], linewidth=2) for i in range(len(runs))]
    handles += [Line2D([], [], color="grey", linewidth=1.2),
                Line2D([], [], color="grey", linestyle="none", marker="o", markeredgecolor="black")]
    fig.legend(handles, [*labels, "training", "validation"], loc="upper center", ncol=min(len(handles), 4),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight() * (1 + (len(handles) - 1) // 4)))
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, out)  # atomic: a reader never sees half a PNG
    return out
