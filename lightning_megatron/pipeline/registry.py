"""Named pipeline schedules: a registry of ``no_pipelining``, ``1f1b``, ``interleaved`` and yours.

A schedule is an object that runs one step's microbatches on this rank's chunks and answers, as pure
arithmetic, what the set-up, the configuration check and the cost estimates ask of it::

    problem(pp_size, vp_size, num_microbatches=None)  -> str | None   does it fit the layout (and m)?
    validate(pp_size, vp_size, num_microbatches)                       the same, raised as ValueError
    in_flight(pp_size, vp_size, stage, num_microbatches) -> int        forwards held at the peak (memory)
    bubble(pp_size, vp_size, num_microbatches)           -> float      idle fraction of a stage (time)
    run(*, forward_step_func, microbatches, model, ...)  -> list[dict] the step (pipeline/schedules.py)
    configure_weight_grads(weight_grads, chunks)                       optional: layers whose dW it runs apart

``MegatronStrategy(pipeline_schedule=...)`` takes a registered name or ``"auto"`` (the rule of the
layout: PP=1 ``no_pipelining``, PP>1 ``1f1b``, PP>1 and VP>1 ``interleaved``). A new schedule is one
class with :func:`register_schedule` in a file of its own, imported before the strategy is built
(docs/pipeline.md, "Adding a schedule").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from lightning_megatron.pipeline.schedules import (
    ForwardStepFunc,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    num_microbatches_problem,
)

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from lightning_megatron.parallel_state import ParallelState
    from lightning_megatron.tensor_parallel.backward import WeightGradPolicy

__all__ = [
    "AUTO",
    "PipelineSchedule",
    "auto_schedule_name",
    "get_forward_backward_func",
    "get_schedule",
    "pipeline_schedule_problem",
    "register_schedule",
    "schedule_names",
]

AUTO = "auto"
"""The schedule of the layout (:func:`auto_schedule_name`)."""


class PipelineSchedule(ABC):
    """A named microbatch schedule (register a subclass with :func:`register_schedule`).

    ``pp_size`` is the number of pipeline stages, ``vp_size`` the model chunks per stage (None or 1:
    one), ``stage`` a pipeline rank and ``num_microbatches`` (``m``) the microbatches of one step.
    """

    name: ClassVar[str] = ""
    """The registered name (set by :func:`register_schedule`)."""

    @abstractmethod
    def run(self, *, forward_step_func: ForwardStepFunc, microbatches: list, model: list[nn.Module],
            num_microbatches: int, parallel_state: ParallelState, tensor_shape: tuple[int, ...], dtype: torch.dtype,
            forward_only: bool = False, grad_scale_func: Callable[[Tensor], Tensor] | None = None,
            trace: list | None = None, overlap_p2p_comm: bool = False,
            weight_grads: WeightGradPolicy | None = None) -> list[dict[str, Any]]:
        """Forward (and, unless ``forward_only``, backward) every microbatch through this rank's chunks;
        return the logged values of each microbatch (last stage; ``[]`` elsewhere). The arguments are
        those of :func:`~lightning_megatron.pipeline.schedules.forward_backward_no_pipelining`; a
        backward pass goes through ``weight_grads.backward_input`` when ``weight_grads`` is given
        (:class:`~lightning_megatron.pipeline.schedules.MicrobatchRunner` does both)."""

    def problem(self, pp_size: int, vp_size: int | None, num_microbatches: int | None = None) -> str | None:
        """Why this schedule cannot run the layout (and ``num_microbatches``, when known), or None.
        The default: any layout, at least one microbatch."""
        if num_microbatches is None:
            return None
        return num_microbatches_problem(num_microbatches, 1, None)

    def validate(self, pp_size: int, vp_size: int | None, num_microbatches: int) -> None:
        """:meth:`problem` as a ``ValueError`` (at set-up, before any communication)."""
        problem = self.problem(pp_size, vp_size, num_microbatches)
        if problem:
            raise ValueError(problem)

    @abstractmethod
    def in_flight(self, pp_size: int, vp_size: int | None, stage: int, num_microbatches: int) -> int:
        """Chunk forwards (microbatch, model chunk) whose activations ``stage`` holds together at its
        peak; with one chunk per stage, microbatches. Each holds ``1 / vp_size`` of the stage's layers."""

    @abstractmethod
    def bubble(self, pp_size: int, vp_size: int | None, num_microbatches: int) -> float:
        """The fraction of the step a stage idles when forward plus backward of one microbatch take the
        same time on every stage (transfers free): ``1 - busy / step``."""

    def configure_weight_grads(self, weight_grads: WeightGradPolicy, chunks: Sequence[nn.Module]) -> None:
        """Once at set-up (the step's policy, before the CPU tuning's pieces): defer the weight gradients
        this schedule computes apart with ``weight_grads.defer(layers)``, which its ``run`` then hands to
        the buffer with ``weight_grads.backward_weight(microbatch)`` (a zero-bubble schedule: every
        linear layer). The default defers none."""


