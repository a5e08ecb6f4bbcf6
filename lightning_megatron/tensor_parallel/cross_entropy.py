"""Cross entropy over logits split along the vocabulary, without gathering them.

For logits z (this rank holds columns [start, end) of the vocabulary) and target y:

    m    = max_j z_j                         (all-reduce MAX)
    Z    = sum_j exp(z_j - m)                (all-reduce SUM)
    z_y  = z_y - m on the rank owning y, 0 elsewhere   (all-reduce SUM)
    loss = log Z - z_y

With label smoothing eps over the V real classes (torch's definition):
    loss = (1 - eps) (log Z - z_y) + eps (log Z - (1/V) sum_j (z_j - m))
Megatron divides the smoothing term by the per-rank vocab; we use the full V.

Padded vocabulary columns (beyond ``vocab_size``) are excluded: they get probability 0 and gradient 0.
Gradient: dloss/dz_j = softmax_j - (1 - eps) [j == y] - eps / V   (j < V).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from lightning_megatron.parallel_state import Group, group_rank, group_size
from lightning_megatron.tensor_parallel.mappings import all_reduce

__all__ = ["recomputing_cross_entropy", "vocab_parallel_cross_entropy"]


def _pieces(rows_per_piece: int | None, *tensors: torch.Tensor | None) -> Iterator[tuple[torch.Tensor | None, ...]]:
    """Yield views of ``tensors`` (each [..., V] or [...] over the same leading dims; None stays None) a piece
    of ``rows_per_piece`` rows of the flattened leading dims at a time; all of them at once when None or when a
    tensor's leading dims cannot be flattened without a copy. No piece has a single row unless there is one row
    in all: a one-row reduction may be split across threads, which adds in another order."""
    n = tensors[1].numel() // tensors[1].size(-1) if tensors[1] is not None else 0
    viewable = all(t is None or t.is_contiguous() for t in tensors)
    if rows_per_piece is None or rows_per_piece >= n or not viewable:
        yield tensors
        return
    lead = tensors[0].shape[:-1]
    flat = [None if t is None else (t.view(-1, t.size(-1)) if t.shape[:-1] == lead else t.view(-1))
            for t in tensors]
    starts = list(range(0, n, rows_per_piece))
    if n - starts[-1] == 1:
        starts.pop()  # the last row joins the piece before it
    for lo, hi in zip(starts, starts[1:] + [n]):
        yield tuple(None if t is None else t[lo:hi] for t in flat)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group, vocab_size, ignore_index, rows_per_piece):
        input_dtype = logits.dtype
        partition = logits.size(-1)
        world, rank = group_size(group), group_rank(group)
        start = rank * partition
        full_vocab = partition * world
        real_vocab = full_vocab if vocab_size is None else vocab_size
        if not 0 < real_vocab <= full_vocab:
            raise ValueError(f"vocab_size={vocab_size} must be in (0, {full_vocab}] (the padded vocab across ranks)")
        valid = max(0, min(partition, real_vocab - start))  # this rank's real (unpadded) columns

        # The max over the real columns, read from the input as it is (the values only: ``max(dim)`` also
        # finds their indices, ~3x the time); a rank holding only padding contributes -inf.
        if valid:
            logits_max = logits[..., :valid].amax(dim=-1).float()
        else:
            logits_max = torch.full(logits.shape[:-1], float("-inf"), dtype=torch.float32, device=logits.device)
        all_reduce(logits_max, group, dist.ReduceOp.MAX)

        ignored = target == ignore_index
        outside = (target < start) | (target >= start + partition) | ignored
        local_target = (target - start).masked_fill(outside, 0)

        # The one working copy, fp32 (a 16-bit input is widened on the way): the input itself is never written.
        # Each row's values depend on that row only, so the passes below may go a piece of rows at a time
        # (``rows_per_piece``): the same bits, with a piece's fp32 rows still in cache from one pass to the next.
        exp_logits = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        predicted, sum_exp = (torch.empty(target.shape, dtype=torch.float32, device=logits.device) for _ in "ab")
        sum_logits = torch.empty_like(sum_exp) if label_smoothing > 0 else None
        for z, out, m, y, pred, sums, sums_z in _pieces(rows_per_piece, logits, exp_logits, logits_max,
                                                        local_target.contiguous(), predicted, sum_exp, sum_logits):
            shifted = torch.sub(z, m.unsqueeze(-1), out=out)
            if valid < partition:
                shifted[..., valid:] = float("-inf")
            torch.gather(shifted, -1, y.unsqueeze(-1), out=pred.unsqueeze(-1))
            if sums_z is not None:
                torch.sum(shifted[..., :valid], dim=-1, out=sums_z)
            shifted.exp_()  # the shifted logits are not needed any more: exp in place
            torch.sum(shifted, dim=-1, out=sums)
        predicted = predicted.masked_fill(outside, 0.0)
        all_reduce(predicted, group)
        all_reduce(sum_exp, group)
        log_z = sum_exp.log()
        loss = log_z - predicted

        if sum_logits is not None:
            all_reduce(sum_logits, group)
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - sum_logits / real_vocab)
        loss = loss.masked_fill(ignored, 0.0)

        # The softmax is exp_logits / sum_exp: the division waits for the backward, where it joins the
        # multiplication by the incoming gradient (one pass over [..., V] fewer than normalising here).
        ctx.save_for_backward(exp_logits, sum_exp, local_target, outside, ignored)
        ctx.label_smoothing, ctx.real_vocab, ctx.valid, ctx.input_dtype = label_smoothing, real_vocab, valid, input_dtype
        ctx.rows_per_piece = rows_per_piece
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        # dloss/dz_j = (e_j - (1 - eps) Z [j == y] - eps Z / V) * g / Z, with e_j = exp(z_j - m), Z = sum_j e_j.
        exp_logits, sum_exp, local_target, outside, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = exp_logits  # saved exponentials are ours alone: update in place
        grad.scatter_add_(-1, local_target.unsqueeze(-1),
                          (-(1.0 - eps) * sum_exp).masked_fill(outside, 0.0).unsqueeze(-1))
        scale = grad_output.masked_fill(ignored, 0.0) / sum_exp
        shift = (eps / ctx.real_vocab) * sum_exp if eps > 0 else None
        # Scaled in fp32 and written in the logits' dtype by the one product (fp32 logits: into the saved tensor,
        # which is the gradient; 16-bit: rounded once on the store, the bits of scaling then narrowing), a piece
        # of rows at a time as in the forward. (The CPU computes a 16-bit output into an fp32 temporary of its
        # size first: a piece's with the CPU tuning's pieces.)
        out = grad if ctx.input_dtype == grad.dtype else torch.empty(grad.shape, dtype=ctx.input_dtype,
                                                                      device=grad.device)
        for piece, piece_out, piece_scale, piece_shift in _pieces(ctx.rows_per_piece, grad, out, scale, shift):
            if piece_shift is not None:
                piece[..., :ctx.valid].sub_(piece_shift.unsqueeze(-1))  # in place (``-=`` on a slice copies it back)
            torch.mul(piece, piece_scale.unsqueeze(-1), out=piece_out)
        return out, None, None, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, *, tp_group: Group = None,
                                 vocab_size: int | None = None, ignore_index: int = -100,
                                 rows_per_piece: int | None = None) -> torch.Tensor:
    """Per-token cross entropy (no reduction) of logits split by vocab across ``tp_group``.

    vocab_parallel_logits: [..., V_padded / t] (this rank's columns); target: [...] global ids.
    vocab_size: the real vocabulary (columns >= vocab_size are padding and excluded); None = all.
    Targets equal to ``ignore_index`` give loss 0 and no gradient. Computed in fp32.
    rows_per_piece: the passes over the fp32 working copy go this many rows (tokens) at a time, each
    piece through all of them while it is in cache; None: all rows in each pass (one kernel per pass: what
    a GPU wants). The values are the same bit for bit (a row's sums are its own); the CPU tuning sets it
    (:meth:`~lightning_megatron.cpu.kernels.CPUKernels.loss_rows`).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if rows_per_piece is not None and rows_per_piece < 2:
        raise ValueError(f"rows_per_piece={rows_per_piece} must be at least 2 rows or None (all rows at once): a "
                         "one-row sum may be split across threads, which would change the loss's last bits")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing),
                                            tp_group, vocab_size, ignore_index, rows_per_piece)


