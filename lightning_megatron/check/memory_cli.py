"""The ``--estimate-memory`` part of ``lightning-megatron check``: predicted next to measured bytes,
and the layouts of N GPUs that fit (from :mod:`lightning_megatron.check.memory`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_megatron.check.layouts import Layout
from lightning_megatron.check.memory import ModelShape, candidate_layouts, estimate_memory, estimate_stage

__all__ = ["fitting_layouts", "memory_table", "model_shape"]

_MIB = 2**20


def model_shape(recipe: Any, on_cpu: bool = False) -> ModelShape:
    """The formulas' sizes from a recipe (``--model.*`` overrides applied); ``on_cpu``: the attention
    path the CPU takes (for comparing with a check run on this machine)."""
    mdl, data = recipe.model, recipe.data
    vocab = mdl.get("vocab_size")
    if vocab is None:
        vocab_file = data.get("vocab_file")
        vocab = 30522 if vocab_file is None else sum(1 for _ in Path(vocab_file).open(encoding="utf-8"))
    spec = str(mdl.get("spec", "bert_layer_local_spec"))
    return ModelShape(
        num_layers=int(mdl.get("num_layers", 2)), hidden_size=int(mdl.get("hidden_size", 128)),
        num_attention_heads=int(mdl.get("num_attention_heads", 4)), ffn_hidden_size=mdl.get("ffn_hidden_size"),
        vocab_size=int(vocab), make_vocab_size_divisible_by=int(mdl.get("make_vocab_size_divisible_by", 128)),
        max_sequence_length=int(mdl.get("max_sequence_length", 128)),
        seq_length=int(data.get("max_seq_length", 128)), micro_batch_size=recipe.micro_batch_size,
        global_batch_size=recipe.global_batch_size, masked_lm_prob=float(data.get("masked_lm_prob", 0.15)),
        params_dtype=str(mdl.get("params_dtype", "float32")), optimizer=str(mdl.get("optimizer", "adamw")),
        post_norm="post_norm" in spec, rmsnorm="rmsnorm" in spec,
        recompute=mdl.get("recompute_granularity") == "full",
        attention_backend=str(mdl.get("attention_backend", "auto")), on_cpu=on_cpu)


def _mib(x: float) -> str:
    return f"{x / _MIB:9.2f}"


def memory_table(recipe: Any, layouts: list[Layout], report: Any) -> str:
    """Predicted vs measured MiB per rank (the fullest pipeline stage; measured: max over its ranks)."""
    m = model_shape(recipe, on_cpu=True)
    lines = ["memory per rank, MiB: predicted / measured (measured: tensors held at step 1 on this machine; "
             "activations: peak bytes saved for backward)",
             f"{'layout':<14} {'stage':>5} {'params':>19} {'grads':>19} {'optimizer':>19} {'activations':>19}"]
    for layout in layouts:
        est = estimate_memory(m, layout)
        ranks = report.runs[layout.name].memory
        per_stage = layout.tp * layout.dp
        mine = ranks[est.stage * per_stage:(est.stage + 1) * per_stage]
        meas = {k: max(r.get(k, 0) for r in mine) for k in ("params", "grads", "optimizer", "activations_peak")}
        cells = [(est.param_bytes, meas["params"]), (est.grad_bytes, meas["grads"]),
                 (est.optimizer_bytes, meas["optimizer"]), (est.activation_bytes, meas["activations_peak"])]
        lines.append(f"{layout.name:<14} {est.stage:>5} " + " ".join(f"{_mib(p)}/{_mib(q).strip():<9}" for p, q in cells))
    return "\n".join(lines)


def fitting_layouts(recipe: Any, gpus: int, gpu_memory: int | None) -> int:
    """Print every layout of ``gpus`` ranks with its predicted bytes; exit status 1 when none fits."""
    m = model_shape(recipe)
    rows = []
    for layout in candidate_layouts(m, gpus):
        est = estimate_memory(m, layout)
        rows.append((est.total_bytes, layout, est))
    rows.sort(key=lambda r: r[0])
    print(f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, ffn {m.ffn}, vocab "
          f"{m.vocab_size}, seq {m.seq_length}, micro batch {m.micro_batch_size}, global batch "
          f"{m.global_batch_size}, {m.params_dtype}, {m.optimizer}{', full recompute' if m.recompute else ''}: "
          f"{estimate_stage(m, Layout(), 0).params / 1e6:.1f} M parameters; {gpus} GPUs"
          + (f" of {gpu_memory / 1e9:.0f} GB" if gpu_memory else ""))
    print(f"{'layout':<22} {'params':>9} {'grads':>9} {'optimizer':>9} {'activ.':>9} {'total GiB':>9}  fits")
    fits = 0
    for total, layout, est in rows:
        ok = gpu_memory is None or total <= gpu_memory
        fits += ok
        g = 2**30
        print(f"{layout.name:<22} {est.param_bytes / g:9.2f} {est.grad_bytes / g:9.2f} {est.optimizer_bytes / g:9.2f} "
              f"{est.activation_bytes / g:9.2f} {total / g:9.2f}  {'yes' if ok else 'no'}")
    if gpu_memory is not None:
        print(f"{fits} of {len(rows)} layouts fit (activations: {m.micro_batch_size} samples per microbatch; "
              f"not counted: framework workspace, allocator fragmentation, communication buffers)")
    return 0 if fits else 1
