"""What a step of the model dispatches on its host, for ``check --estimate-time`` on an accelerator.

An accelerator runs a kernel while its host prepares the next (Python, autograd, the launch): a step whose
kernels are short takes as long as its host's dispatch, whatever the device's rates (the H200's bert-base step:
35.5 ms of kernels in 57.8 ms, docs/benchmarks.md, "GPU check"). The ops a step dispatches do not depend on the
width, the sequence or the batch, so they are counted on a small copy of the model: its own layer and its
one-layer model with the same spec, norms, dropout, heads, groups, experts and adapters
(:meth:`~lightning_megatron.cost.protocols.StepCost.build_layer_step`, ``build_model_step``), run once on the
CPU under a counting dispatch mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from lightning_megatron.check.timing import Device, Framework, HostOps
from lightning_megatron.cost.protocols import StepCost
from lightning_megatron.cost.transformer import TransformerCost
from lightning_megatron.transformer.kernels import Kernels, set_kernels

__all__ = ["count_host_ops", "host_line", "small_copy"]


def small_copy(m: TransformerCost) -> TransformerCost:
    """``m`` with heads 8 wide, MLPs 16 wide, a vocabulary of two padding multiples (less one when ``m``'s is padded:
    the padded columns' masking is ops too) and two samples of 16 tokens (enough for each of a mixture's experts to
    get rows): the same structure, dispatching the same ops."""
    d = 8
    multiple = max(m.make_vocab_size_divisible_by, 1)
    vocab = 2 * multiple - (1 if m.padded_vocab(1) != m.vocab_size else 0)
    seq = max(16, 4 * (m.num_moe_experts or 0))
    narrow = dict(hidden_size=m.num_attention_heads * d, kv_channels=d if m.kv_channels else None,
                  ffn_hidden_size=16 if m.ffn_hidden_size else None,
                  moe_ffn_hidden_size=16 if m.moe_ffn_hidden_size else None,
                  moe_shared_expert_intermediate_size=16 if m.moe_shared_expert_intermediate_size else None,
                  vocab_size=vocab, seq_length=seq, max_sequence_length=max(seq, 16), micro_batch_size=2,
                  global_batch_size=2)
    return dataclasses.replace(m, **narrow)


class _AcceleratorKernels(Kernels):
    """The library's default kernels as an accelerator dispatches them, for counting on the CPU: ``F.dropout`` is
    one fused op there (``native_dropout``, and its backward one), four on the CPU (``empty_like``,
    ``bernoulli_``, ``div_``, ``mul``)."""

    def dropout(self, x: torch.Tensor, p: float) -> torch.Tensor:
        return torch.native_dropout(x, p, True)[0]


def count_host_ops(m: StepCost) -> HostOps | None:
    """The aten ops (views included) of one microbatch of ``m``'s layer and of its ends (embeddings, heads, loss:
    the one-layer model's less the layer's), each with one op per trained parameter (the GradBuffer's hook adding
    the gradient into ``main_grad``), as an accelerator dispatches them: dropout one fused op each way, and fused
    attention one op each way, its dropout inside the kernel (the CPU's SDPA with dropout is its math path, ~45
    ops; counted without the dropout: one op each way there too). None when ``m`` is not a
    :class:`TransformerCost` (no small copy to build); ends of 0 when its family builds no one-layer model."""
    if not isinstance(m, TransformerCost):
        return None
    from lightning_megatron.check.devices import isolated_rng

    small = small_copy(m)
    if not m.unfused_attention:
        small = dataclasses.replace(small, attention_dropout=0.0)
    with isolated_rng():
        layer = _dispatched(small.build_layer_step)
        try:
            model = _dispatched(small.build_model_step)
        except NotImplementedError:
            model = layer
    return HostOps(layer=layer, ends=model - layer)


def _dispatched(build: Callable[[], tuple[Any, Callable[[], None]]]) -> int:
    """Ops of the second run of ``build()``'s step (the first may make what later ones reuse), plus its module's
    trained parameters."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    module, step = build()
    set_kernels(module, _AcceleratorKernels())
    step()
    with Count() as count:
        step()
    return count.ops + sum(p.requires_grad for p in module.parameters())


def host_line(dev: Device, fw: Framework) -> str:
    """``; host ...``: the host time per op and the ops counted, where the step's dispatch is modelled."""
    ops = fw.host_ops
    if dev.host_op is None or ops is None:
        return ""
    return (f"; host {dev.host_op * 1e6:g} us an op: {ops.layer} ops a layer, {ops.ends} the ends, a microbatch, "
            f"{ops.step} a step (the step takes the longer of the device's work and the host's)")
