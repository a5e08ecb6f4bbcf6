"""The process groups of a layout and this rank's place in it (:class:`ParallelState`).

The layout is one record, :class:`~lightning_megatron.parallel_dims.ParallelDims` (sizes, rank order,
the ranks of every group); :func:`initialize_model_parallel` makes its torch groups. Tensor-parallel
ranks vary fastest (so a TP group stays inside one node), then context-, data- and pipeline-parallel.

Nothing here is a hidden global: :func:`initialize_model_parallel` returns a :class:`ParallelState`
that the caller passes to whatever needs a group. Layers take their group as an argument: a
:class:`ParallelGroup`, the torch process group together with the communicator that runs its
collectives (``torch.distributed`` unless the state installed another, e.g. the CPU tuning's shared
memory). Torch's own functions take ``group.process_group`` (:func:`process_group`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch.distributed as dist

from lightning_megatron.communicator import Communicator, TorchCommunicator
from lightning_megatron.parallel_dims import GROUP_DIMS, ParallelDims

__all__ = [
    "ParallelGroup",
    "Group",
    "process_group",
    "group_communicator",
    "GROUP_NAMES",
    "ParallelState",
    "initialize_model_parallel",
    "group_size",
    "group_rank",
]


GROUP_NAMES: tuple[str, ...] = (*GROUP_DIMS, "embedding")
"""Every group a :class:`ParallelState` holds (:data:`~lightning_megatron.parallel_dims.GROUP_DIMS`, and
the embedding group: first and last pipeline stage)."""


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


@dataclass(kw_only=True)
class ParallelState:
    """This rank's place in a layout (:class:`~lightning_megatron.parallel_dims.ParallelDims`) and the
    groups it belongs to.

    ``tp_group``, ``dp_group``, ``pp_group``, ... are torch ``ProcessGroup`` s, as Megatron's
    ``get_tensor_model_parallel_group()`` returns: what ``torch.distributed`` functions take.
    :meth:`group` gives the same group as a :class:`ParallelGroup`, with the communicator that runs
    its collectives: what the library hands to layers and mappings. Every group is ``None`` when the
    job is a single process without ``torch.distributed``.
    """

    dims: ParallelDims
    """The layout, resolved (``dims.dp`` set)."""
    rank: int = 0
    groups: dict[str, ParallelGroup] = field(default_factory=dict)
    """This rank's group of every name of :data:`GROUP_NAMES` (empty for a single process)."""
    members: dict[str, list[int]] = field(default_factory=dict)
    """The global ranks of each of this rank's groups, in rank order."""
    _installed: set[str] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.dims.resolved:
            raise ValueError(f"ParallelState needs resolved dims (dp set), got {self.dims!r}; use "
                             f"dims.for_world_size(world_size)")
        self._coords = self.dims.coordinates(self.rank)

    # -- groups --------------------------------------------------------------------------------------

    def group(self, name: str) -> ParallelGroup | None:
        """The group called ``name`` (:data:`GROUP_NAMES`) with its communicator; None for one process."""
        if name not in GROUP_NAMES:
            raise ValueError(f"unknown group name {name!r}; expected one of {GROUP_NAMES}")
        return self.groups.get(name)

    def _torch_group(self, name: str) -> dist.ProcessGroup | None:
        group = self.group(name)
        return None if group is None else group.process_group

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """Tensor-parallel group (torch)."""
        return self._torch_group("tp")

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """Context-parallel group (torch)."""
        return self._torch_group("cp")

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """Data-parallel group (torch)."""
        return self._torch_group("dp")

    @property
    def dp_cp_group(self) -> dist.ProcessGroup | None:
        """Data- and context-parallel group (torch): where replicated parameters' gradients are reduced."""
        return self._torch_group("dp_cp")

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """Pipeline group (torch): this rank's pipeline, stage 0 first."""
        return self._torch_group("pp")

    @property
    def mp_group(self) -> dist.ProcessGroup | None:
        """Model-parallel group (torch): every TP and PP rank of one replica (the gradient norm's sum)."""
        return self._torch_group("mp")

    @property
    def embedding_group(self) -> dist.ProcessGroup | None:
        """First and last pipeline stage (torch): the tied word embedding's gradient sum."""
        return self._torch_group("embedding")

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """Expert-parallel group (torch)."""
        return self._torch_group("ep")

    @property
    def expert_tp_group(self) -> dist.ProcessGroup | None:
        """Expert tensor-parallel group (torch)."""
        return self._torch_group("expert_tp")

    @property
    def expert_dp_group(self) -> dist.ProcessGroup | None:
        """Expert data-parallel group (torch): where expert parameters' gradients are reduced."""
        return self._torch_group("expert_dp")

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, stage 0 first (for point-to-point sends)."""
        return self.members.get("pp", [self.rank])

    @property
    def embedding_ranks(self) -> list[int]:
        """Global ranks of this rank's embedding group (first and last stage)."""
        return self.members.get("embedding", [self.rank])

    # -- communicators -------------------------------------------------------------------------------

    @property
    def communicators(self) -> dict[str, Communicator]:
        """Communicators installed for this state's groups, by group name ("tp", "dp", "mp", ...);
        a group without one runs its collectives through ``torch.distributed``."""
        return {name: self.groups[name].communicator for name in sorted(self._installed)}

    def set_communicator(self, name: str, comm: Communicator | None) -> None:
        """Run the collectives of group ``name`` through ``comm`` (``None``: back to torch).

        Every collective of :mod:`lightning_megatron.tensor_parallel.mappings` on that group (as
        passed to layers, gradient reduction and metrics) uses it until
        :meth:`close_communicators`. A replaced communicator is closed unless another group still uses it.
        """
        group = self.group(name)
        if group is None:
            raise ValueError(f"ParallelState has no {name!r} group (single process); nothing to install")
        old = group.communicator
        self._installed.discard(name)
        group.communicator = TorchCommunicator(group.process_group) if comm is None else comm
        if comm is not None:
            self._installed.add(name)
        if old is not comm and not any(self.groups[n].communicator is old for n in self._installed):
            old.close()

    def close_communicators(self) -> None:
        """Close every installed communicator; the groups go back to ``torch.distributed``."""
        for name in sorted(self._installed):
            self.set_communicator(name, None)

    # -- sizes and coordinates -----------------------------------------------------------------------

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's coordinate on every dimension (:meth:`ParallelDims.coordinates`)."""
        return dict(self._coords)

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def dp_size(self) -> int:
        return self.dims.sizes()["dp"]

    @property
    def vp_size(self) -> int | None:
        return self.dims.vp

    @property
    def ep_size(self) -> int:
        return self.dims.ep

    @property
    def tp_rank(self) -> int:
        return self._coords["tp"]

    @property
    def cp_rank(self) -> int:
        return self._coords["cp"]

    @property
    def dp_rank(self) -> int:
        return self._coords["dp"]

    @property
    def pp_rank(self) -> int:
        return self._coords["pp"]

    @property
    def ep_rank(self) -> int:
        return self._coords["ep"]

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
        return cls(dims=ParallelDims(dp=1))


