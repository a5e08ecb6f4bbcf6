"""Context parallelism: the sequence of every sample split over the ranks of the CP group.

megatron-core's load-balanced causal split: the sequence is cut into ``2 cp`` chunks and rank ``r`` keeps
chunks ``r`` and ``2 cp - 1 - r``, so every rank holds as many early (cheap) as late (expensive) queries
under the causal mask. Every tensor of a batch that runs along the sequence (``[b, s]``: tokens, labels,
loss mask, positions, document ids) is sliced the same way (:func:`split_batch`); the positions are the
tokens' real ones, so rope and learned positions see the sequence as one process does.

Attention (:class:`ContextParallel`): each rank computes the queries of its tokens against the keys and
values of the whole sequence, gathered over the CP group (an all-gather whose backward reduce-scatters
the keys' and values' gradients to their owners); the mask is causal on the tokens' global indices and,
for packed samples, keeps each token within its document. This is the all-gather variant of megatron-core's
``cp_comm_type="all_gather"``: the keys and values of a layer are held whole during its attention, the
queries and everything else stay split. No Lightning here; the group is an argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_megatron.parallel_state import Group, group_size
from lightning_megatron.tensor_parallel.mappings import gather_from_sequence_parallel_region

__all__ = ["ContextParallel", "context_parallel_indices", "sequence_length_problem", "split_batch"]


def sequence_length_problem(seq_length: int, cp_size: int) -> str | None:
    """Why ``seq_length`` tokens cannot be split over ``cp_size`` ranks (the 2 cp chunks), or None."""
    if cp_size > 1 and seq_length % (2 * cp_size):
        return (f"context parallelism: sequence length {seq_length} is not divisible by 2 x context_parallel_size "
                f"= {2 * cp_size} (each rank keeps two of 2 x {cp_size} equal chunks); choose a seq_length that is")
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


@dataclass(frozen=True)
class ContextParallel:
    """What attention needs to run over a CP group: the group, the mask of this rank's queries against
    the gathered keys (``[b or 1, 1, s / cp, s]``, True where hidden)."""

    group: Group
    mask: torch.Tensor

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` [s / cp, ...] of this rank -> [s, ...] of the group, in rank order (autograd: the gradient is
        reduce-scattered back)."""
        return gather_from_sequence_parallel_region(t, self.group, True)


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
    hidden = (gathered[None, :] > mine[:, None])[None, None]  # [1, 1, s/cp, s]: a later token
    documents = full.get("document_ids")
    if documents is not None:  # and another document
        hidden = hidden | (documents.index_select(1, mine)[:, None, :, None]
                           != documents.index_select(1, gathered)[:, None, None, :])
        out.pop("document_ids")
    return out, ContextParallel(group=group, mask=hidden)
