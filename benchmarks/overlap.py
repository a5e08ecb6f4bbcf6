"""Overlapped data-parallel gradient reduction: step time and exposed gradient communication, on vs off.

Every mode runs ``Trainer.fit`` of bert-base (ours, post-norm spec, fp32, torch AdamW) in fresh
spawned ranks, one mode after another, in an order that alternates between rounds so every mode sees
the same background load. Modes (``overlap_grad_reduce`` x the DP collectives' path):

- ``shm-off``: the default on CPU: shared-memory collectives (synchronous), reductions after backward;
- ``shm-on``: shared memory, each bucket reduced in the hook that finishes it (still synchronous);
- ``gloo-off``: gloo, reductions after backward;
- ``gloo-on``: gloo's asynchronous all-reduce per bucket, started during the last microbatch's
  backward and waited for in ``finalize_model_grads``.

Per timed step and rank: wall time, and ``GradBuffer.exposed_comm_seconds``: the seconds the step was
blocked in gradient collectives (synchronous launches in the hooks, the waits and the TP / tied
embedding sums in ``finalize_model_grads``); the rest of a reduction ran under backward. Reported per
mode: median step time over ranks and steps (slowest rank per step), the median exposed seconds and
their share of the step, and the step-time ratio on / off of the same collectives path.

Run: ``python benchmarks/overlap.py [--tp 2] [--world 4] [--seq 128] [--micro 1] [--microbatches 2]``
(``PYTHONPATH`` = the checkout). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from _common import SIZES, BertSize, launch, median, set_threads

__all__ = ["overlap_rank", "MODES", "run_overlap", "run_overlap_layouts", "overlap_section"]

MODES = ("shm-off", "shm-on", "gloo-off", "gloo-on")


def _fit_once(spec: dict[str, Any], mode: str) -> dict[str, Any]:
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer

    from bert_step import SyntheticBatches, _ours_module
    from lightning_megatron.strategy import MegatronStrategy

    size = BertSize(**spec["size"])
    path, overlap = mode.split("-")
    warmup, steps = spec["warmup"], spec["steps"]
    stamps: list[float] = []
    exposed: list[float] = []
    buckets: list[int] = []

    class Probe(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            stamps.append(time.perf_counter())
            exposed.append(trainer.strategy.grad_buffer.exposed_comm_seconds)
            buffer = trainer.strategy.grad_buffer
            buckets[:] = [len(buffer.buckets), buffer.memory_bytes(),
                          4 * sum(p.numel() for p in pl_module.parameters() if p.requires_grad)]

    strategy = MegatronStrategy(tensor_model_parallel_size=spec["tp"], micro_batch_size=spec["micro"],
                                cpu_tuning=path == "shm", overlap_grad_reduce=overlap == "on",
                                ddp_bucket_size_mb=spec["bucket_mb"])
    world = dist.get_world_size()
    batch = spec["micro"] * spec["microbatches"]
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, precision="32-true",
                      max_steps=warmup + steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      use_distributed_sampler=False, callbacks=[Probe()])
    # every DP rank reads the same synthetic samples: the same work, which is all a timing needs
    data = torch.utils.data.DataLoader(SyntheticBatches((warmup + steps) * batch, spec["seq"], size.vocab_size),
                                       batch_size=batch, shuffle=False)
    trainer.fit(_ours_module(size, bf16=False), train_dataloaders=data)
    return {"step_s": [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:])],
            "exposed_s": exposed[warmup:], "buckets": buckets[0],
            "grad_buffer_bytes": buckets[1], "four_bytes_per_param": buckets[2]}


def overlap_rank(spec: dict[str, Any], mode: str, round_: int) -> dict[str, Any]:
    """One mode's run in this rank (a fresh process per run: several bert-base fits in one process
    grew until the kernel killed a rank on this shared machine)."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    set_threads(dist.get_world_size())
    out = _fit_once(spec, mode)
    if spec.get("log"):  # partial results survive a run that is killed later
        with open(spec["log"], "a") as f:
            f.write(json.dumps({"rank": dist.get_rank(), "round": round_, "mode": mode, **out}) + "\n")
    return out


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    rows = {}
    for mode in MODES:
        per_round = []
        for r in range(len(ranks[0][mode])):
            steps = [max(rank[mode][r]["step_s"][i] for rank in ranks) for i in range(len(ranks[0][mode][r]["step_s"]))]
            exposed = [max(rank[mode][r]["exposed_s"][i] for rank in ranks)
                       for i in range(len(ranks[0][mode][r]["exposed_s"]))]
            per_round.append({"step_s": median(steps), "exposed_s": median(exposed)})
        rows[mode] = {"step_s": [x["step_s"] for x in per_round], "exposed_s": [x["exposed_s"] for x in per_round],
                      "exposed_share": [x["exposed_s"] / x["step_s"] for x in per_round],
                      "buckets": ranks[0][mode][0]["buckets"],
                      "grad_buffer_bytes": next((x["grad_buffer_bytes"] for x in ranks[0][mode]
                                                 if x.get("grad_buffer_bytes")), None),
                      "four_bytes_per_param": next((x["four_bytes_per_param"] for x in ranks[0][mode]
                                                    if x.get("four_bytes_per_param")), None)}
    ratios = {}
    for path in ("shm", "gloo"):
        on, off = rows[f"{path}-on"]["step_s"], rows[f"{path}-off"]["step_s"]
        ratios[f"{path} on/off"] = [a / b for a, b in zip(on, off)]
    ratios["gloo-on / shm-off"] = [a / b for a, b in zip(rows["gloo-on"]["step_s"], rows["shm-off"]["step_s"])]
    return {"modes": rows, "ratios": ratios}


