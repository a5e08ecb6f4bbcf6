"""Start-up of a 2-process `lightning-megatron fit`: where the seconds before the first step go.

    .venv/bin/python benchmarks/startup.py [--profile prof.txt]

1. Wall time of ``fit --config recipes/bert_tiny.yaml`` (2 processes, TP=2, a 1-layer model, logging
   on as the recipe has it) with ``--trainer.max_steps 1`` and ``11``: start-up ~= T(1) - (T(11) - T(1)) / 10.
2. ``python -X importtime`` of what the fit command imports, the 10 largest cumulative entries.
3. ``--profile``: rank 0 under cProfile (cumulative time of the phases: imports, parsing, the Trainer,
   waiting for rank 1 at the process-group rendezvous, set-up, the GEMM peak measurement, W&B).

Indicative only: the machine may be shared; the background load (``os.getloadavg``) is printed with
each measurement, and contended numbers must be labelled as such.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIT = ["fit", "--config", os.path.join(ROOT, "recipes", "bert_tiny.yaml"), "--model.config.num_layers", "1",
       "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
       "--lr_schedule.lr_warmup_steps", "0", "--trainer.log_every_n_steps", "1"]


def _fit(steps: int, folder: str, profile: str | None = None) -> float:
    run = tempfile.mkdtemp(prefix=f"run{steps}-", dir=folder)  # a new run folder each time (runs never share one)
    args = [*FIT, "--trainer.max_steps", str(steps), "--trainer.default_root_dir", run]
    cmd = [sys.executable, "-m", "lightning_megatron.cli", *args]
    if profile:  # rank 0 under cProfile; Lightning starts rank 1 as `python <sys.argv[0]> ...`, i.e. cli.py
        import lightning_megatron.cli as cli

        script = (f"import cProfile, runpy, sys; sys.argv = {[cli.__file__, *args]!r}; "
                  f"cProfile.run('runpy.run_path(sys.argv[0], run_name=\"__main__\")', {profile!r})")
        cmd = [sys.executable, "-c", script]
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    took = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default=None, help="write rank 0's cProfile (cumulative, top 60) here")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        _fit(1, folder)  # caches (corpus, samples mappings) built once, outside the measurement
        load = os.getloadavg()[0]
        one, eleven = _fit(1, folder), _fit(11, folder)
        step = (eleven - one) / 10
        print(f"fit max_steps=1: {one:.1f} s; max_steps=11: {eleven:.1f} s; per step ~{step:.2f} s; "
              f"start-up ~{one - step:.1f} s (load average {load:.1f} on {os.cpu_count()} cores)")
        imports = subprocess.run([sys.executable, "-X", "importtime", "-c",
                                  "import lightning_megatron.cli, lightning.pytorch.cli, lightning_megatron.strategy, "
                                  "lightning_megatron.datamodules, lightning_megatron.models.bert.module, "
                                  "lightning_megatron.callbacks, lightning_megatron.loggers"],
                                 capture_output=True, text=True, timeout=600).stderr.splitlines()
        rows = sorted((int(line.split("|")[1]), line.split("|")[2].rstrip()) for line in imports
                      if line.startswith("import time:") and line.split("|")[1].strip().isdigit())
        print("imports, cumulative microseconds (largest 10):")
        for us, name in rows[-10:]:
            print(f"  {us / 1e6:6.2f} s {name}")
        if a.profile:
            out = os.path.abspath(a.profile) + ".prof"
            _fit(1, folder, profile=out)
            import pstats

            with open(a.profile, "w") as fh:
                pstats.Stats(out, stream=fh).sort_stats("cumulative").print_stats(60)
            print(f"rank 0 profile: {a.profile}")


if __name__ == "__main__":
    main()
