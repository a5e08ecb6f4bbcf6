"""Turn the measurements of run.py into docs/benchmarks.md and docs/img/benchmarks.png.

:func:`derive` adds tokens/s, FLOP/s, MFU, memory and collective shares to each BERT row (the FLOP
formula is in _common.py); :func:`targets` computes the issue's ratios from two rows of the same run;
:func:`write_markdown` and :func:`write_png` render. Rendering needs no measurement: run.py
``--render-only`` re-renders a saved JSON. :func:`write_markdown` rewrites only the part of the page
between ``<!-- report:begin -->`` and ``<!-- report:end -->``; sections recorded by hand around them
are kept.
"""

from __future__ import annotations

from typing import Any

from _common import CPU_COUNT, SIZES, matmul_params, median, step_flops

__all__ = ["derive", "targets", "render_page", "write_markdown", "write_png", "BEGIN", "END", "SEQ", "BATCH",
           "PP_MICRO_BATCH"]

SEQ, BATCH = 128, 8
PP_MICRO_BATCH = 2  # PP=2 runs 4 microbatches of 2 (1F1B); every other layout runs one microbatch of 8


# ---------------------------------------------------------------------------------------------- analysis

def derive(rows: list[dict[str, Any]], peak: dict[str, float]) -> None:
    for row in rows:
        size = SIZES[row["size"]]
        flops = step_flops(size, BATCH, SEQ)
        row["tokens_per_s"] = BATCH * SEQ / row["step_s"]
        row["flops_per_s"] = flops / row["step_s"]
        row["mfu"] = row["flops_per_s"] / peak[row["precision"]]
        ranks = row["ranks"]
        row["max_rss"] = max(r["max_rss"] for r in ranks)
        row["rss_before_model"] = max(r["rss_before_model"] for r in ranks)
        row["state_bytes"] = max(r["state_bytes"]["total"] for r in ranks)
        row["optimizer_stepped"] = all(r.get("optimizer_stepped", False) for r in ranks)
        prof = row.get("profile_ranks") or []
        shares = [r["comm_s"] / r["profile_step_s"] for r in prof if r.get("profile_step_s")]
        row["comm_share"] = max(shares) if shares else None
        row["comm_share_per_rank"] = shares


def _find(rows: list[dict[str, Any]], size: str, fw: str, prec: str, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    for row in rows:
        if (row["size"], row["framework"], row["precision"], row["tp"], row["pp"]) == (size, fw, prec, tp, pp):
            return row
    raise KeyError((size, fw, prec, tp, pp))


def targets(rows: list[dict[str, Any]], size: str = "base") -> list[dict[str, Any]]:
    """The issue's targets as ratios of two rows of this run (skipped when a row was not measured)."""
    out = []
    for name, a, b, key, target, higher in (
        ("bf16 tokens/s: ours (bf16 params, fp32 main) / HF autocast", ("ours", "bf16"), ("hf", "bf16"),
         "tokens_per_s", 1.5, True),
        ("fp32 tokens/s: ours / HF", ("ours", "fp32"), ("hf", "fp32"), "tokens_per_s", 1.0, True),
        ("bf16 tokens/s: ours / HF autocast with our allocator settings (reference, no target)", ("ours", "bf16"),
         ("hf-malloc", "bf16"), "tokens_per_s", None, True),
        ("fp32 tokens/s: ours / HF with our allocator settings (reference, no target)", ("ours", "fp32"),
         ("hf-malloc", "fp32"), "tokens_per_s", None, True),
        ("fp32 tokens/s: TP=2 on 2 processes / TP=1 on 1", ("ours", "fp32", 2), ("ours", "fp32"),
         "tokens_per_s", 0.9, True),
        ("bf16 tokens/s: TP=2 on 2 processes / TP=1 on 1", ("ours", "bf16", 2), ("ours", "bf16"),
         "tokens_per_s", 0.9, True),
        ("fp32 params+grads+optimizer bytes per rank: TP=2 / TP=1", ("ours", "fp32", 2), ("ours", "fp32"),
         "state_bytes", 0.55, False),
        ("bf16 params+grads+optimizer bytes per rank: TP=2 / TP=1", ("ours", "bf16", 2), ("ours", "bf16"),
         "state_bytes", 0.55, False),
    ):
        try:
            value = _find(rows, size, *a)[key] / _find(rows, size, *b)[key]
        except KeyError:
            continue
        met = None if target is None else (value >= target if higher else value <= target)
        out.append({"name": name, "value": value, "target": target, "higher_is_better": higher, "met": met})
    return out


# ---------------------------------------------------------------------------------------------- report

def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f}"


