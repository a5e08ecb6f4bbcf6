"""Faults in the numbers and on the disk during a 2-rank CLI run: what the user gets.

    python benchmarks/trust_faults.py [--scenarios disk_full,nan] [--out DIR]

Runs ``lightning-megatron fit`` (tiny BERT, TP=2, Lightning's subprocess launcher, 6 steps) with a
fault injected by a ``sitecustomize`` on PYTHONPATH, which the launched ranks inherit:

- ``disk_full``: every DCP write fails with ENOSPC (the first checkpoint is the one at the end);
- ``nan``: the loss of step 3 (``global_step == 3``) is multiplied by NaN, as a diverging run.

Prints per scenario the exit status, the log's lines and tracebacks, how often the cause appears,
the last log line, and the checkpoints left with their ``global_step``. Put an older
``lightning_megatron`` first on PYTHONPATH to measure it the same way. Not a test: the fault
measurements of docs/reliability.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

INJECT = {
    "disk_full": '''
import errno
import torch.distributed.checkpoint as dcp


def _full(self, plan, planner):
    raise OSError(errno.ENOSPC, "No space left on device")


dcp.FileSystemWriter.write_data = _full
''',
    "nan": '''
from lightning_megatron.models.bert.module import BertLightningModule

_forward_step = BertLightningModule.forward_step


def _nan_at_step_3(self, batch, chunk):
    out, loss_func = _forward_step(self, batch, chunk)
    if loss_func is None or self.trainer.global_step != 3:
        return out, loss_func

    def nan_loss(output):
        loss, logged = loss_func(output)
        return loss * float("nan"), logged

    return out, nan_loss


BertLightningModule.forward_step = _nan_at_step_3
''',
}
CAUSE = {"disk_full": "disk is full", "nan": "is nan"}


def run(scenario: str, out: Path) -> None:
    import torch

    (out / "inject").mkdir(parents=True, exist_ok=True)
    (out / "inject" / "sitecustomize.py").write_text(INJECT[scenario])
    cmd = [sys.executable, "-m", "lightning_megatron.cli", "fit", "--config", str(ROOT / "recipes/bert_tiny.yaml"),
           "--trainer.devices", "2", "--trainer.strategy.tensor_model_parallel_size", "2",
           "--trainer.strategy.cpu_tuning", "false", "--trainer.default_root_dir", str(out / "run"),
           "--trainer.enable_progress_bar", "false", "--model.config.num_layers", "1",
           "--model.config.hidden_size", "32", "--model.config.num_attention_heads", "2",
           "--model.config.ffn_hidden_size", "64", "--data.global_batch_size", "2",
           "--data.micro_batch_size", "2", "--data.max_seq_length", "32", "--model.config.max_sequence_length", "32",
           "--trainer.max_steps", "6", "--trainer.limit_val_batches", "0", "--lr_schedule.lr_warmup_steps", "0"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(out / "inject"), os.environ.get("PYTHONPATH", "")]),
               WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    (out / "log.txt").write_text(log)
    ckpts = {}
    for d in sorted((out / "run" / "checkpoints").glob("*")) if (out / "run" / "checkpoints").is_dir() else []:
        extra = d / "extra.pt"
        ckpts[d.name] = torch.load(extra, weights_only=True)["global_step"] if extra.is_file() else "incomplete"
    print(f"{scenario}: exit status {proc.returncode}; {len(log.splitlines())} log lines; {log.count('Traceback')} "
          f"tracebacks; '{CAUSE[scenario]}' {log.count(CAUSE[scenario])} time(s); checkpoints {ckpts or 'none'}")
    print(f"  last line: {log.strip().splitlines()[-1][:300]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenarios", default="disk_full,nan")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="trust_faults-"))
    for scenario in a.scenarios.split(","):
        run(scenario, out / scenario)


if __name__ == "__main__":
    main()
