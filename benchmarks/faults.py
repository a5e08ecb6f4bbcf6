"""Fault scenarios on 2-process CPU runs: seconds from the fault to the exit of every rank, and steps lost.

    python benchmarks/faults.py [--cap 120] [--scenarios sigterm,kill1,kill0,raise1] [--paths shm,gloo]

Each scenario runs ``tests/reliability_run.py`` (tiny BERT, TP=2, Lightning's subprocess launcher, a
checkpoint every 2 steps, the strategy's default 30-minute collective timeout) and injects the fault
at the end of step 5 of 40 (``name``), or inside the forward of step 6, before its first
tensor-parallel collective (``name:mid``: the other rank then waits inside that collective):

- ``sigterm``: SIGTERM to rank 0 (the launcher), as a scheduler's preemption or ``scancel`` would;
- ``sigint``: SIGINT to every process of the job, as Ctrl-C in its terminal; ``sigint2``: Ctrl-C twice,
  0.5 s apart;
- ``kill1``:  SIGKILL of rank 1 (a non-zero rank dies: out of memory, a node failure);
- ``kill0``:  SIGKILL of rank 0, the launcher (rank 1 is left without its parent);
- ``raise1``: an exception on rank 1 only.

Measured: the exit status of rank 0's process, seconds from the fault to the moment no rank's
process is left (``>cap`` when some rank was still running after ``--cap`` seconds, then killed),
and steps lost = last completed step - the step of the newest checkpoint a resume would start from.
``shm``: the CPU tuning's shared-memory collectives (``cpu_tuning=True``); ``gloo``: the default (no CPU tuning).
Not a test: the figures depend on the machine's load (docs/reliability.md quotes a run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "reliability_run.py"
FAULT_STEP, MAX_STEPS, EVERY = 5, 40, 2


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _checkpoint_step(ckpt_dir: Path) -> int:
    """The step a resume would start from: the newest of the step=N checkpoints and last.ckpt."""
    import torch

    steps = [0]
    for d in ckpt_dir.glob("*.ckpt"):
        m = re.search(r"step=(\d+)", d.name)
        if m:
            steps.append(int(m.group(1)))
        elif (d / "extra.pt").is_file():
            try:
                steps.append(int(torch.load(d / "extra.pt", weights_only=True, map_location="cpu")["global_step"]))
            except Exception:  # noqa: BLE001 - an unreadable checkpoint resumes nothing
                pass
    return max(steps)


def run_scenario(scenario: str, path: str, cap: float) -> dict:
    fault, _, where = scenario.partition(":")
    root = Path(tempfile.mkdtemp(prefix=f"fault-{fault}-{where or 'end'}-{path}-"))
    cmd = [sys.executable, str(SCRIPT), str(root), "--devices", "2", "--max-steps", str(MAX_STEPS), "--fault", fault,
           "--fault-step", str(FAULT_STEP), "--every", str(EVERY)] + (["--gloo"] if path == "gloo" else []) + (
               ["--mid"] if where == "mid" else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = open(root / "log.txt", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    fault_file = root / "fault.txt"
    while not fault_file.exists() and proc.poll() is None:
        time.sleep(0.05)
    t_fault = float(fault_file.read_text().split()[2]) if fault_file.exists() else time.time()
    pids = [int((root / f"pid-{r}.txt").read_text()) for r in (0, 1) if (root / f"pid-{r}.txt").exists()]
    capped = False
    while True:
        proc.poll()
        if proc.returncode is not None and not any(_alive(p) for p in pids):
            break
        if time.time() - t_fault > cap:
            capped = True
            for p in pids:
                if _alive(p):
                    os.kill(p, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.05)
    t_exit = time.time()
    log.close()
    progress = [int(line.split()[0]) for r in (0, 1) if (root / f"progress-{r}.txt").exists()
                for line in (root / f"progress-{r}.txt").read_text().splitlines() if line]
    last = max(progress, default=0)
    ckpt = _checkpoint_step(root / "ckpt")
    text = (root / "log.txt").read_text(errors="replace")
    return {"fault": scenario, "collectives": path, "exit_status": proc.returncode,
            "seconds_to_exit": None if capped else round(t_exit - t_fault, 1), "capped_at": cap if capped else None,
            "last_step": last, "checkpoint_step": ckpt, "steps_lost": last - ckpt,
            "last_error_line": next((ln.strip()[:160] for ln in reversed(text.splitlines())
                                     if re.search(r"Error|Exception|SIG(TERM|INT) at step", ln)), "")}


def _overhead_rank(iters: int = 300) -> float:
    import torch

    from lightning_megatron.preemption import PreemptionHandler

    handler, times = PreemptionHandler(), []
    for _ in range(iters):
        t = time.perf_counter()
        handler.should_stop(torch.device("cpu"))
        times.append(time.perf_counter() - t)
    times = sorted(times[iters // 5:])
    return times[len(times) // 2] * 1e6


def preemption_overhead() -> list[float]:
    """Median microseconds of the per-step SIGTERM agreement (one all-reduce of one int), 2 CPU ranks."""
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_utils import run_distributed

    return run_distributed(_overhead_rank, 2, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap", type=float, default=120.0)
    parser.add_argument("--scenarios", default="sigterm,sigint,sigint2,kill1,kill0,raise1,sigterm:mid,sigint:mid,"
                                                "kill1:mid,kill0:mid,raise1:mid")
    parser.add_argument("--paths", default="shm,gloo")
    parser.add_argument("--json", default=None)
    parser.add_argument("--overhead", action="store_true", help="only measure the per-step SIGTERM all-reduce")
    a = parser.parse_args()
    if a.overhead:
        print(f"per-step SIGTERM agreement, 2 CPU ranks: median {max(preemption_overhead()):.0f} us")
        return
    rows = []
    for fault in a.scenarios.split(","):
        for path in a.paths.split(","):
            row = run_scenario(fault, path, a.cap)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| fault | collectives | exit status (rank 0) | seconds to exit | last step | checkpoint step | steps lost |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        secs = f"> {r['capped_at']:.0f} (killed)" if r["capped_at"] else f"{r['seconds_to_exit']}"
        print(f"| {r['fault']} | {r['collectives']} | {r['exit_status']} | {secs} | {r['last_step']} | "
              f"{r['checkpoint_step']} | {r['steps_lost']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
