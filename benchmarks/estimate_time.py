"""Predicted (``check --estimate-time --device this``) against measured step time on this machine.

    .venv/bin/python benchmarks/estimate_time.py                       # the full run (~10 min idle)
    .venv/bin/python benchmarks/estimate_time.py --layouts tp1,tp2 --steps 2 --layers 2   # plumbing only
    .venv/bin/python benchmarks/estimate_time.py --model llama-tiny --precision bf16         # the decoder's rows
    .venv/bin/python benchmarks/estimate_time.py --model llama-tiny --lora 8                 # LoRA adapters' rows
    .venv/bin/python benchmarks/estimate_time.py --model mixtral-tiny                        # the experts' rows
    .venv/bin/python benchmarks/estimate_time.py --model llama-tiny --layouts pp2,pp2vp2 --defer-wgrad  # at the flush
    .venv/bin/python benchmarks/estimate_time.py --layouts tp1,pp2,pp2vp2 --weight-grads-per-step   # CPU tuning's
    .venv/bin/python benchmarks/estimate_time.py --untuned --layouts tp1,tp2,dp2,pp2   # a recipe without the tuning

Measures this machine's rates before and after the runs, and predicts with the quieter of the two (the
faster GEMM with its own elementwise and vocabulary rates; the faster copy and links of either;
:func:`lightning_megatron.check.devices.measure_this_machine`: a GEMM of the model's shape on one
core, a memory copy, one transformer layer's forward and backward for the memory-bound kernels, a
one-layer model's for the vocabulary passes of its embeddings, heads and loss, 2-process all-reduces
and gloo sends; other jobs only slow a measurement), then runs each
layout for ``--warmup`` + ``--steps`` optimizer steps of ``Trainer.fit`` in fresh spawned gloo
processes (``benchmarks/bert_step.py``: BERT, post-norm spec, dropout 0.1, the CPU tuning, synthetic
full-length batches; with ``--model llama-tiny`` / ``llama-small``, ``benchmarks/gpt_step.py``'s Llama-shaped
decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied output layer, no dropout, synthetic tokens,
layouts ``DECODER_LAYOUTS`` by default; ``--lora r``: that decoder saved as a transformers Llama once, every run
training rank-``r`` adapters on its four projections with the base frozen (``from_pretrained``, as
``benchmarks/lora_memory.py``); ``--model mixtral-tiny``: ``benchmarks/moe_step.py``'s mixture of experts, 8
SwiGLU experts top 2 with the all-to-all dispatcher, layouts ``MOE_LAYOUTS``) and compares the median step time with the prediction of
:func:`lightning_megatron.check.timing.estimate_time` at efficiencies 1 (measured rates). Ranks share
the cores (``cores / world_size`` each). Target: within 25% on every layout. Other work on the
machine slows the measured steps, not the prediction: run it on an idle machine (the last column, the
busiest rank's CPU seconds per thread, is a lower bound that contention barely moves). One core's GEMM rate is
probed just before and after each run (the last column, against the rate predicted with): on a host whose rate
moves in spells (the Intel AMX host's bf16 rate halved for seconds at a time, docs/benchmarks.md) a run between
probes 15% off it ran in another state than the one measured: it is run again (``--retries``, 2), and a row whose
last run still was is marked and the closing line also counts the others alone.
No number here is a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import CPU_COUNT, BertSize, launch, median  # noqa: E402
from lightning_megatron.parallel_dims import ParallelDims

LAYOUTS = "tp1,tp2,pp2,pp2vp2,dp2,dp2zero1,tp2sp,tp2pp2,tp2dp2zero1"
DECODER_LAYOUTS = "tp1,tp2,tp2sp,dp2,cp2,pp2"
LORA_LAYOUTS = "tp1,tp2,dp2,pp2"
MOE_LAYOUTS = "tp1,ep2,dp2,tp2"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert", choices=("bert", "llama-tiny", "llama-small", "mixtral-tiny"))
    p.add_argument("--layouts", default=None, help=f"default: {LAYOUTS} (bert), {DECODER_LAYOUTS} (decoders), "
                                                   f"{LORA_LAYOUTS} (--lora), {MOE_LAYOUTS} (mixtral-tiny)")
    p.add_argument("--lora", type=int, default=None, help="LoRA adapters of this rank on a llama-* decoder")
    p.add_argument("--defer-wgrad", action="store_true",
                   help="llama-* decoders: defer_embedding_wgrad_compute (the output layer's weight gradient at the "
                        "pipeline flush; layouts with PP)")
    p.add_argument("--weight-grads-per-step", action="store_true",
                   help="the CPU tuning's weight_grads_per_step: every linear layer's weight gradient once a step, "
                        "after the schedule's last backward (CPUTuning(weight_grads_per_step=True))")
    p.add_argument("--untuned", action="store_true",
                   help="the runs without the CPU tuning (cpu_tuning=None: gloo collectives, torch's allocator and "
                        "the library's kernels), predicted as check --estimate-time --device this predicts a recipe "
                        "without it; the predictions with the tuning assumed (what it predicted for such a recipe "
                        "before 2026-12-06) printed beside them")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--retries", type=int, default=2,
                   help="run a layout again (at most this often) when one core's GEMM rate probed just before or after "
                        "its run is more than 15%% off the first measurement's: the host was in another state")
    a = p.parse_args()

    from bert_step import bert_rank
    from gpt_step import _ours, gpt_layout_rank

    from lightning_megatron.check.devices import measure_this_machine, probe_times
    from lightning_megatron.models.bert.cost import BertCost
    from lightning_megatron.check.timing import MEASURED, Framework, estimate_time
    from lightning_megatron.transformer.lora import LORA_TARGETS

    bf16, folder = a.precision == "bf16", None
    if a.untuned and a.weight_grads_per_step:
        raise SystemExit("estimate_time.py: --weight-grads-per-step is a piece of the CPU tuning; --untuned runs "
                         "without it")
    tuned = not a.untuned
    if a.defer_wgrad and not a.model.startswith("llama"):
        raise SystemExit("estimate_time.py: --defer-wgrad is for the llama-* decoders")
    extra = dict(defer_embedding_wgrad_compute=True) if a.defer_wgrad else {}
    if a.model == "bert":
        size = BertSize(name="bench", num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                        ffn_hidden_size=4 * a.hidden)
        shape: Any = BertCost(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                              vocab_size=size.vocab_size, max_sequence_length=size.max_position_embeddings,
                              seq_length=a.seq, micro_batch_size=a.micro_batch, global_batch_size=a.global_batch,
                              params_dtype="bfloat16" if bf16 else "float32", post_norm=True, on_cpu=tuned)
        rank, layouts = bert_rank, a.layouts or LAYOUTS
        title = (f"BERT {a.layers} layers, hidden {a.hidden}, {a.heads} heads, seq {a.seq}, micro batch {a.micro_batch}, "
                 f"global batch {a.global_batch}, {a.precision}, dropout 0.1")
    elif a.model.startswith("mixtral"):
        from moe_step import SIZES as MOES
        from moe_step import _ours as moe_module

        from lightning_megatron.models.gpt.cost import GPTCost

        moe = MOES[a.model]
        if a.lora:
            raise SystemExit("estimate_time.py: --lora is for the llama-* decoders")
        a.seq, a.hidden = moe.seq_length, moe.hidden_size
        shape = GPTCost.from_config(moe_module(moe, bf16).config, seq_length=a.seq, micro_batch_size=a.micro_batch,
                                    global_batch_size=a.global_batch, on_cpu=tuned)
        rank, layouts = gpt_layout_rank, a.layouts or MOE_LAYOUTS
        title = (f"{a.model}: {moe.num_layers} layers, hidden {moe.hidden_size}, {moe.num_attention_heads} heads in "
                 f"{moe.num_query_groups} groups, {moe.num_experts} SwiGLU experts of {moe.expert_ffn_hidden_size} "
                 f"(top {moe.topk}, all-to-all dispatcher), vocabulary {moe.vocab_size}, seq {a.seq}, micro batch "
                 f"{a.micro_batch}, global batch {a.global_batch}, {a.precision}, no dropout")
        decoder = moe
    else:
        from gpt_step import SIZES as DECODERS

        from lightning_megatron.models.gpt.cost import GPTCost

        decoder = DECODERS[a.model]
        a.seq, a.hidden = decoder.seq_length, decoder.hidden_size
        config = _ours(decoder, bf16, **extra).config
        adapters = dict(lora_rank=a.lora, lora_targets=tuple(LORA_TARGETS)) if a.lora else {}
        shape = GPTCost.from_config(config, seq_length=a.seq, micro_batch_size=a.micro_batch,
                                    global_batch_size=a.global_batch, on_cpu=tuned, **adapters)
        rank, layouts = gpt_layout_rank, a.layouts or (LORA_LAYOUTS if a.lora else DECODER_LAYOUTS)
        title = (f"{a.model}: {decoder.num_layers} layers, hidden {decoder.hidden_size}, {decoder.num_attention_heads} "
                 f"heads in {decoder.num_query_groups} groups, SwiGLU {decoder.ffn_hidden_size}, vocabulary "
                 f"{decoder.vocab_size}, seq {a.seq}, micro batch {a.micro_batch}, global batch {a.global_batch}, "
                 f"{a.precision}, no dropout" + (f", LoRA rank {a.lora} on {', '.join(LORA_TARGETS)} (base frozen)"
                                                 if a.lora else "")
                 + (", the output layer's weight gradient deferred to the flush" if a.defer_wgrad else ""))
        if a.lora:
            import tempfile

            from lora_memory import save_llama_folder

            folder = save_llama_folder(decoder, tempfile.mkdtemp(prefix="estimate_time_lora_"))
    def rates(dev: Any) -> str:
        return (f"GEMM {dev.flops_16 / 1e9:.1f} GFLOP/s ({a.seq * a.micro_batch}x{a.hidden}x{shape.ffn}, {a.precision}), "
                f"copy {dev.hbm / 1e9:.2f} GB/s, elementwise kernels of one layer {dev.elementwise / 1e9:.2f} GB/s, "
                f"vocabulary passes of the embeddings, heads and loss {dev.vocab / 1e9:.2f} GB/s, "
                f"the layer on {CPU_COUNT} threads {dev.thread_speedup or 1:.2f}x one, "
                f"all-reduce {dev.link_intra / 1e9:.2f} GB/s + {dev.latency_intra * 1e6:.0f} us, gloo send "
                f"{dev.p2p / 1e9:.2f} GB/s + {dev.p2p_latency * 1e6:.0f} us")

    def probe() -> float:
        """One core's GEMM rate now (the measurement's GEMM, fastest of 10): this host's rate moves in spells."""
        gemm_s = probe_times(a.seq * a.micro_batch, shape.ffn, a.hidden, bf16, rounds=10)["gemm"]
        return 2.0 * a.seq * a.micro_batch * shape.ffn * a.hidden / gemm_s

    # the CPU tuning's pieces, as check --estimate-time --device this takes them from a recipe: all on, or all off
    pieces = dict(shared_memory=tuned, keep_freed=tuned, kernels=tuned)
    t0 = time.perf_counter()
    before = measure_this_machine(a.seq * a.micro_batch, shape.ffn, a.hidden, bf16, shape=shape, **pieces)
    print(f"this machine, per core ({CPU_COUNT} cores): {rates(before)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    # the CPU tuning's synchronous collectives expose the DP reduction and SP's gathers; gloo's are asynchronous
    fw = Framework(overlap_grad_reduce=not tuned, overlap_sp_gather=not tuned,
                   fused_attention=not shape.unfused_attention, weight_grads_per_step=a.weight_grads_per_step)
    if a.untuned:
        title += ", without the CPU tuning (gloo collectives, torch's allocator and kernels)"
    if a.weight_grads_per_step:
        from lightning_megatron.cpu import CPUTuning

        title += ", the CPU tuning's weight gradients once a step"
    runs = []
    for layout in ParallelDims.parse_list(layouts):
        if a.model == "bert":
            run = dict(framework="ours", size=size.as_dict(), precision=a.precision, tp=layout.tp, pp=layout.pp,
                       vp=layout.vp, sp=layout.sequence_parallel, zero1=layout.zero1, micro_batch=a.micro_batch,
                       batch=a.global_batch // layout.dp, seq=a.seq, warmup=a.warmup, steps=a.steps,
                       cpu_tuning={"weight_grads_per_step": a.weight_grads_per_step} if tuned else None)
        else:
            if layout.zero1 or (layout.ep > 1 and not a.model.startswith("mixtral")):
                raise SystemExit(f"estimate_time.py --model {a.model}: layout {layout.name} is not run here")
            run = dict(size=dataclasses.asdict(decoder), precision=a.precision, warmup=a.warmup, steps=a.steps,
                       batch=a.global_batch // layout.dp, micro_batch=a.micro_batch,
                       moe=a.model.startswith("mixtral"), folder=folder, lora=a.lora, config=extra,
                       strategy=dict(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                     virtual_pipeline_model_parallel_size=layout.vp,
                                     context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
                                     sequence_parallel=layout.sequence_parallel,
                                     **({"cpu_tuning": CPUTuning(weight_grads_per_step=True)}
                                        if a.weight_grads_per_step else {} if tuned else {"cpu_tuning": None})))
        t1 = time.perf_counter()
        for attempt in range(a.retries + 1):
            around = [probe(), 0.0]
            results = launch(rank, layout.world_size, run, timeout=1800)
            around[1] = probe()
            if all(abs(x / before.flops_16 - 1) <= 0.15 for x in around) or attempt == a.retries:
                break
            print(f"{layout.name}: one core's GEMM {around[0] / 1e9:.0f} and {around[1] / 1e9:.0f} GFLOP/s around the "
                  f"run, more than 15% off the measurement's {before.flops_16 / 1e9:.0f}: run again", flush=True)
        measured = max(median(r["step_times"]) for r in results)
        # CPU seconds per thread of the busiest rank: what the step would take with the cores to
        # itself if it never waited (a lower bound that other jobs on the machine barely move).
        busy = max(median(r["step_cpu"]) / r["threads"] for r in results) if "step_cpu" in results[0] else float("nan")
        runs.append((layout, measured, busy, around))
        print(f"{layout.name}: measured {measured:.3f} s ({time.perf_counter() - t1:.0f} s; one core's GEMM "
              f"{around[0] / 1e9:.0f} GFLOP/s before the run, {around[1] / 1e9:.0f} after)", flush=True)
    after = measure_this_machine(a.seq * a.micro_batch, shape.ffn, a.hidden, bf16, shape=shape, **pieces)
    print(f"this machine again after the runs: {rates(after)}")
    # Other jobs only slow a measurement down: each independent rate is the faster of the two measurements, the
    # latencies the smaller (what this machine does when it is not shared). The GEMM, elementwise and vocabulary
    # rates are one measurement's: the last two are what the model's layer and one-layer model took beyond
    # their GEMMs at that measurement's GEMM rate, so mixing them with the other's GEMM rate would count the
    # same time twice as fast (before 2026-12-03 it did: a 4x jump of the elementwise rate between the two
    # measurements under-predicted every layout). The quieter measurement's (the faster GEMM) is used.
    quiet = before if before.flops_16 >= after.flops_16 else after
    dev = dataclasses.replace(quiet, hbm=max(before.hbm, after.hbm),
                              link_intra=max(before.link_intra, after.link_intra),
                              link_inter=max(before.link_inter, after.link_inter),
                              latency_intra=min(before.latency_intra, after.latency_intra),
                              latency_inter=min(before.latency_inter, after.latency_inter),
                              p2p=max(before.p2p, after.p2p), p2p_latency=min(before.p2p_latency, after.p2p_latency))
    print(f"used below (GEMM, elementwise and vocabulary rates of the {'first' if quiet is before else 'second'} "
          f"measurement, the quieter; the faster copy and links of the two): {rates(dev)}; change from before to "
          f"after: GEMM "
          f"{after.flops_16 / before.flops_16 - 1:+.0%}, "
          f"elementwise {after.elementwise / before.elementwise - 1:+.0%}, "
          f"vocabulary {after.vocab / before.vocab - 1:+.0%} "
          f"(a large change means the machine was busy: the measured step times are not meaningful then)")
    rows = [(layout, estimate_time(shape, layout, dev, MEASURED, fw), measured, busy, around)
            for layout, measured, busy, around in runs]
    print(f"\n{title}; median of {a.steps} steps after {a.warmup}\n")
    print("| layout | ranks | predicted s | compute (of which vocabulary / grad accumulation) / TP / CP / EP / PP / "
          "bubble / DP / optimizer s | measured s | measured / predicted | CPU s per thread (busiest rank) | "
          "GEMM around the run / used |")
    print("|---|---|---|---|---|---|---|---|")
    worst, within, steady, steady_within = 0.0, 0, 0, 0
    for layout, pred, measured, busy, around in rows:
        parts = (pred.tp_comm, pred.cp_comm, pred.ep_comm, pred.pp_comm, pred.bubble, pred.dp_comm, pred.optimizer)
        ratio = measured / pred.total
        worst = max(worst, abs(ratio - 1))
        within += abs(ratio - 1) <= 0.25
        # the host's GEMM rate just before and after the run against the rate predicted with: a run between two
        # probes 15% off it ran in another host state than the one measured (this host's rate moves in spells)
        host = [x / dev.flops_16 for x in around]
        same = all(abs(x - 1) <= 0.15 for x in host)
        steady += same
        steady_within += same and abs(ratio - 1) <= 0.25
        print(f"| {layout.name} | {layout.world_size} | {pred.total:.3f} | {pred.compute:.3f} ({pred.vocab:.3f} / "
              f"{pred.accumulate:.3f}) / {' / '.join(f'{x:.3f}' for x in parts)} "
              f"| {measured:.3f} | {ratio:.2f} | {'-' if busy != busy else f'{busy:.3f}'} "
              f"| {host[0]:.2f}, {host[1]:.2f}{'' if same else ' (host state differed)'} |")
    print(f"\nlargest error: {worst:.0%}; {within} of {len(rows)} layouts within 25% (target 25%); of the {steady} run "
          f"with the host's GEMM rate within 15% of the one used before and after, {steady_within}")
    if a.untuned:  # what the estimate predicted for these runs while it took the tuning for granted
        as_tuned = dataclasses.replace(shape, on_cpu=True)
        assumed = measure_this_machine(a.seq * a.micro_batch, shape.ffn, a.hidden, bf16, shape=as_tuned)
        fw_tuned = dataclasses.replace(fw, overlap_grad_reduce=False, overlap_sp_gather=False,
                                       fused_attention=not as_tuned.unfused_attention)
        print(f"\nthe same runs predicted with the CPU tuning assumed ({rates(assumed)}):\n")
        print("| layout | predicted s, tuning assumed | measured / that |")
        print("|---|---|---|")
        for layout, _, measured, _, _ in rows:
            pred = estimate_time(as_tuned, layout, assumed, MEASURED, fw_tuned).total
            print(f"| {layout.name} | {pred:.3f} | {measured / pred:.2f} |")
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