def _label(row: dict[str, Any]) -> str:
    if row["framework"].startswith("hf"):
        label = "HF BertForPreTraining" + (" (bf16 autocast)" if row["precision"] == "bf16" else "")
        return label + (" + our allocator settings" if row["framework"] == "hf-malloc" else "")
    layout = f"TP={row['tp']}" if row["pp"] == 1 else f"PP={row['pp']}"
    return f"ours {layout}" + (" (bf16, fp32 main)" if row["precision"] == "bf16" else "")


BEGIN, END = "<!-- report:begin -->", "<!-- report:end -->"
"""The part of the page this module writes lies between these two lines; everything before and after
them (sections recorded by hand or by other scripts: the GPU check, the CPU tuning A/B, checkpoint
memory, dated quick runs) is kept verbatim when the page is written again."""


def _surroundings(path: str) -> tuple[str, str]:
    """(text before ``BEGIN``, text after ``END``) of the page at ``path``; ``("", "")`` when there is no
    page yet. A page without the markers is refused rather than overwritten: its hand-written
    sections would be lost."""
    try:
        text = open(path).read()
    except FileNotFoundError:
        return "", ""
    begin, end = text.find(BEGIN + "\n"), text.find(END + "\n")
    if begin < 0 or end < begin or text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{path} exists without exactly one {BEGIN!r} line followed by one {END!r} line: "
                         f"put them around the generated part (the rest of the page is kept) or write to "
                         f"another --markdown path")
    return text[:begin], text[end + len(END) + 1:]


def render_page(path: str, generated: str) -> str:
    """The page at ``path`` with its generated part replaced by ``generated``."""
    before, after = _surroundings(path)
    return f"{before}{BEGIN}\n{generated.rstrip()}\n{END}\n{after}"


