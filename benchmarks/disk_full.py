"""A full disk during a 2-rank CLI run: how much the user reads and where the cause is.

    python benchmarks/disk_full.py [--out /tmp/disk_full]

Runs ``lightning-megatron fit`` (tiny BERT, TP=2, Lightning's subprocess launcher) with every rank's
DCP writes failing with ENOSPC from the first checkpoint on (a ``sitecustomize`` on PYTHONPATH, which
the launched ranks inherit), and prints the exit status, the log's lines and tracebacks, and how often
the disk-full message appears. Not a test: a fault measurement for docs/reliability.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

INJECT = '''
import errno
import torch.distributed.checkpoint as dcp


def _full(self, plan, planner):
    raise OSError(errno.ENOSPC, "No space left on device")


dcp.FileSystemWriter.write_data = _full
'''


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="disk_full-"))
    (out / "inject").mkdir(parents=True, exist_ok=True)
    (out / "inject" / "sitecustomize.py").write_text(INJECT)
    cmd = [sys.executable, "-m", "lightning_megatron.cli", "fit", "--config", str(ROOT / "recipes/bert_tiny.yaml"),
           "--trainer.devices", "2", "--trainer.strategy.tensor_model_parallel_size", "2",
           "--trainer.strategy.cpu_tuning", "false", "--trainer.default_root_dir", str(out / "run"),
           "--trainer.enable_progress_bar", "false", "--model.num_layers", "1", "--model.hidden_size", "32",
           "--model.num_attention_heads", "2", "--model.ffn_hidden_size", "64", "--data.global_batch_size", "2",
           "--data.micro_batch_size", "2", "--data.max_seq_length", "32", "--model.max_sequence_length", "32",
           "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--lr_schedule.lr_warmup_steps", "0"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(out / "inject"), os.environ.get("PYTHONPATH", "")]),
               WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    print(f"exit status {proc.returncode}; {len(log.splitlines())} log lines; {log.count('Traceback')} tracebacks; "
          f"'disk is full' {log.count('disk is full')} time(s)")
    print("last line:", log.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
