"""Where one TP=1 training step of our BERT or Llama-shaped decoder goes: forward / backward / optimizer, top ops,
copy sources.

    .venv/bin/python benchmarks/profile_step.py [--size base] [--dtype bf16] [--ops aten::copy_,aten::max]
    .venv/bin/python benchmarks/profile_step.py --size llama-tiny    # gpt_step.py's decoder, seq 256, batch 8
    .venv/bin/python benchmarks/profile_step.py --layers 4 --batch 4 --microbatches 4   # estimate_time.py's tp1

Runs the model of :class:`BertLightningModule` (``--size`` base, tiny) or of ``gpt_step.py``'s
:class:`GPTLightningModule` (``--size`` llama-tiny, llama-small: RMSNorm, SwiGLU, rope, grouped-query attention;
their sequence length and batch unless ``--seq`` / ``--batch`` say otherwise) directly (no Trainer: one process, all cores), the
way the MegatronStrategy's no-pipelining schedule does: ``forward_step`` -> ``backward`` (16-bit grads
added into the fp32 :class:`GradBuffer` by its hooks) -> optimizer step (the wrapper the MegatronOptimizerCallback
installs: bf16 the fp32-main-params one, scale 1; fp32 ``FP32Optimizer``; no clipping; the grads read from the
buffer as under the strategy, the norm computed).
After ``--warmup`` steps one step runs under ``torch.profiler`` with shapes recorded, and prints

- wall time of the phases (``FWD``, ``BWD``, ``OPT`` record_function ranges);
- the step's time by kind (:func:`by_kind`): GEMM, copies and casts, norms, softmax and attention,
  dropout and random numbers, other elementwise ops, the optimizer step (everything under ``OPT``:
  grad finalize, unscale, the update, the copy back to 16-bit), and the rest of the wall time, which
  no op accounts for (Python, autograd's engine, the profiler's own cost);
- the GEMM floor (:func:`gemm_floor`): the step's GEMMs run again alone at their shapes, their rate
  against the square GEMM rate measured in the same process, and the unprofiled step against both
  (``--gemms``: each distinct GEMM's shapes, count, time and rate, which tells the shapes that run below it);
- the top ops by self CPU time;
- for each op named in ``--ops``: its time grouped by the chain of calling ops and input shape, which
  tells which line of the model issued it (e.g. ``aten::clone < aten::contiguous < FWD`` on
  [b, s, V] is ``logits.transpose(0, 1).contiguous()`` in BertModel.forward).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import resource
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import CPU_COUNT, SIZES, TokenBatches  # noqa: E402
from bert_step import LR, WEIGHT_DECAY, SyntheticBatches  # noqa: E402
from lightning_megatron.parallel_dims import ParallelDims


def build(size_name: str, dtype: str, batch: int, seq: int, layers: int | None = None, dropout: float = 0.1):
    from lightning_megatron.models.bert import BertConfig
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.tensor_parallel.random import model_parallel_seed

    model_parallel_seed(1234, 0)
    s = SIZES[size_name]
    if layers is not None:
        s = dataclasses.replace(s, num_layers=layers)
    config = BertConfig(num_layers=s.num_layers, hidden_size=s.hidden_size, num_attention_heads=s.num_attention_heads,
                        ffn_hidden_size=s.ffn_hidden_size, vocab_size=s.vocab_size,
                        max_sequence_length=s.max_position_embeddings, spec="bert_layer_post_norm_spec",
                        params_dtype="bfloat16" if dtype == "bf16" else "float32",
                        hidden_dropout=dropout, attention_dropout=dropout)
    module = BertLightningModule(config, lr=LR, weight_decay=WEIGHT_DECAY)
    module.configure_model()
    return module, module.configure_optimizers(), _stacked(SyntheticBatches(batch, seq, s.vocab_size), batch)


def build_decoder(size_name: str, dtype: str, batch: int | None, seq: int | None, layers: int | None = None,
                  dropout: float = 0.0):
    """``gpt_step.py``'s decoder of ``size_name`` (its sequence length and batch unless given)."""
    from gpt_step import LLAMA_SHAPE, _ours
    from gpt_step import SIZES as DECODERS

    from lightning_megatron.tensor_parallel.random import model_parallel_seed

    model_parallel_seed(1234, 0)
    s = DECODERS[size_name]
    s = dataclasses.replace(s, num_layers=layers or s.num_layers, seq_length=seq or s.seq_length,
                            batch=batch or s.batch)
    if dropout != LLAMA_SHAPE["hidden_dropout"]:
        raise SystemExit(f"--dropout {dropout}: the Llama shape has no dropout (0.0)")
    module = _ours(s, dtype == "bf16")
    module.configure_model()
    return module, module.configure_optimizers(), _stacked(TokenBatches(s.batch, s.seq_length, s.vocab_size), s.batch)


