"""Rotary position embeddings (RoPE), non-interleaved "rotate_half" convention (Hugging Face Llama,
megatron-core's default).

For a head vector x of width d, the first d_rot = int(d * rotary_percent) channels are rotated by an
angle that grows with the position p; the rest pass unchanged. With x = [x_1, x_2] (halves of the
rotated part) and inverse frequencies theta_i = base^(-2i / d_rot), i = 0 .. d_rot/2 - 1::

    angle(p) = [p theta, p theta]                      # [d_rot], the table RotaryEmbedding returns
    rope(x, p) = x * cos(angle) + rotate_half(x) * sin(angle),   rotate_half([x_1, x_2]) = [-x_2, x_1]

so <rope(q, p), rope(k, p')> depends on p - p' only. The angle table is fp32; cos and sin are cast to
the activation dtype before the product (as Hugging Face and megatron-core do).

The model computes the table for the whole sequence once and passes it down as ``rotary_pos_emb``
(TransformerBlock -> TransformerLayer -> SelfAttention), as a :class:`RotaryTable`: the angles with their cos
and sin, made once for all the layers (a layer given the bare angles makes its own). Under sequence
parallelism q and k are full-sequence after linear_qkv's all-gather, so the full table applies. With a KV
cache the new tokens sit at positions ``offset ..``: ``RotaryEmbedding(seq_len, offset)`` gives their rows.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "RotaryTable", "apply_rotary_pos_emb", "apply_rotary_pos_emb_heads", "llama3_scaling",
           "rotate_half"]

LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_LENGTH = 1.0, 4.0, 8192
"""Meta's Llama 3.1 / 3.2 frequency scaling constants, as megatron-core fixes them (transformers reads them from
``rope_scaling``: every released Llama 3.x has these)."""


def llama3_scaling(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's scaled inverse frequencies (transformers' ``_compute_llama3_parameters``, megatron-core's
    ``RotaryEmbedding._apply_scaling``): a wavelength over the original length divided by ``factor``, one under a
    quarter of it kept, those between interpolated linearly in ``original length / wavelength``."""
    low_wavelen = LLAMA3_ORIGINAL_LENGTH / LLAMA3_LOW_FREQ_FACTOR
    high_wavelen = LLAMA3_ORIGINAL_LENGTH / LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (LLAMA3_ORIGINAL_LENGTH / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """The angle table of RoPE: ``forward(seq_len, offset=0)`` -> freqs [seq_len, 1, 1, d_rot] (fp32),
    row i for position ``offset + i``."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: float = 10000.0,
                 scaling_factor: float | None = None) -> None:
        super().__init__()
        dim = int(kv_channels * rotary_percent)
        if dim < 2 or dim % 2 != 0:
            raise ValueError(f"rotary_percent={rotary_percent} of kv_channels={kv_channels} gives {dim} rotary "
                             f"channels; they must be a positive even number: choose rotary_percent so that "
                             f"kv_channels * rotary_percent is even")
        if not rotary_base > 0:
            raise ValueError(f"rotary_base={rotary_base} must be > 0 (e.g. 10000.0)")
        self.dim, self.base = dim, float(rotary_base)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.scaling_factor = scaling_factor  # Llama 3.1's (llama3_scaling), None: none
        if scaling_factor is not None:
            inv_freq = llama3_scaling(inv_freq, scaling_factor)
        # Not a parameter and not saved: it is a function of the config.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, offset: int = 0) -> torch.Tensor:
        positions = torch.arange(offset, offset + seq_len, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq.float())  # [s, d_rot/2]
        return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, d_rot]

    def extra_repr(self) -> str:
        scaled = f", llama3 scaling x{self.scaling_factor}" if self.scaling_factor is not None else ""
        return f"dim={self.dim}, base={self.base}{scaled}"


class RotaryTable:
    """The angle table of one forward's positions, ``freqs`` [s, 1, 1, d_rot] (or [s, b, 1, d_rot]: each sample's
    own positions; fp32), with its cos and sin in each dtype a layer asks for, made on the first ask: every layer
    of a forward rotates by the same tables (as Hugging Face Llama's ``position_embeddings``), where each would
    compute and cast its own (host time on an accelerator, docs/check.md, "Host"). A model may keep one from step
    to step for positions every step shares: what inference mode asks for is made and kept apart (its tensors
    cannot be saved for a backward)."""

    def __init__(self, freqs: torch.Tensor) -> None:
        self.freqs = freqs
        self._cos_sin: dict[tuple[torch.dtype, int, bool], tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, dtype: torch.dtype, ndim: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos(freqs), sin(freqs))`` computed in fp32 and cast to ``dtype`` (as Hugging Face and megatron-core
        do before the product), with singleton dims before the last to ``ndim`` dims ([s, 1, 1, 1, d_rot] for
        :func:`apply_rotary_pos_emb_heads`). Those made in inference mode serve its asks alone (a training step
        cannot save them for its backward)."""
        inference = torch.is_inference_mode_enabled()
        pair = self._cos_sin.get((dtype, ndim, inference))
        if pair is None:
            base = (dtype, self.freqs.dim(), inference)
            cos, sin = self._cos_sin.get(base) or (self.freqs.cos().to(dtype), self.freqs.sin().to(dtype))
            self._cos_sin[base] = cos, sin
            shape = (*cos.shape[:-1], *(1,) * (ndim - cos.dim()), cos.shape[-1])
            pair = self._cos_sin[(dtype, ndim, inference)] = cos.view(shape), sin.view(shape)
        return pair

    @staticmethod
    def of(table: torch.Tensor | RotaryTable) -> RotaryTable:
        """``table`` itself, or the bare angles ``table`` in a new one."""
        return table if isinstance(table, RotaryTable) else RotaryTable(table)

    def __repr__(self) -> str:
        return f"RotaryTable(freqs={tuple(self.freqs.shape)}, made={sorted({str(key[0]) for key in self._cos_sin})})"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x_1, x_2] -> [-x_2, x_1] along the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor | RotaryTable) -> torch.Tensor:
    """RoPE of ``t`` [s, b, heads, d] (or [s, b, groups, heads, d], any strides) by the angle table ``freqs``
    [s, 1, 1, d_rot] (d_rot <= d; or a :class:`RotaryTable`, whose cos and sin are made once): a new contiguous
    tensor, the leading d_rot channels rotated, the rest copied."""
    table = RotaryTable.of(freqs)
    _check_table(t, table.freqs)
    if torch.compiler.is_compiling():  # the expression itself: the compiler fuses it (and cannot trace out= views)
        angles = table.freqs.reshape(t.shape[0], *(1,) * (t.dim() - 2), table.freqs.shape[-1])
        cos, sin = angles.cos().to(t.dtype), angles.sin().to(t.dtype)
        rot = cos.shape[-1]
        t_rot, t_pass = t[..., :rot], t[..., rot:]
        t_rot = t_rot * cos + rotate_half(t_rot) * sin
        return t_rot if t_pass.shape[-1] == 0 else torch.cat([t_rot, t_pass], dim=-1)
    cos, sin = table.cos_sin(t.dtype, ndim=t.dim())
    return _Rotate.apply(t, cos, sin, False)


