"""What a step costs, declared below the models and computed without building one (docs/memory.md,
docs/check.md).

- :mod:`.protocols`: the contracts (:class:`MemoryCost`, :class:`StepCost`, :class:`EstimatesCost`);
- :mod:`.transformer`: :class:`TransformerCost`, transformer layers' parameters and activations from a
  config record (a family declares its ends in ``models/<family>/cost.py``);
- :mod:`.memory`: the layout's part (gradients, optimizer state, ZeRO-1, microbatches in flight per
  pipeline schedule) and the search over layouts.

No Lightning, CLI, ``check/``, ``callbacks/`` or model family is imported here; ``check`` asks the
module class for its cost record and never names a family.
"""

from lightning_megatron.cost.memory import (LayoutSearch, MemoryEstimate, candidate_layouts, estimate_memory,
                                            estimate_stage, layout_schedule, node_bytes, search_layouts)
from lightning_megatron.cost.protocols import EstimatesCost, MemoryCost, StepCost
from lightning_megatron.cost.transformer import DEFAULT_DROPOUT, TransformerCost

__all__ = ["DEFAULT_DROPOUT", "EstimatesCost", "LayoutSearch", "MemoryCost", "MemoryEstimate", "StepCost",
           "TransformerCost", "candidate_layouts", "estimate_memory", "estimate_stage", "layout_schedule",
           "node_bytes", "search_layouts"]