def _mixed_precision(opt, dtype: str, grads, ps):
    """The optimizer as the MegatronOptimizerCallback wraps it (``OptimizerConfig.wrap``; here no clipping), reading
    the grads from the strategy's buffer ``grads`` as there: bf16 the fp32-main-params wrapper (scale 1; without the
    buffer it would read the 16-bit params' ``.grad``, which the buffer's hooks empty: the update would step
    nothing), fp32 the ``FP32Optimizer`` (its exact norm and NaN/Inf check over the buffer's gradients, one pass;
    until 2026-12-04 fp32 timed the plain optimizer, without that pass)."""
    from lightning_megatron.optimizer.config import OptimizerConfig

    return OptimizerConfig(clip_grad=0.0).wrap(opt, parallel_state=ps, grad_buffer=grads)


def _check_updated(opt) -> None:
    """Refuse to time a step whose Adam update stepped no state for some parameter (its grad never reached it)."""
    inner = getattr(opt, "optimizer", opt)
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        params = [p for group in inner.param_groups for p in group["params"]]
        missing = sum(1 for p in params if not inner.state.get(p))
        if missing:
            raise SystemExit(f"the optimizer updated {len(params) - missing} of {len(params)} parameters in the "
                             f"warm-up: the timed step would leave out the update of the rest")


def _stacked(ds, batch: int) -> dict[str, torch.Tensor]:
    return {k: torch.stack([ds[i][k] for i in range(batch)]) for k in ds[0]}


_KINDS = (
    ("GEMM", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation",
              "aten::mkldnn_linear", "aten::mkldnn_matmul")),
    ("copies and casts", ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat",
                          "aten::_unsafe_view", "aten::index", "aten::index_put_", "aten::embedding_dense_backward")),
    ("norms", ("aten::native_layer_norm", "aten::native_layer_norm_backward", "aten::_fused_rms_norm",
               "aten::rms_norm", "aten::_fused_rms_norm_backward")),
    ("softmax and attention", ("aten::_softmax", "aten::_softmax_backward_data", "aten::_log_softmax",
                               "aten::_log_softmax_backward_data", "aten::_scaled_dot_product",
                               "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::masked_fill",
                               # on a GPU (gpu_check.step_by_kind) the kernels run under these, inside SDPA's op
                               "aten::_flash_attention", "aten::_efficient_attention", "aten::_cudnn_attention",
                               "aten::nll_loss", "aten::nll_loss_backward")),
    ("dropout and random numbers", ("aten::bernoulli_", "aten::native_dropout", "aten::uniform_", "aten::rand", "aten::random_",
                                    "aten::native_dropout_backward")),
)


def by_kind(events, wall: float) -> list[tuple[str, float]]:
    """Seconds of the profiled step by kind: each op's self CPU time, the ones under the ``OPT`` range
    as "optimizer step", the others by name (:data:`_KINDS`, prefixes; "other elementwise" for the
    rest); "not in any op" is the wall time less all ops' self time."""
    seconds: collections.Counter = collections.Counter()
    for e in events:
        if e.name in ("FWD", "BWD", "OPT") or e.name.startswith(("ProfilerStep", "autograd::", "Optimizer.")):
            continue
        parent, in_opt = e.cpu_parent, False
        while parent is not None:
            in_opt = in_opt or parent.name == "OPT"
            parent = parent.cpu_parent
        if in_opt:
            kind = "optimizer step"
        else:
            kind = next((k for k, names in _KINDS if e.name.startswith(names)), "other elementwise")
        seconds[kind] += e.self_cpu_time_total / 1e6
    seconds["not in any op (Python, autograd, profiler)"] = max(0.0, wall - sum(seconds.values()))
    return seconds.most_common()


_GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
_TORCH_DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16, "double": torch.float64}


def _gemm_flops(name: str, shapes: list[list[int]]) -> float:
    """2 m k n (times the batch) of one recorded GEMM."""
    a, b = (shapes[0], shapes[1]) if name in ("aten::mm", "aten::bmm") else (shapes[1], shapes[2])
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def gemm_floor(events, repeats: int = 5) -> tuple[float, float, int, list[tuple[str, tuple, int, float, float]]]:
    """``(seconds, flops, gemms, rows)``: every GEMM of the profiled step (mm, addmm, bmm, baddbmm, by the
    shapes and dtypes the profiler recorded) run again alone, outside the profiler, on fresh contiguous
    operands: each distinct one ``repeats`` times after a warm-up, its median times its count. What the step's
    matrix multiplications cost by themselves on this machine at these shapes: no step can be shorter,
    and its FLOPs over this time is the rate these GEMMs reach (below the square-GEMM peak). ``rows``: per
    distinct GEMM ``(op, shapes, count, seconds for all its calls, FLOP/s)``, slowest in total first."""
    seen: collections.Counter = collections.Counter()
    for e in events:
        if e.name in _GEMMS and e.input_shapes:
            dtypes = tuple(getattr(e, "input_dtypes", ()) or ())
            seen[(e.name, tuple(tuple(x) for x in e.input_shapes), dtypes)] += 1
    total = flops = 0.0
    rows = []
    for (name, shapes, dtypes), count in seen.items():
        dtype = _TORCH_DTYPES.get(next((d for d in dtypes if d), "float"), torch.float32)
        operands = 2 if name in ("aten::mm", "aten::bmm") else 3  # compiled code also records an out= tensor
        args = [torch.randn(*shape, dtype=torch.float32).to(dtype) for shape in shapes[:operands]]
        op = getattr(torch, name.removeprefix("aten::"))
        op(*args)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            op(*args)
            times.append(time.perf_counter() - t0)
        median, one = sorted(times)[repeats // 2], _gemm_flops(name, [list(x) for x in shapes])
        total += median * count
        flops += one * count
        rows.append((name, shapes[:operands], count, median * count, one / median))
    rows.sort(key=lambda row: -row[3])
    return total, flops, sum(seen.values()), rows


def square_gemm_rate(dtype: torch.dtype, sizes: tuple[int, ...] = (1024, 2048), repeats: int = 5) -> float:
    """FLOP/s of ``n x n @ n x n`` in ``dtype``: the best of ``repeats`` at each of ``sizes``, the highest.

    The peak ``benchmarks/gemm.py`` measures. One size, best of 3, read ~7% low in one fp32 run here (189
    against 202 GFLOP/s, and the step's own GEMMs then ran at "103%" of it); on this kind of host the rate
    moves by a few % between sizes (bf16: ~440 at 1024, ~429 at 2048, ~405 at 4096 GFLOP/s), so the
    highest of two sizes is what a percentage of "the machine's rate" is taken against."""
    best_rate = 0.0
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        best_rate = max(best_rate, 2.0 * n**3 / best)
    return best_rate


def map_each_block(threshold: int = 1 << 17) -> None:
    """glibc: every block of ``threshold`` bytes or more its own ``mmap``, unmapped when freed (a fixed
    threshold: glibc's own rises with the blocks freed), so the process's resident memory follows the live
    tensors (what a GPU's allocator reports as allocated), not the heap's high-water mark."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_mmap_threshold = -3
    if not libc.mallopt(m_mmap_threshold, threshold):
        raise SystemExit("--peak-memory needs glibc's mallopt")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def step_peak_bytes(step) -> int:
    """Bytes by which the process's resident memory rises above its level before ``step()`` at the step's
    peak (Linux: the high-water mark ``VmHWM`` reset through ``/proc/self/clear_refs``; with
    :func:`map_each_block`, the transient tensors of the step: activations, the logits and their gradients,
    weight gradients before they reach the buffer)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    step()
    return (_status_kib("VmHWM") - before) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="base", choices=sorted(SIZES) + ["llama-small", "llama-tiny"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=None, help="micro batch size (BERT: 8; a decoder: its own)")
    parser.add_argument("--microbatches", type=int, default=1, help="microbatches per step (grad accumulation)")
    parser.add_argument("--layers", type=int, default=None, help="override the size's layer count")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (BERT: 128; a decoder: its own)")
    parser.add_argument("--dropout", type=float, default=None, help="hidden and attention dropout (BERT: 0.1; a decoder: 0)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each transformer layer and the loss, as compile=True does")
    parser.add_argument("--warmup", type=int, default=4, help="steps before the profiled one (the first ones page-fault)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--steps", type=int, default=5, help="unprofiled steps timed after the warm-up ones")
    parser.add_argument("--gemms", action="store_true", help="list the step's GEMMs by shape: time and rate of each")
    parser.add_argument("--peak-memory", action="store_true",
                        help="only measure a step's peak memory (step_peak_bytes), not its time")
    parser.add_argument("--ops", default="aten::copy_", help="comma-separated ops to attribute to their callers")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(CPU_COUNT)
    import torch.distributed as dist

    from lightning_megatron.grads import GradBuffer, buffer_order, finalize_model_grads
    from lightning_megatron.parallel_state import initialize_model_parallel

    from lightning_megatron.cpu.allocator import keep_freed_memory

    if args.peak_memory:
        map_each_block()
    else:
        keep_freed_memory()  # as the opt-in CPU tuning does (CPUTuning(keep_freed_memory=True))
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    ps = initialize_model_parallel(ParallelDims(tp=1, pp=1))
    if args.size.startswith("llama"):
        module, opt, data = build_decoder(args.size, args.dtype, args.batch, args.seq, args.layers,
                                          0.0 if args.dropout is None else args.dropout)
    else:
        module, opt, data = build(args.size, args.dtype, args.batch or 8, args.seq or 128, args.layers,
                                  0.1 if args.dropout is None else args.dropout)
    chunk = module.model_chunks[0]
    from lightning_megatron.cpu import CPUTuning

    CPUTuning().configure_model(chunk, torch.device("cpu"))  # the CPU kernels, as the CPU tuning installs them
    if args.compile:
        layers = chunk.compile_layers()
        print(f"compiled {layers} transformer layers{' and the loss' if chunk.compile_loss() else ''}")
    # The strategy's fp32 grad buffer (filled by backward hooks), with what the CPU tuning hands it.
    grads = GradBuffer(buffer_order([chunk]), **CPUTuning().grad_buffer_options(torch.device("cpu")))
    opt = _mixed_precision(opt, args.dtype, grads, ps)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        grads.start(args.microbatches)
        for _ in range(args.microbatches):  # the same batch each time: the work, not the numbers, matters
            with torch.profiler.record_function("FWD"):
                loss, _ = module.forward_step(data, chunk)
            with torch.profiler.record_function("BWD"):
                loss.backward()
        with torch.profiler.record_function("OPT"):
            finalize_model_grads(grads, ps)
            opt.step()

    for _ in range(args.warmup):
        t0 = time.perf_counter()
        step()
        print(f"warm-up step {time.perf_counter() - t0:.3f} s")
    _check_updated(opt)
    if args.peak_memory:
        peaks = [step_peak_bytes(step) for _ in range(3)]
        print(f"a step's peak of memory above what lives between steps: {min(peaks) / 2**20:.1f} MiB "
              f"(3 steps: {', '.join(f'{p / 2**20:.1f}' for p in peaks)} MiB)")
        return
    # Timed before the profiler and the GEMM replay: after them a step ran up to 1.4x slower here
    # (llama-tiny bf16: 1.74 s against 1.24-1.31 s before and in a plain loop).
    gemm_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    peak_before = square_gemm_rate(gemm_dtype)
    unprofiled = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        unprofiled.append(time.perf_counter() - t0)
    # The profiler's own records, allocated during the step, can move the step's large tensors to memory the heap
    # never had: bert-base bf16 page-faulted 24,000-34,000 times in some profiled steps, where the word
    # embedding's [30592, 768] gradient was zero-filled in 90-127 ms and summed with the output layer's in
    # 105-153 ms (0.9 and 2.6 ms in a profiled step without faults; unprofiled steps fault a few times): the
    # table then charges the kernel's page zeroing to the ops that first touch the memory. Headroom touched and
    # freed first stays resident at the top of the heap (the CPU tuning's allocator setting); 512 MiB or 1 GiB
    # left some runs faulting (fp32, llama-tiny), 2 GiB is past that setting's trim threshold (2 GiB - 1: the
    # freed top is given back at once); 1.75 GiB left 38-45 faults in every run tried. The faults are printed.
    headroom = torch.ones(448 * 2**20)  # 1.75 GiB
    del headroom
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    events = prof.events()
    phases = collections.Counter()
    for e in events:
        if e.name in ("FWD", "BWD", "OPT"):
            phases[e.name] += e.cpu_time_total / 1e6
    print(f"\nprofiled step {wall:.3f} s: " + ", ".join(f"{k} {v:.3f} s ({100 * v / wall:.0f}%)"
                                                      for k, v in phases.items())
          + f"; {faults} page faults (thousands: the kernel's page zeroing is in the table)")
    print("by kind (self CPU time of the ops):")
    for kind, sec in by_kind(events, wall):
        print(f"  {kind:<45} {sec:7.3f} s  {100 * sec / wall:5.1f}%")
    floor, flops, count, rows = gemm_floor(events)
    # Measured before the unprofiled steps and after the replay, the higher: one measurement disturbed by the
    # shared host's neighbours read half the rate here once (214 against ~420 GFLOP/s in bf16).
    peak = max(peak_before, square_gemm_rate(gemm_dtype))
    step_s, fastest = sorted(unprofiled)[len(unprofiled) // 2], min(unprofiled)
    print(f"\nthe step's {count} GEMMs ({flops / 1e9:.0f} GFLOP executed) replayed alone: {floor:.3f} s, "
          f"{flops / floor / 1e9:.0f} GFLOP/s = {flops / floor / peak:.0%} of the square {args.dtype} GEMM rate "
          f"measured now ({peak / 1e9:.0f} GFLOP/s: the best of n=1024 and 2048, before the steps and after the replay)")
    if args.gemms:
        print("by GEMM (replayed alone; all calls of each, slowest first):")
        for name, shapes, calls, seconds, rate in rows:
            print(f"  {1e3 * seconds:8.1f} ms  x{calls:<3} {rate / 1e9:5.0f} GFLOP/s = {rate / peak:4.0%}  "
                  f"{name} {' @ '.join(str(list(x)) for x in shapes)}")
    print(f"unprofiled step (median of {len(unprofiled)}): {step_s:.3f} s = {flops / step_s / 1e9:.0f} GFLOP/s = "
          f"{flops / step_s / peak:.0%} of that rate; GEMMs alone {floor / step_s:.0%} of the step, "
          f"the rest {step_s - floor:.3f} s")
    # The fastest step against the fastest GEMMs (both best-of): what the step reaches when nothing beside it
    # slows it, on a shared host whose state moves the median by 10% and more between runs.
    print(f"fastest unprofiled step: {fastest:.3f} s = {flops / fastest / peak:.0%} of that rate "
          f"(steps: {', '.join(f'{t:.3f}' for t in unprofiled)} s)")
    print(f"peak RSS of the process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=50))
    wanted = set(args.ops.split(","))
    by_caller: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for e in events:
        if e.name not in wanted:
            continue
        chain, parent = [], e.cpu_parent
        while parent is not None and len(chain) < 3:
            chain.append(parent.name)
            parent = parent.cpu_parent
        key = (e.name, " < ".join(chain), str(e.input_shapes[:1]) if e.input_shapes else "")
        by_caller[key] += e.cpu_time_total / 1e3
        calls[key] += 1
    print(f"\n{', '.join(sorted(wanted))} by caller chain and first input shape:")
    for key, ms in by_caller.most_common(args.top):
        print(f"{ms:9.1f} ms  x{calls[key]:<4d} {key[0]} < {key[1][:90]}  {key[2][:50]}")


if __name__ == "__main__":
    main()
