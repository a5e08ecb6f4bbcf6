"""Process groups for tensor, pipeline and data parallelism, in Megatron's rank order.

Global rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank: tensor-parallel ranks vary fastest
(so a TP group stays inside one node), then data-parallel, then pipeline-parallel.

Nothing here is a hidden global: :func:`initialize_model_parallel` returns a :class:`ParallelState`
that the caller passes to whatever needs a group. Layers take their group as an argument: a
:class:`ParallelGroup`, the torch process group together with the communicator that runs its
collectives (``torch.distributed`` unless the state installed another, e.g. the CPU tuning's shared
memory). Torch's own functions take ``group.process_group`` (:func:`process_group`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from lightning_megatron.communicator import Communicator, TorchCommunicator

__all__ = [
    "ParallelGroup",
    "Group",
    "process_group",
    "group_communicator",
    "ParallelLayout",
    "model_parallel_size_problems",
    "validate_model_parallel_sizes",
    "ParallelState",
    "initialize_model_parallel",
    "group_size",
    "group_rank",
]


_GROUP_NAMES = ("tp", "dp", "pp", "mp", "embedding")


class ParallelGroup:
    """One process group of this rank and the communicator that runs its collectives.

    What layers, mappings and the gradient code are given as their group. ``size`` and ``rank`` are
    read once from torch (or given, for a group torch does not know); ``communicator`` is
    :class:`~lightning_megatron.communicator.TorchCommunicator` unless the owning
    :class:`ParallelState` installed another (:meth:`ParallelState.set_communicator`).
    """

    __slots__ = ("process_group", "size", "rank", "communicator")

    def __init__(self, process_group: dist.ProcessGroup, *, size: int | None = None, rank: int | None = None,
                 communicator: Communicator | None = None) -> None:
        self.process_group = process_group
        """The torch group (what ``torch.distributed`` functions take)."""
        self.size: int = dist.get_world_size(process_group) if size is None else size
        self.rank: int = dist.get_rank(process_group) if rank is None else rank
        self.communicator: Communicator = TorchCommunicator(process_group) if communicator is None else communicator

    def __repr__(self) -> str:
        return f"ParallelGroup(size={self.size}, rank={self.rank}, communicator={type(self.communicator).__name__})"


Group = ParallelGroup | dist.ProcessGroup | None
"""What a layer or collective takes as its group: a :class:`ParallelGroup` (its communicator), a plain
torch group (``torch.distributed``), or ``None`` (no parallelism: one rank)."""


def group_size(group: Group) -> int:
    """World size of ``group``; ``None`` means "no parallelism" (size 1)."""
    if group is None:
        return 1
    if isinstance(group, ParallelGroup):
        return group.size
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank in ``group``; ``None`` means "no parallelism" (rank 0)."""
    if group is None:
        return 0
    if isinstance(group, ParallelGroup):
        return group.rank
    return dist.get_rank(group)


def process_group(group: Group) -> dist.ProcessGroup | None:
    """The torch group of ``group``, for ``torch.distributed``'s own functions (broadcast, send, ...)."""
    return group.process_group if isinstance(group, ParallelGroup) else group


def group_communicator(group: Group) -> Communicator:
    """The communicator that runs ``group``'s collectives: a :class:`ParallelGroup`'s own, else torch's."""
    if isinstance(group, ParallelGroup):
        return group.communicator
    return TorchCommunicator(group)


def model_parallel_size_problems(tp: Any, pp: Any, vp: Any, *, sequence_parallel: bool = False) -> list[str]:
    """The rules on the sizes alone (no world size), one message per broken rule: positive integers,
    a virtual pipeline size only with pipelining (``vp`` set with ``pp=1`` would be ignored), sequence
    parallelism only with tensor parallelism. The strategy, the layout and the pre-launch config
    check all read these rules here."""
    problems = []
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{name}={value!r} must be a positive integer")
    if problems:
        return problems
    if vp is not None:
        if not isinstance(vp, int) or isinstance(vp, bool) or vp < 1:
            problems.append(f"virtual_pipeline_model_parallel_size={vp!r} must be a positive integer or None")
        elif pp < 2:
            problems.append(f"virtual_pipeline_model_parallel_size={vp} needs pipeline_model_parallel_size >= 2 "
                            f"(got {pp}); leave it None (null) without pipelining")
    if sequence_parallel and tp == 1:
        problems.append("sequence_parallel=True has no effect with tensor_model_parallel_size=1; "
                        "set tensor_model_parallel_size > 1 or turn it off")
    return problems


