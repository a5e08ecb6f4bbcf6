"""The KV cache of incremental decoding: :class:`InferenceContext` (megatron-core's static batching).

During generation the model runs once on the prompt (positions 0 .. s0-1) and then once per new token
(position s0, s0+1, ...). Each attention layer keeps the keys (already rotated by RoPE) and values of
the positions seen so far, on this rank's key/value heads [max_s, max_b, g/t, d], so a step costs
O(s) instead of re-running the whole sequence. The caller (the generation loop) passes the context
as ``inference_context=`` through TransformerBlock -> TransformerLayer -> SelfAttention, computes
the rotary table (and learned positions) for positions ``sequence_len_offset ..`` and calls
:meth:`InferenceContext.advance` after each forward. New queries attend to every cached position
and causally among themselves (the queries are the last positions of the keys).
"""

from __future__ import annotations

import torch

__all__ = ["InferenceContext"]


class InferenceContext:
    """Per-layer key/value buffers of one batch of sequences being generated.

    ``max_batch_size`` and ``max_sequence_length`` (prompt + new tokens) size the buffers, allocated
    on the first forward of each layer with the dtype and device of its keys.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int) -> None:
        for name, value in (("max_batch_size", max_batch_size), ("max_sequence_length", max_sequence_length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.sequence_len_offset = 0
        """Positions already in the cache: the first new token of the next forward sits here."""
        self.key_value_memory: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def append(self, layer_number: int, key: torch.Tensor, value: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``, ``value`` [s, b, g/t, d] at positions ``sequence_len_offset ..`` of layer
        ``layer_number``; return the keys and values of every position so far [offset + s, b, g/t, d]."""
        s, b = key.shape[:2]
        start, end = self.sequence_len_offset, self.sequence_len_offset + s
        if end > self.max_sequence_length:
            raise ValueError(f"the KV cache holds max_sequence_length={self.max_sequence_length} positions but "
                             f"{start} + {s} new ones were given: build the InferenceContext with a larger "
                             f"max_sequence_length (prompt length + new tokens)")
        if b > self.max_batch_size:
            raise ValueError(f"batch of {b} sequences exceeds the KV cache's max_batch_size={self.max_batch_size}")
        if layer_number not in self.key_value_memory:
            shape = (self.max_sequence_length, self.max_batch_size, *key.shape[2:])
            self.key_value_memory[layer_number] = (key.new_empty(shape), value.new_empty(shape))
        keys, values = self.key_value_memory[layer_number]
        keys[start:end, :b] = key
        values[start:end, :b] = value
        return keys[:end, :b], values[:end, :b]

    def advance(self, tokens: int) -> None:
        """After a forward over ``tokens`` new positions: they are now cached."""
        self.sequence_len_offset += tokens

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept for the next batch)."""
        self.sequence_len_offset = 0
