"""What a model declares about its costs, for estimates that build no model.

- :class:`MemoryCost`: parameters per TP rank and pipeline stage, activation bytes per layer and
  microbatch, what the first and last stage add. :mod:`lightning_megatron.cost.memory` adds the
  layout's part (gradients, optimizer state, ZeRO-1 shards, microbatches in flight per schedule).
- :class:`StepCost`: a :class:`MemoryCost` that also gives the sizes the step-time model counts FLOPs
  and bytes with (per layer, head, vocabulary) and builds one of its own layers and a one-layer model
  for timing on this machine (``check --estimate-time --device this``).
- :class:`EstimatesCost`: on a LightningModule class, the classmethod that makes its cost record from
  a recipe's ``model`` and ``data`` arguments.

:class:`~lightning_megatron.cost.transformer.TransformerCost` implements :class:`StepCost` for
transformer layers; a family declares its ends in ``models/<family>/cost.py``. Pure declarations: no
torch, no model family, no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = ["EstimatesCost", "MemoryCost", "StepCost"]


@runtime_checkable
class MemoryCost(Protocol):
    """A model's costs per rank for ``lightning-megatron check --estimate-memory`` (no model is built)."""

    num_layers: int
    """Transformer layers (split evenly over pipeline stages and virtual chunks)."""
    micro_batch_size: int
    global_batch_size: int
    param_bytes: int
    """Bytes per parameter element (4: fp32, 2: 16-bit)."""
    optimizer: str
    """"adam"/"adamw" (two fp32 moments) or another (one)."""
    recompute: bool
    """Full activation recomputation (each layer keeps only its input)."""

    def stage_parameters(self, tp: int, pp: int, stage: int) -> int:
        """Parameter elements on one TP rank of pipeline stage ``stage`` (its ``num_layers / pp`` layers and
        the embeddings or heads the stage holds, the tied embedding's second copy included)."""

    def layer_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        """Bytes one layer saves for backward for one microbatch."""

    def layer_input_bytes(self, tp: int, sequence_parallel: bool) -> float:
        """Bytes one layer keeps per microbatch under full recomputation (its input)."""

    def first_stage_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        """Bytes the first stage saves outside the layers per microbatch (e.g. the embedding dropout's mask)."""

    def last_stage_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        """Bytes the last stage saves outside the layers per microbatch (heads and loss; under sequence
        parallelism what runs on the sequence's chunk keeps the chunk)."""

    def tensor_parallel_problem(self, tp: int) -> str | None:
        """Why the model cannot be split over ``tp`` ranks (heads, FFN not divisible), or None."""

    def describe(self) -> str:
        """One line: the sizes the estimate used."""


@runtime_checkable
class StepCost(MemoryCost, Protocol):
    """A :class:`MemoryCost` whose step time ``check --estimate-time`` predicts
    (:mod:`lightning_megatron.check.timing`): transformer layers of these sizes, a head over
    ``head_fraction`` of the tokens (with a dense ``h x h`` layer before it when ``head_dense``), a
    (padded, vocab-parallel) vocabulary."""

    hidden_size: int
    num_attention_heads: int
    seq_length: int
    hidden_dropout: float
    attention_dropout: float

    @property
    def ffn(self) -> int:
        """The MLP's hidden width."""

    @property
    def head_fraction(self) -> float:
        """Fraction of the tokens that go through the output layer (a masked LM: its masking rate)."""

    @property
    def head_dense(self) -> bool:
        """A dense ``h x h`` layer before the output layer (BERT's LM head)."""

    @property
    def unfused_attention(self) -> bool:
        """The attention keeps its ``[b, a, s, s]`` probabilities (else a fused kernel's statistics)."""

    @property
    def mask_bytes(self) -> int:
        """Bytes per element of a saved dropout mask."""

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary padded for ``tp`` ranks."""

    def build_layer_step(self) -> tuple[Any, Callable[[], None]]:
        """``(module, step)``: one of the model's own layers at these sizes (one TP rank) and a step that
        runs its forward and backward on one microbatch; the caller may swap the module's kernels
        before timing ``step``."""

    def build_model_step(self, num_layers: int = 1) -> tuple[Any, Callable[[], None]]:
        """``(module, step)``: a model of these sizes with ``num_layers`` layers, its embeddings, heads and loss,
        and a step that runs one microbatch's forward and backward as a training step does. Raises
        ``NotImplementedError`` when the family does not build one (its vocabulary passes are then timed
        at the copy rate)."""


@runtime_checkable
class EstimatesCost(Protocol):
    """Optional, on the module's class: its costs for ``lightning-megatron check --estimate-memory`` (any
    :class:`MemoryCost`) and ``--estimate-time`` (a :class:`StepCost`), which build no model."""

    @classmethod
    def estimate_shape(cls, model: Mapping[str, Any], data: Mapping[str, Any], *, micro_batch_size: int,
                       global_batch_size: int) -> MemoryCost:
        """The module's :class:`MemoryCost` from the recipe's ``model`` and ``data`` arguments (dropout as
        given)."""
