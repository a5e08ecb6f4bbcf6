"""Context parallelism: the sequence of every sample split over the ranks of the CP group.

megatron-core's load-balanced causal split: the sequence is cut into ``2 cp`` chunks and rank ``r`` keeps
chunks ``r`` and ``2 cp - 1 - r``, so every rank holds as many early (cheap) as late (expensive) queries
under the causal mask. Every tensor of a batch that runs along the sequence (``[b, s]``: tokens, labels,
loss mask, positions, document ids) is sliced the same way (:func:`split_batch`); the positions are the
tokens' real ones, so rope and learned positions see the sequence as one process does.

Attention (:class:`ContextParallel`): each rank computes the queries of its tokens against the keys and
values of the whole sequence, gathered over the CP group (an all-gather whose backward reduce-scatters
the keys' and values' gradients to their owners) and put in sequence order; each of its two chunks attends
causally to the keys up to its own end (no mask but, for packed samples, the documents'). This is megatron-core's
``cp_comm_type="all_gather"``: the keys and values of a layer are held whole during its attention, the
queries and everything else stay split. ``cp_comm_type="a2a"`` (Ulysses, DeepSpeed's all-to-all
sequence parallelism) instead trades the sequence split for a split of the heads before the attention
(an all-to-all of queries, keys and values: every rank then holds the whole sequence of ``1/cp`` of the
heads) and back after it. No Lightning here; the group is an argument.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron.parallel_state import Group, group_size, process_group
from lightning_megatron.tensor_parallel.mappings import gather_from_sequence_parallel_region
from lightning_megatron.transformer.utils import owned

__all__ = ["ContextParallel", "context_parallel_indices", "sequence_length_problem", "split_batch"]


def sequence_length_problem(seq_length: int, cp_size: int) -> str | None:
    """Why ``seq_length`` tokens cannot be split over ``cp_size`` ranks (the 2 cp chunks), or None."""
    if cp_size > 1 and seq_length % (2 * cp_size):
        below, above = [k * 2 * cp_size for k in (seq_length // (2 * cp_size), seq_length // (2 * cp_size) + 1)]
        return (f"context parallelism: sequence length {seq_length} is not divisible by 2 x context_parallel_size "
                f"= {2 * cp_size} (each rank keeps two of 2 x {cp_size} equal chunks); choose a seq_length that is "
                f"a multiple of {2 * cp_size} (e.g. {f'{below} or ' if below else ''}{above})")
    return None


def context_parallel_indices(seq_length: int, cp_size: int, cp_rank: int, device: Any = None) -> torch.Tensor:
    """The global indices of the tokens CP rank ``cp_rank`` keeps: chunks ``cp_rank`` and ``2 cp - 1 - cp_rank``
    of ``2 cp`` equal chunks (``seq_length`` must divide into them)."""
    problem = sequence_length_problem(seq_length, cp_size)
    if problem:
        raise ValueError(problem)
    chunk = seq_length // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def _all_to_all(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``x`` [cp, ...]: part ``j`` goes to rank ``j``; returns [cp, ...], part ``j`` from rank ``j``."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous like x (empty_like keeps a permuted tensor's strides)
    dist.all_to_all_single(out, x, group=process_group(group))
    return out


def _seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[s/cp, b, h, d] of this rank's tokens -> [s, b, h/cp, d]: the whole sequence (in rank order) of this
    rank's ``1/cp`` of the heads."""
    cp = group_size(group)
    s, b, h, d = x.shape
    parts = x.reshape(s, b, cp, h // cp, d).permute(2, 0, 1, 3, 4)
    return _all_to_all(parts, group).reshape(cp * s, b, h // cp, d)


def _heads_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: [s, b, h/cp, d] -> [s/cp, b, h, d]."""
    cp = group_size(group)
    s, b, h, d = x.shape
    parts = _all_to_all(x.reshape(cp, s // cp, b, h, d), group)
    return parts.permute(1, 2, 0, 3, 4).reshape(s // cp, b, cp * h, d)


class _HeadsForSequence(torch.autograd.Function):
    """:func:`_seq_to_heads` (``to_heads``) or :func:`_heads_to_seq`; the backward is the other one."""

    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.group), None, None


@dataclass
class ContextParallel:
    """What attention needs to run over a CP group: the group, which chunks of the sequence this rank holds,
    the order the gathered sequence comes in, and the documents of packed samples."""

    group: Group
    chunks: tuple[int, int]
    """The indices of this rank's two chunks of the sequence (of ``2 cp``), in the order it holds them."""
    chunk: int
    """Tokens per chunk."""
    gathered: torch.Tensor
    """The global index of each token of the gathered sequence (rank order)."""
    documents: torch.Tensor | None = None
    """``document_ids`` [b, s] of the gathered sequence (the split's order), for packed samples."""
    _natural_documents: torch.Tensor | None = field(default=None, repr=False)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` [s / cp, ...] of this rank -> [s, ...] of the group, in rank order (autograd: the gradient is
        reduce-scattered back)."""
        return gather_from_sequence_parallel_region(t, self.group, True)

    def positions(self) -> torch.Tensor:
        """This rank's tokens' places in the sequence, in the order it holds them."""
        return torch.cat([torch.arange(c * self.chunk, (c + 1) * self.chunk, device=self.gathered.device)
                          for c in self.chunks])

    def natural_order(self) -> torch.Tensor:
        """The gathered positions in sequence order (``gathered[natural_order()]`` is ``0 .. s-1``)."""
        return torch.argsort(self.gathered)

    def document_mask(self, queries: slice = slice(None), keys: slice = slice(None)) -> torch.Tensor | None:
        """Packed samples: [b, 1, queries, keys] of the sequence in order, True where the key is in another
        document (the causal triangle is the attention's own); None otherwise."""
        if self.documents is None:
            return None
        if self._natural_documents is None:
            self._natural_documents = self.documents.index_select(1, self.natural_order())
        documents = self._natural_documents
        return documents[:, None, queries, None] != documents[:, None, None, keys]

    def attention(self, core: Callable[..., torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, comm_type: str) -> torch.Tensor:
        """``core(q, k, v, mask, causal=True)`` (the layer's core attention) over the CP group, from this rank's
        queries [s/cp, b, n, d], keys and values [s/cp, b, g, d]; returns this rank's context [s/cp, b, n d]."""
        if comm_type == "p2p":
            from lightning_megatron.transformer.ring_attention import ring_attention

            if core.training and core.config.attention_dropout > 0:
                raise ValueError("cp_comm_type='p2p' (ring attention) has no attention dropout: set "
                                 "attention_dropout=0.0 or use cp_comm_type='all_gather' or 'a2a'")
            if self.documents is not None and self._natural_documents is None:
                self._natural_documents = self.documents.index_select(1, self.natural_order())
            return ring_attention(query, key, value, self.group, core.softmax_scale, self._natural_documents)
        if comm_type == "all_gather":
            # The whole sequence's keys and values, in sequence order; each of this rank's chunks attends to
            # the keys up to its own end, causally (bottom-right aligned), within its documents.
            natural = self.natural_order()
            key, value = (self.gather(t).index_select(0, natural) for t in (key, value))
            # the queries, if a view of linear_qkv's output, copied out: this rank's keys and values in it are
            # no longer read (their gathered copies are), and the attention keeps the queries for its backward
            query = owned(query) if torch.is_grad_enabled() and not torch.compiler.is_compiling() else query
            out = []
            for i, c in enumerate(self.chunks):
                begin, end = c * self.chunk, (c + 1) * self.chunk
                mask = self.document_mask(slice(begin, end), slice(0, end))
                out.append(core(query[i * self.chunk:(i + 1) * self.chunk], key[:end], value[:end], mask, causal=True))
            return torch.cat(out)
        cp, (s, b, n, d), g = group_size(self.group), query.shape, key.shape[2]
        if n % cp:
            raise ValueError(f"cp_comm_type='a2a': the {n} attention heads of a tensor-parallel rank do not divide "
                             f"over context_parallel_size={cp}; use cp_comm_type='all_gather'")
        if g % cp:  # fewer key/value heads than CP ranks: each query head group takes its own copy
            key, value = key.repeat_interleave(n // g, dim=2), value.repeat_interleave(n // g, dim=2)
        # The whole sequence of 1/cp of the heads, put in sequence order: plain causal attention (no mask
        # but the documents'), then back to the split's order and to this rank's tokens.
        natural = self.natural_order()
        q, k, v = (_HeadsForSequence.apply(t, self.group, True).index_select(0, natural) for t in (query, key, value))
        context = core(q, k, v, self.document_mask(), causal=True).index_select(0, self.gathered)  # [s, b, n/cp d]
        return _HeadsForSequence.apply(context.reshape(cp * s, b, n // cp, d), self.group, False).reshape(s, b, n * d)


def split_batch(batch: Mapping[str, Any], group: Group, cp_rank: int) -> tuple[dict[str, Any], ContextParallel]:
    """This CP rank's part of a batch of ``[b, s]`` tensors (every tensor whose dim 1 is the sequence of
    ``tokens``; others as they are), with ``position_ids`` (the real positions, ``arange`` when the batch has
    none) and the :class:`ContextParallel` of its attention (causal on the global indices, within
    ``document_ids`` when the batch has them)."""
    cp_size = group_size(group)
    tokens = batch["tokens"]
    b, s = tokens.shape
    device = tokens.device
    mine = context_parallel_indices(s, cp_size, cp_rank, device)
    gathered = torch.cat([context_parallel_indices(s, cp_size, r, device) for r in range(cp_size)])
    full = dict(batch)
    if full.get("position_ids") is None:
        full["position_ids"] = torch.arange(s, device=device).expand(b, s)
    out = {k: v.index_select(1, mine) if torch.is_tensor(v) and v.dim() >= 2 and v.shape[:2] == (b, s) else v
           for k, v in full.items()}
    documents = out.pop("document_ids", None)  # travel with the chunks: the attention gathers them
    gathered_documents = None if documents is None else full["document_ids"].index_select(1, gathered)
    return out, ContextParallel(group=group, chunks=(cp_rank, 2 * cp_size - 1 - cp_rank), chunk=s // (2 * cp_size),
                                gathered=gathered, documents=gathered_documents)
