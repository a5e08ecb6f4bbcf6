"""TransformerBlock: the contiguous range of layers one pipeline chunk owns, plus the final norm.

The block builds the layers with GLOBAL indices ``layer_range`` (e.g. layers 2..3 of 4 on the
second of two stages), each inside the RNG stream keyed ``"layers.<global index>"``, so a chunk
gets exactly the weights the full model has for those layers, at any TP size.

Activation recomputation (``config.recompute_granularity``):
- "full", "uniform": the chunk's layers are checkpointed in groups of ``recompute_num_layers``;
  only each group's input is kept, the group is re-run in backward.
- "full", "block": the first ``recompute_num_layers`` layers of the chunk are checkpointed one by
  one; the rest keep their activations (use the memory headroom of the later stages).
- "selective": only core attention is checkpointed (inside SelfAttention).
Recomputation restores the CPU, accelerator and tracker RNG states, so dropout masks repeat and
loss and gradients are those of the run without recomputation.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from lightning_megatron.tensor_parallel import get_rng_tracker, recompute
from lightning_megatron.transformer.config import TransformerConfig
from lightning_megatron.transformer.inference import InferenceContext
from lightning_megatron.transformer.layer import layer_norm_spec, norm_placement
from lightning_megatron.transformer.rotary import RotaryTable
from lightning_megatron.transformer.spec import ModuleSpec, build_module
from lightning_megatron.transformer.utils import seeded

if TYPE_CHECKING:
    from lightning_megatron.transformer.context_parallel import ContextParallel

__all__ = ["TransformerBlock"]


class TransformerBlock(nn.Module):
    """Layers ``layer_range`` (global indices; None = all) of a stack built from one layer spec.

    [s, b, h] -> [s, b, h] ([s/t, b, h] under sequence parallelism). ``post_layer_norm`` adds the
    final norm on the chunk that ends the stack (``post_process``); None decides from the spec:
    yes for pre-norm layers, no for post-norm ones (their output is already normalized).
    """

    def __init__(self, config: TransformerConfig, spec: ModuleSpec, *, tp_group: dist.ProcessGroup | None = None,
                 layer_range: range | None = None, pre_process: bool = True, post_process: bool = True,
                 post_layer_norm: bool | None = None, seed: int = 1234, key_prefix: str = "layers",
                 expert_groups: object | None = None) -> None:
        super().__init__()
        self.config = config
        self.layer_range = range(config.num_layers) if layer_range is None else layer_range
        r = self.layer_range
        if r.step != 1 or len(r) < 1 or r.start < 0 or r.stop > config.num_layers:
            raise ValueError(f"layer_range={r} must be a non-empty contiguous range inside "
                             f"range(num_layers={config.num_layers})")
        self.pre_process, self.post_process = pre_process, post_process
        self.input_tensor: torch.Tensor | None = None
        layers = []
        for i in self.layer_range:
            with seeded(seed, f"{key_prefix}.{i}"):
                extra = {} if expert_groups is None else {"expert_groups": expert_groups}
                layers.append(build_module(spec, config=config, layer_number=i + 1, tp_group=tp_group, **extra))
        self.layers = nn.ModuleList(layers)
        if post_layer_norm is None:
            post_layer_norm = norm_placement(spec) == "pre"
        self.final_layernorm = (
            build_module(layer_norm_spec(spec), config=config, hidden_size=config.hidden_size,
                         eps=config.layernorm_epsilon)
            if post_process and post_layer_norm else None)

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """Pipeline hook: when ``pre_process`` is False the block's input is this tensor."""
        self.input_tensor = input_tensor

    def _run(self, start: int, end: int):
        def run(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                rotary_pos_emb: RotaryTable | None, inference_context: InferenceContext | None = None,
                context_parallel: ContextParallel | None = None) -> torch.Tensor:
            extra = {} if context_parallel is None else {"context_parallel": context_parallel}
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states, attention_mask, rotary_pos_emb=rotary_pos_emb,
                                      inference_context=inference_context, **extra)
            return hidden_states
        return run

    def forward(self, hidden_states: torch.Tensor | None, attention_mask: torch.Tensor | None, *,
                rotary_pos_emb: torch.Tensor | RotaryTable | None = None,
                inference_context: InferenceContext | None = None,
                context_parallel: ContextParallel | None = None) -> torch.Tensor:
        """``rotary_pos_emb``: the RoPE table [s, 1, 1, d_rot] of the full sequence (also under sequence
        parallelism) or None; it reaches every layer's attention, recomputed or not, as one
        :class:`~lightning_megatron.transformer.rotary.RotaryTable` (its cos and sin made once for them all).
        ``inference_context``: the KV cache of generation (no recomputation then).
        ``context_parallel``: this rank's part of the sequence
        (:class:`~lightning_megatron.transformer.context_parallel.ContextParallel`), for every attention."""
        if not self.pre_process:
            if self.input_tensor is None:
                raise ValueError("TransformerBlock with pre_process=False needs set_input_tensor(...) before forward")
            hidden_states = self.input_tensor
        if rotary_pos_emb is not None:
            rotary_pos_emb = RotaryTable.of(rotary_pos_emb)
        cfg, n = self.config, len(self.layers)
        # Under sequence parallelism each rank holds a different sequence chunk, so hidden dropout
        # must draw from the per-rank model-parallel stream (Megatron does the same).
        drops = self.training and (cfg.hidden_dropout > 0 or cfg.attention_dropout > 0)
        rng = get_rng_tracker().fork() if cfg.sequence_parallel and drops else contextlib.nullcontext()
        with rng:
            if cfg.recompute_granularity == "full" and self.training and inference_context is None:
                k = cfg.recompute_num_layers
                if cfg.recompute_method == "uniform":
                    for start in range(0, n, k):
                        hidden_states = recompute(self._run(start, min(start + k, n)), hidden_states, attention_mask,
                                                  rotary_pos_emb, None, context_parallel)
                else:  # "block"
                    for i in range(n):
                        if i < k:
                            hidden_states = recompute(self._run(i, i + 1), hidden_states, attention_mask,
                                                      rotary_pos_emb, None, context_parallel)
                        else:
                            hidden_states = self._run(i, i + 1)(hidden_states, attention_mask, rotary_pos_emb, None,
                                                                context_parallel)
            else:
                hidden_states = self._run(0, n)(hidden_states, attention_mask, rotary_pos_emb, inference_context,
                                                context_parallel)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