def write_markdown(path: str, meta: dict[str, Any], gemm: dict[str, Any], rows: list[dict[str, Any]],
                   mlp: list[dict[str, Any]], adamw: dict[str, Any] | None, tgt: list[dict[str, Any]],
                   zero1: dict[str, Any] | None = None, collectives: dict[str, Any] | None = None,
                   data: dict[str, Any] | None = None, overlap: dict[str, Any] | None = None) -> None:
    L: list[str] = []
    add = L.append
    add("# Benchmarks\n")
    add(f"Written by `{meta['command']}` on {meta['date']} ({meta['elapsed_min']:.1f} min). "
        f"Library: lightning_megatron at `{meta.get('git', 'unknown')}` (`-dirty`: the working tree had uncommitted "
        f"changes). Machine: {meta['cpu']}, {CPU_COUNT} cores, no GPU; "
        + ", ".join(f"{k} {v}" for k, v in meta['versions'].items()) + ".\n")
    add("Every number below comes from this one run. Each configuration runs in fresh spawned gloo processes; "
        f"one process gets {CPU_COUNT} threads, two processes 1 thread each (the machine's cores are shared "
        "between ranks, so TP=2 and PP=2 compete with TP=1 for the same silicon). "
        "*Background* is how many cores other processes kept busy during that measurement "
        f"(0 = quiet, {CPU_COUNT} = a second job as large as ours); with background load the step times are "
        f"inflated. Each configuration ran {meta['rounds']} time(s) in alternating order and the fastest run "
        "is kept. Medians of the timed steps. "
        f"OpenMP wait policy of every process: `OMP_WAIT_POLICY={meta['omp_wait_policy']}` (on this shared machine "
        "spinning OpenMP threads of concurrent jobs slowed a bert-base step about 2x; sleeping ones do not; "
        f"`--omp-spin` keeps the default). Waited for a quiet machine: {meta['quiet_waited_s']:.0f} s in all. "
        "The host of this 2-core VM is shared too, beyond what *background* can see: expect 10-30% between "
        "runs of the same configuration and compare ratios within one run.\n")
    if not all(r["optimizer_stepped"] for r in rows):
        add("**WARNING: in some runs below the optimizer never updated a parameter** (AdamW holds no state after "
            "the timed steps: *optimizer stepped* = no); their step times measure forward and backward only. "
            "The strategy is not applying its gradients: fix it before reading these numbers.\n")
    else:
        add("*Optimizer stepped* checks, in every run, that AdamW holds state after the timed steps (the "
            "parameters were really updated).\n")

    add("## The limit: matrix multiply\n")
    add(f"`C = A @ B`, square n x n, 2 n^3 FLOPs, best of several products after a warm-up; measured "
        f"{gemm.get('runs', 1)} time(s) in the run (start, after the BERT runs, end), best of each kept.\n")
    add("| dtype | n | threads | GFLOP/s | background |\n|---|---:|---:|---:|---:|")
    for r in gemm["rows"]:
        add(f"| {r['dtype']} | {r['n']} | {r['threads']} | {r['flops_per_s'] / 1e9:.0f} | "
            f"{r.get('background', float('nan')):.2f} |")
    add(f"\nPeak used for MFU ({CPU_COUNT} threads, best size): fp32 {gemm['peak']['fp32'] / 1e9:.0f} GFLOP/s, "
        f"bf16 {gemm['peak']['bf16'] / 1e9:.0f} GFLOP/s.")
    if any(r["mfu"] > 1.0 for r in rows if r["framework"] != "ours"):
        add(" **Some MFU values of Hugging Face exceed 100%: the GEMM limit was measured under background load "
            "and is underestimated in this run; compare tokens/s, not MFU.**")
    add("")

    add("## BERT pretraining step\n")
    add(f"Sequence {SEQ}, batch {BATCH} (= {SEQ * BATCH} tokens per step), full-length sequences, 15% masked, "
        "dropout 0.1, AdamW (lr 1e-4, weight decay 0.01 except biases and norms), masked-LM + NSP/SOP loss. "
        f"Ours: `BertLightningModule(BertConfig(spec=\"bert_layer_post_norm_spec\"))` (Hugging Face's layer layout) under "
        f"`MegatronStrategy(cpu_tuning=True)` (the opt-in CPU tuning: shared-memory collectives, allocator setting, CPU kernels); PP=2 runs 1F1B over {BATCH // PP_MICRO_BATCH} microbatches of {PP_MICRO_BATCH}, "
        f"everything else one microbatch of {BATCH}; bf16 = bf16 parameters with `MegatronOptimizerCallback"
        "(clip_grad=0)` (fp32 main params, `precision=\"bf16-true\"`). HF: `transformers.BertForPreTraining` "
        "(SDPA attention) in a plain LightningModule; bf16 = `precision=\"bf16-mixed\"` (autocast, fp32 params). "
        "*+ our allocator settings*: the same HF run with the glibc malloc settings of our opt-in CPU tuning "
        "(`lightning_megatron.cpu.allocator.keep_freed_memory`, which the benchmarks switch on: no mmap, no trimming, so memory freed in "
        "one step is reused, not page-faulted in again, in the next): it shows how much of our lead is the "
        "allocator, which any HF user can get with `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...`.\n")
    add("FLOPs per step = tokens x (6 N + 12 L s h): 6 N for the matmuls of the N parameters (forward 2, "
        "backward 4 per parameter and token; the word embedding counted once, as the tied LM output "
        "projection; position and token-type embeddings left out), 12 L s h for attention scores and "
        "weighted values (4 s h per token and layer forward, x3 with backward). "
        + ", ".join(f"{name}: N = {matmul_params(s) / 1e6:.2f} M, {step_flops(s, BATCH, SEQ) / 1e12:.3f} TFLOP/step"
                    for name, s in SIZES.items() if any(r['size'] == name for r in rows))
        + ". MFU = achieved FLOP/s / the GEMM peak of the same dtype above. These are the model's nominal "
        "FLOPs, the same for both implementations; ours runs the LM head on the masked tokens only "
        "(`lm_head_on_masked_only`, same loss and gradients), so it executes fewer: at the tiny size, where the "
        "vocabulary projection is most of the FLOPs, its nominal MFU can exceed 100%.\n")
    add("*CPU s/step* = CPU seconds all ranks used per step (user + system): with no background load "
        f"and perfect use of the cores it equals {CPU_COUNT} x the step time; a rank blocked in a gloo "
        "collective sleeps and uses none.\n")
    add("*Peak RSS* is each rank's `getrusage` high-water mark (max over ranks; it includes ~"
        f"{_gib(median([r['rss_before_model'] for r in rows]))} GiB of interpreter and imports before the model "
        "exists). *State* = params + grads + optimizer state bytes alive after an optimizer step, summed from "
        "the tensors (each storage once; fp32 main params and their grads included), max over ranks.\n")
    for size in dict.fromkeys(r["size"] for r in rows):
        add(f"### {size}\n")
        add("| configuration | ranks x threads | step (s) | CPU s/step | tokens/s | TFLOP/s | MFU | "
            "peak RSS/rank (GiB) | state/rank (MiB) | comm share | background | optimizer stepped |")
        add("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in (r for r in rows if r["size"] == size):
            threads = r["ranks"][0]["threads"]
            comm = "-" if r["comm_share"] is None or r["world"] == 1 else f"{100 * r['comm_share']:.1f}%"
            add(f"| {_label(r)} | {r['world']} x {threads} | {r['step_s']:.3f} | {r['cpu_s']:.2f} | "
                f"{r['tokens_per_s']:.0f} | "
                f"{r['flops_per_s'] / 1e12:.3f} | {100 * r['mfu']:.1f}% | {_gib(r['max_rss'])} | "
                f"{_mib(r['state_bytes'])} | {comm} | {r['background']:.2f} | "
                f"{'yes' if r['optimizer_stepped'] else '**no**'} |")
        add("")

    add("## Targets (bert-base, same run)\n")
    add("| ratio | measured | target | met |\n|---|---:|---:|---|")
    for t in tgt:
        sign = ">=" if t["higher_is_better"] else "<="
        if t["target"] is None:
            add(f"| {t['name']} | {t['value']:.2f} | - | - |")
        else:
            add(f"| {t['name']} | {t['value']:.2f} | {sign} {t['target']} | {'yes' if t['met'] else '**no**'} |")
    add("")

    add("## Share of a step in collectives\n")
    add("One extra step per configuration ran under `torch.profiler`; *comm share* = time of the rank's main "
        "thread inside collectives and point-to-point ops (outermost `shm:*` events of the shared-memory "
        "collectives the strategy uses for TP and DP ranks on one host, `c10d::*` / gloo events for the rest) / "
        "that step's wall time. `shm:*` includes waiting for the other ranks.\n")
    add("| configuration | size | per rank | ops (rank 0, ms) |\n|---|---|---|---|")
    for r in rows:
        if r["world"] > 1 and r.get("profile_ranks") and "comm_by_name" in r["profile_ranks"][0]:
            per_rank = ", ".join(f"{100 * s:.1f}%" for s in r["comm_share_per_rank"])
            ops = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(r["profile_ranks"][0]["comm_by_name"].items(),
                                                                    key=lambda kv: -kv[1]))
            add(f"| {_label(r)} | {r['size']} | {per_rank} | {ops} |")
    add("")

    add("## Tensor-parallel MLP: ours vs megatron-core\n")
    h = SIZES["base"].hidden_size
    add(f"`ColumnParallelLinear({h} -> {4 * h}) -> gelu -> RowParallelLinear({4 * h} -> {h})` on x = "
        f"[{SEQ}, {BATCH}, {h}], same weights in both, forward + backward (input and weight grads), median "
        "per iteration (slowest rank), the two implementations alternating. megatron-core built with "
        "`use_cpu_initialization=True`, its own `parallel_state` groups (gloo).\n")
    add("| TP | dtype | ours (ms) | megatron-core (ms) | ours / megatron-core | max abs output diff | background |")
    add("|---:|---|---:|---:|---:|---:|---:|")
    for r in mlp:
        if "skipped" in r:
            add(f"| - | - | - | skipped: {r['skipped']} | | | |")
        elif "error" in r:
            add(f"| {r['tp']} | {r['dtype']} | - | failed: {r['error']} | | | |")
        else:
            add(f"| {r['tp']} | {r['dtype']} | {r['ours_s'] * 1e3:.1f} | {r['mcore_s'] * 1e3:.1f} | "
                f"{r['ours_s'] / r['mcore_s']:.2f} | {r['max_abs_diff']:.1e} | {r['background']:.2f} |")
    add("")

    if adamw:
        add("## AdamW step on bert-base's parameters (fp32)\n")
        add(f"{adamw['numel'] / 1e6:.1f} M parameters, {adamw['threads']} threads, median of the timed steps "
            f"(background {adamw['background']:.2f} cores).\n")
        add("| implementation | step (ms) |\n|---|---:|")
        for k in ("for-loop (default)", "foreach=True", "fused=True"):
            add(f"| `torch.optim.AdamW` {k} | {adamw[k] * 1e3:.0f} |")
        add("")

    if collectives:
        _collectives_section(add, collectives)
    if zero1:
        _zero1_section(add, zero1)
    if data:
        from data import markdown_section

        L.extend(markdown_section(data))
    if overlap:
        from overlap import overlap_section

        overlap_section(add, overlap)
    add("## Where our TP=1 step goes (torch.profiler, top ops by self CPU time)\n")
    for prec in ("fp32", "bf16"):
        try:
            r = _find(rows, "base" if any(x["size"] == "base" for x in rows) else rows[0]["size"], "ours", prec)
        except KeyError:
            continue
        prof = (r.get("profile_ranks") or [{}])[0]
        if "top_ops" not in prof:
            continue
        add(f"### {r['size']}, {prec}: profiled step {prof['profile_step_s']:.2f} s\n")
        add("| op | self (ms) | share of step | calls |\n|---|---:|---:|---:|")
        for op in prof["top_ops"]:
            add(f"| `{op['name'][:70]}` | {op['self_s'] * 1e3:.0f} | {100 * op['self_s'] / prof['profile_step_s']:.1f}% "
                f"| {op['calls']} |")
        add("")
    findings = _findings(rows, adamw)
    if findings:
        add("## Findings of this run\n")
        L.extend(f"- {f}" for f in findings)
        add("")
    add("![benchmarks](img/benchmarks.png)\n")
    page = render_page(path, "\n".join(L))  # the hand-written sections around the markers are kept
    with open(path, "w") as f:
        f.write(page)


