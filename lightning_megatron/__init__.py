"""lightning_megatron: Megatron-LM-style tensor, pipeline and data parallel training for PyTorch Lightning."""

from __future__ import annotations

__version__ = "0.1.0"


def _leave_ctrl_c_to_rank_0_if_started_by_it() -> None:
    # A local rank that rank 0's launcher started leaves Ctrl-C to rank 0 from its first import of the package (the
    # CLI's included) until its stop handler is in place (lightning_megatron.launch.leave_ctrl_c_to_rank_0). The
    # variable is launch.CHILD_ENV (spelled out: launch is imported only where it is set; tests/test_launch.py
    # reads it).
    import os

    if os.environ.get("LIGHTNING_MEGATRON_LAUNCHED_BY_RANK_0") == "1":
        from lightning_megatron.launch import leave_ctrl_c_to_rank_0

        leave_ctrl_c_to_rank_0()


_leave_ctrl_c_to_rank_0_if_started_by_it()

_LAZY = {"MegatronStrategy": "lightning_megatron.strategy", "MegatronLightningModule": "lightning_megatron.module",
         "ParallelDims": "lightning_megatron.parallel_dims",
         "ParallelState": "lightning_megatron.parallel_state",
         "initialize_model_parallel": "lightning_megatron.parallel_state"}


def __getattr__(name: str):
    # Imported on first use: `import lightning_megatron` (and the `lightning-megatron` command's plot,
    # preprocess, train-tokenizer and --help) costs no torch import, and `tensor_parallel` /
    # `transformer` users do not pay for the Lightning glue.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_megatron' has no attribute {name!r}")


__all__ = ["MegatronStrategy", "MegatronLightningModule", "ParallelDims", "ParallelState", "initialize_model_parallel",
           "__version__"]
