"""Gradient norm, clipping and zero counting over all model-parallel ranks.

The norm of the *whole* model's gradient, although each rank holds only a piece of it:

    ||g||_p = ( sum over TP and PP ranks of sum over this rank's counted params of ||g_i||_p^p )^(1/p)
    ||g||_inf = max over ranks and params of max |g_i|

A parameter is counted on exactly one rank of its model-parallel replica
(:func:`~lightning_megatron.tensor_parallel.param_facts.is_counted`, from its
:class:`~lightning_megatron.tensor_parallel.ParamFacts`):

- shards (``sharded_over``, e.g. tensor-parallel weights) are disjoint slices: every rank
  counts its own slice;
- parameters replicated over a dimension (``replicated_over``: TP for norms and biases) are counted
  on its rank 0 only;
- the tied word embedding (``shared_embedding=True``) lives on the first and the last
  pipeline stage: counted on ``pp_rank == 0`` only.

Clipping scales every gradient (counted or not: duplicates must stay equal) by
``max_norm / (norm + 1e-6)`` when that coefficient is below 1, as ``torch.nn.utils.clip_grad_norm_``.
Data-parallel replicas hold identical (already reduced) gradients, so the group is the model-parallel
group of one replica (``ParallelState.mp_group``), never the world.

Exactness: the squares of the fp32 gradients are summed in fp64 (:func:`sum_of_squares_fp64`),
by every optimizer wrapper, the DistributedOptimizer's shards included. An fp32 square is exact in
fp64, and an fp64 sum of ``n`` terms is off by ``~n * 1e-16`` relative at worst, so the norm does
not depend on how the gradient is cut (TP, PP, DP shards) beyond ~1e-12 relative; an fp32 sum lost
~1e-3 of the squared norm of the word embedding's gradient on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from lightning_megatron.parallel_state import Group
from lightning_megatron.tensor_parallel.mappings import all_reduce
from lightning_megatron.tensor_parallel.param_facts import is_counted

__all__ = [
    "get_grad_norm_fp32",
    "clip_grad_norm",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
    "grads_for_norm",
    "grad_norm_and_found_inf",
    "grad_norm_squares",
    "clip_grads_by_squares",
    "clip_grads_by_total_norm",
    "sum_of_squares_fp64",
    "NORM_PIECE",
]

NORM_PIECE = 1 << 24
"""The longest piece of a gradient the default (fused) norm takes at once: longer gradients go to it as views of
this many elements. Where torch's fp64 foreach norm goes tensor by tensor (a CPU), it makes an fp64 copy of each,
so the transient stays within 128 MiB however long a gradient is; a GPU's multi-tensor kernel takes the views as
they come (a 7 B model's word embedding: ~32 views)."""


def _as_list(parameters: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


def grads_for_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor, *, coordinates: Mapping[str, int] | None = None
) -> list[torch.Tensor]:
    """The gradients this rank contributes to the global norm (see the module docstring); ``coordinates``:
    this rank's (``ParallelState.coordinates``; None: one process)."""
    coordinates = coordinates or {}
    return [p.grad for p in _as_list(parameters) if p.grad is not None and is_counted(p, coordinates)]


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    """Where a rank's part of the norm lives: its gradients' device; a rank holding no gradient (a stage whose
    parameters are frozen) still takes part in the collective, on the current accelerator (NCCL refuses a CPU
    tensor), else the CPU (gloo)."""
    if tensors:
        return tensors[0].device
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return torch.device(acc.current_accelerator().type, acc.current_device_index())
    return torch.device("cpu")


def _flat_pieces(t: torch.Tensor, piece: int) -> list[torch.Tensor]:
    """``t``'s elements as 1-d pieces of ``piece`` (views when ``t`` is contiguous)."""
    flat = t.reshape(-1)
    return [flat[lo: lo + piece] for lo in range(0, flat.numel(), piece)]


def sum_of_squares_fp64(tensors: Iterable[torch.Tensor], device: torch.device | None = None, *,
                        piece: int | None = None) -> torch.Tensor:
    """``sum_i sum_j t_ij^2`` over ``tensors`` as a 0-d fp64 tensor on ``device`` (exact squares, fp64 sums).

    By default (``piece=None``, the accelerators' way) one fused ``torch._foreach_norm`` with fp64 sums gives
    every tensor's norm (on a GPU one multi-tensor kernel per 400 tensors, reading each gradient once; a gradient
    longer than :data:`NORM_PIECE` as views of that many elements) and their squares are summed: a tensor's sum
    comes back within two fp64 roundings (its root and the square). With ``piece`` (the opt-in CPU tuning's
    cache-sized pieces, :meth:`lightning_megatron.cpu.CPUTuning.norm_piece`: on a CPU torch's fp64 foreach norm
    goes tensor by tensor, with an fp64 copy of each), each ``piece`` elements of a tensor are converted into one
    reused fp64 scratch tensor and dotted with itself. The sum does not depend on the way beyond fp64 rounding
    (~1e-16 per term)."""
    tensors = _as_list(tensors)
    device = device if device is not None else _device_of(tensors)
    if piece is None:
        if not tensors:
            return torch.zeros((), dtype=torch.float64, device=device)
        with torch.no_grad():  # values only, no per-tensor detach (host time on an accelerator)
            pieces = [part for t in tensors for part in
                      (_flat_pieces(t, NORM_PIECE) if t.numel() > NORM_PIECE and t.is_contiguous() else [t])]
            norms = torch._foreach_norm(pieces, 2, dtype=torch.float64)
            if any(n.device != device for n in norms):
                norms = [n.to(device) for n in norms]
            return torch.stack(norms).square().sum()
    if piece < 1:
        raise ValueError(f"piece={piece} must be a positive number of elements (None: one fused norm)")
    total = torch.zeros((), dtype=torch.float64, device=device)
    scratch: dict[torch.device, torch.Tensor] = {}
    for t in tensors:
        if t.device not in scratch:
            longest = max(x.numel() for x in tensors if x.device == t.device)
            scratch[t.device] = torch.empty(min(piece, longest), dtype=torch.float64, device=t.device)
        for src in _flat_pieces(t.detach(), piece):
            part = scratch[t.device][: src.numel()]
            part.copy_(src)
            total += torch.dot(part, part).to(total.device)
    return total


def get_grad_norm_fp32(
    grads_for_norm: Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float = 2,
    model_parallel_group: Group = None,
) -> float:
    """Total ``norm_type``-norm of ``grads_for_norm`` over ``model_parallel_group`` (fp64 sums).

    ``grads_for_norm`` must already exclude duplicates (use :func:`grads_for_norm`). p-norms sum
    ``||g_i||_p^p`` locally, all-reduce SUM, then take the p-th root; the inf-norm all-reduces MAX.
    ``None`` group means a single process. Returns a Python float (inf or nan propagate).
    """
    grads = _as_list(grads_for_norm)
    norm_type = float(norm_type)
    device = _device_of(grads)
    if norm_type == math.inf:
        local = [g.detach().abs().max().float() for g in grads if g.numel() > 0]
        total = torch.stack(local).max() if local else torch.zeros((), device=device)
        total = total.reshape(1).clone()
        if model_parallel_group is not None:
            all_reduce(total, model_parallel_group, dist.ReduceOp.MAX)
        return float(total.item())
    if norm_type <= 0:
        raise ValueError(f"norm_type={norm_type!r} must be > 0 or inf")
    if norm_type == 2.0:
        total = sum_of_squares_fp64(grads, device).reshape(1)
    else:
        local = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float64) for g in grads]
        total = (torch.stack(local) ** norm_type).sum() if local else torch.zeros((), device=device)
        total = total.reshape(1).to(torch.float64)
    if model_parallel_group is not None:
        all_reduce(total, model_parallel_group)
    return float(total.item()) ** (1.0 / norm_type)


