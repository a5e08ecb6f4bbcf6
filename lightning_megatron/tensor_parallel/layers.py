"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Y = XA + b with A of shape [in, out] (torch stores A^T as ``weight`` [out, in]).

Column parallel: A = [A_1 ... A_t] split by columns; rank i computes Y_i = X A_i + b_i. X must be
the same on every rank (copy_to: identity forward, all-reduce backward, because dL/dX = sum_i
dL/dY_i A_i^T is a sum over ranks). Y = [Y_1 ... Y_t] stays split unless ``gather_output``.

Row parallel: A = [A_1; ...; A_t] split by rows and X = [X_1 ... X_t] by columns; rank i computes
X_i A_i, and Y = sum_i X_i A_i + b (all-reduce forward, identity backward). Feeding a column-parallel
output straight into a row-parallel input (``input_is_parallel``) gives one all-reduce per MLP or
attention block forward and one backward: the reason up-projections are column-parallel and
down-projections row-parallel.

Sequence parallel: activations outside the TP region are split along the sequence (dim 0, shape
[s/t, b, h]); the column layer all-gathers its input along s and the row layer reduce-scatters its
output along s (same communication volume as one all-reduce, activations t times smaller). For its
weight gradient the column layer keeps its own part of the input, not the gathered one, and gathers it
again in the backward while the input gradient's GEMM runs (megatron-core's way): t times less of that
input kept, for one more all-gather in each backward.

Initialization is layout-independent: the full master weight is built on the CPU in fp32 with
``init_method`` and this rank keeps its slice, so TP=k shards are exact slices of the TP=1 weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from lightning_megatron.parallel_state import Group, group_rank, group_size
from lightning_megatron.tensor_parallel.backward import policy_embedding, policy_linear
from lightning_megatron.tensor_parallel.deferred_wgrad import DeferredWeightGrad
from lightning_megatron.tensor_parallel.mappings import (
    _gather_along_dim,
    _reduce_scatter_along_first_dim,
    all_gather_into_tensor,
    all_reduce_coalesced,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from lightning_megatron.tensor_parallel.param_facts import (
    param_facts,
    set_param_facts,
    set_tensor_model_parallel_attributes,
)
from lightning_megatron.tensor_parallel.utils import VocabUtility, divide

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "init_method_normal",
    "scaled_init_method_normal",
    "all_reduce_sequence_parallel_grads",
]

InitMethod = Callable[[torch.Tensor], object]


