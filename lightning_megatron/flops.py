"""FLOPs of a transformer training step from its sizes: Megatron's count, as one pure function.

Used by :func:`lightning_megatron.transformer.config.training_flops` (what a module declares through
:class:`~lightning_megatron.protocols.CountsFlops` and ``ThroughputCallback`` logs) and by the
step-time estimate of ``lightning-megatron check --estimate-time`` (a config-level count: no model is
built). No torch import: the arguments may be numbers or tensors.
"""

from __future__ import annotations

from typing import Any

__all__ = ["transformer_flops"]


def transformer_flops(*, num_layers: int, hidden_size: int, ffn_hidden_size: int, seq_length: int, tokens: Any,
                      head_tokens: Any, vocab_size: int, head_dense: bool = True, recompute: bool = False,
                      query_projection_size: int | None = None, kv_projection_size: int | None = None,
                      gated_linear_unit: bool = False) -> Any:
    """FLOPs of one training step (a multiply-add is 2 FLOPs, the backward twice the forward)::

        r (6 T L (4 h^2 + 2 h f) + 12 T L s h)  +  6 T_head (h V + [head_dense] h^2)

    ``T = tokens`` of the step (all replicas), L layers, h hidden, f FFN hidden, s ``seq_length``, V
    ``vocab_size``: the layers' weight matmuls (qkv 3h^2, projection h^2, MLP 2hf), the attention
    scores and their weighted sum, and the LM head run on ``head_tokens`` tokens (BERT's has a dense
    h x h layer before the output layer, GPT's only the output layer). ``r = 4/3`` with full
    activation recomputation (one more forward of every layer: the hardware FLOPs), else 1.

    With f = 4h, no head dense and recomputation this is the 96 B s l h^2 (1 + s/6h + V/16lh) of
    Narayanan et al. 2021 (eq. 3), with T = B s.

    Decoders (megatron-core's count): with P = ``query_projection_size`` (n d; default h) and
    K = ``kv_projection_size`` (g d for grouped-query attention; default P) the attention matmuls are
    2 h P (q, proj) + 2 h K (k, v) instead of 4 h^2 and the scores 12 T L s P; a gated MLP
    (``gated_linear_unit``, SwiGLU) has three h x f matrices instead of two.
    """
    L, h, f, s = num_layers, hidden_size, ffn_hidden_size, seq_length
    p = h if query_projection_size is None else query_projection_size
    k = p if kv_projection_size is None else kv_projection_size
    mlp = (3 if gated_linear_unit else 2) * h * f
    layers = 6.0 * tokens * L * (2 * h * p + 2 * h * k + mlp) + 12.0 * tokens * L * s * p
    head = 6.0 * head_tokens * (h * vocab_size + (h * h if head_dense else 0))
    return layers * (4.0 / 3.0 if recompute else 1.0) + head
