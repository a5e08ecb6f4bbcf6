"""Context parallelism's split (megatron-core's load-balanced order) and its attention mask, against the
one-process causal and document masks; the layouts themselves (CP=2 alone and with TP + SP, interleaved
PP and ZeRO-1) equal one process in ``tests/test_gpt_parallel.py``."""

from __future__ import annotations

import pytest
import torch

from lightning_megatron.transformer.attention import document_attention_mask
from lightning_megatron.transformer.context_parallel import context_parallel_indices, split_batch


def test_each_rank_keeps_an_early_and_a_late_chunk():
    assert context_parallel_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context_parallel_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    ranks = [context_parallel_indices(24, 4, r) for r in range(4)]
    assert sorted(torch.cat(ranks).tolist()) == list(range(24))  # every token once
    assert len({int(r.sum()) for r in ranks}) == 1  # as much causal work on every rank
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by 2 x context_parallel_size = 4"):
        context_parallel_indices(10, 2, 0)


def test_a_rank_s_batch_and_mask_are_the_one_process_ones_at_its_tokens(monkeypatch):
    """Rank 1 of 2 on a packed batch: every [b, s] tensor sliced at its tokens, the real positions kept, and
    its mask (queries: its tokens; keys: the gathered sequence in rank order) equal to the one-process
    causal + document mask at those places."""
    import lightning_megatron.transformer.context_parallel as cp

    monkeypatch.setattr(cp, "group_size", lambda group: 2)  # the split's arithmetic only: no collective runs
    s = 8
    tokens = torch.arange(2 * s).view(2, s)
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(2, s), "document_ids": documents,
             "sample_index": torch.tensor([3, 4])}
    local, context = split_batch(batch, group=object(), cp_rank=1)
    mine, gathered = [2, 3, 4, 5], [0, 1, 6, 7, 2, 3, 4, 5]
    assert local["tokens"].tolist() == tokens[:, mine].tolist() and local["labels"].tolist() == (tokens + 1)[:, mine].tolist()
    assert local["position_ids"].tolist() == [mine, mine] and "document_ids" not in local
    assert local["sample_index"].tolist() == [3, 4]  # not along the sequence: as it is
    full = document_attention_mask(documents) | torch.ones(s, s, dtype=torch.bool).triu(1)
    assert torch.equal(context.mask, full[:, :, mine][:, :, :, gathered])
