"""ZeRO-1 parameter all-gather overlapped with the next forward: exposed gather time, on vs off.

Every mode runs ``Trainer.fit`` of bert-base (ours, post-norm spec, torch AdamW wrapped in our
DistributedOptimizer through ``MegatronOptimizerCallback(OptimizerConfig(use_distributed_optimizer=True))``) at DP=2 on
gloo, in fresh spawned ranks, one mode after another, alternating the order between rounds so both
modes see the same background load. Modes: ``MegatronStrategy(overlap_param_gather=False)`` (``off``:
every bucket gathered inside the optimizer step) and ``True`` (``on``: launched asynchronously after
the step, each bucket waited for in the forward pre-hook of its first module).

Per timed step and rank: wall time, and ``GradBuffer.param_gather_seconds``: the seconds the previous
optimizer step's parameter all-gather blocked this rank (launches, waits, copies into the params; read
in ``on_before_optimizer_step``, when every gather of the previous step has been waited for). Reported
per mode: median step time (slowest rank per step) and median exposed gather seconds, and their ratio
on / off per round. The gradient reduction overlaps in both modes (``overlap_grad_reduce`` default on gloo).

Run: ``python benchmarks/param_gather.py [--rounds 2] [--steps 3] [--bucket-mb 25] [--bf16]``
(``PYTHONPATH`` = the checkout). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from _common import SIZES, BertSize, launch, median, set_threads

__all__ = ["param_gather_rank", "run_param_gather"]

MODES = ("off", "on")


def param_gather_rank(spec: dict[str, Any], mode: str) -> dict[str, Any]:
    """One mode's fit in this rank (a fresh process per run)."""
    import warnings

    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer

    from bert_step import SyntheticBatches, _ours_module
    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.optimizer import OptimizerConfig
    from lightning_megatron.strategy import MegatronStrategy

    warnings.filterwarnings("ignore")
    world = dist.get_world_size()
    set_threads(world)
    size = BertSize(**spec["size"])
    warmup, steps = spec["warmup"], spec["steps"]
    stamps: list[float] = []
    exposed: list[float] = []
    buckets: list[int] = []

    class Probe(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            exposed.append(trainer.strategy.grad_buffer.param_gather_seconds)  # the previous step's gather

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            stamps.append(time.perf_counter())
            buckets[:] = [len(trainer.strategy.grad_buffer.buckets)]

    strategy = MegatronStrategy(micro_batch_size=spec["micro"], overlap_param_gather=mode == "on",
                                ddp_bucket_size_mb=spec["bucket_mb"])
    batch = spec["micro"] * spec["microbatches"]
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy,
                      precision="bf16-true" if spec["bf16"] else "32-true", max_steps=warmup + steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                      callbacks=[MegatronOptimizerCallback(OptimizerConfig(clip_grad=0.0, use_distributed_optimizer=True)), Probe()])
    data = torch.utils.data.DataLoader(SyntheticBatches((warmup + steps) * batch, spec["seq"], size.vocab_size),
                                       batch_size=batch, shuffle=False)
    trainer.fit(_ours_module(size, bf16=spec["bf16"]), train_dataloaders=data)
    # exposed[i] is measured in step i and belongs to step i - 1's gather: the timed steps' gathers
    # are exposed[warmup + 1:] (the last step's gather is finished at the end of fit, not timed).
    return {"step_s": [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:])],
            "exposed_s": exposed[warmup:], "buckets": buckets[0]}


def run_param_gather(*, seq: int = 128, micro: int = 1, microbatches: int = 2, rounds: int = 2, steps: int = 3,
                     warmup: int = 1, bucket_mb: float = 25.0, size: str = "base", bf16: bool = False) -> dict[str, Any]:
    spec = {"size": SIZES[size].as_dict(), "seq": seq, "micro": micro, "microbatches": microbatches,
            "steps": steps, "warmup": warmup, "bucket_mb": bucket_mb, "bf16": bf16}
    world = 2
    ranks: list[dict[str, list[dict[str, Any]]]] = [{m: [] for m in MODES} for _ in range(world)]
    for r in range(rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            for rank, res in zip(ranks, launch(param_gather_rank, world, spec, mode, timeout=1800)):
                rank[mode].append(res)
    rows: dict[str, Any] = {}
    for mode in MODES:
        step_s, exposed_s = [], []
        for r in range(rounds):
            runs = [rank[mode][r] for rank in ranks]
            step_s.append(median([max(x["step_s"][i] for x in runs) for i in range(len(runs[0]["step_s"]))]))
            exposed_s.append(median([max(x["exposed_s"][i] for x in runs) for i in range(len(runs[0]["exposed_s"]))]))
        rows[mode] = {"step_s": step_s, "exposed_gather_s": exposed_s, "buckets": ranks[0][mode][0]["buckets"]}
    ratios = {"step on/off": [a / b for a, b in zip(rows["on"]["step_s"], rows["off"]["step_s"])],
              "exposed gather on/off": [a / b for a, b in zip(rows["on"]["exposed_gather_s"],
                                                              rows["off"]["exposed_gather_s"])]}
    return {"spec": {**spec, "size": size, "world": world, "dp": world}, "modes": rows, "ratios": ratios}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--size", default="base", choices=sorted(SIZES))
    parser.add_argument("--bf16", action="store_true", help="bf16 params (gathered in bf16), fp32 main params")
    args = parser.parse_args(argv)
    print(json.dumps(run_param_gather(seq=args.seq, micro=args.micro, microbatches=args.microbatches,
                                      rounds=args.rounds, steps=args.steps, bucket_mb=args.bucket_mb,
                                      size=args.size, bf16=args.bf16), indent=1))


if __name__ == "__main__":
    main()
