"""Peak RSS while saving and loading a ZeRO-1 checkpoint, against steady-state training RSS.

Two spawned gloo ranks (DP=2, ZeRO-1 ``DistributedOptimizer``) train a BERT of >= 300 M parameters
(bert-large shape by default: 24 layers, hidden 1024, 16 heads, ffn 4096, vocab 30522 = 335 M) with
bf16 parameters, fp32 main params and fp32 AdamW moments for ``--steps`` steps, then:

- ``steady``: the RSS after the last step (the training state at rest: params, grad buffer,
  the 1/2 shards of main params and moments, allocator caches);
- ``save peak``: the highest RSS sampled (every 2 ms, a thread reading /proc/self/statm) during
  ``trainer.save_checkpoint``, as a ratio to that run's ``steady``;
- ``load peak``: a second, fresh pair of processes resumes with ``fit(ckpt_path=...)``; the
  highest RSS during the strategy's ``load_checkpoint`` (right after setup, as in every resume),
  as a ratio to the ``steady`` RSS of that run after ``--steps`` more steps.

Printed per rank in GiB (target for both ratios: <= 1.1). Before format 2 every rank
gathered the full fp32 main params and both moments to save (~12 bytes x all parameters extra).

Run: ``python benchmarks/checkpoint_memory.py [--size large|base] [--dir /tmp/ckpt_mem]`` (needs
~6 GiB per rank for the large size; the checkpoint, ~4 GB, is deleted afterwards).
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (puts the repo and tests/ on sys.path)
from _common import SIZES as COMMON_SIZES
from _common import BertSize, current_rss_bytes, launch, set_threads

SIZES = {"tiny": COMMON_SIZES["tiny"],  # a smoke test of this script
    "large": BertSize(name="large", num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096),
    "base": BertSize(name="base", num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072),
}
SEQ, BATCH_PER_RANK = 128, 2


class PeakRSS:
    """Highest RSS of this process while the ``with`` block runs (sampled every ``interval`` s)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        self.peak = current_rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_bytes())


def _trainer(bert: BertSize, max_steps: int):
    import torch
    from lightning.pytorch import Trainer

    from bert_step import SyntheticBatches
    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.optimizer import OptimizerConfig
    from lightning_megatron.strategy import MegatronStrategy

    rank = torch.distributed.get_rank()
    ds = SyntheticBatches(10**6, SEQ, bert.vocab_size, seed=1 + rank)
    data = [{k: torch.stack([ds[i * BATCH_PER_RANK + j][k] for j in range(BATCH_PER_RANK)]) for k in ds[0]}
            for i in range(max_steps)]
    strategy = MegatronStrategy(micro_batch_size=BATCH_PER_RANK)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-true", max_steps=max_steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      use_distributed_sampler=False,
                      callbacks=[MegatronOptimizerCallback(OptimizerConfig(clip_grad=1.0, use_distributed_optimizer=True))])
    return trainer, torch.utils.data.DataLoader(data, batch_size=None)


def _rank(size: dict[str, Any], steps: int, directory: str, phase: str) -> dict[str, Any]:
    """``phase="save"``: train ``steps`` steps, then save. ``"load"``: a fresh run resumes from that
    checkpoint (``fit(ckpt_path=...)``, the load measured) and trains ``steps`` more steps."""
    import gc
    import warnings

    import torch

    from bert_step import _ours_module

    warnings.filterwarnings("ignore")
    set_threads(torch.distributed.get_world_size())
    bert = BertSize(**size)
    path = Path(directory) / "zero1.ckpt"
    out: dict[str, Any] = {"rank": torch.distributed.get_rank()}
    trainer, loader = _trainer(bert, steps if phase == "save" else 2 * steps)
    module = _ours_module(bert, bf16=True)
    if phase == "load":
        strategy, load = trainer.strategy, trainer.strategy.load_checkpoint

        def measured_load(*args: Any, **kwargs: Any) -> Any:
            out["before_load"] = current_rss_bytes()
            t0 = time.perf_counter()
            with PeakRSS() as peak:
                result = load(*args, **kwargs)
            out["load_s"], out["load_peak"] = time.perf_counter() - t0, peak.peak
            return result

        strategy.load_checkpoint = measured_load  # this run's own strategy object, not Lightning's class
    trainer.fit(module, train_dataloaders=loader, ckpt_path=path if phase == "load" else None)
    opt = trainer.strategy.optimizers[0]
    assert type(opt).__name__ == "DistributedOptimizer", type(opt).__name__
    del loader
    gc.collect()
    torch.distributed.barrier()
    out["steady"] = current_rss_bytes()
    out["params"] = sum(p.numel() for p in module.parameters())
    out["global_step"] = trainer.global_step
    if phase == "save":
        t0 = time.perf_counter()
        with PeakRSS() as save:
            trainer.save_checkpoint(path)
        out["save_s"], out["save_peak"] = time.perf_counter() - t0, save.peak
        torch.distributed.barrier()
        out["checkpoint_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="large")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/lightning_megatron_checkpoint_memory")
    parser.add_argument("--json", help="write the per-rank results here")
    args = parser.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        saved = launch(_rank, 2, SIZES[args.size].as_dict(), args.steps, str(directory), "save", timeout=3600)
        loaded = launch(_rank, 2, SIZES[args.size].as_dict(), args.steps, str(directory), "load", timeout=3600)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    gib = 2**30
    print(f"BERT {args.size}: {saved[0]['params'] / 1e6:.0f} M parameters, bf16 params + fp32 main/AdamW, "
          f"ZeRO-1 DP=2, checkpoint {saved[0]['checkpoint_bytes'] / gib:.2f} GiB")
    print("save run: train, then save               load run: fit(ckpt_path=...), then train")
    print("rank  steady GiB  save peak GiB (x)  save s    steady GiB  before load  load peak GiB (x)  load s")
    for s_, l_ in zip(saved, loaded):
        print(f"{s_['rank']:>4}  {s_['steady'] / gib:10.2f}  {s_['save_peak'] / gib:8.2f} ({s_['save_peak'] / s_['steady']:.3f})"
              f"  {s_['save_s']:6.1f}    {l_['steady'] / gib:10.2f}  {l_['before_load'] / gib:11.2f}"
              f"  {l_['load_peak'] / gib:8.2f} ({l_['load_peak'] / l_['steady']:.3f})  {l_['load_s']:6.1f}")
    assert all(r["global_step"] == 2 * args.steps for r in loaded), "the load run did not resume"
    results = {"save": saved, "load": loaded}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
