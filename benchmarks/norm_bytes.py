"""Bytes a norm layer's forward and backward move per activation element, counted at dispatch (device-independent).

    python benchmarks/norm_bytes.py [--norm RMSNorm|LayerNorm] [--hidden 2048] [--tokens 2048]

Each aten op's inputs and outputs (views excluded) in one forward and backward of the library's norm on a bf16
activation [tokens, 1, hidden]. On an accelerator these ops are memory-bound: bytes / bandwidth estimates their
time (docs/benchmarks.md, "GPU check": RMSNorm was the llama decoder's largest non-GEMM lead). Counted on the meta
device (as on CPU): the RMSNorm (torch's ``F.rms_norm``) is there the composite of fp32 ops that CUDA runs as one
fused kernel each way, so its figure is what the arithmetic spelled out moves, not what a GPU's fused kernel does;
the LayerNorm is torch's kernel each way, as on a GPU (on CPU a 16-bit LayerNorm sums its weight and bias
gradients in fp32 itself, ``transformer/norms.py``: 48 more bytes an element in its backward).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze", "squeeze",
         "reshape", "as_strided", "detach", "alias"}


def _nbytes(x: object) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def norm_bytes(norm: str = "RMSNorm", hidden: int = 2048, tokens: int = 2048) -> dict[str, object]:
    """{"forward": bytes per element, "backward": ..., "ops": [(phase, op, bytes per element)]}."""
    from lightning_megatron.transformer.norms import LayerNorm, RMSNorm

    config = SimpleNamespace(layernorm_epsilon=1e-6, params_dtype=torch.bfloat16, sequence_parallel=False)
    with torch.device("meta"):  # shapes only; and not the CPU's correction of its 16-bit LayerNorm sums
        layer = (RMSNorm if norm == "RMSNorm" else LayerNorm)(config, hidden)
        x = torch.randn(tokens, 1, hidden, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(tokens, 1, hidden, dtype=torch.bfloat16)
    phase, ops = ["forward"], []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ not in VIEWS:
                ops.append((phase[0], func.overloadpacket.__name__, (_nbytes(list(args)) + _nbytes(out)) / x.numel()))
            return out

    with Count():
        y = layer(x)
        phase[0] = "backward"
        y.backward(grad)
    return {"forward": sum(b for p, _, b in ops if p == "forward"),
            "backward": sum(b for p, _, b in ops if p == "backward"), "ops": ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--norm", default="RMSNorm", choices=["RMSNorm", "LayerNorm"])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    result = norm_bytes(args.norm, args.hidden, args.tokens)
    print(f"{args.norm}: forward {result['forward']:.0f} B/element, backward {result['backward']:.0f} B/element")
    for phase, op, b in result["ops"]:
        print(f"  {phase:8s} {op:12s} {b:5.1f}")


if __name__ == "__main__":
    main()
