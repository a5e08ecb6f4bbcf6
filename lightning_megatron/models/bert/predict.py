"""What ``predict_step`` returns per microbatch, from vocab-parallel logits without gathering them.

- ``masked_lm``: ``{"ids": [b, s, k], "probs": [b, s, k]}``, the ``k`` most likely tokens at every
  position and their softmax probabilities over the real vocabulary (``ids[..., 0]`` is the argmax);
- ``pooled``: the pooler output ``tanh(W h_0 + b)``, ``[b, h]``;
- ``hidden``: the encoder output, ``[b, s, h]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.parallel_state import Group, group_rank, group_size, process_group

__all__ = ["vocab_parallel_argmax", "vocab_parallel_topk", "predict_outputs"]


def vocab_parallel_argmax(logits: torch.Tensor, tp_group: Group, vocab_size: int) -> torch.Tensor:
    """Global argmax over vocab-parallel logits [..., V/t] without gathering them (padding excluded)."""
    partition = logits.size(-1)
    start = group_rank(tp_group) * partition
    valid = max(0, min(partition, vocab_size - start))
    if valid == 0:  # a rank holding only padding: never the argmax
        values = logits.new_full(logits.shape[:-1], float("-inf"), dtype=torch.float32)
        index = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    else:
        # The real columns only, in the logits' own dtype (the max of bf16 values is exact in bf16).
        values, index = logits.detach()[..., :valid].max(dim=-1)
    index = index + start
    if group_size(tp_group) == 1:
        return index
    both = torch.stack([values.float(), index.float()], dim=-1)  # ids < 2^24 are exact in fp32
    gathered = [torch.empty_like(both) for _ in range(group_size(tp_group))]
    dist.all_gather(gathered, both.contiguous(), group=process_group(tp_group))
    stacked = torch.stack(gathered)  # [t, ..., 2]
    best = stacked[..., 0].argmax(dim=0, keepdim=True)  # first rank wins ties, as a global argmax would
    return stacked[..., 1].gather(0, best).squeeze(0).long()


def vocab_parallel_topk(logits: torch.Tensor, tp_group: Group, vocab_size: int,
                        k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, ids)`` of the ``k`` largest of the real-vocabulary logits ``[..., V/t]`` sharded over
    ``tp_group``: softmax over the whole vocabulary (max and sum of exps all-reduced), candidates
    all-gathered (``t * k`` per position, never the full logits)."""
    partition = logits.size(-1)
    start = group_rank(tp_group) * partition
    valid = max(0, min(partition, vocab_size - start))
    k = min(k, vocab_size)
    local = logits.detach()[..., :valid].float()
    shape = logits.shape[:-1]
    if valid:
        values, index = local.topk(min(k, valid), dim=-1)
        index = index + start
        local_max = local.max(dim=-1).values
    else:  # a rank holding only padding
        values = local.new_full((*shape, 0), float("-inf"))
        index = torch.zeros((*shape, 0), dtype=torch.long, device=logits.device)
        local_max = local.new_full(shape, float("-inf"))
    pad = k - values.size(-1)  # every rank contributes k candidates (a short rank: -inf)
    if pad:
        values = torch.cat([values, values.new_full((*shape, pad), float("-inf"))], dim=-1)
        index = torch.cat([index, index.new_zeros((*shape, pad))], dim=-1)
    world = group_size(tp_group)
    global_max = local_max.clone()
    if world > 1:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=process_group(tp_group))
    sum_exp = (local - global_max.unsqueeze(-1)).exp().sum(dim=-1)
    if world > 1:
        dist.all_reduce(sum_exp, group=process_group(tp_group))
        both = torch.cat([values, index.float()], dim=-1).contiguous()  # ids < 2^24 are exact in fp32
        gathered = [torch.empty_like(both) for _ in range(world)]
        dist.all_gather(gathered, both, group=process_group(tp_group))
        values = torch.cat([g[..., :k] for g in gathered], dim=-1)
        index = torch.cat([g[..., k:] for g in gathered], dim=-1).long()
    # Stable: equal logits keep the lower id first, as a global topk would.
    order = values.argsort(dim=-1, descending=True, stable=True)[..., :k]
    values, index = values.gather(-1, order), index.gather(-1, order)
    probs = (values - global_max.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1)
    return probs, index


def predict_outputs(chunk: nn.Module, batch: dict[str, torch.Tensor], mode: str, *, tp_group: Group,
                    vocab_size: int, top_k: int) -> torch.Tensor | dict[str, torch.Tensor]:
    """The predictions of one microbatch on the last chunk (see the module docstring)."""
    tokens, mask, types = batch["tokens"], batch.get("attention_mask"), batch.get("token_types")
    if mask is None:
        mask = torch.ones_like(tokens)
    if mode == "masked_lm":
        logits, _ = chunk(tokens, mask, types)  # [b, s, V/t]
        probs, ids = vocab_parallel_topk(logits, tp_group, vocab_size, top_k)
        return {"ids": ids, "probs": probs}
    if mode == "hidden":
        hidden = chunk(tokens, mask, types, return_hidden_states=True)  # [s, b, h], full sequence
        return hidden.detach().transpose(0, 1).contiguous()
    if not chunk.add_binary_head:
        raise ValueError("predict_output='pooled' needs the pooler (add_binary_head=True); "
                         "use predict_output='hidden' and take the first token")
    return chunk(tokens, mask, types, return_pooled=True).detach()
