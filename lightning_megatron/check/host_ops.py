"""What a step of the model dispatches on its host, for ``check --estimate-time`` on an accelerator.

An accelerator runs a kernel while its host prepares the next (Python, autograd, the launch): a step whose
kernels are short takes as long as its host's dispatch, whatever the device's rates (docs/check.md, "Host").
The ops a step dispatches do not depend on the width, the sequence or the batch, so they are counted on a small
copy of the model with the same spec, norms, dropout, heads, groups, experts and adapters: its models of two
layers and of one (:meth:`~lightning_megatron.cost.protocols.StepCost.build_model_step`; a layer is their
difference, as it runs inside the model, rotary embeddings and masks included), run on the CPU under a counting
dispatch mode, with the functions that are one fused kernel each way on an accelerator but a composite of
several ops on the CPU (:data:`FUSED_ON_ACCELERATORS`) dispatched as the GPU's fused kernels are, and the weight
gradients the library sums in fp32 on the CPU left to torch's kernels, as on a GPU
(:func:`~lightning_megatron.tensor_parallel.utils.torch_kernel_sums`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_megatron.check.records import Device, Framework, HostOps
from lightning_megatron.cost.protocols import StepCost
from lightning_megatron.cost.transformer import TransformerCost
from lightning_megatron.tensor_parallel.utils import torch_kernel_sums

__all__ = ["FUSED_ON_ACCELERATORS", "count_host_ops", "host_line", "small_copy"]

FUSED_ON_ACCELERATORS = (F.dropout, F.rms_norm, F.scaled_dot_product_attention)
"""One kernel each way on a GPU, several ops on the CPU, and so counted as the GPU dispatches them: ``F.dropout``
(four ops forward on the CPU) as ``native_dropout``, which the CPU has too; SDPA with dropout (its ~45-op math
path on the CPU) as SDPA without, one fused kernel on both (a GPU's applies the dropout inside); ``F.rms_norm``
(the CPU composes ~25 ops; ``_fused_rms_norm`` on a GPU) as the CPU's fused LayerNorm without its bias."""


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


def count_host_ops(m: StepCost) -> HostOps | None:
    """The aten ops (views included) of one microbatch of ``m``'s layer and of its ends (embeddings, heads, loss:
    the one-layer model's less a layer), each with one op per trained parameter (the GradBuffer's hook adding the
    gradient into ``main_grad``), as an accelerator dispatches them (:data:`FUSED_ON_ACCELERATORS`). None when
    ``m`` is not a :class:`TransformerCost` (no small copy to build); without a family's models, its layer alone
    (:meth:`~lightning_megatron.cost.protocols.StepCost.build_layer_step`) and ends of 0."""
    if not isinstance(m, TransformerCost):
        return None
    from lightning_megatron.check.devices import isolated_rng

    small = small_copy(m)
    with isolated_rng():
        try:
            one, two = _dispatched(lambda: small.build_model_step(1)), _dispatched(lambda: small.build_model_step(2))
        except NotImplementedError:
            return HostOps(layer=_dispatched(small.build_layer_step), ends=0)
    return HostOps(layer=two - one, ends=2 * one - two)


class _Counter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _AsAccelerator(TorchFunctionMode):
    """Each call of :data:`FUSED_ON_ACCELERATORS` as a GPU dispatches it (training dropouts; the others)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in FUSED_ON_ACCELERATORS or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        if func is F.dropout:
            x, p = args[0], kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            if not kwargs.get("training", args[2] if len(args) > 2 else True) or p == 0:
                return func(*args, **kwargs)
            return torch.native_dropout(x, p, True)[0]
        if func is F.scaled_dot_product_attention:
            if len(args) > 4:  # (query, key, value, attn_mask, dropout_p, ...)
                return func(*args[:4], 0.0, *args[5:], **kwargs)
            return func(*args, **{**kwargs, "dropout_p": 0.0})
        # F.rms_norm(input, normalized_shape, weight, eps): a fused norm kernel each way, as the CPU's LayerNorm
        full = dict(zip(("input", "normalized_shape", "weight", "eps"), args), **kwargs)
        return F.layer_norm(full["input"], full["normalized_shape"], full.get("weight"), None, full.get("eps") or 1e-5)


def _dispatched(build: Callable[[], tuple[Any, Callable[[], None]]]) -> int:
    """Ops of the second run of ``build()``'s step (the first may make what later ones reuse), plus its module's
    trained parameters."""
    with torch_kernel_sums():  # a GPU's kernels sum 16-bit weight gradients in fp32 themselves
        module, step = build()
        step()
        counter = _Counter()
        with counter, _AsAccelerator():
            step()
    return counter.ops + sum(p.requires_grad for p in module.parameters())


def host_line(dev: Device, fw: Framework) -> str:
    """``; host ...``: the host time per op and the ops counted, where the step's dispatch is modelled."""
    ops = fw.host_ops
    if dev.host_op is None or ops is None:
        return ""
    return (f"; host {dev.host_op * 1e6:g} us an op: {ops.layer} ops a layer, {ops.ends} the ends, a microbatch, "
            f"{ops.step} a step (the step takes the longer of the device's work and the host's)")
