"""Megatron's tensor-parallel building blocks. No Lightning imports here."""

from __future__ import annotations

from lightning_megatron.communicator import Communicator, TorchCommunicator
from lightning_megatron.tensor_parallel.backward import WeightGradPolicy, defer_output_layer_weight_grad
from lightning_megatron.tensor_parallel.cross_entropy import recomputing_cross_entropy, vocab_parallel_cross_entropy
from lightning_megatron.tensor_parallel.deferred_wgrad import DeferredWeightGrad
from lightning_megatron.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_reduce_sequence_parallel_grads,
    init_method_normal,
    scaled_init_method_normal,
)
from lightning_megatron.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from lightning_megatron.tensor_parallel.random import (
    MODEL_PARALLEL_RNG_TRACKER_NAME,
    RNGStatesTracker,
    get_rng_tracker,
    model_parallel_seed,
    recompute,
)
from lightning_megatron.tensor_parallel.param_facts import (
    ParamFacts,
    is_counted,
    mark_replicated,
    param_facts,
    set_param_facts,
    set_tensor_model_parallel_attributes,
)
from lightning_megatron.tensor_parallel.utils import VocabUtility, divide, pad_vocab_size

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "recomputing_cross_entropy",
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "all_reduce_sequence_parallel_grads",
    "init_method_normal", "scaled_init_method_normal", "RNGStatesTracker", "get_rng_tracker",
    "model_parallel_seed", "recompute", "MODEL_PARALLEL_RNG_TRACKER_NAME", "VocabUtility", "divide",
    "pad_vocab_size", "set_tensor_model_parallel_attributes", "ParamFacts", "param_facts", "set_param_facts",
    "mark_replicated", "is_counted", "Communicator", "TorchCommunicator", "DeferredWeightGrad", "WeightGradPolicy",
    "defer_output_layer_weight_grad",
]
