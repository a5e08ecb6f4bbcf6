"""The model summary at the start of ``fit``: the whole model, not rank 0's shard.

Lightning's ``ModelSummary`` counts ``pl_module.parameters()`` on rank 0: under tensor or pipeline
parallelism that is one shard ("2.2 M" for a 4.4 M model at TP=2), and its FLOPs column needs an
``example_input_array`` (else it prints 0). :class:`MegatronModelSummary` keeps Lightning's layer table
of this rank's modules and adds the whole model's parameter count (:func:`model_parameter_count`,
every tensor-parallel shard, pipeline stage and expert-parallel rank's experts, each duplicated parameter
once); it prints no FLOPs: ``ThroughputCallback`` measures them per step (``tflops_per_device``, ``mfu``).

:func:`run_summary` is what ``lightning-megatron fit`` prints at the end: every logged metric, the
median throughput and MFU, where the metrics and checkpoints are.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary import summarize
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from typing_extensions import override

from lightning_megatron.tensor_parallel.param_facts import has_param_facts, is_counted, param_facts
from lightning_megatron.strategy import MegatronStrategy

__all__ = ["MegatronModelSummary", "model_parameter_count", "run_summary"]

def model_parameter_count(trainer: pl.Trainer, pl_module: pl.LightningModule, *, trainable: bool = False) -> int:
    """Parameters of the whole model: this rank's, each tensor-parallel duplicate and the tied embedding's
    second copy counted once, summed over the model-parallel group, and under expert parallelism the experts'
    over theirs (``expert_mp``: each EP rank holds other experts; the gradient norm's groups). A collective: every
    rank calls it."""
    params = [p for p in pl_module.parameters() if p.requires_grad or not trainable]
    strategy = trainer.strategy
    if not isinstance(strategy, MegatronStrategy) or strategy.parallel_state is None:
        return sum(p.numel() for p in params)
    ps = strategy.parallel_state
    counted = [p for p in params if is_counted(p, ps.coordinates)]
    # without EP the experts are summed with the rest; the decision follows the layout, the same on every rank
    experts = sum(p.numel() for p in counted if ps.ep_size > 1 and has_param_facts(p)
                  and param_facts(p).data_parallel == "expert_dp")
    sums = [(sum(p.numel() for p in counted) - experts, ps.group("mp"))]
    sums += [(experts, ps.group("expert_mp"))] if ps.ep_size > 1 else []
    count = 0
    for part, group in sums:
        if group is not None and group.size > 1:
            total = torch.tensor([float(part)], dtype=torch.float64, device=strategy.root_device)
            dist.all_reduce(total, group=group.process_group)
            part = int(total.item())
        count += part
    return count


class MegatronModelSummary(ModelSummary):
    """Lightning's layer table of this rank's modules, then the whole model's parameter count."""

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = model_parameter_count(trainer, pl_module)  # every rank: a collective
        trainable = model_parameter_count(trainer, pl_module, trainable=True)
        if not trainer.is_global_zero:
            return
        local = summarize(pl_module, max_depth=self._max_depth)
        rows = [("", "Name", "Type", "Params (this rank)")]
        rows += [(str(i), n, t, get_human_readable_count(c))
                 for i, (n, t, c) in enumerate(zip(local.layer_names, local.layer_types, local.param_nums))]
        widths = [max(len(r[j]) for r in rows) for j in range(4)]
        lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        strategy = trainer.strategy
        where = ""
        if isinstance(strategy, MegatronStrategy) and strategy.parallel_state is not None:
            ps = strategy.parallel_state
            experts = f" x EP={ps.ep_size}" if ps.ep_size > 1 else ""
            where = (f" over TP={ps.tp_size} x PP={ps.pp_size}{experts}; global rank 0 holds "
                     f"{get_human_readable_count(local.total_parameters)} ({local.model_size:.1f} MB)")
        lines.append(f"Whole model: {get_human_readable_count(total)} parameters "
                     f"({get_human_readable_count(trainable)} trainable){where}")
        rank_zero_info("\n" + "\n".join(lines))


_THROUGHPUT = ("tokens_per_sec", "tflops_per_device", "mfu")
"""ThroughputCallback's metrics: the summary gives their median over the run (the first step, which
includes warm-up, left out when there are more)."""


def run_summary(trainer: pl.Trainer) -> str:
    """The closing lines of ``lightning-megatron fit``: every metric of the CSV logs (first -> last
    value; the median of the throughput metrics), and where the metrics and the checkpoints are."""
    import csv
    import statistics
    from pathlib import Path

    if trainer.fast_dev_run:
        return ("lightning-megatron: fast_dev_run: every step, validation and test ran once on "
                f"{int(trainer.fast_dev_run)} batch(es); nothing was logged or saved")
    lines = []
    csv_dirs = [lg.log_dir for lg in trainer.loggers if type(lg).__name__ == "CSVLogger"]
    for d in csv_dirs:
        path = Path(d) / "metrics.csv"
        if not path.is_file():
            continue
        with path.open() as fh:
            rows = list(csv.DictReader(fh))
        keys = [k for k in (rows[0].keys() if rows else ()) if k not in ("epoch", "step")]
        order = {"loss": 0, "train": 1, "val": 2, "test": 3}
        keys.sort(key=lambda k: (k in _THROUGHPUT, order.get(k.split("_")[0], 4), k))
        for key in keys:
            values = [(int(r["step"]), float(r[key])) for r in rows if r.get(key) not in (None, "")]
            if not values:
                continue
            if key in _THROUGHPUT:
                middle = statistics.median(v for _, v in (values[1:] or values))
                flag = ("   (above 1: impossible, the peak is too low; see ThroughputCallback's warning)"
                        if key == "mfu" and max(v for _, v in values) > 1.0 else "")
                lines.append(f"  {key:24s} median over steps {values[0][0]}-{values[-1][0]}: {middle:.4g}{flag}")
            elif len(values) == 1:
                lines.append(f"  {key:24s} step {values[0][0]:>5d}: {values[0][1]:10.4f}")
            else:
                (s0, v0), (s1, v1) = values[0], values[-1]
                lines.append(f"  {key:24s} step {s0:>5d}: {v0:10.4f}   ->   step {s1:>5d}: {v1:10.4f}")
        lines.append(f"  metrics: {path}")
    for cb in trainer.checkpoint_callbacks:
        if getattr(cb, "dirpath", None):
            lines.append(f"  checkpoints: {cb.dirpath} (last: {cb.last_model_path or cb.best_model_path})")
    return "\n".join(["lightning-megatron: run summary"] + lines)
