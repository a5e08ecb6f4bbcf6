"""The host's share of a training step: bert-base's structure at a width where the arithmetic is negligible.

On a GPU our BERT step is host-bound (docs/benchmarks.md, "GPU check": bert-base's kernels took 35.5 ms of a
57.8 ms step, the device idle in the optimizer step and the logging). What the host does per step does not
depend on the width, so it can be measured here: bert-base's depth and modules (12 layers, the MLM and SOP
heads, bf16 parameters, fp32 main params, fused AdamW) at hidden size 64, seq 32, batch 2, one thread, through
``Trainer.fit`` with the library's default path (no CPU tuning), against Hugging Face's ``BertForPreTraining``
of the same shape under plain Lightning (bf16-mixed, torch AdamW with the same weight-decay groups).

Per step (median over the timed steps, milliseconds), from Lightning's hooks (no patching):

- ``forward+backward``: ``on_train_batch_start`` to ``on_before_optimizer_step`` (the training step: forward,
  backward, the strategy's logging of the step's means);
- ``optimizer``: to the first callback's ``on_train_batch_end`` (the optimizer step: norm, update, copies);
- ``batch-end callbacks``: to the last callback's ``on_train_batch_end`` (the optimizer callback's logging);
- ``loop and data``: to the next ``on_train_batch_start`` (Lightning's loop, the next batch);
- ``step``: ``on_train_batch_start`` to the next one;
- ``ops``, ``non-view ops``: the aten ops one step dispatches (counted in the last warm-up step, untimed), so
  that ``step / ops`` is the host's time per op (on a GPU machine: with its launches).

On a GPU the host time after the step's last read of the device (the optimizer's tail, the batch-end
callbacks, the loop and the next batch) is time the device waits.

    .venv/bin/python benchmarks/host_step.py [--rounds 3] [--steps 150] [--frameworks ours,ours-zero1,hf] [--clip-grad 1.0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from _common import BertSize  # noqa: E402

HOST = BertSize(name="bert-base-depth", num_layers=12, hidden_size=64, num_attention_heads=2, ffn_hidden_size=256,
                vocab_size=1024, max_position_embeddings=64)
SEQ, BATCH, WARMUP = 32, 2, 30
PHASES = ("forward+backward", "optimizer", "batch-end callbacks", "loop and data", "step", "ops", "non-view ops")


def run(framework: str, steps: int, device: torch.device = torch.device("cpu"), warmup: int = WARMUP,
        clip_grad: float = 0.0) -> dict[str, float]:
    """Median milliseconds per phase of ``steps`` timed steps (after ``warmup``) of ``framework`` ("ours";
    "ours-zero1": the same with the ZeRO-1 wrapper, at one rank a flat step over the buffer's runs; "hf") on
    ``device`` (a GPU: the host's step with its launches and its reads of the device; the GPU check's ``host``
    part), clipping by the global norm at ``clip_grad`` (0: off; Hugging Face's through the Trainer's
    ``gradient_clip_val``)."""
    import lightning.pytorch as pl

    from bert_step import SyntheticBatches, _hf_module, _ours_module

    marks: dict[str, list[float]] = {name: [] for name in ("start", "before_opt", "first_end", "last_end")}
    counter = _OpCounter()

    class First(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == warmup:
                counter.__exit__(None, None, None)
            marks["start"].append(time.perf_counter())
            if batch_idx == warmup - 1:
                counter.__enter__()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            marks["before_opt"].append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks["first_end"].append(time.perf_counter())

    class Last(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks["last_end"].append(time.perf_counter())

    total = warmup + steps + 1
    if framework in ("ours", "ours-zero1"):
        from lightning_megatron.callbacks import MegatronOptimizerCallback
        from lightning_megatron.optimizer import OptimizerConfig
        from lightning_megatron.strategy import MegatronStrategy

        module = _ours_module(HOST, bf16=True)
        strategy: Any = MegatronStrategy(micro_batch_size=BATCH)  # the library's default path: no CPU tuning
        precision = "bf16-true"
        callbacks: list[Any] = [First(), MegatronOptimizerCallback(OptimizerConfig(
            clip_grad=clip_grad, use_distributed_optimizer=framework == "ours-zero1")), Last()]
    else:
        module, strategy, precision = _hf_module(HOST, SEQ), "auto", "bf16-mixed"
        callbacks = [First(), Last()]
    data = torch.utils.data.DataLoader(SyntheticBatches(total * BATCH, SEQ, HOST.vocab_size), batch_size=BATCH)
    accelerator = "cpu" if device.type == "cpu" else "gpu"
    hf_clip = {"gradient_clip_val": clip_grad} if clip_grad and framework == "hf" else {}
    trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy=strategy, precision=precision, max_steps=total,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         use_distributed_sampler=False, callbacks=callbacks, **hf_clip)
    trainer.fit(module, train_dataloaders=data)
    if not len(marks["start"]) == len(marks["before_opt"]) == len(marks["last_end"]) == total:
        raise RuntimeError(f"{framework}: hooks fired {[len(v) for v in marks.values()]} times, expected {total}")
    timed = range(warmup, total - 1)
    s, b, f, e = (marks[k] for k in ("start", "before_opt", "first_end", "last_end"))
    phases = {"forward+backward": [b[i] - s[i] for i in timed], "optimizer": [f[i] - b[i] for i in timed],
              "batch-end callbacks": [e[i] - f[i] for i in timed], "loop and data": [s[i + 1] - e[i] for i in timed],
              "step": [s[i + 1] - s[i] for i in timed]}
    result = {name: statistics.median(values) * 1e3 for name, values in phases.items()}
    return {**result, "ops": float(counter.ops), "non-view ops": float(counter.ops - counter.views)}


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is on (views apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.views += bool(getattr(func, "is_view", False))
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each framework")
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run (after 30 warm-up steps)")
    parser.add_argument("--frameworks", default="ours,hf", help="of ours, ours-zero1 (the ZeRO-1 wrapper), hf")
    parser.add_argument("--clip-grad", type=float, default=0.0, help="clip by the global norm (the recipes: 1.0)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a GPU step's host work is one thread
    frameworks = args.frameworks.split(",")
    results: dict[str, list[dict[str, float]]] = {fw: [] for fw in frameworks}
    for _ in range(args.rounds):
        for fw in frameworks:
            results[fw].append(run(fw, args.steps, clip_grad=args.clip_grad))
    print(f"\nhost ms per step, {HOST.num_layers} layers at hidden {HOST.hidden_size}, seq {SEQ} x batch {BATCH} "
          f"(median of {args.steps} steps; each round's figure){f', clipped at {args.clip_grad:g}' if args.clip_grad else ''}")
    print(f"| phase | {' | '.join(frameworks)} |")
    print(f"|---|{'---:|' * len(frameworks)}")
    for phase in PHASES:
        cells = [", ".join(f"{r[phase]:.0f}" if "ops" in phase else f"{r[phase]:.2f}" for r in results[fw])
                 for fw in frameworks]
        print(f"| {phase} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
