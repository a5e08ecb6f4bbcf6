"""Strided TP partitions (Megatron's ``partition_stride``; the gated MLP's fc1, [gate_r; up_r] per rank)
in checkpoints and ``check``: each rank's blocks at their global rows of [gate; up]."""

from __future__ import annotations


import torch

from lightning_megatron.check.parity import _assemble
from lightning_megatron.check.worker import global_pieces, module_names
from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.sharded_state import ShardedStateMapper, shard_info
from lightning_megatron.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_replicated,
    set_tensor_model_parallel_attributes,
)
from lightning_megatron.transformer import MLP, MLPSubmodules, TransformerConfig


def test_strided_fc1_shards_sit_at_their_global_rows_in_checkpoints_and_check():
    """The TP shards of a gated fc1 ([gate_r; up_r], stride 2) are two row blocks each of the global
    [gate; up]: the checkpoint chunks and ``check``'s assembled tensors put them there."""
    f, h, t = 6, 2, 2
    full = torch.arange(2 * f * h, dtype=torch.float32).view(2 * f, h)  # [gate; up]
    gate, up = full.chunk(2)
    per_rank_pieces, per_rank_chunks = [], []
    for r in range(t):
        local = torch.nn.Parameter(torch.cat([gate.chunk(t)[r], up.chunk(t)[r]]))
        set_tensor_model_parallel_attributes(local, True, 0, stride=2)
        info = shard_info(local, {"tp": r}, {"tp": t})
        assert info.global_shape == (2 * f, h)
        ps = ParallelState(dims=ParallelDims(tp=t, dp=1), rank=r)  # this rank's place, no process groups
        state: dict = {}
        ShardedStateMapper(ps, [("w", local)], []).put(state, "model.w", local.detach(), local)
        per_rank_chunks += state["model.w"].pieces
        per_rank_pieces.append(global_pieces([("w", local)], {"w": local}, ps))
    rebuilt = torch.full_like(full, -1.0)
    for offsets, chunk in per_rank_chunks:
        rebuilt[offsets[0]:offsets[0] + chunk.shape[0]] = chunk
    assert torch.equal(rebuilt, full)
    assert torch.equal(_assemble(per_rank_pieces)["w"], full)
    # Loading fills the same chunks, which are views of the parameter: a TP=2 rank gets its shard.
    for r in range(t):
        target = torch.nn.Parameter(torch.zeros(2 * f // t, h))
        set_tensor_model_parallel_attributes(target, True, 0, stride=2)
        ps = ParallelState(dims=ParallelDims(tp=t, dp=1), rank=r)
        state = {}
        ShardedStateMapper(ps, [("w", target)], []).put(state, "model.w", target.detach(), target)
        for offsets, chunk in state["model.w"].pieces:  # what DCP does on load
            chunk.copy_(full[offsets[0]:offsets[0] + chunk.shape[0]])
        assert torch.equal(target.detach(), torch.cat([gate.chunk(t)[r], up.chunk(t)[r]]))
    # check's per-module output comparison skips the strided fc1 (its TP outputs are [gate_r; up_r]
    # per rank, not slices of the TP=1 output) and keeps its neighbours.
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=6,
                               gated_linear_unit=True, activation="silu")
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    mark_replicated(mlp.parameters())
    names = set(module_names([(f"mlp.{n}", p) for n, p in mlp.named_parameters()], [mlp]).values())
    assert names == {"mlp", "mlp.linear_fc2"}, names