def initialize_model_parallel(dims: ParallelDims, *, timeout: datetime.timedelta | None = None) -> ParallelState:
    """Build every group of ``dims`` (:data:`GROUP_NAMES`) on the default process group.

    Every rank must call this with the same ``dims`` (``new_group`` is collective). ``dims.dp`` may be
    None (the rest of the world). One torch group is made per distinct set of ranks, so names that
    span the same ranks (``dp`` and ``dp_cp`` without context parallelism) share it; each name keeps
    its own :class:`ParallelGroup` (and communicator). Returns this rank's :class:`ParallelState`.
    Raises :class:`~lightning_megatron.parallel_dims.ParallelDimsError` before creating any group
    when the sizes do not fit the world.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel needs an initialized default process group; call "
            "torch.distributed.init_process_group first (the MegatronStrategy does this for you)"
        )
    if not isinstance(dims, ParallelDims):
        raise TypeError(f"initialize_model_parallel takes a ParallelDims (e.g. ParallelDims(tp=2)), got {dims!r}")
    dims = dims.for_world_size(dist.get_world_size())
    rank = dist.get_rank()
    kwargs = {} if timeout is None else {"timeout": timeout}
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    groups: dict[str, ParallelGroup] = {}
    members: dict[str, list[int]] = {}
    for name in GROUP_NAMES:
        for ranks in dims.group_ranks(name):  # every rank creates every group, in the same order
            key = tuple(ranks)
            if key not in made:
                made[key] = dist.new_group(list(ranks), **kwargs)
            if rank in ranks:
                groups[name] = ParallelGroup(made[key], size=len(ranks), rank=ranks.index(rank))
                members[name] = list(ranks)
    return ParallelState(dims=dims, rank=rank, groups=groups, members=members)