_ZERO1_LABELS = {"ours": "ours, non-distributed optimizer", "ours-zero1": "ours, DistributedOptimizer (ZeRO-1)",
                 "deepspeed": "DeepSpeed ZeRO stage 1"}


def _collectives_section(add: Any, coll: dict[str, Any]) -> None:
    add("## Collectives between two processes: gloo vs shared memory\n")
    if "error" in coll:
        add(f"Not measured: {coll['error']}.\n")
        return
    add("Two processes on this host (1 thread each), fp32 tensors; *size* is the full tensor (the all-gather "
        "output, the reduce-scatter input). Median per call of the slowest rank, gloo (TCP loopback) and our "
        "shared-memory path (`cpu/shared_memory.py`, which the opt-in CPU tuning installs) alternating "
        f"in blocks (background {coll['background']:.2f} cores). 3 MiB is one bert-base activation "
        "[128, 8, 768], the message of every tensor-parallel all-reduce above.\n")
    add("| op | size | gloo (us) | shared memory (us) | speed-up | shared memory GB/s |\n|---|---:|---:|---:|---:|---:|")
    for r in coll["rows"]:
        size = f"{r['bytes'] >> 20} MiB" if r["bytes"] >= 1 << 20 else f"{r['bytes'] >> 10} KiB"
        add(f"| {r['op']} | {size} | {r['gloo_s'] * 1e6:.0f} | {r['shm_s'] * 1e6:.0f} | "
            f"{r['gloo_s'] / r['shm_s']:.1f}x | {r['bytes'] / r['shm_s'] / 1e9:.1f} |")
    add("")


