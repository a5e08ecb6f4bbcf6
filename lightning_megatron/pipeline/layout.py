"""Which transformer layers each pipeline stage and model chunk owns (pure arithmetic, no groups).

With ``p`` pipeline stages and ``v`` model chunks per stage (virtual pipeline, ``v = 1`` without
interleaving) the ``L`` layers are cut into ``p * v`` contiguous *pieces*. Megatron's interleaved
assignment gives piece ``vp_rank * p + pp_rank`` to chunk ``vp_rank`` of stage ``pp_rank``, so an
activation visits stage 0, 1, ..., p-1, then stage 0 again (chunk 1), and so on::

    L = 8, p = 2, v = 2:   piece 0 = layers 0-1 -> (pp 0, vp 0)    piece 1 = layers 2-3 -> (pp 1, vp 0)
                           piece 2 = layers 4-5 -> (pp 0, vp 1)    piece 3 = layers 6-7 -> (pp 1, vp 1)

Uneven splits: with ``q = p * v`` pieces, every piece gets ``L // q`` layers and the first
``L % q`` pieces (in piece order) get one more. ``L = 10, p = 4`` gives 3, 3, 2, 2.

The embedding lives on the first piece (pp 0, vp 0); the heads and the loss on the last piece
(pp p-1, vp v-1). Megatron calls these ``pre_process`` and ``post_process``.

Uneven stages (megatron-core's ``num_layers_in_first_pipeline_stage`` /
``num_layers_in_last_pipeline_stage``): the first (last) stage holds that many layers in all, the
other stages share the rest as above, and each stage splits its layers over its ``v`` chunks (the
earlier chunks one more). The last stage also computes the LM head and the loss (at bert-base about
three layers' worth of forward FLOPs), so giving it fewer layers balances the pipeline::

    L = 12, p = 2, last = 4:   stage 0 = layers 0-7,  stage 1 = layers 8-11 (+ LM head, loss)
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_megatron.parallel_dims import STRATEGY_ARGUMENTS

__all__ = [
    "STAGE_SIZES",
    "ChunkLayout",
    "get_layer_range",
    "get_num_layers_to_build",
    "is_first_chunk_stage",
    "is_last_chunk_stage",
    "stage_chunks",
]


STAGE_SIZES = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
"""A config's uneven stage sizes (module docstring): where the layers go, not what they compute."""


def _check(num_layers: int, pp_size: int, pp_rank: int, vp_size: int | None, vp_rank: int) -> int:
    """Validate a (stage, chunk) coordinate; return the number of chunks per stage ``v``."""
    v = 1 if vp_size is None else vp_size
    if pp_size < 1 or v < 1:
        raise ValueError(f"pp_size={pp_size} and vp_size={vp_size} must be >= 1")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is outside [0, pp_size={pp_size})")
    if not 0 <= vp_rank < v:
        raise ValueError(f"vp_rank={vp_rank} is outside [0, vp_size={v})")
    pieces = pp_size * v
    if pieces > num_layers:
        raise ValueError(
            f"num_layers={num_layers} cannot fill pp_size={pp_size} * vp_size={v} = {pieces} model "
            f"chunks (each chunk needs at least one layer); use fewer stages or chunks"
        )
    return v


def _piece_sizes(num_layers: int, pp_size: int, v: int, first: int | None, last: int | None) -> list[int]:
    """Layers of each of the ``pp_size * v`` pieces, in piece order, with uneven first / last stages."""
    ends = {0: first, pp_size - 1: last}
    fixed = {s: n for s, n in ends.items() if n is not None}
    for name, n in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
        if n is None:
            continue
        if pp_size < 2 or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}={n!r} needs pipeline_model_parallel_size >= 2 (got {pp_size}) and a whole "
                             f"number of layers >= 1")
        if n < v:
            raise ValueError(f"{name}={n} is fewer layers than the stage's {v} model chunks "
                             f"({STRATEGY_ARGUMENTS['vp']}={v}; every chunk needs at least one layer): give "
                             f"it at least {v} layers, or fewer chunks")
    middle = [s for s in range(pp_size) if s not in fixed]
    rest = num_layers - sum(fixed.values())
    if rest < len(middle) * v or (not middle and rest != 0):
        raise ValueError(
            f"num_layers={num_layers} does not fit num_layers_in_first_pipeline_stage={first} and "
            f"num_layers_in_last_pipeline_stage={last}: {rest} layers are left for {len(middle)} other stage(s) "
            f"of {v} chunk(s) each; every chunk needs at least one layer and every layer a stage")
    per_stage = dict(fixed)
    base, extra = divmod(rest, len(middle)) if middle else (0, 0)
    per_stage.update({s: base + (i < extra) for i, s in enumerate(middle)})
    sizes = []
    for piece in range(pp_size * v):
        stage, chunk = piece % pp_size, piece // pp_size
        n, e = divmod(per_stage[stage], v)
        sizes.append(n + (chunk < e))
    return sizes


