"""``lightning-megatron plot``: the curves of one or more run folders, one panel per quantity.

A run folder (``trainer.default_root_dir``) holds one ``csv/version_N/metrics.csv`` per start of the
run: a resumed run adds a version that continues the steps of the one before. Each run is drawn as
one line per quantity: its versions joined by step (where two overlap, the later one's rows win: a
resume repeats the steps after its checkpoint). The logs of ``validate``/``test``/``predict``
(``csv/validate/version_N``, ...) are not the training run's and are left out. A quantity ``q`` is a
panel: the training curve (``loss`` for ``q="loss"``, else ``train_<q>``) as a line and its validation
(``val_<q>``) as markers of the same colour, so that a single validation point is visible. The legend
names each run by its folder (with as many parent folders as it takes to tell two runs apart).

Runs are grouped by what they measured (:func:`objective`), a column of panels per group: a decoder's
``lm_loss`` is the next-token loss, an encoder's the masked-LM loss, and the two never share a panel. A
panel that would repeat another (a decoder's total loss is its LM loss) is left out. ``perplexity`` is
``exp`` of the LM loss for the training curve and the logged ``val_perplexity`` (the whole split's) for
validation, on a log scale.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

from lightning_megatron.atomic_files import unique_tag

__all__ = ["EVALUATION_FOLDERS", "QUANTITIES", "columns", "objective", "plot_runs", "read_run"]

_CLASSIFIER_SCORES = ("accuracy", "f1", "matthews_corrcoef", "pearson", "spearman")

QUANTITIES = ("loss", "lm_loss", "binary_loss", "mlm_accuracy", "perplexity", *_CLASSIFIER_SCORES)
"""The panels drawn when a run has them: total loss, LM loss, SOP/NSP loss, masked-LM accuracy, perplexity; a
classifier's accuracy and its split's scores (F1, Matthews, a regression's Pearson and Spearman correlations)."""

EVALUATION_FOLDERS = ("validate", "test", "predict")
"""Folders of a run's evaluation logs (``csv/validate/version_0``): not part of its training curves."""

_TITLES = {
    "masked LM": {"loss": "total loss (MLM + SOP/NSP)", "lm_loss": "masked-LM loss", "binary_loss": "SOP/NSP loss",
                  "mlm_accuracy": "masked-LM accuracy", "perplexity": "masked-LM perplexity"},
    "next-token": {"loss": "next-token loss", "lm_loss": "next-token loss", "perplexity": "perplexity"},
    "classifier": {"f1": "F1", "matthews_corrcoef": "Matthews correlation", "pearson": "Pearson correlation",
                   "spearman": "Spearman correlation"},
}
_GROUP_TITLES = {"masked LM": "masked LM (encoder)", "next-token": "next-token LM (decoder)",
                 "classifier": "classifier (fine-tuning)", "other": ""}


def read_run(run_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every metric of a run folder's training: ``name -> [(step, value), ...]`` sorted by step, its
    ``metrics.csv`` files joined in version order (a later version wins where steps repeat); the logs
    under :data:`EVALUATION_FOLDERS` are left out. ``run_dir`` may be one ``metrics.csv`` itself."""
    root = Path(run_dir)
    if not root.exists():
        raise FileNotFoundError(f"run folder {os.fspath(run_dir)!r} does not exist")

    def version(path: Path) -> tuple[int, str]:
        name = path.parent.name
        return (int(name.split("_")[-1]) if name.split("_")[-1].isdigit() else -1, str(path))

    files = [root] if root.is_file() and root.suffix == ".csv" else sorted(
        (p for p in root.rglob("metrics.csv") if not set(p.relative_to(root).parts[:-1]) & set(EVALUATION_FOLDERS)),
        key=version)
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


def objective(run: dict[str, list[tuple[int, float]]]) -> str:
    """What a run's losses measure, from what it logged: ``"masked LM"`` (an encoder: a masked-LM accuracy
    or a SOP/NSP loss beside its ``lm_loss``), ``"next-token"`` (a decoder: ``lm_loss`` alone), ``"classifier"``
    (``finetune fit``: an accuracy or a split's scores), ``"other"``."""
    names = set(run)
    if any(n.endswith(("mlm_accuracy", "binary_loss")) for n in names):
        return "masked LM"
    if any(n.endswith("lm_loss") for n in names):
        return "next-token"
    if names & {f"{stage}_{score}" for stage in ("train", "val") for score in _CLASSIFIER_SCORES}:
        return "classifier"
    return "other"


Curve = tuple[list[tuple[int, float]], list[tuple[int, float]]]


def _curves(run: dict[str, list[tuple[int, float]]], q: str) -> Curve:
    """(training, validation) points of quantity ``q`` in one run."""
    if q == "perplexity":
        train = run.get("train_lm_loss", [])
        val = run.get("val_perplexity") or [(s, math.exp(v)) for s, v in run.get("val_lm_loss", [])]
        return [(s, math.exp(min(v, 700.0))) for s, v in train], val
    return run.get("loss" if q == "loss" else f"train_{q}", []), run.get(f"val_{q}", [])


def _labels(run_dirs: list[str | os.PathLike[str]]) -> list[str]:
    """The shortest trailing parts of the run paths that tell the runs apart (``bert_tiny``, ``a/run``)."""
    parts = [Path(os.path.abspath(r)).parts for r in run_dirs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [os.fspath(r) for r in run_dirs]


Panel = tuple[str, str, dict[int, Curve]]
"""(quantity, y-axis label, run index -> its curves)."""


def columns(runs: list[dict[str, list[tuple[int, float]]]],
            quantities: tuple[str, ...] = QUANTITIES) -> list[tuple[str, list[Panel]]]:
    """The figure: (group title, panels) per :func:`objective` of the runs, in the order the runs come; a
    group's panels are the quantities some of its runs have, less any whose curves repeat an earlier one's."""
    groups: dict[str, list[int]] = {}
    for i, run in enumerate(runs):
        groups.setdefault(objective(run), []).append(i)
    out = []
    for group, members in groups.items():
        panels: list[Panel] = []
        for q in quantities:
            curves = {i: _curves(runs[i], q) for i in members}
            curves = {i: c for i, c in curves.items() if c[0] or c[1]}
            if curves and all(curves != other for _, _, other in panels):
                panels.append((q, _TITLES.get(group, {}).get(q, q.replace("_", " ")), curves))
        if panels:
            out.append((_GROUP_TITLES[group], panels))
    return out


def plot_runs(run_dirs: list[str | os.PathLike[str]], output: str | os.PathLike[str],
              quantities: tuple[str, ...] = QUANTITIES) -> Path:
    """Write a PNG with a column of panels per group of runs that measured the same thing, one panel per
    quantity present, and one line per run (see the module)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = Path(output)
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix.lower().lstrip(".") not in formats:
        raise ValueError(f"--output {os.fspath(output)!r}: the suffix names the format, and matplotlib writes no "
                         f"{out.suffix or 'file without one'!r}; use e.g. curves.png, curves.pdf or curves.svg")
    runs = [read_run(r) for r in run_dirs]
    silent = [os.fspath(r) for r, run in zip(run_dirs, runs) if not run]
    if silent:
        raise ValueError(f"run {silent[0]!r} logged no values (its metrics.csv files hold no row with a step): "
                         f"leave it out, or plot it once it has logged"
                         + (f"; also {silent[1:]}" if silent[1:] else ""))
    labels = _labels(run_dirs)
    figure = columns(runs, quantities)
    if not figure:
        found = sorted({n for run in runs for n in run})
        raise ValueError(f"none of the quantities {list(quantities)} (train_<q>/val_<q>, or loss/val_loss) is in the "
                         f"runs {[os.fspath(r) for r in run_dirs]}; their metrics are {found}")
    rows = max(len(panels) for _, panels in figure)
    fig, axes = plt.subplots(rows, len(figure), figsize=(8 if len(figure) == 1 else 5.5 * len(figure),
                                                         2.6 * rows + 0.8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for c, (title, panels) in enumerate(figure):
        for r in range(rows):
            ax = axes[r, c]
            if r >= len(panels):
                ax.set_visible(False)
                continue
            q, ylabel, curves = panels[r]
            for i, (train, val) in curves.items():
                color = colors[i % len(colors)]
                if train:
                    steps, values = zip(*train)
                    ax.plot(steps, values, color=color, linewidth=1.2, marker="." if len(steps) < 3 else None)
                if val:
                    steps, values = zip(*val)
                    ax.plot(steps, values, color=color, linestyle="none", marker="o", markersize=5,
                            markeredgecolor="black", markeredgewidth=0.6, zorder=3)
            if q == "perplexity":
                ax.set_yscale("log")
            ax.set_ylabel(ylabel)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: a short run ticked 0.25, 0.5
            ax.grid(alpha=0.3)
            if r == 0 and title:
                ax.set_title(title, fontsize=10)
            if r == len(panels) - 1:
                ax.set_xlabel("step")
    # One legend for the figure: a colour per run, then what a line and a marker are.
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colors[i % len(colors)], linewidth=2) for i in range(len(runs))]
    handles += [Line2D([], [], color="grey", linewidth=1.2),
                Line2D([], [], color="grey", linestyle="none", marker="o", markeredgecolor="black")]
    fig.legend(handles, [*labels, "training", "validation"], loc="upper center", ncol=min(len(handles), 4),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight() * (1 + (len(handles) - 1) // 4)))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{unique_tag()}{out.suffix}")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, out)  # atomic: a reader never sees half a PNG
    return out