def _zero1_section(add: Any, zero1: dict[str, Any]) -> None:
    add("## ZeRO-1: ours vs DeepSpeed (bert-base, DP=2)\n")
    if "skipped" in zero1:
        add(f"Not measured: {zero1['skipped']}.\n")
        return
    add("Two data-parallel ranks (1 thread each), 4 samples x 128 tokens per rank, one microbatch, our "
        "`BertLightningModule` (post-norm spec) on both sides with the same weights and batches, AdamW "
        "(lr 1e-4, weight decay 0.01), no clipping; bf16 = bf16 model with fp32 main params. Ours runs under "
        "`Trainer` + `MegatronStrategy` + `MegatronOptimizerCallback(OptimizerConfig(use_distributed_optimizer=...))`; DeepSpeed "
        "(`zero_optimization.stage = 1`) wraps the same model in its own engine loop, because Lightning's "
        "`DeepSpeedStrategy` refuses CPUs. *Tensors/rank* = every tensor storage alive after the last timed "
        "step (garbage-collector scan plus each tensor's `.grad`, each storage once: parameters, gradients, "
        "optimizer state and flat buffers, whoever owns them), max over ranks; *bytes/param* divides it by the "
        "parameter count. One run per configuration.\n")
    add("| configuration | dtype | optimizer class | step (s) | tokens/s | tensors/rank (MiB) | bytes/param | "
        "peak RSS/rank (GiB) | background |")
    add("|---|---|---|---:|---:|---:|---:|---:|---:|")
    rows = zero1["rows"]
    for r in rows:
        if "error" in r:
            add(f"| {_ZERO1_LABELS[r['framework']]} | {r['precision']} | failed: {r['error']} | | | | | | |")
            continue
        add(f"| {_ZERO1_LABELS[r['framework']]} | {r['precision']} | `{r['optimizer']}` | {r['step_s']:.3f} | "
            f"{zero1['tokens_per_step'] / r['step_s']:.0f} | {r['live_bytes'] / 2**20:.0f} | "
            f"{r['live_bytes'] / r['num_params']:.1f} | {_gib(r['max_rss'])} | {r['background']:.2f} |")
    by = {(r["framework"], r["precision"]): r for r in rows if "error" not in r}
    notes = []
    for prec in ("fp32", "bf16"):
        ours, ds = by.get(("ours-zero1", prec)), by.get(("deepspeed", prec))
        if ours and ds:
            notes.append(f"{prec}: our ZeRO-1 runs at {ds['step_s'] / ours['step_s']:.2f}x DeepSpeed's tokens/s and "
                         f"holds {ours['live_bytes'] / ds['live_bytes']:.2f}x its tensor bytes per rank "
                         f"({ours['live_bytes'] / ours['num_params']:.1f} vs {ds['live_bytes'] / ds['num_params']:.1f} "
                         "bytes per parameter).")
    if notes:
        add("")
        for n in notes:
            add(f"- {n}")
    add("\nWhere the bytes differ: ours keeps Megatron's layout, a persistent fp32 gradient buffer of all "
        "parameters (4 bytes each) that backward accumulates into, that is reduce-scattered and then reused "
        "as the all-gather target of the updated parameters; DeepSpeed's stage 1 holds no gradients between "
        "steps (it reduces them during backward into the rank's partition and frees them after the step). "
        "The tensor column is measured between steps; *peak RSS* is the high-water mark within them.\n")


