"""lightning_megatron: Megatron-LM-style tensor, pipeline and data parallel training for PyTorch Lightning."""

from __future__ import annotations

__version__ = "0.1.0"
