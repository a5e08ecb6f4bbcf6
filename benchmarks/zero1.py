"""ZeRO-1 side by side: our DistributedOptimizer against DeepSpeed's, on the same model, DP=2.

:func:`zero1_rank` trains our bert-base (``BertLightningModule``, post-norm spec) for ``warmup +
steps`` steps on one of two data-parallel ranks, as one of:

- ``ours``: ``MegatronStrategy`` (DP=2) with ``MegatronOptimizerCallback(OptimizerConfig(clip_grad=0))``: every rank
  holds the whole optimizer state (the reference);
- ``ours-zero1``: the same with ``use_distributed_optimizer=True`` (our ZeRO-1);
- ``deepspeed``: DeepSpeed's ZeRO stage 1 engine wrapping the same model (its ``forward_step``),
  in DeepSpeed's own loop (``engine(batch)``, ``engine.backward``, ``engine.step``): Lightning's
  ``DeepSpeedStrategy`` refuses CPUs, DeepSpeed itself runs on them (its CPU accelerator, gloo).

Same model, seed, batches (4 samples of 128 tokens per rank, one microbatch), AdamW (lr 1e-4,
weight decay 0.01 on all parameters: DeepSpeed takes the optimizer as built), no clipping;
bf16 = bf16 model with fp32 main params on both sides. Returned per rank: step times (the time
between consecutive step ends after the warm-up), ``live_bytes`` (every tensor storage alive after
the last timed step, found through the garbage collector plus each tensor's ``.grad``, counted
once: parameters, gradients, optimizer state, flat buffers, whoever owns them) and the RSS
high-water mark.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch

from _common import BertSize, max_rss_bytes, set_threads
from bert_step import SyntheticBatches, _ours_module

__all__ = ["zero1_rank", "live_tensor_bytes"]

LR, WEIGHT_DECAY, SEQ, BATCH_PER_RANK = 1e-4, 0.01, 128, 4


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (each storage once)."""
    gc.collect()
    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in seen:
            seen.add(ptr)
            total += storage.nbytes()

    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
        except ReferenceError:  # a dead weak proxy
            continue
        add(obj)
        if obj.grad is not None:  # a .grad lives in C++ until Python asks for it
            add(obj.grad)
    return total


def _batches(size: BertSize, n: int, rank: int) -> list[dict[str, torch.Tensor]]:
    ds = SyntheticBatches(10**6, SEQ, size.vocab_size, seed=1 + rank)
    return [{k: torch.stack([ds[i * BATCH_PER_RANK + j][k] for j in range(BATCH_PER_RANK)]) for k in ds[0]}
            for i in range(n)]


def _ours(run: dict[str, Any], size: BertSize, bf16: bool, result: dict[str, Any]) -> list[float]:
    from lightning.pytorch import Callback, Trainer

    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.optimizer import OptimizerConfig
    from lightning_megatron.strategy import MegatronStrategy

    total = run["warmup"] + run["steps"]
    stamps: list[float] = []

    class Probe(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            stamps.append(time.perf_counter())
            if batch_idx == total - 1:
                result["live_bytes"] = live_tensor_bytes()
                result["optimizer"] = type(trainer.strategy.optimizers[0]).__name__

    callbacks = [Probe(), MegatronOptimizerCallback(OptimizerConfig(clip_grad=0.0,
                                                    use_distributed_optimizer=run["framework"] == "ours-zero1"))]
    trainer = Trainer(accelerator="cpu", devices=2, strategy=MegatronStrategy(micro_batch_size=BATCH_PER_RANK, cpu_tuning=True),
                      precision="bf16-true" if bf16 else "32-true", max_steps=total, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                      callbacks=callbacks)
    data = _batches(size, total, torch.distributed.get_rank())
    module = _ours_module(size, bf16)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    result["num_params"] = sum(p.numel() for p in module.parameters())
    return stamps


def _deepspeed(run: dict[str, Any], size: BertSize, bf16: bool, result: dict[str, Any]) -> list[float]:
    import deepspeed

    from lightning_megatron.tensor_parallel.random import model_parallel_seed

    torch.manual_seed(1234)
    model_parallel_seed(1234, 0)
    module = _ours_module(size, False)  # DeepSpeed casts the model to bf16 itself
    module.configure_model()
    chunk = module.model_chunks[0]

    class Step(torch.nn.Module):
        """The model as DeepSpeed drives it: batch in, loss out."""

        def __init__(self) -> None:
            super().__init__()
            self.chunk = chunk

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            loss, _ = module.forward_step(batch, self.chunk)
            return loss

    model = Step()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    config = {"train_micro_batch_size_per_gpu": BATCH_PER_RANK, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "bf16": {"enabled": bf16}}
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                      dist_init_required=False)
    result["optimizer"] = type(ds_optimizer).__name__
    result["num_params"] = sum(p.numel() for p in model.parameters())
    total = run["warmup"] + run["steps"]
    stamps = []
    for batch in _batches(size, total, torch.distributed.get_rank()):
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        stamps.append(time.perf_counter())
    result["live_bytes"] = live_tensor_bytes()
    return stamps


def zero1_rank(run: dict[str, Any]) -> dict[str, Any]:
    """One run on this rank; ``run`` = framework, precision, size, warmup, steps."""
    import warnings

    warnings.filterwarnings("ignore")
    threads = set_threads(torch.distributed.get_world_size())
    size = BertSize(**run["size"])
    bf16 = run["precision"] == "bf16"
    result: dict[str, Any] = {"rank": torch.distributed.get_rank(), "threads": threads, "pid": os.getpid()}
    run_fn = _deepspeed if run["framework"] == "deepspeed" else _ours
    stamps = run_fn(run, size, bf16, result)
    w = run["warmup"]
    result["step_times"] = [b - a for a, b in zip(stamps[w - 1:], stamps[w:])]
    result["max_rss"] = max_rss_bytes()
    return result