def validate_model_parallel_sizes(tp: int, pp: int, vp: int | None, *, sequence_parallel: bool = False) -> None:
    """:func:`model_parallel_size_problems` as one ``ValueError``."""
    problems = model_parallel_size_problems(tp, pp, vp, sequence_parallel=sequence_parallel)
    if problems:
        raise ValueError("; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """The sizes of a layout and their validation; no process groups (pure arithmetic)."""

    world_size: int
    """Total number of processes."""
    tensor_model_parallel_size: int = 1
    """Ranks a linear layer is split across (TP)."""
    pipeline_model_parallel_size: int = 1
    """Number of pipeline stages (PP)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank for the interleaved schedule (VP); None for one chunk."""

    def __post_init__(self) -> None:
        tp, pp, w = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.world_size
        validate_model_parallel_sizes(tp, pp, self.virtual_pipeline_model_parallel_size)
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise ValueError(f"world_size={w!r} must be a positive integer")
        if w % (tp * pp) != 0:
            raise ValueError(
                f"world_size={w} is not divisible by tensor_model_parallel_size={tp} * "
                f"pipeline_model_parallel_size={pp} (= {tp * pp}); choose sizes whose product divides "
                f"the number of processes"
            )

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)`` of a global rank."""
        tp, dp = self.tensor_model_parallel_size, self.data_parallel_size
        return rank % tp, (rank // tp) % dp, rank // (tp * dp)

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        tp, dp = self.tensor_model_parallel_size, self.data_parallel_size
        return pp_rank * dp * tp + dp_rank * tp + tp_rank

    def tp_groups(self) -> list[list[int]]:
        tp, dp, pp = self.tensor_model_parallel_size, self.data_parallel_size, self.pipeline_model_parallel_size
        return [[self.rank_of(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)]

    def dp_groups(self) -> list[list[int]]:
        tp, dp, pp = self.tensor_model_parallel_size, self.data_parallel_size, self.pipeline_model_parallel_size
        return [[self.rank_of(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)]

    def pp_groups(self) -> list[list[int]]:
        tp, dp, pp = self.tensor_model_parallel_size, self.data_parallel_size, self.pipeline_model_parallel_size
        return [[self.rank_of(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)]

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups: every TP and PP rank of one data-parallel replica."""
        tp, dp, pp = self.tensor_model_parallel_size, self.data_parallel_size, self.pipeline_model_parallel_size
        return [[self.rank_of(t, d, p) for p in range(pp) for t in range(tp)] for d in range(dp)]

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline (one rank when PP=1)."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]


@dataclass(kw_only=True)
class ParallelState:
    """This rank's place in a layout and the groups it belongs to.

    Groups are ``None`` when the job is a single process without ``torch.distributed``.
    """

    layout: ParallelLayout
    rank: int = 0
    tp_group: ParallelGroup | None = None
    dp_group: ParallelGroup | None = None
    pp_group: ParallelGroup | None = None
    mp_group: ParallelGroup | None = None
    embedding_group: ParallelGroup | None = None
    pp_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks of this rank's pipeline, stage 0 first (for point-to-point sends)."""
    embedding_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks of this rank's embedding group (first and last stage)."""
    _installed: set[str] = field(default_factory=set, init=False, repr=False)

    @property
    def communicators(self) -> dict[str, Communicator]:
        """Communicators installed for this state's groups, by group name ("tp", "dp", "mp", ...);
        a group without one runs its collectives through ``torch.distributed``."""
        return {name: self.group(name).communicator for name in sorted(self._installed)}

    def group(self, name: str) -> ParallelGroup | None:
        """The group called ``name``: "tp", "dp", "pp", "mp" or "embedding"."""
        if name not in _GROUP_NAMES:
            raise ValueError(f"unknown group name {name!r}; expected one of {_GROUP_NAMES}")
        return getattr(self, f"{name}_group")

    def set_communicator(self, name: str, comm: Communicator | None) -> None:
        """Run the collectives of group ``name`` through ``comm`` (``None``: back to torch).

        Every collective of :mod:`lightning_megatron.tensor_parallel.mappings` on that group (as
        passed to layers, gradient reduction and metrics) uses it until
        :meth:`close_communicators`. A replaced communicator is closed.
        """
        group = self.group(name)
        if group is None:
            raise ValueError(f"ParallelState has no {name!r} group (single process); nothing to install")
        old = group.communicator
        if name in self._installed and old is not comm:
            old.close()
        self._installed.discard(name)
        group.communicator = TorchCommunicator(group.process_group) if comm is None else comm
        if comm is not None:
            self._installed.add(name)

    def close_communicators(self) -> None:
        """Close every installed communicator; the groups go back to ``torch.distributed``."""
        for name in sorted(self._installed):
            self.set_communicator(name, None)

    @property
    def tp_size(self) -> int:
        return self.layout.tensor_model_parallel_size

    @property
    def pp_size(self) -> int:
        return self.layout.pipeline_model_parallel_size

    @property
    def dp_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def vp_size(self) -> int | None:
        return self.layout.virtual_pipeline_model_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[1]

    @property
    def pp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[2]

    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around)."""
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @classmethod
    def single_process(cls) -> ParallelState:
        """The trivial layout: one process, no groups."""
        return cls(layout=ParallelLayout(world_size=1))


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    *,
    timeout: datetime.timedelta | None = None,
) -> ParallelState:
    """Build the TP, DP, PP, model-parallel and embedding groups on the default process group.

    Every rank must call this with the same arguments (``new_group`` is collective). Returns this
    rank's :class:`ParallelState`. Raises ``ValueError`` before creating any group when the world
    size is not divisible by ``tp * pp``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel needs an initialized default process group; call "
            "torch.distributed.init_process_group first (the MegatronStrategy does this for you)"
        )
    layout = ParallelLayout(
        world_size=dist.get_world_size(),
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
    )
    rank = dist.get_rank()
    kwargs = {} if timeout is None else {"timeout": timeout}

    def mine(all_groups: list[list[int]]) -> tuple[ParallelGroup | None, list[int]]:
        chosen, chosen_ranks = None, [rank]
        for ranks in all_groups:  # every rank creates every group, in the same order
            group = dist.new_group(ranks, **kwargs)
            if rank in ranks:
                chosen, chosen_ranks = group, ranks
        if chosen is None:
            return None, chosen_ranks
        return ParallelGroup(chosen), chosen_ranks

    tp_group, _ = mine(layout.tp_groups())
    dp_group, _ = mine(layout.dp_groups())
    pp_group, pp_ranks = mine(layout.pp_groups())
    mp_group, _ = mine(layout.mp_groups())
    embedding_group, embedding_ranks = mine(layout.embedding_groups())
    return ParallelState(
        layout=layout,
        rank=rank,
        tp_group=tp_group,
        dp_group=dp_group,
        pp_group=pp_group,
        mp_group=mp_group,
        embedding_group=embedding_group,
        pp_ranks=list(pp_ranks),
        embedding_ranks=list(embedding_ranks),
    )
