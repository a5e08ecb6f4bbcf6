"""Tokens/s, achieved TFLOP/s and MFU per device, logged every step.

FLOPs per step: the module's own count when it implements
:class:`~lightning_megatron.protocols.CountsFlops` (``BertLightningModule``: Megatron's count,
:func:`~lightning_megatron.transformer.config.training_flops`), else ``6 N T`` with N the model's
parameter count and T the tokens of the step (the first tensor of the batch, or ``batch["tokens"]``).
The step time is the median of the last ``window`` (5) steps' times, so a row is a smoothed rate (two rows may
repeat it; the first few steps, which warm up, weigh in the first rows' values only).
Achieved TFLOP/s per device = FLOPs / step time / world size. MFU = achieved / peak; the peak is
``peak_tflops`` or, when None, measured once on this device with a square GEMM of the model dtype
(:func:`measure_matmul_tflops`: a size aimed at 20 ms, best of 5).
``tokens_per_sec`` and ``mfu`` are shown on the progress bar.

An MFU above 1 is impossible, and is flagged, not clamped: the value is logged as measured (a clamped 1.0
would hide that the peak is wrong), the callback warns once naming the peak, the progress bar marks it
``108%!`` and the run summary says so. It happens when the peak is below what the device reaches: a
measured peak taken while other processes ran, or from a matmul that runs below the device's best (on a
CPU, one whose clock or threads differ from the training steps'), or a ``peak_tflops`` that is not the
dense peak of the model's dtype; or when the FLOPs counted exceed those run. The check reads the value
every ``log_every_n_steps`` steps, when Lightning reads the logged values anyway.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_megatron.callbacks.summary import model_parameter_count
from lightning_megatron.protocols import CountsFlops
from lightning_megatron.strategy import MegatronStrategy

__all__ = ["ThroughputCallback", "measure_matmul_tflops", "next_matmul_size"]


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device, n: int | None = None, repeats: int = 5,
                          *, min_seconds: float = 0.02, max_n: int = 8192) -> float:
    """Measured TFLOP/s of a square n x n x n matmul (the best of ``repeats``).

    ``n=None``: sizes from 256 up (:func:`next_matmul_size`), each timed once, until one takes at least
    ``min_seconds`` (or reaches ``max_n``); that one is timed ``repeats`` times. A rate near the device's dense
    peak for about ``repeats x 1.1 x min_seconds``: the size is aimed at ``min_seconds``, not doubled past it.
    A smaller matmul runs a little below the peak, so MFU errs high by as much; pass ``peak_tflops`` to the
    callback for the datasheet value (and no measurement).

    The operands come from a private generator: how many sizes are tried depends on the machine's speed,
    and drawing them from the global one would make the run's dropout masks depend on it too."""
    generator = torch.Generator(device=device).manual_seed(0)
    size = n if n is not None else 256
    while True:
        a = torch.randn(size, size, device=device, generator=generator).to(dtype)
        b = torch.randn(size, size, device=device, generator=generator).to(dtype)
        torch.matmul(a, b)
        best = _timed_matmul(a, b)
        if n is not None or best >= min_seconds or size >= max_n:
            break
        size = next_matmul_size(size, best, min_seconds, max_n)
    for _ in range(repeats - 1):
        best = min(best, _timed_matmul(a, b))
    return 2 * size**3 / best / 1e12


def next_matmul_size(size: int, seconds: float, min_seconds: float, max_n: int, multiple: int = 256) -> int:
    """The square size to try after ``size``'s matmul took ``seconds`` (below ``min_seconds``).

    The cubic law's size for ``1.1 x min_seconds``, rounded up to a multiple of ``multiple``: at least one
    multiple more, at most twice ``size`` (a small matmul runs below the peak, so the law aims short and the
    next try corrects it), at most ``max_n``. Doubling alone overshot up to 8x the time: on one CPU core a
    1024 matmul took 13 ms of the 20, and 2048's five repeats cost 0.6 s of a 5 s start."""
    aimed = size * (1.1 * min_seconds / max(seconds, 1e-9)) ** (1 / 3)
    rounded = -(-int(aimed) // multiple) * multiple
    return min(max_n, 2 * size, max(rounded, size + multiple))


def _timed_matmul(a: torch.Tensor, b: torch.Tensor) -> float:
    """Seconds of one ``a @ b`` with the device's queue drained before and after."""
    _synchronize()
    start = time.perf_counter()
    torch.matmul(a, b)
    _synchronize()
    return time.perf_counter() - start


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
        self._params: int | None = None
        self._measured: str | None = None  # how the peak was measured (None: given as peak_tflops)
        self._flagged = False

    @staticmethod
    def _dp_size(trainer: Trainer) -> int:
        strategy = trainer.strategy
        return strategy.parallel_state.dp_size if isinstance(strategy, MegatronStrategy) else trainer.world_size

    def _model_params(self, trainer: Trainer, pl_module: LightningModule) -> int:
        """Parameters of the whole model (:func:`~lightning_megatron.callbacks.summary.model_parameter_count`)."""
        if self._params is None:
            self._params = model_parameter_count(trainer, pl_module)
        return self._params

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.peak_tflops is None:
            dtype = next(pl_module.parameters()).dtype
            self.peak_tflops = measure_matmul_tflops(dtype, next(pl_module.parameters()).device)
            self._measured = f"measured at the start of fit with one {str(dtype).removeprefix('torch.')} matmul"

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
        dp = self._dp_size(trainer)
        global_tokens = tokens.numel() * dp
        if isinstance(pl_module, CountsFlops):
            flops = pl_module.training_flops(batch, dp)
        else:
            flops = 6.0 * self._model_params(trainer, pl_module) * global_tokens
        tflops_per_device = flops / step_time / trainer.world_size / 1e12
        pl_module.log("tokens_per_sec", global_tokens / step_time, on_step=True, prog_bar=True, rank_zero_only=True)
        pl_module.log("tflops_per_device", tflops_per_device, on_step=True, rank_zero_only=True)
        if self.peak_tflops:
            mfu = tflops_per_device / self.peak_tflops
            pl_module.log("mfu", mfu, on_step=True, prog_bar=True, rank_zero_only=True)
            logged = trainer.global_step % max(1, trainer.log_every_n_steps) == 0
            if logged and not self._flagged and trainer.is_global_zero:
                self._flag_impossible(float(mfu), trainer.global_step)  # reads the value: only when it is logged

    def _flag_impossible(self, mfu: float, step: int) -> None:
        """Warn once when the MFU exceeds 1 (module docstring)."""
        if mfu <= 1.0 or self._flagged:
            return
        self._flagged = True
        if self._measured is not None:
            peak = (f"the peak it divides by, {self.peak_tflops:.4g} TFLOP/s {self._measured}, is below what this "
                    f"device reaches (measured while other processes ran, or at a size that runs below its best); "
                    f"set peak_tflops to the device's datasheet dense peak for the model's dtype")
        else:
            peak = (f"peak_tflops={self.peak_tflops:g} is below what this device reaches: give its dense peak for "
                    f"the model's dtype, per device")
        rank_zero_warn(f"ThroughputCallback: mfu {mfu:.3f} at step {step} is above 1, which is impossible: {peak} "
                       f"(the value is logged as measured; the progress bar marks it with '!')", category=UserWarning)