_REGISTRY: dict[str, PipelineSchedule] = {}

S = TypeVar("S", bound=type[PipelineSchedule])


def register_schedule(name: str) -> Callable[[S], S]:
    """Class decorator: register an instance of the class as the schedule ``name`` (the class is
    returned unchanged). A name is registered once; importing the same class again is allowed."""
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"register_schedule: name={name!r} must be a non-empty string other than {AUTO!r}")

    def register(cls: S) -> S:
        if not (isinstance(cls, type) and issubclass(cls, PipelineSchedule)):
            raise TypeError(f"register_schedule({name!r}) decorates a PipelineSchedule subclass, got {cls!r}")
        old = _REGISTRY.get(name)
        if old is not None and (type(old).__module__, type(old).__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"register_schedule: {name!r} is already {type(old).__module__}.{type(old).__qualname__}; "
                             f"choose another name")
        cls.name = name
        _REGISTRY[name] = cls()
        return cls

    return register


def schedule_names() -> list[str]:
    """The registered names, in the order they were registered."""
    return list(_REGISTRY)


def auto_schedule_name(pp_size: int, vp_size: int | None) -> str:
    """The schedule of a layout: ``no_pipelining`` (PP=1), ``interleaved`` (PP>1, VP>1), else ``1f1b``
    (``vp_size=1`` is one chunk per stage)."""
    if pp_size > 1:
        return "interleaved" if vp_size is not None and vp_size > 1 else "1f1b"
    return "no_pipelining"


def pipeline_schedule_problem(name: Any, pp_size: int, vp_size: int | None,
                              num_microbatches: int | None = None) -> str | None:
    """Why ``pipeline_schedule=name`` cannot run the layout (and ``num_microbatches`` when known), or
    None: the strategy's constructor and set-up and ``config_checks`` before launch ask this."""
    if name == AUTO:
        name = auto_schedule_name(pp_size, vp_size)
    schedule = _REGISTRY.get(name) if isinstance(name, str) else None
    if schedule is None:
        return (f"pipeline_schedule={name!r} is not a registered schedule; use 'auto' or one of "
                f"{schedule_names()} (a new one is registered with "
                f"lightning_megatron.pipeline.register_schedule, imported before the strategy is built)")
    problem = schedule.problem(pp_size, vp_size, num_microbatches)
    return None if problem is None else f"pipeline_schedule={name!r}: {problem}"


def get_schedule(name: str, pp_size: int, vp_size: int | None) -> PipelineSchedule:
    """The registered schedule ``name`` (``"auto"``: the layout's), checked against the layout."""
    problem = pipeline_schedule_problem(name, pp_size, vp_size)
    if problem:
        raise ValueError(problem)
    return _REGISTRY[auto_schedule_name(pp_size, vp_size) if name == AUTO else name]


