"""The KV cache of incremental decoding: :class:`InferenceContext` (megatron-core's static batching).

During generation the model runs once on the prompt (positions 0 .. s0-1) and then once per new token
(position s0, s0+1, ...). Each attention layer keeps the keys (already rotated by RoPE) and values of
the positions seen so far, on this rank's key/value heads [max_s, max_b, g/t, d], so a step costs
O(s) instead of re-running the whole sequence. The caller (the generation loop) passes the context
as ``inference_context=`` through TransformerBlock -> TransformerLayer -> SelfAttention, computes
the rotary table (and learned positions) for positions ``sequence_len_offset ..`` and calls
:meth:`InferenceContext.advance` after each forward. New queries attend to every cached position
and causally among themselves (the queries are the last positions of the keys).

Prompts of different lengths share one batch left-padded (``left_padding``: the pad positions at the
start of each row), as Hugging Face pads for generation. The context then owns what padding changes:

- each row's positions count from its first real token (:meth:`InferenceContext.position_ids`,
  Hugging Face's ``cumsum(attention_mask) - 1``), which the model gives its learned positions or RoPE;
- the mask of every forward, prefill and cached steps alike (:meth:`InferenceContext.attention_mask`,
  which SelfAttention applies): a real token never sees a padding key. Padding queries see only padding
  keys (themselves at least), so no softmax row is empty and no NaN reaches the cache; their outputs are
  never read. With the causal triangle on top this is the packed-document mask of two "documents" per
  row (padding, then the prompt and its continuation).

:func:`sequence_parallel_off`: generation runs the layers of a sequence-parallel model without splitting
the sequence (one new token cannot be split over the TP ranks); the weights are the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lightning_megatron.transformer.config import TransformerConfig

__all__ = ["InferenceContext", "sequence_parallel_off"]


class InferenceContext:
    """Per-layer key/value buffers of one batch of sequences being generated.

    ``max_batch_size`` and ``max_sequence_length`` (prompt + new tokens) size the buffers, allocated
    on the first forward of each layer with the dtype and device of its keys. ``left_padding`` [b]
    (int64, on the tokens' device): how many positions at the start of each row are padding (None:
    none, every row starts at position 0).
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int, *,
                 left_padding: torch.Tensor | None = None) -> None:
        for name, value in (("max_batch_size", max_batch_size), ("max_sequence_length", max_sequence_length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if left_padding is not None:
            if left_padding.shape != (max_batch_size,) or left_padding.is_floating_point():
                raise ValueError(f"left_padding of shape {tuple(left_padding.shape)} and dtype {left_padding.dtype}: "
                                 f"expected integers [max_batch_size={max_batch_size}], the pad positions of each row")
            if bool((left_padding < 0).any()) or bool((left_padding >= max_sequence_length).any()):
                raise ValueError(f"left_padding={left_padding.tolist()}: each row needs 0 <= padding < "
                                 f"max_sequence_length={max_sequence_length} (at least one real token)")
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.left_padding = left_padding
        """Pad positions at the start of each row [b], or None."""
        self.sequence_len_offset = 0
        """Positions already in the cache: the first new token of the next forward sits here."""
        self.key_value_memory: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mask: tuple[int, int, torch.Tensor] | None = None  # (offset, length, mask): shared by the layers

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

    def position_ids(self, length: int) -> torch.Tensor | None:
        """The positions [b, length] of the next forward's ``length`` tokens, each row counted from its
        first real token (padding at 0); None without ``left_padding`` (then they are ``offset ..``)."""
        if self.left_padding is None:
            return None
        offset = self.sequence_len_offset
        positions = torch.arange(offset, offset + length, device=self.left_padding.device)
        return (positions[None, :] - self.left_padding[:, None]).clamp(min=0)

    def attention_mask(self, length: int) -> torch.Tensor | None:
        """bool [b, 1, length, offset + length], True where a key is hidden from a query of the next forward:
        one of them is padding and the other is not (module docstring); None without ``left_padding``.
        Causal attention adds its triangle on top."""
        if self.left_padding is None:
            return None
        offset = self.sequence_len_offset
        if self._mask is not None and self._mask[:2] == (offset, length):
            return self._mask[2]
        real = torch.arange(offset + length, device=self.left_padding.device) >= self.left_padding[:, None]  # [b, sk]
        mask = real[:, None, offset:, None] != real[:, None, None, :]
        self._mask = (offset, length, mask)
        return mask

    def advance(self, tokens: int) -> None:
        """After a forward over ``tokens`` new positions: they are now cached."""
        self.sequence_len_offset += tokens

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept for the next batch)."""
        self.sequence_len_offset = 0
        self._mask = None


@contextlib.contextmanager
def sequence_parallel_off(module: nn.Module) -> Iterator[None]:
    """Inside the block, ``module`` runs as if built with ``sequence_parallel=False``: the
    ``sequence_parallel`` flag of every tensor-parallel linear (and LoRA adapter) and of every submodule's
    :class:`TransformerConfig` is False (``set_sequence_parallel``), and restored on exit. The parameters are the same
    (sequence parallelism splits activations only), so the outputs are those of the model without it:
    whole-sequence activations on every TP rank, the all-reduces of plain tensor parallelism."""
    from lightning_megatron.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from lightning_megatron.transformer.lora import LoRAAdapter

    configs = {id(c): c for m in module.modules()
               if isinstance(c := getattr(m, "config", None), TransformerConfig) and c.sequence_parallel}
    layers = [m for m in module.modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear, LoRAAdapter)) and m.sequence_parallel]
    owners = [*configs.values(), *layers]
    for owner in owners:
        owner.set_sequence_parallel(False)
    try:
        yield
    finally:
        for owner in owners:
            owner.set_sequence_parallel(True)
