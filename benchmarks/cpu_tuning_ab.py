"""A/B of each piece of the opt-in CPU tuning (lightning_megatron.cpu.CPUTuning) on a BERT step.

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_tuning_ab.py [--size base] [--tp 2] [--dtype bf16] [--rounds 2]

Runs ours (bert_step.bert_rank, fresh spawned gloo ranks per run) with: every piece on; each piece
off in turn (shared-memory collectives, the glibc allocator setting, the CPU kernels); no tuning at
all (the library's default path). Rounds alternate the order; the fastest round of each variant is
kept. Prints one markdown table: median step seconds, tokens/s and the ratio to "all on".

``--micro``: per piece, a measurement that background load disturbs less, because the two sides
alternate in one process (or count events instead of time): gloo vs shared-memory all-reduce of a
bert-base activation between two ranks (collectives.py, alternating blocks); torch's dropout vs the
CPU kernel on bert-base tensors (alternating calls); the minor page faults of a bert-base layer
forward + backward with and without the allocator setting (fresh processes; faults, not seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import SIZES, median  # noqa: E402

VARIANTS = {
    "all on": {},
    "no shared-memory collectives": {"shared_memory_collectives": False},
    "no allocator setting": {"keep_freed_memory": False},
    "no CPU kernels": {"kernels": False},
    "no tuning (library default)": None,
}


def _dropout_micro(reps: int = 30) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from lightning_megatron.cpu.dropout import cpu_dropout

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread: a busy machine disturbs it least (as each TP=2 rank runs)
    rows = []
    for name, shape, dtype in (("attention probs bf16 [8, 12, 128, 128]", (8, 12, 128, 128), torch.bfloat16),
                               ("attention probs fp32 [8, 12, 128, 128]", (8, 12, 128, 128), torch.float32),
                               ("hidden fp32 [128, 8, 768]", (128, 8, 768), torch.float32)):
        x = torch.randn(shape).to(dtype)
        times: dict[str, list[float]] = {"torch": [], "cpu kernel": []}
        for _ in range(reps):
            for label, fn in (("torch", lambda: F.dropout(x, 0.1, True)), ("cpu kernel", lambda: cpu_dropout(x, 0.1))):
                t0 = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - t0)
        rows.append({"tensor": name, "torch_ms": 1e3 * min(times["torch"]),
                     "cpu_kernel_ms": 1e3 * min(times["cpu kernel"])})
    return rows


def _faults_rank(keep: bool) -> dict:
    import resource

    import torch

    from lightning_megatron.transformer import TransformerBlock, TransformerConfig
    from lightning_megatron.models.bert.specs import bert_layer_post_norm_spec

    if keep:
        from lightning_megatron.cpu.allocator import keep_freed_memory

        keep_freed_memory()
    cfg = TransformerConfig(num_layers=2, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
                            hidden_dropout=0.0, attention_dropout=0.0)
    block = TransformerBlock(cfg, bert_layer_post_norm_spec)
    x = torch.randn(128, 8, 768, requires_grad=True)
    faults, times = [], []
    for step in range(4):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        block(x, None).sum().backward()
        if step > 0:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            times.append(time.perf_counter() - t0)
    return {"faults": median(faults), "step_s": median(times)}


def micro() -> None:
    from _common import launch
    from collectives import collectives_rank

    print("Dropout, p = 0.1, forward (best of 30 alternating calls, ms, 1 thread):\n")
    print("| tensor | torch F.dropout | CPU kernel | ratio |\n|---|---|---|---|")
    for r in _dropout_micro():
        print(f"| {r['tensor']} | {r['torch_ms']:.2f} | {r['cpu_kernel_ms']:.2f} | "
              f"{r['torch_ms'] / r['cpu_kernel_ms']:.1f}x |")
    print("\nAllocator: 2 bert-base layers, forward + backward, batch 8 x 128, fp32 (fresh process each):\n")
    print("| malloc | minor page faults / step | s / step |\n|---|---|---|")
    for keep in (False, True, False, True):
        [r] = launch(_faults_rank, 1, keep, timeout=600)
        print(f"| {'keep_freed_memory' if keep else 'glibc default'} | {r['faults']:.0f} | {r['step_s']:.2f} |")
    print("\nCollectives between 2 ranks, fp32 (median us per call, gloo and shared memory alternating):\n")
    ranks = launch(collectives_rank, 2, 10, 3, timeout=900)
    print("| op | bytes | gloo us | shared memory us | gloo / shm |\n|---|---|---|---|---|")
    for a, b in zip(ranks[0]["rows"], ranks[1]["rows"]):
        g, m = max(a["gloo_s"], b["gloo_s"]), max(a["shm_s"], b["shm_s"])
        print(f"| {a['op']} | {a['bytes']} | {g * 1e6:.0f} | {m * 1e6:.0f} | {g / m:.1f}x |")


def main() -> None:
    from bert_step import bert_rank
    from run import _measured  # fresh spawned ranks, and the cores other processes used meanwhile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="base", choices=sorted(SIZES))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--micro", action="store_true", help="the per-piece measurements (see the docstring)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as run.py: spinning OpenMP threads of other jobs distort
    if args.micro:
        micro()
        return
    size = SIZES[args.size]
    best: dict[str, float] = {}
    background: dict[str, float] = {}
    for r in range(args.rounds):
        names = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
        for name in names:
            spec = dict(framework="ours", precision=args.dtype, tp=args.tp, pp=1, size=size.as_dict(), seq=args.seq,
                        batch=args.batch, micro_batch=args.batch, warmup=1, steps=args.steps, profile=False,
                        cpu_tuning=VARIANTS[name])
            t0 = time.perf_counter()
            ranks, bg, _ = _measured(bert_rank, args.tp, spec, timeout=1200)
            step = median([max(ts) for ts in zip(*(rk["step_times"] for rk in ranks))])
            if step < best.get(name, float("inf")):
                best[name], background[name] = step, bg
            print(f"[round {r}] {name}: {step:.3f} s/step, background {bg:.2f} cores "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    tokens = args.seq * args.batch
    ref = best["all on"]
    print(f"\nbert-{args.size} {args.dtype}, TP={args.tp}, batch {args.batch} x {args.seq}, {args.rounds} round(s):\n")
    print("| variant | s/step | tokens/s | step time / all on | background (cores) |\n|---|---|---|---|---|")
    for name in VARIANTS:
        print(f"| {name} | {best[name]:.3f} | {tokens / best[name]:.0f} | {best[name] / ref:.2f} | "
              f"{background[name]:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "step_s": best, "background": background}, fh, indent=1)


if __name__ == "__main__":
    main()