class _RecomputingCrossEntropy(torch.autograd.Function):
    """The cross entropy of one rank's whole vocabulary, its backward recomputing the softmax from the logits."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, valid, ignore_index):
        z = logits[..., :valid].float()
        log_z = torch.logsumexp(z, dim=-1)
        ignored = target == ignore_index
        target = target.masked_fill(ignored, 0)
        loss = log_z - z.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        if label_smoothing > 0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - z.mean(dim=-1))
        ctx.save_for_backward(logits, log_z, target, ignored)
        ctx.label_smoothing, ctx.valid = label_smoothing, valid
        return loss.masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad_output):
        # dloss/dz_j = softmax_j - (1 - eps) [j == y] - eps / V; the target's term by comparison, not by a scatter
        # (whose backward a compiler cannot fuse: an fp32 [..., V] of zeros written, then read).
        logits, log_z, target, ignored = ctx.saved_tensors
        eps, valid = ctx.label_smoothing, ctx.valid
        z = logits[..., :valid].float()
        hit = torch.arange(valid, device=logits.device) == target.unsqueeze(-1)
        grad = torch.exp(z - log_z.unsqueeze(-1)) - (1.0 - eps) * hit.to(z.dtype)
        if eps > 0:
            grad = grad - eps / valid
        grad = (grad * grad_output.masked_fill(ignored, 0.0).unsqueeze(-1)).to(logits.dtype)
        if valid < logits.size(-1):  # the padded columns: no gradient
            grad = torch.nn.functional.pad(grad, (0, logits.size(-1) - valid))
        return grad, None, None, None, None


def recomputing_cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0, *,
                              vocab_size: int | None = None, ignore_index: int = -100) -> torch.Tensor:
    """:func:`vocab_parallel_cross_entropy` of logits holding the whole vocabulary (one TP rank), for a compiler to
    fuse (``compile=True``: :meth:`~lightning_megatron.language.LanguageModule.compile_loss`): plain tensor
    expressions, and a backward that recomputes the softmax from the (16-bit) logits where the function keeps an
    fp32 ``[..., V]`` of exponentials, 4 bytes a logit for the whole backward (on a GPU at Llama 3's vocabulary,
    4.2 GB a microbatch of 8,192 tokens). Compiled, the forward reads the logits in one fused reduction and the
    backward writes the gradient in one pass, with no ``[..., V]`` temporary. The same loss and gradient within
    fp32 rounding (another order of the sums). Eager it works too, in several passes and fp32 temporaries."""
    full = logits.size(-1)
    valid = full if vocab_size is None else vocab_size
    if not 0 < valid <= full:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, {full}] (the padded vocab)")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    return _RecomputingCrossEntropy.apply(logits, target, float(label_smoothing), valid, ignore_index)