def grad_norm_and_found_inf(
    counted: Iterable[torch.Tensor],
    others: Iterable[torch.Tensor] = (),
    model_parallel_group: Group = None,
    *,
    piece: int | None = None,
) -> tuple[float, bool]:
    """(global L2 norm of ``counted``, whether any of ``counted`` or ``others`` holds inf/nan).

    One pass over every gradient instead of two (an overflow check, then the norm): the sum of
    squares of ``g`` is inf/nan exactly when ``g`` holds an inf or a nan (fp64 sums: a finite fp32
    grad never overflows). ``counted`` are the grads this rank contributes to the norm
    (:func:`grads_for_norm`), ``others`` the duplicates it holds but does not count: they are
    checked, not counted. One all-reduce (SUM) over ``model_parallel_group`` of
    ``[sum of fp64 squares over counted, sum of fp32 ||g|| over others]`` answers both; a non-finite value on any
    rank makes the sum non-finite on every rank, so all ranks take the same decision (Megatron
    MAX-reduces a found-inf flag over the same group). ``piece``: :func:`sum_of_squares_fp64`'s.
    """
    squares, checked = grad_norm_squares(counted, others, model_parallel_group, piece=piece).tolist()
    found_inf = not (math.isfinite(squares) and math.isfinite(checked))
    return squares**0.5, found_inf


