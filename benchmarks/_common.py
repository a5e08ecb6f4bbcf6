"""Shared pieces of the benchmarks: model sizes, the FLOP count, memory probes, launching ranks.

FLOPs of one training step (forward + backward), for ``T`` tokens of sequence length ``s``::

    FLOPs = T * (6 N + 12 L s h)

- ``6 N``: every parameter that multiplies an activation costs 2 FLOPs per token forward and 4
  backward (grad of the input and of the weight). ``N`` counts the word embedding once (the LM
  head's output projection is tied to it and is a real matmul) and leaves out the position and
  token-type embeddings (lookups, no matmul); biases and norms are included (a rounding error).
- ``12 L s h``: attention scores ``Q K^T`` and ``A V`` are ``2 * 2 s^2 h`` FLOPs per layer and
  sequence forward, i.e. ``4 s h`` per token, times 3 for forward + backward.

MFU = achieved FLOP/s / the machine's measured GEMM FLOP/s of the same dtype (all cores, one process).
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, os.path.join(ROOT, "tests"), HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

__all__ = [
    "BertSize",
    "SIZES",
    "matmul_params",
    "step_flops",
    "max_rss_bytes",
    "current_rss_bytes",
    "launch",
    "median",
    "CPU_COUNT",
]

CPU_COUNT = os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True)
class BertSize:
    """A BERT shape (Hugging Face's names in comments)."""

    name: str
    num_layers: int
    """num_hidden_layers"""
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    """intermediate_size"""
    vocab_size: int = 30522
    max_position_embeddings: int = 512
    type_vocab_size: int = 2

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


SIZES = {
    # bert-tiny (Turc et al.): 2 layers, hidden 128, the real 30522 vocabulary (embeddings dominate).
    "tiny": BertSize(name="tiny", num_layers=2, hidden_size=128, num_attention_heads=2, ffn_hidden_size=512),
    "base": BertSize(name="base", num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072),
}


def matmul_params(size: BertSize) -> int:
    """N of the FLOP formula: BertForPreTraining's parameters minus position and token-type embeddings."""
    h, f, v, L = size.hidden_size, size.ffn_hidden_size, size.vocab_size, size.num_layers
    layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 2 * 2 * h  # qkv + proj, fc1 + fc2, two LayerNorms
    embeddings = v * h + 2 * h  # word embedding (tied LM output projection) + embedding LayerNorm
    heads = (h * h + h + 2 * h) + v + (h * h + h) + (2 * h + 2)  # LM transform + vocab bias, pooler, NSP head
    return L * layer + embeddings + heads


def step_flops(size: BertSize, batch: int, seq: int) -> float:
    """FLOPs of one training step: tokens * (6 N + 12 L s h)."""
    tokens = batch * seq
    return float(tokens) * (6 * matmul_params(size) + 12 * size.num_layers * seq * size.hidden_size)


def max_rss_bytes() -> int:
    """This process's resident-set high-water mark (``getrusage``; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def set_threads(world_size: int) -> int:
    """All cores for one process, an equal share each for several (2 cores here: 2 or 1 thread)."""
    import torch

    threads = max(1, CPU_COUNT // world_size)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # Lightning would otherwise pick its own
    return threads


def launch(fn: Any, world_size: int, *args: Any, timeout: float = 600.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh spawned gloo ranks (tests/dist_utils).

    A fresh process per measurement keeps ``getrusage``'s high-water mark about that run only.
    """
    from dist_utils import run_distributed

    return run_distributed(fn, world_size, *args, timeout=timeout, **kwargs)


class TokenBatches:
    """Deterministic full-length decoder samples from sample ``offset`` on: tokens, labels shifted by one, every
    target counted (a map-style dataset; the decoder benchmarks share it)."""

    def __init__(self, num_samples: int, seq: int, vocab: int, offset: int = 0) -> None:
        self.num_samples, self.seq, self.vocab, self.offset = num_samples, seq, vocab, offset

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

        ids = torch.randint(0, self.vocab, (self.seq + 1,), generator=torch.Generator().manual_seed(self.offset + index))
        return {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": torch.ones(self.seq)}


def plain_lightning_causal_lm(model: Any, lr: float, weight_decay: float) -> Any:
    """A transformers causal LM in a plain LightningModule, what a user of plain Lightning writes: the mean token
    cross entropy (plus ``router_aux_loss_coef`` x the model's ``aux_loss`` when it returns one: a mixture of
    experts), AdamW with no weight decay on biases and norms."""
    import torch
    from lightning.pytorch import LightningModule

    class PlainCausalLM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            out = self.model(input_ids=batch["tokens"])
            loss = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), batch["labels"].flatten())
            if getattr(out, "aux_loss", None) is not None:
                loss = loss + self.model.router_aux_loss_coef * out.aux_loss.to(loss.dtype)
            self.log("loss", loss.detach(), prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            decay, no_decay = [], []
            for name, p in self.model.named_parameters():
                (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
            return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=lr)

    return PlainCausalLM()


def timed_fit(framework: str, module: Any, bf16: bool, dataset: Any, batch: int, warmup: int, steps: int, *,
              devices: int = 1, micro_batch: int | None = None, **strategy_kwargs: Any) -> list[float]:
    """``Trainer.fit`` of ``warmup + steps`` steps of ``module`` on ``dataset`` in this (spawned) process; the
    seconds of each step after the warm-up. ``framework`` "ours": the MegatronStrategy (``strategy_kwargs``, the
    opt-in CPU tuning) with bf16 parameters and fp32 main params in bf16 (``bf16-true``), ``batch`` rows per rank
    and step in microbatches of ``micro_batch`` (default: one microbatch); otherwise plain Lightning, bf16 by
    autocast (``bf16-mixed``)."""
    import time

    import torch
    from lightning.pytorch import Callback, Trainer

    class Stamps(Callback):
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.t.append(time.perf_counter())

    stamps = Stamps()
    callbacks: list[Any] = [stamps]
    if framework == "ours":
        from lightning_megatron.strategy import MegatronStrategy

        # the CPU tuning unless the run names its own (a CPUTuning record)
        strategy: Any = MegatronStrategy(**{"micro_batch_size": micro_batch or batch, "cpu_tuning": True,
                                            **strategy_kwargs})
        precision = "bf16-true" if bf16 else "32-true"
        if bf16:
            from lightning_megatron.callbacks import MegatronOptimizerCallback
            from lightning_megatron.optimizer import OptimizerConfig

            callbacks.append(MegatronOptimizerCallback(OptimizerConfig(clip_grad=0.0)))
    else:
        if devices != 1:
            raise ValueError("the plain Lightning run is one process")
        strategy, precision = "auto", "bf16-mixed" if bf16 else "32-true"
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision=precision,
                      max_steps=warmup + steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      use_distributed_sampler=False, callbacks=callbacks)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(dataset, batch_size=batch))
    return [b - a for a, b in zip(stamps.t[warmup - 1:], stamps.t[warmup:])]
