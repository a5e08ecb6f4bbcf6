"""lightning_megatron: Megatron-LM-style tensor, pipeline and data parallel training for PyTorch Lightning."""

from __future__ import annotations

__version__ = "0.1.0"

from lightning_megatron.parallel_state import ParallelLayout, ParallelState, initialize_model_parallel


def __getattr__(name: str):
    # The Lightning glue is imported lazily so that `tensor_parallel` / `transformer` users do not pay for it.
    if name == "MegatronStrategy":
        from lightning_megatron.strategy import MegatronStrategy

        return MegatronStrategy
    if name == "MegatronLightningModule":
        from lightning_megatron.module import MegatronLightningModule

        return MegatronLightningModule
    raise AttributeError(f"module 'lightning_megatron' has no attribute {name!r}")


__all__ = ["MegatronStrategy", "MegatronLightningModule", "ParallelLayout", "ParallelState", "initialize_model_parallel", "__version__"]