def grad_norm_squares(
    counted: Iterable[torch.Tensor],
    others: Iterable[torch.Tensor] = (),
    model_parallel_group: Group = None,
    *,
    piece: int | None = None,
) -> torch.Tensor:
    """:func:`grad_norm_and_found_inf`'s all-reduced ``[sum of fp64 squares over counted, sum of fp32 ||g|| over
    others]`` (fp64, on the grads' device), not read on the host: both are finite exactly when every gradient
    is."""
    counted, others = _as_list(counted), _as_list(others)
    device = _device_of(counted + others)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    rest = [torch.linalg.vector_norm(g.detach(), 2, dtype=torch.float32) for g in others]
    total = torch.stack([sum_of_squares_fp64(counted, device, piece=piece),
                         torch.stack(rest).double().sum() if rest else zero])
    if model_parallel_group is not None:
        all_reduce(total, model_parallel_group)
    return total


def clip_grads_by_squares(grads: list[torch.Tensor], max_norm: float, squares: torch.Tensor,
                          skip: torch.Tensor) -> None:
    """:func:`clip_grad_by_total_norm_fp32` on ``grads`` with the norm's square ``squares`` (an fp64 device
    tensor) read on the device: the same coefficient ``max_norm / (sqrt(squares) + 1e-6)`` in fp64, rounded to
    the grads' fp32 as a host number would be, where it is < 1 (elsewhere a product by 1, exact); by 1 where
    ``skip`` (a non-finite norm: the step is skipped, and the gradients stay as they are for the error to name)."""
    coeff = max_norm / (squares.sqrt() + 1.0e-6)
    coeff = torch.where(skip | (coeff >= 1.0), torch.ones_like(coeff), coeff)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, same in by_dtype.items():
        torch._foreach_mul_(same, coeff.to(dtype))


def clip_grad_by_total_norm_fp32(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, total_norm: float
) -> None:
    """Scale every grad of ``parameters`` by ``max_norm / (total_norm + 1e-6)`` if that is < 1.

    A nan or inf ``total_norm`` gives a coefficient that is not < 1: grads are left alone (the
    mixed-precision optimizer skips such steps before clipping).
    """
    clip_grads_by_total_norm([p.grad.detach() for p in _as_list(parameters) if p.grad is not None], max_norm,
                             total_norm)


def clip_grads_by_total_norm(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """:func:`clip_grad_by_total_norm_fp32` on ``grads`` themselves: one foreach product (each element times the
    same coefficient as a ``mul_`` would give)."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def clip_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2,
    *,
    model_parallel_group: Group = None,
    coordinates: Mapping[str, int] | None = None,
) -> float:
    """Clip the gradients of ``parameters`` in place by their global norm; return that norm.

    Equivalent to ``torch.nn.utils.clip_grad_norm_`` applied to the unsharded one-process model.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be > 0; to only measure the norm use get_grad_norm_fp32")
    params = _as_list(parameters)
    total_norm = get_grad_norm_fp32(
        grads_for_norm(params, coordinates=coordinates), norm_type, model_parallel_group
    )
    clip_grad_by_total_norm_fp32(params, max_norm, total_norm)
    return total_norm


def count_zeros_fp32(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    *,
    model_parallel_group: Group = None,
    coordinates: Mapping[str, int] | None = None,
) -> int:
    """Number of exactly-zero gradient entries over the model-parallel replica (duplicates once)."""
    grads = grads_for_norm(parameters, coordinates=coordinates)
    device = _device_of(grads)
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for g in grads:
        total += g.numel() - torch.count_nonzero(g)
    if model_parallel_group is not None:
        all_reduce(total, model_parallel_group)
    return int(total.item())