def init_method_normal(sigma: float = 0.02) -> InitMethod:
    """N(0, sigma^2) initialization (Megatron's default for weights)."""

    def init_(tensor: torch.Tensor) -> object:
        return nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> InitMethod:
    """N(0, (sigma / sqrt(2 * num_layers))^2): Megatron's init for output projections."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def _initialize_affine_weight(weight: torch.Tensor, full_shape: tuple[int, int], partition_dim: int,
                              init_method: InitMethod, rank: int, world: int, stride: int = 1) -> None:
    """Fill ``weight`` (this rank's shard) with its slice of a master weight built on the CPU in fp32."""
    set_tensor_model_parallel_attributes(weight, is_parallel=world > 1, dim=partition_dim, stride=stride)
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    per_partition = weight.size(partition_dim)
    # With stride s the dimension is s interleaved blocks; rank r keeps piece r of every block.
    pieces = torch.split(master, per_partition // stride, dim=partition_dim)
    mine = torch.cat(pieces[rank::world], dim=partition_dim)
    with torch.no_grad():
        weight.copy_(mine.to(dtype=weight.dtype, device=weight.device))


class _SequenceParallelLinear(torch.autograd.Function):
    """``F.linear`` of the sequence-parallel ``x`` [s/t, b, h] all-gathered along the sequence, keeping ``x`` (this
    rank's part) for the backward, not the gathered input. The backward gathers ``x`` again while the input
    gradient's GEMM runs (asynchronously where the TP communicator is), reduce-scatters that gradient along the
    sequence, and computes the weight gradient as autograd does for ``F.linear`` (``grad^T @ input``), or stashes
    it with ``deferral`` (:class:`~lightning_megatron.tensor_parallel.deferred_wgrad.DeferredWeightGrad`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group,
                deferral: DeferredWeightGrad | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.deferral, ctx.has_bias = group, deferral, bias is not None
        return torch.nn.functional.linear(_gather_along_dim(x, group, 0), weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        x = x.contiguous()
        total = torch.empty((group_size(ctx.group) * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
        gathering = all_gather_into_tensor(total, x, ctx.group, async_op=True)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:  # the input gradient's GEMM while the input is gathered
            grad_x = torch.mm(grad_2d, weight).view(*grad.shape[:-1], weight.shape[-1])
        gathering.wait()
        if grad_x is not None:
            grad_x = _reduce_scatter_along_first_dim(grad_x, ctx.group)
        total_2d = total.view(-1, total.shape[-1])
        grad_weight = None
        if ctx.deferral is not None:
            ctx.deferral.stash(weight, grad_2d.detach(), total_2d)
        elif ctx.needs_input_grad[1]:
            grad_weight = torch.mm(grad_2d.t(), total_2d)
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split by columns: weight [out/t, in], bias [out/t].

    Returns ``(output, bias)``: ``bias`` is None unless ``skip_bias_add`` (then the caller fuses the
    add, e.g. bias-gelu), as Megatron does. ``forward(x, weight=...)`` takes an external weight when
    the layer was built with ``skip_weight_param_allocation`` (the LM head tied to the embedding).
    Input [s, b, in] (or [s/t, b, in] with sequence parallel); output [s, b, out/t] or [s, b, out].
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group: Group = None,
                 bias: bool = True, gather_output: bool = False, skip_bias_add: bool = False,
                 init_method: InitMethod | None = None, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 stride: int = 1, skip_weight_param_allocation: bool = False) -> None:
        super().__init__()
        world = group_size(tp_group)
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True is incompatible with sequence_parallel=True")
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = tp_group
        self.weight_grad_deferral: DeferredWeightGrad | None = None  # set by a WeightGradPolicy's step
        self.gather_output, self.skip_bias_add, self.sequence_parallel = gather_output, skip_bias_add, sequence_parallel
        self.output_size_per_partition = divide(output_size, world, "output_size")
        init_method = init_method or init_method_normal()
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size,
                                                   dtype=params_dtype, device=device))
            _initialize_affine_weight(self.weight, (output_size, input_size), 0, init_method,
                                      group_rank(tp_group), world, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, is_parallel=world > 1, dim=0, stride=stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if weight is None:
            if self.weight is None:
                raise ValueError("ColumnParallelLinear was built with skip_weight_param_allocation=True: "
                                 "pass the weight to forward(input, weight=...)")
            weight = self.weight
        adapter = self._modules.get("adapter")
        if self.sequence_parallel and adapter is None and self._keeps_its_part(input_, weight):
            deferral = self.weight_grad_deferral
            if deferral is not None and not deferral.defers(weight):
                deferral = None
            bias = None if self.skip_bias_add else self.bias
            output = _SequenceParallelLinear.apply(input_, weight, bias, self.tp_group, deferral)
        else:
            if self.sequence_parallel:
                total_input = gather_from_sequence_parallel_region(input_, self.tp_group, True)
            else:
                total_input = copy_to_tensor_model_parallel_region(input_, self.tp_group)
            output = self.apply_weight(total_input, weight)
            if adapter is not None:  # a side branch (LoRA) on the same input: under SP this rank's part of it
                output = adapter(input_ if self.sequence_parallel else total_input, output)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)

    def _keeps_its_part(self, input_: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the sequence-parallel forward keeps its part of the input (:class:`_SequenceParallelLinear`):
        on more than one rank, for a weight gradient, without autocast (which the function's own GEMMs would
        bypass) and outside ``torch.compile`` (whose graphs keep the gathered input as before)."""
        return (group_size(self.tp_group) > 1 and weight.requires_grad and torch.is_grad_enabled()
                and not torch.is_autocast_enabled(input_.device.type) and not torch.compiler.is_compiling())

    def apply_weight(self, total_input: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``total_input @ weight.T (+ bias)`` without the TP mappings (the input already gathered), the
        weight gradient deferred when the step's policy defers this layer's (:mod:`.backward`)."""
        weight = self.weight if weight is None else weight
        bias = None if self.skip_bias_add else self.bias
        return policy_linear(self, total_input, weight, bias)

    def set_sequence_parallel(self, on: bool) -> bool:
        """Run with (``on``) or without sequence parallelism from now on (the weights do not depend on it);
        returns the previous setting."""
        previous, self.sequence_parallel = self.sequence_parallel, on
        return previous

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, out_per_partition={self.output_size_per_partition}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split by rows: weight [out, in/t], bias [out] replicated, added after the reduce.

    Input [s, b, in/t] when ``input_is_parallel`` else [s, b, in] (scattered here). Output [s, b, out]
    (or [s/t, b, out] with sequence parallel, where the reduce becomes a reduce-scatter).
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group: Group = None,
                 bias: bool = True, input_is_parallel: bool = False, skip_bias_add: bool = False,
                 init_method: InitMethod | None = None, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 stride: int = 1) -> None:
        super().__init__()
        world = group_size(tp_group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True requires input_is_parallel=True")
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = tp_group
        self.weight_grad_deferral: DeferredWeightGrad | None = None  # set by a WeightGradPolicy's step
        self.input_is_parallel, self.skip_bias_add, self.sequence_parallel = input_is_parallel, skip_bias_add, sequence_parallel
        self.input_size_per_partition = divide(input_size, world, "input_size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition,
                                               dtype=params_dtype, device=device))
        _initialize_affine_weight(self.weight, (output_size, input_size), 1, init_method or init_method_normal(),
                                  group_rank(tp_group), world, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            # Under sequence parallelism each rank adds the bias to its own sequence chunk only, so
            # its gradient is partial: the strategy all-reduces it over TP.
            set_param_facts(self.bias, sharded_over=(), replicated_over=("tp",), partition_dim=0,
                            sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_parallel = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        output_parallel = policy_linear(self, input_parallel, self.weight, None)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        else:
            # output_parallel is a fresh matmul result used nowhere else: reduce it in place.
            output = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group, inplace=True)
        adapter = self._modules.get("adapter")
        if adapter is not None:  # a side branch on the same input (LoRA), added before the bias
            output = adapter(input_parallel, output)
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None

    def set_sequence_parallel(self, on: bool) -> bool:
        """Run with (``on``) or without sequence parallelism from now on (the weights do not depend on it);
        returns the previous setting."""
        previous, self.sequence_parallel = self.sequence_parallel, on
        return previous

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, in_per_partition={self.input_size_per_partition}, out={self.output_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across TP ranks: weight [V/t, h].

    Rank i owns ids [i V/t, (i+1) V/t); ids outside its slice look up row 0 and are zeroed, and the
    partial embeddings are all-reduced (each id is owned by exactly one rank). ``num_embeddings`` must
    already be padded to a multiple of t (see ``pad_vocab_size``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: Group = None,
                 init_method: InitMethod | None = None, params_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        world, rank = group_size(tp_group), group_rank(tp_group)
        self.num_embeddings, self.embedding_dim, self.tp_group = num_embeddings, embedding_dim, tp_group
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, rank, world)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                               dtype=params_dtype, device=device))
        _initialize_affine_weight(self.weight, (num_embeddings, embedding_dim), 0,
                                  init_method or init_method_normal(), rank, world)

    def forward(self, input_: torch.Tensor, *, reduce: bool = True) -> torch.Tensor:
        """The rows of ``input_``'s ids; ``reduce=False``: this rank's partial sum (its ids' rows, zeros for the
        others'), for a caller that reduces it itself (a reduce-scatter into sequence-parallel chunks)."""
        if group_size(self.tp_group) == 1:
            return policy_embedding(self, input_, self.weight)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        output_parallel = policy_embedding(self, local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if not reduce:
            return output_parallel
        return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group, inplace=True)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, per_partition={self.num_embeddings_per_partition}, "
                f"embedding_dim={self.embedding_dim}")


def all_reduce_sequence_parallel_grads(parameters: Iterable[nn.Parameter], tp_group: Group) -> None:
    """Sum over TP the grads of parameters marked ``sequence_parallel`` (replicated weights that saw
    only this rank's sequence chunk: norms, row-parallel biases). One flat all-reduce."""
    all_reduce_coalesced([p.grad for p in parameters if param_facts(p).sequence_parallel and p.grad is not None],
                         tp_group)