def _check_table(t: torch.Tensor, freqs: torch.Tensor) -> None:
    """Refuses a table whose positions are not ``t``'s sequence."""
    if freqs.shape[0] != t.shape[0]:
        raise ValueError(f"rotary table has {freqs.shape[0]} positions but the tensor has sequence length "
                         f"{t.shape[0]}: compute the table for the whole sequence (RotaryEmbedding(seq_len, offset))")


class _Rotate(torch.autograd.Function):
    """``t * cos + rotate_half(t) * sin`` on the leading channels, the bits of that expression through autograd
    without rotate_half's negated copy and concatenation (nor the one that appends the passing channels): with
    halves 1, 2 of the rotated channels, ``[t1 c1 - t2 s1, t2 c2 + t1 s2]`` (``a + (-b)`` is ``a - b`` exactly),
    and the backward its transpose ``[g1 c1 + g2 s2, g2 c2 - g1 s1]``, the rotation by the opposite angle
    (``inverse``: the same tables, the signs of the sin terms swapped, the bits of rotating by ``-sin``). Saves
    cos and sin ([s, 1, 1, d_rot])."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.inverse = inverse
        return _rotated(t, cos, sin, inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # The transpose is the rotation by the opposite angle: the same Function, so that a second derivative is
        # taken through it too.
        cos, sin = ctx.saved_tensors
        return _Rotate.apply(grad, cos, sin, not ctx.inverse), None, None, None


def apply_rotary_pos_emb_heads(t: torch.Tensor, freqs: torch.Tensor | RotaryTable, heads: int) -> torch.Tensor:
    """RoPE of the leading ``heads`` heads of ``t`` [s, b, groups, heads + k, d] by ``freqs`` [s, 1, 1, d_rot] (or a
    :class:`RotaryTable`), the other ``k`` copied: a new tensor of ``t``'s shape. On linear_qkv's group-major output
    (each group's query heads, its key, its value) one pass rotates every query and key, where
    :func:`apply_rotary_pos_emb` on the query and the key after their split would be two, each a dozen ops forward
    and backward (host time on an accelerator, docs/check.md, "Host"); the same bits. With one query head a group
    the queries, keys and values are views of the new tensor (with more, the queries' ``[s, b, n, d]`` would be a
    copy, and the keys and values views keeping all of it: ``SelfAttention`` rotates them apart then)."""
    table = RotaryTable.of(freqs)
    _check_table(t, table.freqs)
    if torch.compiler.is_compiling():
        freqs = table.freqs.unsqueeze(-2)  # [s, 1, 1, 1, d_rot]
        return torch.cat([apply_rotary_pos_emb(t[..., :heads, :], freqs), t[..., heads:, :]], dim=-2)
    cos, sin = table.cos_sin(t.dtype, ndim=5)
    return _RotateHeads.apply(t, cos, sin, heads, False)


class _RotateHeads(torch.autograd.Function):
    """:class:`_Rotate` on the leading ``heads`` heads (dim -2) of a new tensor, the others copied; the backward
    the same by the opposite angle."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                inverse: bool) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.heads, ctx.inverse = heads, inverse
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        _rotated(t[..., :heads, :], cos, sin, inverse, out[..., :heads, :])
        out[..., heads:, :].copy_(t[..., heads:, :])
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        cos, sin = ctx.saved_tensors
        return _RotateHeads.apply(grad, cos, sin, ctx.heads, not ctx.inverse), None, None, None, None


def _rotated(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """``t * cos + rotate_half(t) * sin`` on the leading channels (``inverse``: ``- rotate_half(t) * sin``, by the
    opposite angle), into ``out`` (a new tensor when None)."""
    rot = cos.shape[-1]
    h = rot // 2
    if out is None:
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    whole = rot == t.shape[-1]  # every channel rotated (the usual case): no views of all of them to dispatch
    o, r = (out, t) if whole else (out[..., :rot], t[..., :rot])
    torch.mul(r, cos, out=o)
    # both halves of each in one op (a split is one dispatch, two slices two: host time on an accelerator)
    (o1, o2), (t1, t2), (s1, s2) = (x.split(h, dim=-1) for x in (o, r, sin))
    first, second = (o1.add_, o2.sub_) if inverse else (o1.sub_, o2.add_)
    first(t2 * s1)
    second(t1 * s2)
    if not whole:
        out[..., rot:].copy_(t[..., rot:])
    return out