def run_overlap(*, tp: int, world: int, seq: int, micro: int, microbatches: int, rounds: int,
                steps: int = 3, warmup: int = 1, bucket_mb: float = 25.0, size: str = "base",
                log: str | None = None) -> dict[str, Any]:
    spec = {"size": SIZES[size].as_dict(), "tp": tp, "seq": seq, "micro": micro, "microbatches": microbatches,
            "rounds": rounds, "steps": steps, "warmup": warmup, "bucket_mb": bucket_mb, "log": log}
    ranks: list[dict[str, list[dict[str, Any]]]] = [{m: [] for m in MODES} for _ in range(world)]
    for r in range(rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):  # alternate: every mode sees the same load
            for rank, res in zip(ranks, launch(overlap_rank, world, spec, mode, r, timeout=1800)):
                rank[mode].append(res)
    return {"spec": {**spec, "world": world, "dp": world // tp}, **summarize(ranks)}


LAYOUTS = {  # name: (tp, world, seq); TP=2 x DP=2 is 4 processes on this machine's cores: shorter sequences
    "DP=2": (1, 2, 128),
    "TP=2 x DP=2": (2, 4, 64),
}


def run_overlap_layouts(rounds: int = 2) -> dict[str, Any]:
    """Both layouts of the report (bert-base, micro-batch 1, 2 microbatches per step)."""
    out: dict[str, Any] = {}
    for name, (tp, world, seq) in LAYOUTS.items():
        try:
            out[name] = run_overlap(tp=tp, world=world, seq=seq, micro=1, microbatches=2, rounds=rounds)
        except Exception as e:  # noqa: BLE001 - report, don't abort the other sections
            out[name] = {"error": f"{type(e).__name__}: {str(e)[-300:]}"}
    return out


def _range(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}-{format(hi, fmt)}"


def overlap_section(add: Any, data: dict[str, Any]) -> None:
    """The report's section (benchmarks/report.py) from :func:`run_overlap_layouts`."""
    add("## Overlapped gradient reduction (bert-base, fp32)\n")
    add("`MegatronStrategy(overlap_grad_reduce=...)` on vs off, on the shared-memory and the gloo DP path, all "
        "modes one after another in fresh ranks, in alternating order (`benchmarks/overlap.py`). *exposed*: seconds per step "
        "blocked in gradient collectives (`GradBuffer.exposed_comm_seconds`, slowest rank). Ranges over "
        "rounds.\n")
    for name, res in data.items():
        if "error" in res:
            add(f"{name}: not measured: {res['error']}.\n")
            continue
        spec = res["spec"]
        add(f"### {name}: micro-batch {spec['micro']} x {spec['microbatches']} microbatches x {spec['seq']} tokens, "
            f"{res['modes']['shm-off']['buckets']} buckets of {spec['bucket_mb']:.0f} MB\n")
        mode0 = next((res["modes"][m] for m in MODES if res["modes"][m].get("grad_buffer_bytes")), {})
        if mode0:
            add(f"fp32 grads per rank (rank 0): the buffer, {mode0['grad_buffer_bytes']:,} bytes = 4 bytes x "
                f"{mode0['four_bytes_per_param'] // 4:,} parameters + {mode0['grad_buffer_bytes'] - mode0['four_bytes_per_param']} "
                "bytes of padding; no other fp32 grad tensor.\n")
        add("| mode | step (s) | exposed grad comm (s) | share of step |\n|---|---:|---:|---:|")
        for mode in MODES:
            row = res["modes"][mode]
            add(f"| {mode} | {_range(row['step_s'], '.2f')} | {_range(row['exposed_s'], '.2f')} | "
                f"{_range([100 * x for x in row['exposed_share']], '.0f')}% |")
        add("")
        add("| ratio of step times | " + " | ".join(res["ratios"]) + " |\n|---|" + "---:|" * len(res["ratios"]))
        add("| per round | " + " | ".join(_range(v, ".2f") for v in res["ratios"].values()) + " |")
        add("")


def from_log(path: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The summary of the runs a ``--log`` file holds (also of an interrupted run)."""
    runs: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            runs.setdefault((row["mode"], row["round"]), {})[row["rank"]] = row
    world = max(len(r) for r in runs.values())
    ranks: list[dict[str, list[dict[str, Any]]]] = [{m: [] for m in MODES} for _ in range(world)]
    for (mode, _), by_rank in sorted(runs.items(), key=lambda kv: kv[0][1]):
        if len(by_rank) == world:  # a run every rank finished
            for rank in range(world):
                ranks[rank][mode].append(by_rank[rank])
    return {"spec": spec, **summarize(ranks)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--size", default="base", choices=sorted(SIZES))
    parser.add_argument("--log", default=None, help="append each finished run of each rank to this JSON-lines file")
    parser.add_argument("--summarize", metavar="LOG", default=None,
                        help="measure nothing: summarize a --log file and print the report section")
    args = parser.parse_args(argv)
    if args.summarize:
        spec = {"size": args.size, "tp": args.tp, "seq": args.seq, "micro": args.micro,
                "microbatches": args.microbatches, "bucket_mb": args.bucket_mb, "world": args.world}
        res = from_log(args.summarize, spec)
        lines: list[str] = []
        overlap_section(lines.append, {f"TP={args.tp} x DP={args.world // args.tp}": res})
        print(json.dumps(res, indent=1))
        print("\n".join(lines))
        return
    print(json.dumps(run_overlap(tp=args.tp, world=args.world, seq=args.seq, micro=args.micro,
                                 microbatches=args.microbatches, rounds=args.rounds, steps=args.steps,
                                 bucket_mb=args.bucket_mb, size=args.size, log=args.log), indent=1))


if __name__ == "__main__":
    main()