_INF_CHECK_OPS = ("aten::isfinite", "aten::eq", "aten::ne", "aten::abs", "aten::any", "aten::bitwise_not")


def _profile(rows: list[dict[str, Any]], size: str, fw: str, prec: str, tp: int = 1, pp: int = 1
             ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    try:
        row = _find(rows, size, fw, prec, tp, pp)
    except KeyError:
        return None, {}
    return row, (row.get("profile_ranks") or [{}])[0]


def _findings(rows: list[dict[str, Any]], adamw: dict[str, Any] | None) -> list[str]:
    """A few facts computed from this run's numbers (no hand-written figures that could go stale)."""
    out = []
    size = "base" if any(r["size"] == "base" for r in rows) else rows[0]["size"]
    fp32, prof32 = _profile(rows, size, "ours", "fp32")
    bf16, prof16 = _profile(rows, size, "ours", "bf16")
    if adamw and fp32:
        saved = adamw["for-loop (default)"] - adamw["fused=True"]
        out.append(f"`torch.optim.AdamW(fused=True)` (BertLightningModule's default) saves {saved * 1e3:.0f} ms per "
                   f"bert-base step over torch's default for-loop AdamW, which the HF runs use "
                   f"({100 * saved / fp32['step_s']:.0f}% of our fp32 TP=1 step, "
                   f"{100 * saved / bf16['step_s']:.0f}% of the bf16 one, whose AdamW runs on fp32 main params)."
                   if bf16 else f"`AdamW(fused=True)` saves {saved * 1e3:.0f} ms per bert-base step.")
    if prof16.get("top_ops"):
        inf = sum(op["self_s"] for op in prof16["top_ops"] if op["name"] in _INF_CHECK_OPS)
        if inf > 0:
            out.append(f"The per-parameter inf/nan check of the bf16 optimizer step (isfinite -> eq/ne/abs, any) "
                       f"took at least {inf * 1e3:.0f} ms ({100 * inf / prof16['profile_step_s']:.0f}%) of the "
                       f"profiled bf16 step (only ops among the top {len(prof16['top_ops'])} counted).")
    for prec, prof in (("fp32", prof32), ("bf16", prof16)):
        drop = sum(op["self_s"] for op in prof.get("top_ops", []) if op["name"] in ("aten::bernoulli_", "aten::random_"))
        if drop > 0:
            out.append(f"Dropout random numbers (`aten::random_`, one 64-bit draw per four mask elements, p=0.1 on "
                       f"37 tensors) cost {drop * 1e3:.0f} ms ({100 * drop / prof['profile_step_s']:.0f}%) of the "
                       f"profiled {prec} step; torch's dropout, which Hugging Face uses, calls `bernoulli_`: one "
                       "draw per element (docs/model.md, Dropout).")
    for prec in ("fp32", "bf16"):
        try:
            plain, tuned = _find(rows, size, "hf", prec), _find(rows, size, "hf-malloc", prec)
        except KeyError:
            continue
        out.append(f"HF {prec} with our allocator settings: {plain['step_s'] / tuned['step_s']:.2f}x the tokens/s of "
                   f"plain HF ({tuned['step_s']:.2f} s vs {plain['step_s']:.2f} s per step; CPU s/step "
                   f"{tuned['cpu_s']:.2f} vs {plain['cpu_s']:.2f}): the share of our lead that is the allocator.")
    m, p = BATCH // PP_MICRO_BATCH, 2
    for prec in ("fp32", "bf16"):
        row, _ = _profile(rows, size, "ours", prec, 1, 2)
        if row and row.get("comm_share_per_rank"):
            out.append(f"PP=2 ({prec}): stage 0 spends {100 * row['comm_share_per_rank'][0]:.0f}% of the step in "
                       f"send/recv, stage 1 {100 * row['comm_share_per_rank'][-1]:.0f}%; the 1F1B bubble alone is "
                       f"(p-1)/(m+p-1) = {100 * (p - 1) / (m + p - 1):.0f}% at m={m}: stage 1, which with an equal "
                       "layer split also carries the LM head and the loss, sets the pace.")
    return out


def write_png(path: str, rows: list[dict[str, Any]], mlp: list[dict[str, Any]], tgt: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    colors = {("hf", "fp32"): "#9e9e9e", ("ours", "fp32"): "#1f77b4", ("hf", "bf16"): "#cfcfcf",
              ("ours", "bf16"): "#ff7f0e", ("hf-malloc", "fp32"): "#6e6e6e", ("hf-malloc", "bf16"): "#a8a8a8"}
    for ax, size in zip(axes[0], sizes):
        sel = [r for r in rows if r["size"] == size]
        values = [r["tokens_per_s"] for r in sel]
        bars = ax.barh(range(len(sel)), values, color=[colors[(r["framework"], r["precision"])] for r in sel])
        for bar, r in zip(bars, sel):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {r['tokens_per_s']:.0f} tok/s, MFU {100 * r['mfu']:.0f}%, state {_mib(r['state_bytes'])} MiB, "
                    f"bg {r['background']:.1f}", va="center", fontsize=7)
        ax.set_yticks(range(len(sel)), [_label(r).replace(" (", "\n(") for r in sel], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, max(values) * 1.9)
        ax.set_xlabel("tokens / s (higher is better)")
        ax.set_title(f"BERT {size}: seq {SEQ}, batch {BATCH}, {CPU_COUNT} CPU cores")
    ax = axes[1][0]
    tgt = [t for t in tgt if t["target"] is not None]
    names = [t["name"].replace(": ", ":\n") for t in tgt]
    vals = [t["value"] for t in tgt]
    ax.barh(range(len(tgt)), vals, color=["#2ca02c" if t["met"] else "#d62728" for t in tgt])
    right = max(vals + [t["target"] for t in tgt])
    for i, t in enumerate(tgt):
        ax.plot([t["target"]] * 2, [i - 0.4, i + 0.4], color="black", lw=2)
        ax.text(right * 1.03, i, f"{t['value']:.2f} ({'>=' if t['higher_is_better'] else '<='} {t['target']})",
                va="center", fontsize=8)
    ax.set_yticks(range(len(tgt)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, right * 1.35)
    ax.set_title("Targets at bert-base (black: target; green: met)")
    ax = axes[1][1]
    ok = [r for r in mlp if "error" not in r and "skipped" not in r]
    if ok:
        x = range(len(ok))
        ax.bar([i - 0.2 for i in x], [r["ours_s"] * 1e3 for r in ok], width=0.4, label="ours", color="#1f77b4")
        ax.bar([i + 0.2 for i in x], [r["mcore_s"] * 1e3 for r in ok], width=0.4, label="megatron-core",
               color="#76b900")
        ax.set_xticks(list(x), [f"TP={r['tp']}, {r['dtype']}" for r in ok])
        ax.set_ylabel("ms per forward + backward (lower is better)")
        ax.legend()
    h = SIZES["base"].hidden_size
    ax.set_title(f"Column -> gelu -> Row parallel MLP, [{SEQ}, {BATCH}, {h}] -> {4 * h}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
