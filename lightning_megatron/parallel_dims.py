"""ParallelDims: the one record of a run's parallel dimensions (torchtitan's ``ParallelDims`` is the model).

Every part of the library that needs the layout reads it here: the strategy takes its sizes and keeps
this record (``strategy.parallel_dims``), ``lightning-megatron check`` parses and prints it as a
short string (``tp2pp2vp2dp2sp-zero1``), ``config_checks`` validates a recipe by constructing it,
a checkpoint records it (:meth:`ParallelDims.as_record`) and :func:`~lightning_megatron.parallel_state.initialize_model_parallel`
derives every process group from it (:meth:`ParallelDims.group_ranks`). Pure arithmetic: no process
groups, no torch.

Dimensions (Megatron's names in brackets, the strategy's arguments)::

    tp   tensor parallel           [tensor_model_parallel_size]      a linear layer split over ranks
    cp   context parallel          [context_parallel_size]           the sequence split over ranks
    dp   data parallel             (the rest of the world)           model replicas
    pp   pipeline stages           [pipeline_model_parallel_size]
    vp   virtual stages per rank   [virtual_pipeline_model_parallel_size]  (interleaved schedule)
    ep   expert parallel           [expert_model_parallel_size]      experts split over ranks
    etp  expert tensor parallel    [expert_tensor_parallel_size]     an expert's linear layers split

Rank order (megatron-core's default ``tp-cp-ep-dp-pp``): ``tp`` varies fastest, then ``cp``, then
``dp``, then ``pp``, so TP groups stay inside one node::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Expert layers see the same ranks of one pipeline stage (``tp * cp * dp`` of them) as
``etp x ep x edp``, ``etp`` fastest: expert-data-parallel size ``edp = tp cp dp / (etp ep)``.

The options that travel with the layout: ``sequence_parallel``, ``zero1`` (the distributed
optimizer: optimizer state sharded over the data-parallel group) and ``schedule`` (the pipeline
schedule by name, or ``"auto"``: :mod:`lightning_megatron.pipeline.schedules`).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

__all__ = ["ParallelDims", "ParallelDimsError", "GROUP_DIMS", "STRATEGY_ARGUMENTS", "parallel_dims_problems"]


GROUP_DIMS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "dp_cp": ("dp", "cp"),
    "tp_cp": ("tp", "cp"),
    "mp": ("tp", "pp"),
    "ep": ("ep",),
    "expert_tp": ("etp",),
    "expert_dp": ("edp",),
    "expert_mp": ("etp", "ep", "pp"),
}
"""The process groups of a layout, by name: the mesh dimensions whose ranks each group spans (the
others fixed). ``dp_cp`` reduces the gradients of parameters replicated over DP and CP, ``mp`` (the
model-parallel group: TP x PP) sums the gradient norm; ``tp_cp`` holds the tokens of one microbatch
(the MoE router's statistics); ``ep`` / ``expert_tp`` / ``expert_dp`` / ``expert_mp`` are taken over the
expert view of the ranks (``etp x ep x edp x pp``): ``expert_dp`` averages the experts' gradients,
``expert_mp`` sums their part of the gradient norm. The embedding group (first and
last pipeline stage) is derived from the pipeline groups."""

STRATEGY_ARGUMENTS: dict[str, str] = {
    "tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
    "vp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size", "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size", "sequence_parallel": "sequence_parallel", "schedule": "pipeline_schedule"}
"""Each field of the record set by a :class:`~lightning_megatron.strategy.MegatronStrategy` argument -> its name
(Megatron's): the one table of them (``dp`` is the rest of the world, ``zero1`` the optimizer callback's)."""
STRATEGY_DEFAULTS: dict[str, Any] = {"tp": 1, "pp": 1, "vp": None, "cp": 1, "ep": 1, "etp": None,
                                     "sequence_parallel": False, "schedule": "auto"}

_DENSE = ("tp", "cp", "dp", "pp")  # rank order, fastest first
_EXPERT = ("etp", "ep", "edp", "pp")

_TOKEN = re.compile(r"(etp|tp|cp|ep|pp|vp|dp)(\d+)|(sp)|(zero1)")
_SIZES = re.compile(r"(?:(?:etp|tp|cp|ep|pp|vp|dp)\d+|sp|zero1)+")


def _implied_dp(tp: int, cp: int, ep: int, etp: int | None) -> int:
    """The smallest data-parallel size whose stage (``tp cp dp`` ranks) holds ``etp x ep`` expert ranks."""
    expert = (tp if etp is None else etp) * ep
    return expert // math.gcd(expert, tp * cp)


class ParallelDimsError(ValueError):
    """A layout that cannot run; ``problems`` lists each broken rule with its values and the fix."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(problems))


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def parallel_dims_problems(*, tp: Any = 1, pp: Any = 1, vp: Any = None, cp: Any = 1, ep: Any = 1, etp: Any = None,
                           dp: Any = None, sequence_parallel: Any = False, zero1: Any = False,
                           schedule: Any = "auto", world_size: int | None = None) -> list[str]:
    """Every broken rule of these sizes, one message each naming the values and the fix ([] when they
    can run). ``world_size``: check the sizes against it too (``dp`` None is derived from it). The one
    place the layout's rules are written: :class:`ParallelDims` raises them, ``config_checks`` lists them."""
    problems = [f"{STRATEGY_ARGUMENTS[k]}={v!r} must be a positive integer" for k, v in
                (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)) if not _positive(v)]
    if etp is not None and not _positive(etp):
        problems.append(f"expert_tensor_parallel_size={etp!r} must be a positive integer or None (= the TP size)")
    if dp is not None and not _positive(dp):
        problems.append(f"data-parallel size dp={dp!r} must be a positive integer or None (= the rest of the world)")
    if world_size is not None and not _positive(world_size):
        problems.append(f"world_size={world_size!r} must be a positive integer")
    for name, value in (("sequence_parallel", sequence_parallel), ("zero1 (use_distributed_optimizer)", zero1)):
        if not isinstance(value, bool):
            problems.append(f"{name}={value!r} must be True or False")
    if not isinstance(schedule, str) or not schedule:
        problems.append(f"pipeline_schedule={schedule!r} must be a schedule name or 'auto'")
    if problems:
        return problems
    if vp is not None:
        if not _positive(vp):
            problems.append(f"virtual_pipeline_model_parallel_size={vp!r} must be a positive integer or None")
        elif pp < 2:
            problems.append(f"virtual_pipeline_model_parallel_size={vp} needs pipeline_model_parallel_size >= 2 "
                            f"(got {pp}); leave it None (null) without pipelining")
    if sequence_parallel and tp == 1:
        problems.append("sequence_parallel=True has no effect with tensor_model_parallel_size=1; "
                        "set tensor_model_parallel_size > 1 or turn it off")
    per_stage = tp * cp
    if world_size is not None:
        if world_size % (per_stage * pp):
            factors = " x ".join(f"{STRATEGY_ARGUMENTS[k]}={v}" for k, v in (("tp", tp), ("cp", cp), ("pp", pp))
                                 if k != "cp" or v > 1)
            problems.append(f"world_size={world_size} is not divisible by {factors} (= {per_stage * pp}); choose sizes "
                            f"whose product divides the number of processes")
            return problems
        derived = world_size // (per_stage * pp)
        if dp is not None and dp != derived:
            problems.append(f"data-parallel size dp={dp} but world_size={world_size} / (tp={tp} x cp={cp} x pp={pp}) "
                            f"= {derived}; give {dp * per_stage * pp} processes or dp={derived}")
            return problems
        dp = derived
    if dp is not None and (ep > 1 or (etp or tp) != tp):
        expert = (etp or tp) * ep
        if (per_stage * dp) % expert:
            problems.append(
                f"expert_tensor_parallel_size={etp or tp} x expert_model_parallel_size={ep} (= {expert}) does not divide "
                f"the {per_stage * dp} ranks of a pipeline stage (tp={tp} x cp={cp} x dp={dp}); choose expert sizes "
                f"whose product divides it")
    return problems


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The sizes of a layout and the options that travel with it (module docstring); validated on
    construction (:class:`ParallelDimsError` lists every broken rule)."""

    tp: int = 1
    """Tensor-parallel size: ranks each linear layer is split across."""
    pp: int = 1
    """Pipeline stages."""
    vp: int | None = None
    """Virtual pipeline stages (model chunks) per pipeline rank, for the interleaved schedule; None: one."""
    cp: int = 1
    """Context-parallel size: ranks the sequence of one sample is split across."""
    ep: int = 1
    """Expert-parallel size: ranks the experts of a mixture-of-experts layer are split across."""
    etp: int | None = None
    """Expert tensor-parallel size: ranks each expert's linear layers are split across; None: ``tp``."""
    dp: int | None = None
    """Data-parallel replicas; None until the world size is known (:meth:`for_world_size`)."""
    sequence_parallel: bool = False
    """Activations outside the tensor-parallel regions split along the sequence (needs ``tp`` > 1)."""
    zero1: bool = False
    """The distributed optimizer (ZeRO stage 1): fp32 main params and optimizer state sharded over DP."""
    schedule: str = "auto"
    """The pipeline schedule by registered name, or "auto" (chosen from ``pp`` and ``vp``)."""

    def __post_init__(self) -> None:
        problems = parallel_dims_problems(**{f.name: getattr(self, f.name) for f in fields(self)})
        if problems:
            raise ParallelDimsError(problems)

    def unsupported(self) -> list[str]:
        """What the record allows but the training engine does not implement yet (one message each): an
        expert tensor-parallel size other than the TP size. (Context and expert parallelism are the
        module's to take: :func:`lightning_megatron.module.context_parallel_problem`, and the model's
        ``num_moe_experts``.)"""
        out = []
        if self.etp is not None and self.etp != self.tp:
            out.append(f"expert_tensor_parallel_size={self.etp}: an expert tensor-parallel size other than the TP size "
                       f"({self.tp}) is not supported yet; leave it None (the experts are split over TP like the "
                       f"dense MLP)")
        return out

    # -- sizes ---------------------------------------------------------------------------------------

    def for_world_size(self, world_size: int) -> ParallelDims:
        """This record with ``dp`` = the rest of ``world_size`` (refused when the sizes do not divide it,
        or when ``dp`` was given and disagrees)."""
        problems = parallel_dims_problems(**{f.name: getattr(self, f.name) for f in fields(self)},
                                          world_size=world_size)
        if problems:
            raise ParallelDimsError(problems)
        return replace(self, dp=world_size // (self.tp * self.cp * self.pp))

    @property
    def resolved(self) -> bool:
        """Whether ``dp`` is known (the world size is ``tp cp dp pp``)."""
        return self.dp is not None

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self._dp * self.pp

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size (``etp``, or ``tp`` when unset)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size: ``tp cp dp / (etp ep)``."""
        return self.tp * self.cp * self._dp // (self.expert_tp * self.ep)

    @property
    def num_chunks(self) -> int:
        """Model chunks per pipeline rank (``vp``, or 1)."""
        return self.vp or 1

    @property
    def _dp(self) -> int:
        if self.dp is None:
            raise ValueError(f"{self.name}: the data-parallel size is not resolved yet; use "
                             f"ParallelDims.for_world_size(world_size) first")
        return self.dp

    def sizes(self) -> dict[str, int]:
        """The size of every mesh dimension by name (``edp``: expert data parallel)."""
        return {"tp": self.tp, "cp": self.cp, "dp": self._dp, "pp": self.pp, "etp": self.expert_tp, "ep": self.ep,
                "edp": self.expert_dp}

    # -- ranks ---------------------------------------------------------------------------------------

    def coordinates(self, rank: int) -> dict[str, int]:
        """The coordinates of global ``rank`` on every dimension (dense and expert view)."""
        sizes = self.sizes()
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks ({self.name})")
        out: dict[str, int] = {}
        for order in (_DENSE, _EXPERT):
            rest = rank
            for dim in order:
                out[dim] = rest % sizes[dim]
                rest //= sizes[dim]
        return out

    def rank_of(self, **coords: int) -> int:
        """The global rank at dense coordinates ``tp=..., cp=..., dp=..., pp=...`` (missing ones: 0)."""
        sizes, rank, scale = self.sizes(), 0, 1
        for dim in _DENSE:
            rank += coords.get(dim, 0) * scale
            scale *= sizes[dim]
        return rank

    def group_ranks(self, name: str) -> list[list[int]]:
        """Every group ``name`` (:data:`GROUP_DIMS`, or ``"embedding"``) as lists of global ranks, each in
        rank order; every rank is in exactly one group of each name."""
        if name == "embedding":  # first and last stage of each pipeline
            return [sorted({g[0], g[-1]}) for g in self.group_ranks("pp")]
        if name not in GROUP_DIMS:
            raise ValueError(f"unknown group {name!r}; expected one of {sorted(GROUP_DIMS)} or 'embedding'")
        spans = GROUP_DIMS[name]
        order = _EXPERT if any(d in ("etp", "ep", "edp") for d in spans) else _DENSE
        sizes = self.sizes()
        fixed = [d for d in order if d not in spans]
        varying = [d for d in order if d in spans]
        groups = []
        for outer in itertools.product(*(range(sizes[d]) for d in fixed)):
            ranks = []
            for inner in itertools.product(*(range(sizes[d]) for d in varying)):
                coords = dict(zip(fixed, outer)) | dict(zip(varying, inner))
                rank, scale = 0, 1
                for dim in order:
                    rank += coords[dim] * scale
                    scale *= sizes[dim]
                ranks.append(rank)
            groups.append(sorted(ranks))
        return sorted(groups)

    # -- names and records ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The short form ``check --layouts`` reads and prints: sizes above 1 (``tp2pp2vp2dp2``), then
        ``sp`` and ``zero1``; a named schedule after a dash (``pp2-gpipe``). One process: ``tp1``."""
        implied = {"dp": _implied_dp(self.tp, self.cp, self.ep, self.etp)}
        parts = [f"{d}{getattr(self, d)}" for d in ("tp", "cp", "ep", "etp", "pp", "vp", "dp")
                 if getattr(self, d) is not None and getattr(self, d) > implied.get(d, 1)]
        parts += (["sp"] if self.sequence_parallel else []) + (["zero1"] if self.zero1 else [])
        name = "".join(parts) or "tp1"
        return name if self.schedule == "auto" else f"{name}-{self.schedule}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str | ParallelDims) -> ParallelDims:
        """``"tp2pp2"`` -> ``ParallelDims(tp=2, pp=2, dp=1)`` (an unnamed size is 1: the string gives the whole
        layout, ``dp`` included; an unnamed ``dp`` is the smallest that holds the experts: ``ep2`` is
        ``ep2dp2``, experts taken from the data-parallel ranks as in megatron-core); separators ``-`` / ``_`` are allowed; a trailing word that is no size is the
        pipeline schedule's name (``pp2-gpipe``). Raises ValueError naming the part it cannot read."""
        if isinstance(text, ParallelDims):
            return text
        s = text.strip().lower()
        schedule = "auto"
        head, sep, tail = s.rpartition("-")
        if sep and re.fullmatch(r"[a-z0-9][a-z0-9_]*", tail) and not _SIZES.fullmatch(tail.replace("_", "")):
            s, schedule = head, tail  # pp2-gpipe: a schedule's name, not sizes
        s = s.replace("-", "").replace("_", "")
        sizes: dict[str, Any] = {}
        pos = 0
        while pos < len(s):
            m = _TOKEN.match(s, pos)
            if m is None:
                raise ValueError(f"layout {text!r}: cannot read {s[pos:]!r}; write e.g. tp2, pp2vp2, tp2pp2dp2, "
                                 f"tp2sp, dp2zero1")
            key = m.group(1) or m.group(3) or m.group(4)
            if key in sizes:
                raise ValueError(f"layout {text!r}: {key!r} given twice")
            sizes[key] = int(m.group(2)) if m.group(2) else True
            pos = m.end()
        if not sizes:
            raise ValueError(f"layout {text!r} is empty")
        tp, cp, ep, etp = sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("ep", 1), sizes.get("etp")
        implied = 1 if 0 in (tp, cp, ep, etp) else _implied_dp(tp, cp, ep, etp)  # a size 0: the record names it
        return cls(tp=tp, cp=cp, ep=ep, etp=etp, pp=sizes.get("pp", 1), vp=sizes.get("vp"),
                   dp=sizes.get("dp", implied),
                   sequence_parallel=bool(sizes.get("sp", False)), zero1=bool(sizes.get("zero1", False)),
                   schedule=schedule)

    @classmethod
    def parse_list(cls, text: str | list) -> list[ParallelDims]:
        """A comma-separated list (or a list) of layouts."""
        items = [t for t in text.split(",") if t.strip()] if isinstance(text, str) else list(text)
        return [cls.parse(t) for t in items]

    def strategy_kwargs(self) -> dict[str, Any]:
        """The :class:`~lightning_megatron.strategy.MegatronStrategy` arguments of this layout (its sizes,
        Megatron's names; ``zero1`` is the optimizer callback's ``use_distributed_optimizer``)."""
        return {argument: getattr(self, field) for field, argument in STRATEGY_ARGUMENTS.items()}

    @staticmethod
    def fields_of_strategy_kwargs(arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The record's fields from MegatronStrategy arguments (a recipe's ``init_args``; a missing one takes
        the strategy's default): the inverse of :meth:`strategy_kwargs`, without ``dp`` and ``zero1``."""
        return {field: arguments.get(argument, STRATEGY_DEFAULTS[field])
                for field, argument in STRATEGY_ARGUMENTS.items()}

    def as_record(self) -> dict[str, Any]:
        """Plain values for a checkpoint (with the world size once resolved)."""
        record = asdict(self)
        if self.resolved:
            record["world_size"] = self.world_size
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ParallelDims:
        """The record :meth:`as_record` wrote, or an older checkpoint's ``{world_size, tp, pp, vp, dp}``."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in known})