def get_layer_range(num_layers: int, pp_size: int, pp_rank: int, vp_size: int | None = None,
                    vp_rank: int = 0, *, num_layers_in_first_pipeline_stage: int | None = None,
                    num_layers_in_last_pipeline_stage: int | None = None) -> range:
    """Global layer indices owned by model chunk ``vp_rank`` on pipeline stage ``pp_rank``.

    Piece index ``i = vp_rank * pp_size + pp_rank`` of ``q = pp_size * v`` pieces; with
    ``n, e = divmod(num_layers, q)`` piece ``i`` holds ``n + (i < e)`` layers starting at
    ``i * n + min(i, e)``. Raises ``ValueError`` when a chunk would be empty (``q > num_layers``).
    With ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` the stages
    are sized as in the module docstring (pieces keep their order: the ranges still tile ``[0, L)``).
    """
    v = _check(num_layers, pp_size, pp_rank, vp_size, vp_rank)
    piece = vp_rank * pp_size + pp_rank
    if num_layers_in_first_pipeline_stage is not None or num_layers_in_last_pipeline_stage is not None:
        sizes = _piece_sizes(num_layers, pp_size, v, num_layers_in_first_pipeline_stage,
                             num_layers_in_last_pipeline_stage)
        start = sum(sizes[:piece])
        return range(start, start + sizes[piece])
    base, extra = divmod(num_layers, pp_size * v)
    start = piece * base + min(piece, extra)
    return range(start, start + base + (1 if piece < extra else 0))


def get_num_layers_to_build(num_layers: int, pp_size: int, pp_rank: int, vp_size: int | None = None,
                            vp_rank: int = 0) -> int:
    """Number of layers in chunk ``vp_rank`` of stage ``pp_rank`` (Megatron's name)."""
    return len(get_layer_range(num_layers, pp_size, pp_rank, vp_size, vp_rank))


def is_first_chunk_stage(pp_rank: int, vp_rank: int = 0) -> bool:
    """True for the chunk that holds the embedding: the first piece, (pp 0, vp 0)."""
    return pp_rank == 0 and vp_rank == 0


def is_last_chunk_stage(pp_rank: int, pp_size: int, vp_rank: int = 0, vp_size: int | None = None) -> bool:
    """True for the chunk that holds the heads and the loss: the last piece, (pp p-1, vp v-1)."""
    v = 1 if vp_size is None else vp_size
    return pp_rank == pp_size - 1 and vp_rank == v - 1


@dataclass(frozen=True, kw_only=True)
class ChunkLayout:
    """What one model chunk of this stage builds."""

    vp_rank: int
    """Index of the chunk on its stage (0 without interleaving)."""
    layers: range
    """Global indices of the transformer layers in the chunk."""
    pre_process: bool
    """The chunk holds the embedding (first piece)."""
    post_process: bool
    """The chunk holds the heads and computes the loss (last piece)."""


def stage_chunks(num_layers: int, pp_size: int, pp_rank: int, vp_size: int | None = None, *,
                 num_layers_in_first_pipeline_stage: int | None = None,
                 num_layers_in_last_pipeline_stage: int | None = None) -> list[ChunkLayout]:
    """The ``v`` chunks stage ``pp_rank`` builds, in ``vp_rank`` order (the order of ``model``); the
    stage sizes as :func:`get_layer_range` takes them."""
    v = 1 if vp_size is None else vp_size
    return [
        ChunkLayout(
            vp_rank=c,
            layers=get_layer_range(num_layers, pp_size, pp_rank, vp_size, c,
                                   num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
                                   num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage),
            pre_process=is_first_chunk_stage(pp_rank, c),
            post_process=is_last_chunk_stage(pp_rank, pp_size, c, vp_size),
        )
        for c in range(v)
    ]
