"""A LoRA adapter's output side, before and after it accumulates into the base's output: seconds per microbatch.

    .venv/bin/python benchmarks/lora_adapter.py [--rounds 3] [--dtype fp32|bf16]

``lightning_megatron.transformer.lora.LoRAAdapter`` adds ``(alpha / r) B a`` (``a`` = ``A x``, ``[tokens, r]``)
to its base layer's output. Before 2026-12-03 it computed ``B a``, scaled it and added it to the base's output
(three passes over ``[tokens, out]`` forward, a fourth for the scale's backward); since then one ``addmm``
accumulates the scaled product into the base's output (the scale lands on the ``r``-wide operands). Measured,
alternating, in one process on all cores (llama-tiny's shapes: 4 x 256 tokens, r = 8, the four projections'
output widths 768, 512, 2752, 512):

- *output side*: forward + backward of exactly those ops, each way;
- *layer*: one llama-tiny decoder layer (RMSNorm, grouped-query attention, SwiGLU; base frozen, the CPU
  tuning's kernels) forward + backward, without adapters and with rank-8 adapters on its four projections
  added each way (the old way by the ``_up`` this file puts back), the adapters' time being the difference.

Median of ``--rounds`` x 30 timed repetitions. Times measured while other jobs share the machine are
contended: compare the two columns of a row, not rows of different runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

TOKENS, RANK, HIDDEN = 1024, 8, 512
OUTPUTS = {"linear_qkv": 768, "linear_proj": 512, "linear_fc1": 2752, "linear_fc2": 512}


def _timed(step: Callable[[], None], repeats: int = 30) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def output_side(out: int, dtype: torch.dtype) -> tuple[float, float]:
    """Seconds of ``base + scaling * (a B^T)`` forward + backward: separate ops, then ``addmm``."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(TOKENS, RANK, generator=g).to(dtype).requires_grad_()
    b = torch.randn(out, RANK, generator=g).to(dtype).requires_grad_()
    base = torch.randn(TOKENS, out, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(TOKENS, out, generator=g).to(dtype)

    def separate() -> None:
        (base + F.linear(a, b) * 2.0).backward(grad)

    def fused() -> None:
        torch.addmm(base, a, b.t(), alpha=2.0).backward(grad)

    return _timed(separate), _timed(fused)


def _separate_up(self: Any, a: torch.Tensor, b_w: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    """``LoRAAdapter._up`` as it was: the scaled product written, then added to the base's output."""
    out = F.linear(a, b_w) * self.scaling
    return out if base is None else base + out


def layer(dtype: torch.dtype) -> tuple[float, float, float]:
    """Seconds of one frozen llama-tiny layer forward + backward: no adapters, adapters added separately, by addmm."""
    from lightning_megatron.cpu.kernels import CPUKernels
    from lightning_megatron.models.gpt.cost import GPTCost
    from lightning_megatron.tensor_parallel.random import model_parallel_seed
    from lightning_megatron.transformer import lora
    from lightning_megatron.transformer.kernels import set_kernels
    from lightning_megatron.transformer.spec import build_module

    model_parallel_seed(0, 0)
    cost = GPTCost(num_layers=1, hidden_size=HIDDEN, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1376,
                   gated_linear_unit=True, add_bias_linear=False, rmsnorm=True, position_embedding_type="rope",
                   vocab_size=32000, seq_length=256, micro_batch_size=4, global_batch_size=4, on_cpu=True,
                   hidden_dropout=0.0, attention_dropout=0.0,
                   params_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")

    def build(adapters: str | None) -> Callable[[], None]:
        holder = nn.Module()
        holder.layers = nn.ModuleList([build_module(cost.layer_spec(), config=cost.layer_config(), layer_number=1)])
        if adapters is None:
            holder.requires_grad_(False)
        else:
            lora.add_lora(holder, lora.LoRAConfig(rank=RANK, alpha=2.0 * RANK),
                          global_names={id(p): n for n, p in holder.named_parameters()})
            with torch.no_grad():  # B is zero at the start: give it values
                for name, p in holder.named_parameters():
                    if name.endswith(lora.ADAPTER_OUT):
                        p.normal_()
            if adapters == "separate":
                for module in holder.modules():
                    if isinstance(module, lora.LoRAAdapter):
                        module._up = types.MethodType(_separate_up, module)
        set_kernels(holder, CPUKernels())
        x = torch.randn(256, 4, HIDDEN, dtype=dtype, requires_grad=True)

        def step() -> None:
            y = holder.layers[0](x, None)
            y.backward(torch.ones_like(y))
            holder.zero_grad(set_to_none=True)
            x.grad = None

        return step

    return _timed(build(None)), _timed(build("separate")), _timed(build("addmm"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(f"{torch.get_num_threads()} threads, {args.dtype}, {TOKENS} tokens, r = {RANK}; median of {args.rounds} rounds\n")
    sides = {name: ([], []) for name in OUTPUTS}
    layers: tuple[list[float], list[float], list[float]] = ([], [], [])
    for _ in range(args.rounds):
        for name, out in OUTPUTS.items():
            for acc, x in zip(sides[name], output_side(out, dtype)):
                acc.append(x)
        for acc, x in zip(layers, layer(dtype)):
            acc.append(x)
    print("| output side of | out | separate scale and add ms | addmm ms | after / before |")
    print("|---|---:|---:|---:|---:|")
    for name, (before, after) in sides.items():
        b, a = statistics.median(before), statistics.median(after)
        print(f"| {name} | {OUTPUTS[name]} | {b * 1e3:.2f} | {a * 1e3:.2f} | {a / b:.2f} |")
    frozen, before, after = (statistics.median(x) for x in layers)
    print(f"\nlayer, base frozen: {frozen * 1e3:.1f} ms; with adapters added separately {before * 1e3:.1f} ms (adapters "
          f"{(before - frozen) * 1e3:.1f}), by addmm {after * 1e3:.1f} ms (adapters {(after - frozen) * 1e3:.1f})")


if __name__ == "__main__":
    main()