def get_forward_backward_func(pp_size: int, vp_size: int | None) -> Callable[..., list[dict[str, Any]]]:
    """Megatron's name: the ``run`` of the layout's schedule (``get_schedule("auto", pp, vp).run``)."""
    return get_schedule(AUTO, pp_size, vp_size).run


def _one_chunk_problem(name: str, vp_size: int | None) -> str | None:
    if vp_size is not None and vp_size > 1:
        return (f"{name} runs one model chunk per stage, got virtual_pipeline_model_parallel_size={vp_size}; "
                f"use 'interleaved' (or 'auto')")
    return None


# -- the built-in schedules: Megatron's (pipeline/schedules.py runs them) ---------------------------


@register_schedule("no_pipelining")
class NoPipelining(PipelineSchedule):
    """PP=1: each microbatch's forward and backward in turn (gradient accumulation)."""

    run = staticmethod(forward_backward_no_pipelining)

    def problem(self, pp_size: int, vp_size: int | None, num_microbatches: int | None = None) -> str | None:
        if pp_size != 1:
            return (f"no_pipelining runs one stage, got pipeline_model_parallel_size={pp_size}; use '1f1b' "
                    f"(or 'auto')")
        return _one_chunk_problem("no_pipelining", vp_size) or super().problem(pp_size, vp_size, num_microbatches)

    def in_flight(self, pp_size: int, vp_size: int | None, stage: int, num_microbatches: int) -> int:
        return 1

    def bubble(self, pp_size: int, vp_size: int | None, num_microbatches: int) -> float:
        return 0.0


@register_schedule("1f1b")
class OneForwardOneBackward(PipelineSchedule):
    """1F1B: stage ``r`` runs ``min(p - r - 1, m)`` warm-up forwards, then one forward one backward."""

    run = staticmethod(forward_backward_pipelining_without_interleaving)

    def problem(self, pp_size: int, vp_size: int | None, num_microbatches: int | None = None) -> str | None:
        if pp_size < 2:
            return (f"1f1b needs pipeline_model_parallel_size >= 2, got {pp_size}; use 'no_pipelining' "
                    f"(or 'auto')")
        return _one_chunk_problem("1f1b", vp_size) or super().problem(pp_size, vp_size, num_microbatches)

    def in_flight(self, pp_size: int, vp_size: int | None, stage: int, num_microbatches: int) -> int:
        return min(num_microbatches, pp_size - stage)  # the warm-up forwards + 1

    def bubble(self, pp_size: int, vp_size: int | None, num_microbatches: int) -> float:
        return (pp_size - 1) / (num_microbatches + pp_size - 1)


@register_schedule("interleaved")
class Interleaved(PipelineSchedule):
    """Interleaved 1F1B over ``v`` chunks per stage (``m % p == 0``): the fill and drain shrink ``v`` times."""

    run = staticmethod(forward_backward_pipelining_with_interleaving)

    def problem(self, pp_size: int, vp_size: int | None, num_microbatches: int | None = None) -> str | None:
        if pp_size < 2 or vp_size is None or vp_size < 2:
            return (f"interleaved needs pipeline_model_parallel_size >= 2 and virtual_pipeline_model_parallel_size "
                    f">= 2, got {pp_size} and {vp_size}; use '1f1b' or 'no_pipelining' (or 'auto')")
        # Megatron's rule: m % p == 0 (the microbatches run in groups of p per chunk)
        return None if num_microbatches is None else num_microbatches_problem(num_microbatches, pp_size, vp_size)

    def in_flight(self, pp_size: int, vp_size: int | None, stage: int, num_microbatches: int) -> int:
        p, v = pp_size, vp_size or 1
        return min(num_microbatches * v, 2 * (p - stage - 1) + (v - 1) * p + 1)  # the warm-up forwards + 1

    def bubble(self, pp_size: int, vp_size: int | None, num_microbatches: int) -> float:
        p, v = pp_size, vp_size or 1
        return (p - 1) / (v * num_microbatches + p - 1)
