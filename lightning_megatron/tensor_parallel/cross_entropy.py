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

import torch
import torch.distributed as dist

from lightning_megatron.parallel_state import Group, group_rank, group_size
from lightning_megatron.tensor_parallel.mappings import all_reduce

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group, vocab_size, ignore_index):
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
        # The one working copy, fp32 (a 16-bit input is widened on the way): the input itself is never written.
        logits = torch.sub(logits, logits_max.unsqueeze(-1), out=torch.empty(logits.shape, dtype=torch.float32,
                                                                               device=logits.device))
        if valid < partition:
            logits[..., valid:] = float("-inf")

        ignored = target == ignore_index
        outside = (target < start) | (target >= start + partition) | ignored
        local_target = (target - start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        all_reduce(predicted, group)

        sum_logits = logits[..., :valid].sum(dim=-1) if label_smoothing > 0 else None
        exp_logits = logits.exp_()  # the shifted logits are not needed any more: exp in place
        sum_exp = exp_logits.sum(dim=-1)
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
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        # dloss/dz_j = (e_j - (1 - eps) Z [j == y] - eps Z / V) * g / Z, with e_j = exp(z_j - m), Z = sum_j e_j.
        exp_logits, sum_exp, local_target, outside, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = exp_logits  # saved exponentials are ours alone: update in place
        grad.scatter_add_(-1, local_target.unsqueeze(-1),
                          (-(1.0 - eps) * sum_exp).masked_fill(outside, 0.0).unsqueeze(-1))
        if eps > 0:
            grad[..., :ctx.valid] -= (eps / ctx.real_vocab) * sum_exp.unsqueeze(-1)
        grad.mul_((grad_output.masked_fill(ignored, 0.0) / sum_exp).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, *, tp_group: Group = None,
                                 vocab_size: int | None = None, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross entropy (no reduction) of logits split by vocab across ``tp_group``.

    vocab_parallel_logits: [..., V_padded / t] (this rank's columns); target: [...] global ids.
    vocab_size: the real vocabulary (columns >= vocab_size are padding and excluded); None = all.
    Targets equal to ``ignore_index`` give loss 0 and no gradient. Computed in fp32.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing),
                                            tp_group, vocab_size, ignore_index)
