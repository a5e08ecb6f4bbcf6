"""Ring attention for context parallelism (``cp_comm_type="p2p"``): the keys and values travel around the CP
group, one rank's block at a time, and never stand whole on a rank.

Each rank holds two chunks of the sequence (the load-balanced split of
:mod:`~lightning_megatron.transformer.context_parallel`). At step ``j`` it holds the keys and values of rank
``r - j``, while the next block is already on its way (the exchange is posted before the block is computed and
waited for after). Each of its query chunks attends to each key chunk before it in the sequence: whole
(an earlier chunk), causal (its own chunk), or not at all (a later one: skipped). The partial results are
merged by their log-sum-exp (FlashAttention's online softmax). The backward runs the same ring with the
saved log-sum-exp, recomputing each block's probabilities; each rank's key and value gradients for every
block are sent back to the block's owner by one all-to-all. The matrix products run in the inputs' dtype (fp32
accumulation, each product rounded once, as the unfused attention's; a 16-bit model's at its 16-bit GEMM rate),
the softmax, the log-sum-exp merge and the accumulated outputs and gradients in fp32; no attention dropout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_megatron.parallel_state import Group, group_rank, group_size, process_group

__all__ = ["ring_attention"]


def _chunks_of(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def _exchange(send: torch.Tensor, group: Group) -> tuple[torch.Tensor, list]:
    """Post: ``send`` to the next rank of the ring, a tensor like it from the previous; returns (the receive
    buffer, the requests to wait for)."""
    pg = process_group(group)
    ranks = dist.get_process_group_ranks(pg)
    me = ranks.index(dist.get_rank())
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, ranks[(me + 1) % len(ranks)], pg),
           dist.P2POp(dist.irecv, recv, ranks[(me - 1) % len(ranks)], pg)]
    return recv, dist.batch_isend_irecv(ops)


def _visible_blocks(rank: int, src: int, cp: int, c: int, documents: torch.Tensor | None):
    """(query rows, key columns, causal, hidden) of every block of rank ``rank``'s queries that sees the keys
    of rank ``src``: a query chunk sees an earlier key chunk whole, its own causally, a later one not at all."""
    for qi, qc in enumerate(_chunks_of(rank, cp)):
        for ki, kc in enumerate(_chunks_of(src, cp)):
            if kc > qc:
                continue
            hidden = None if documents is None else (
                documents[:, None, qc * c:(qc + 1) * c, None] != documents[:, None, None, kc * c:(kc + 1) * c])
            yield slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c), kc == qc, hidden


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, hidden: torch.Tensor | None) -> torch.Tensor:
    """[b, n, C, C] fp32 scores of a query chunk against a key chunk, -inf where hidden: the product in the inputs'
    dtype (fp32 accumulation, one rounding: the unfused attention's ``Q K^T``), then fp32."""
    # Inside the ring's autograd Function: nothing records these ops, so the fresh product is scaled and
    # masked in place (the same values as out of place, no copies of the block).
    s = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if hidden is not None:
        s.masked_fill_(hidden, float("-inf"))
    return s


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, documents):
        # q [b, n, 2C, d]; k, v [b, g, 2C, d]; documents [b, s] in sequence order or None
        cp, r = group_size(group), group_rank(group)
        b, n, s2, d = q.shape
        g, c = k.shape[1], s2 // 2
        out = torch.zeros(b, n, s2, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, n, s2), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=1).contiguous()
        for step in range(cp):
            src = (r - step) % cp
            pending = _exchange(kv, group) if step < cp - 1 else None
            kb = kv[:, :g].repeat_interleave(n // g, dim=1)
            vb = kv[:, g:].repeat_interleave(n // g, dim=1)
            for rows, cols, causal, hidden in _visible_blocks(r, src, cp, c, documents):
                scores = _scores(q[:, :, rows], kb[:, :, cols], scale, causal, hidden)
                block_lse = torch.logsumexp(scores, dim=-1)
                seen = torch.isfinite(block_lse)
                probs = torch.where(seen[..., None], torch.exp(scores - block_lse[..., None]), 0.0)
                block_out = torch.matmul(probs.to(q.dtype), vb[:, :, cols]).float()
                new = torch.logaddexp(lse[:, :, rows], block_lse)
                old_w = torch.where(torch.isfinite(lse[:, :, rows]), torch.exp(lse[:, :, rows] - new), 0.0)
                new_w = torch.where(seen, torch.exp(block_lse - new), 0.0)
                out[:, :, rows] = out[:, :, rows] * old_w[..., None] + block_out * new_w[..., None]
                lse[:, :, rows] = torch.where(torch.isfinite(new), new, lse[:, :, rows])
            if pending is not None:
                recv, requests = pending
                for request in requests:
                    request.wait()
                kv = recv
        ctx.save_for_backward(q, k, v, out, lse, documents if documents is not None else torch.empty(0))
        ctx.group, ctx.scale, ctx.has_documents = group, scale, documents is not None
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, documents = ctx.saved_tensors
        documents = documents if ctx.has_documents else None
        group, scale = ctx.group, ctx.scale
        cp, r = group_size(group), group_rank(group)
        b, n, s2, d = q.shape
        g, c = k.shape[1], s2 // 2
        do = grad_out.to(q.dtype)
        delta = (grad_out.float() * out).sum(-1)  # [b, n, 2C]
        dq = torch.zeros(b, n, s2, d, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(cp, b, 2 * g, s2, d, dtype=torch.float32, device=q.device)  # per source block
        kv = torch.cat([k, v], dim=1).contiguous()
        for step in range(cp):
            src = (r - step) % cp
            pending = _exchange(kv, group) if step < cp - 1 else None
            kb = kv[:, :g].repeat_interleave(n // g, dim=1)
            vb = kv[:, g:].repeat_interleave(n // g, dim=1)
            dk_full = torch.zeros(b, n, s2, d, dtype=torch.float32, device=q.device)
            dv_full = torch.zeros_like(dk_full)
            for rows, cols, causal, hidden in _visible_blocks(r, src, cp, c, documents):
                scores = _scores(q[:, :, rows], kb[:, :, cols], scale, causal, hidden)
                row_lse = lse[:, :, rows, None]
                probs = torch.where(torch.isfinite(row_lse), torch.exp(scores - row_lse), 0.0)
                dprobs = torch.matmul(do[:, :, rows], vb[:, :, cols].transpose(-1, -2)).float()
                dscores = (probs * (dprobs - delta[:, :, rows, None])).to(q.dtype)
                dq[:, :, rows] += torch.matmul(dscores, kb[:, :, cols]).float() * scale
                dk_full[:, :, cols] += torch.matmul(dscores.transpose(-1, -2), q[:, :, rows]).float() * scale
                dv_full[:, :, cols] += torch.matmul(probs.to(q.dtype).transpose(-1, -2), do[:, :, rows]).float()
            per_group = n // g  # the query heads of one key/value head share its gradient
            dkv[src, :, :g] = dk_full.view(b, g, per_group, s2, d).sum(2)
            dkv[src, :, g:] = dv_full.view(b, g, per_group, s2, d).sum(2)
            if pending is not None:
                recv, requests = pending
                for request in requests:
                    request.wait()
                kv = recv
        # Every rank's gradient of block ``src`` goes back to rank ``src``, which sums them.
        received = torch.empty_like(dkv)
        dist.all_to_all_single(received, dkv, group=process_group(group))
        mine = received.sum(0)
        return dq.to(q.dtype), mine[:, :g].to(k.dtype), mine[:, g:].to(v.dtype), None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Group, scale: float,
                   documents: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's attention context [2C, b, n d] from its query chunks [2C, b, n, d] and its keys and values
    [2C, b, g, d] (the load-balanced split), over the CP ``group``; ``documents`` [b, s] in sequence order
    for packed samples."""
    s2, b, n, d = query.shape
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, 2C, d]
    context = _Ring.apply(q, k, v, group, scale, documents)
    return context.permute(2, 0, 1, 3).reshape(s2, b, n * d)
