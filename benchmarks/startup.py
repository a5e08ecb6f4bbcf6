"""Start-up of a 2-process `lightning-megatron fit`: where the seconds before the first step go.

    .venv/bin/python benchmarks/startup.py [--repeats N] [--wandb-mode offline|disabled] [--profile prof.txt]

1. ``fit --config recipes/bert_tiny.yaml`` (2 processes, TP=2, a 1-layer model, logging on as the
   recipe has it) with ``--trainer.max_steps 1``, its output read as it comes: when rank 0 has parsed
   (``Seed set``), when each rank reaches its process group (``Initializing distributed``), and when the
   first step is done (Lightning's ``Trainer.fit` stopped: `max_steps=1` reached``, said after the step
   and before the last checkpoint and the exit); and T(1), T(11): the wall times of the whole commands
   (start-up ~= T(1) - (T(11) - T(1)) / 10 counts the last checkpoint, the run summary and the exit too).
2. ``python -X importtime`` of what the fit command imports, the 10 largest cumulative entries.
3. ``--profile``: rank 0 under cProfile (cumulative time of the phases: imports, parsing, the Trainer,
   waiting for rank 1 at the process-group rendezvous, set-up, the GEMM peak measurement, W&B).

It runs the command with its own interpreter, so it measures that environment: the README's training command
installs the library alone; with the ``test`` extra installed too (the tests' command), Lightning's
``torchmetrics`` also imports scipy, 0.6-1 s more on 2 cores (docs/benchmarks.md, "Start-up: a user's install").

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


MARKS = {"rank 0 parsed": "Seed set to",
         "rank 0 at its process group": "Initializing distributed: GLOBAL_RANK: 0",
         "rank 1 parsed": "[rank: 1] Seed set to",
         "rank 1 at its process group": "Initializing distributed: GLOBAL_RANK: 1",
         "first step done": "`Trainer.fit` stopped"}
"""What the run says, and the phrase that says it (the first line holding it counts)."""


def _fit(steps: int, folder: str, profile: str | None = None,
         wandb_mode: str = "offline") -> tuple[float, dict[str, float]]:
    """(wall time of the command, seconds after launch at which each of :data:`MARKS` was said)."""
    run = tempfile.mkdtemp(prefix=f"run{steps}-", dir=folder)  # a new run folder each time (runs never share one)
    args = [*FIT, "--trainer.max_steps", str(steps), "--trainer.default_root_dir", run]
    cmd = [sys.executable, "-m", "lightning_megatron.cli", *args]
    if profile:  # rank 0 under cProfile; Lightning starts rank 1 as `python <sys.argv[0]> ...`, i.e. cli.py
        import lightning_megatron.cli as cli

        script = (f"import cProfile, runpy, sys; sys.argv = {[cli.__file__, *args]!r}; "
                  f"cProfile.run('runpy.run_path(sys.argv[0], run_name=\"__main__\")', {profile!r})")
        cmd = [sys.executable, "-c", script]
    env = dict(os.environ, WANDB_MODE=wandb_mode, WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks: dict[str, float] = {}
    lines: list[str] = []
    try:
        for line in proc.stdout:  # one pipe for both streams: the order the ranks said things in
            lines.append(line)
            for name, phrase in MARKS.items():
                if name not in marks and phrase in line and not (name == "rank 0 parsed" and "[rank: " in line):
                    marks[name] = time.perf_counter() - start
        proc.wait(timeout=900)
    finally:
        proc.kill()
    took = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit("".join(lines)[-6000:])
    return took, marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default=None, help="write rank 0's cProfile (cumulative, top 60) here")
    parser.add_argument("--repeats", type=int, default=3, help="runs of max_steps=1 (each timed from its output)")
    parser.add_argument("--wandb-mode", default="offline", choices=["offline", "disabled"],
                        help="the recipe's WandbLogger offline (as the README runs it), or disabled: what W&B's "
                             "start costs is the difference")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        # caches (corpus, samples mappings) built once, outside the measurement
        _fit(1, folder, wandb_mode=a.wandb_mode)
        load = os.getloadavg()[0]
        runs = [_fit(1, folder, wandb_mode=a.wandb_mode) for _ in range(a.repeats)]
        eleven, _ = _fit(11, folder, wandb_mode=a.wandb_mode)
        print(f"launch to (seconds; {a.repeats} runs of max_steps=1, W&B {a.wandb_mode}, load average {load:.1f} on "
              f"{os.cpu_count()} cores):")
        for name in MARKS:
            times = (f"{marks[name]:5.2f}" if name in marks else "    -" for _, marks in runs)
            print(f"  {name:28s} " + "  ".join(times))
        one = sorted(t for t, _ in runs)[len(runs) // 2]
        step = (eleven - one) / 10
        print(f"fit max_steps=1: {one:.1f} s (median); max_steps=11: {eleven:.1f} s; per step ~{step:.2f} s; "
              f"T(1) - step ~{one - step:.1f} s (with the last checkpoint, the summary and the exit)")
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
            _fit(1, folder, profile=out, wandb_mode=a.wandb_mode)
            import pstats

            with open(a.profile, "w") as fh:
                pstats.Stats(out, stream=fh).sort_stats("cumulative").print_stats(60)
            print(f"rank 0 profile: {a.profile}")


if __name__ == "__main__":
    main()
