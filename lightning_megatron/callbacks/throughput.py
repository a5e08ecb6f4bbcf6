"""Tokens/s, achieved TFLOP/s and MFU per device, logged every step.

FLOPs per step, Megatron's count (forward 2 FLOPs per multiply-add; backward twice the forward;
recomputation not counted):

    6 T L (4 h^2 + 2 h f)  +  12 T L s h  +  6 T_head (h V + h^2)

with T tokens per step, L layers, h hidden, f ffn hidden, s sequence length, V vocabulary: the
layers' weight matmuls (qkv 3h^2, projection h^2, MLP 2hf), the attention scores and their
weighted sum, and the LM head (dense h^2 and the [h, V] output layer) on T_head tokens: every
token, or only the masked ones when the model runs its head on those (``lm_head_on_masked_only``).
For models without these attributes, 6 N T + 12 T L s h with N the parameter count.
Achieved TFLOP/s per device = FLOPs / step time / world size. MFU = achieved / peak; the peak is
``peak_tflops`` or, when None, measured once on this device with a square GEMM of the model dtype.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

__all__ = ["ThroughputCallback", "measure_matmul_tflops"]


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device, n: int = 2048, repeats: int = 5) -> float:
    """Measured TFLOP/s of an n x n x n matmul (the best of ``repeats``)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        _synchronize()
        start = time.perf_counter()
        torch.matmul(a, b)
        _synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def _synchronize() -> None:
    """Wait for queued device work (nothing to wait for on a host without an accelerator)."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


class ThroughputCallback(Callback):
    """Log ``tokens_per_sec``, ``tflops_per_device`` and ``mfu`` each training step (rank-zero values).

    No host synchronisation per step: the masked-token count stays a device tensor, and Lightning
    reads the logged values only when it writes the logs (``log_every_n_steps``).
    """

    def __init__(self, peak_tflops: float | None = None, window: int = 5) -> None:
        if peak_tflops is not None and peak_tflops <= 0:
            raise ValueError(f"peak_tflops={peak_tflops} must be positive or None (measure)")
        self.peak_tflops = peak_tflops
        self.window = window
        self._times: list[float] = []
        self._start = 0.0

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.peak_tflops is None:
            dtype = next(pl_module.parameters()).dtype
            self.peak_tflops = measure_matmul_tflops(dtype, next(pl_module.parameters()).device)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._times.append(time.perf_counter() - self._start)
        self._times = self._times[-self.window:]
        step_time = sorted(self._times)[len(self._times) // 2]
        tokens = batch["tokens"] if isinstance(batch, dict) else batch[0]
        ps = getattr(trainer.strategy, "parallel_state", None)
        dp = ps.dp_size if ps is not None else trainer.world_size
        global_tokens = tokens.numel() * dp
        head_tokens: int | torch.Tensor = global_tokens
        if isinstance(batch, dict) and "loss_mask" in batch and getattr(pl_module, "hparams", {}).get(
                "lm_head_on_masked_only", False):
            head_tokens = (batch["loss_mask"] > 0).sum().double() * dp  # a device tensor: no sync
        flops = _step_flops(pl_module, global_tokens, tokens.size(-1), head_tokens)
        tflops_per_device = flops / step_time / trainer.world_size / 1e12
        pl_module.log("tokens_per_sec", global_tokens / step_time, on_step=True, rank_zero_only=True)
        pl_module.log("tflops_per_device", tflops_per_device, on_step=True, rank_zero_only=True)
        if self.peak_tflops:
            pl_module.log("mfu", tflops_per_device / self.peak_tflops, on_step=True, rank_zero_only=True)


def _step_flops(pl_module: LightningModule, tokens: int, seq: int,
                head_tokens: int | torch.Tensor) -> float | torch.Tensor:
    config = getattr(pl_module, "config", None)
    vocab = getattr(pl_module, "vocab_size", None)
    if config is None or vocab is None:
        hp = getattr(pl_module, "hparams", {})
        layers, hidden = hp.get("num_layers", 0), hp.get("hidden_size", 0)
        return 6.0 * _total_params(pl_module) * tokens + 12.0 * layers * seq * hidden * tokens
    L, h, f = config.num_layers, config.hidden_size, config.ffn_hidden_size
    return (6.0 * tokens * L * (4 * h * h + 2 * h * f) + 12.0 * tokens * L * seq * h
            + 6.0 * head_tokens * (h * vocab + h * h))


def _total_params(pl_module: LightningModule) -> int:
    """Parameters of the whole model: this rank's count scaled by TP and summed over pipeline stages."""
    cached = getattr(pl_module, "_lm_total_params", None)
    if cached is not None:
        return cached
    ps = getattr(pl_module, "parallel_state", None)
    count = 0
    for p in pl_module.parameters():
        n = p.numel()
        if ps is not None and getattr(p, "tensor_model_parallel", False):
            n *= ps.tp_size
        if getattr(p, "shared_embedding", False) and ps is not None and not ps.is_pipeline_first_stage():
            n = 0
        count += n
    if ps is not None and ps.pp_size > 1:
        import torch.distributed as dist

        t = torch.tensor([float(count)])
        dist.all_reduce(t, group=ps.pp_group)
        count = int(t.item())
    pl_module._lm_total_params = count
    return count
