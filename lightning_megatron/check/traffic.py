"""What each rank of a layout sends in a step, predicted and counted: the communication half of the time model
checked in bytes, which no device's speed moves.

The prediction is :func:`~lightning_megatron.check.communication.stage_traffic`: the collectives and sends the time model
times (:func:`~lightning_megatron.check.communication.stage_messages`), each as the bytes a rank puts on the wire.
:class:`TrafficCounter` counts the same on a rank of a check run: every collective of the parallel state's groups
(their communicators, whatever runs them) and the all-to-alls and point-to-point sends the library issues itself
(context parallelism's, the experts' dispatch, the pipeline's), each as the ring algorithm the model assumes
sends it (:func:`~lightning_megatron.check.records.collective_time`: an all-reduce of ``n`` bytes over ``k`` ranks
``2 (k-1)/k n``, an all-gather or reduce-scatter ``(k-1)/k n``), an all-to-all as what leaves the rank, a send
as its bytes.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron.check.communication import stage_traffic
from lightning_megatron.check.records import Framework, collective_time

__all__ = ["DIMENSIONS", "TrafficCounter", "traffic_table"]

DIMENSIONS = ("tp", "cp", "ep", "pp", "dp")
"""The parts of a step's communication, as :class:`~lightning_megatron.check.timing.StepTime` splits it."""

_GROUP_DIMENSION = {"tp": "tp", "mp": "tp", "cp": "cp", "tp_cp": "cp", "ep": "ep", "expert_tp": "ep",
                    "expert_mp": "ep", "pp": "pp", "embedding": "pp", "dp": "dp", "dp_cp": "dp", "expert_dp": "dp"}
"""The part a parallel state's group's collectives count to (the gradient norm's model-parallel sum: TP's; the MoE
router's token group, TP x CP, CP's, TP's without CP)."""

_CALLER_DIMENSION = {"lightning_megatron.transformer.context_parallel": "cp",
                     "lightning_megatron.transformer.ring_attention": "cp",
                     "lightning_megatron.transformer.moe.dispatcher": "ep", "lightning_megatron.pipeline.p2p": "pp"}
"""The modules that call ``torch.distributed``'s all-to-all and batched sends themselves, and their part."""


class _Counting:
    """A group's communicator that counts what its collectives send, then runs them."""

    def __init__(self, inner: Any, dimension: str, size: int, counter: TrafficCounter) -> None:
        self.inner, self.dimension, self.size, self.counter = inner, dimension, size, counter

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.counter.add(self.dimension, collective_time("all_reduce", tensor.nbytes, self.size, 1.0, 0.0))
        return self.inner.all_reduce(tensor, *args, **kwargs)

    def all_gather_into_tensor(self, out: torch.Tensor, tensor: torch.Tensor, **kwargs: Any) -> Any:
        self.counter.add(self.dimension, collective_time("all_gather", out.nbytes, self.size, 1.0, 0.0))
        return self.inner.all_gather_into_tensor(out, tensor, **kwargs)

    def reduce_scatter_tensor(self, out: torch.Tensor, tensor: torch.Tensor, **kwargs: Any) -> Any:
        self.counter.add(self.dimension, collective_time("reduce_scatter", tensor.nbytes, self.size, 1.0, 0.0))
        return self.inner.reduce_scatter_tensor(out, tensor, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TrafficCounter:
    """Counts the bytes this rank sends while :attr:`counting`, by part, from :meth:`install` to :meth:`remove`."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = dict.fromkeys((*DIMENSIONS, "other"), 0.0)
        self.counting = False
        self._groups: list[tuple[Any, Any]] = []
        self._patched: tuple[Any, ...] = ()

    def add(self, dimension: str, nbytes: float) -> None:
        if self.counting:
            self.sent[dimension] += nbytes

    def install(self, ps: Any) -> None:
        """Wrap the communicator of every group of ``ps`` and torch's all-to-all and batched sends."""
        for name, group in ps.groups.items():
            if group.size > 1 and not isinstance(group.communicator, _Counting):
                part = "tp" if name == "tp_cp" and ps.cp_size == 1 else _GROUP_DIMENSION.get(name, "other")
                self._groups.append((group, group.communicator))
                group.communicator = _Counting(group.communicator, part, group.size, self)
        all_to_all, batched = dist.all_to_all_single, dist.batch_isend_irecv
        self._patched = (all_to_all, batched)

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            k, me = dist.get_world_size(group), dist.get_rank(group)
            rows = input.shape[0] if input.dim() else 1
            splits = list(input_split_sizes) if input_split_sizes else [rows // k] * k
            row = input.nbytes / max(rows, 1)
            self.add(self._caller(), (sum(splits) - splits[me]) * row)
            return all_to_all(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

        def batch_isend_irecv(ops):
            self.add(self._caller(), sum(op.tensor.nbytes for op in ops if op.op.__name__ == "isend"))
            return batched(ops)

        dist.all_to_all_single, dist.batch_isend_irecv = all_to_all_single, batch_isend_irecv

    @staticmethod
    def _caller() -> str:
        module = sys._getframe(2).f_globals.get("__name__", "")
        return _CALLER_DIMENSION.get(module, "other")

    def remove(self) -> None:
        for group, communicator in self._groups:
            group.communicator = communicator
        if self._patched:
            dist.all_to_all_single, dist.batch_isend_irecv = self._patched
        self._groups, self._patched = [], ()


def _mib(x: float) -> str:
    return f"{x / 2**20:.3f}"


def traffic_table(recipe: Any, layouts: list, report: Any, fw: Framework) -> str:
    """Predicted vs counted MiB a rank sends in step 1, by part, a row for each pipeline stage (counted: the most
    of the stage's ranks)."""
    from lightning_megatron.check.memory_cli import model_shape

    m = model_shape(recipe, cpu_run=True, training=True)
    lines = ["MiB a rank sends in a step: predicted / counted (predicted: the collectives and sends the time model "
             "times; counted: step 1, the most of the stage's ranks)",
             f"{'layout':<14} {'stage':>5} " + " ".join(f"{d.upper():>17}" for d in DIMENSIONS) + f" {'other':>8}"]
    for layout in layouts:
        run = report.runs[layout.name]
        if layout.world_size == 1 or not any(run.traffic):
            continue
        # a head that runs on the tokens the data picks (BERT's masked ones): the most a microbatch of the step had
        tokens = [r["head_tokens"] for r in run.memory if "head_tokens" in r]
        shape = m.with_head_tokens(max(tokens)) if tokens and hasattr(m, "with_head_tokens") else m
        for stage in range(layout.pp):
            predicted = stage_traffic(shape, layout, stage, fw)
            mine = [r for i, r in enumerate(run.traffic) if layout.coordinates(i)["pp"] == stage]
            counted = {d: max(r.get(d, 0.0) for r in mine) for d in (*DIMENSIONS, "other")}
            lines.append(f"{layout.name:<14} {stage:>5} "
                         + " ".join(f"{_mib(predicted[d]) + '/' + _mib(counted[d]):>17}" for d in DIMENSIONS)
                         + f" {_mib(counted['other']):>8}")
    return "\n".join(lines)
