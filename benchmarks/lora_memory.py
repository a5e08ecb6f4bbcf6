"""Full fine-tuning against LoRA adapters of the same pretrained decoder: what trains, what it holds, how fast.

    python benchmarks/lora_memory.py [--quick] [--size llama-small] [--precisions fp32,bf16] [--lora-ranks 8,16]
                                     [--tp 1] [--repeats 1] [--out results.json]

``--quick``: sequence 128, batch 2, 1 + 3 steps (about 3 minutes here); otherwise the size's sequence and batch
(llama-small: 512 x 4), 1 + 5 steps.

One transformers ``LlamaForCausalLM`` of ``--size`` (benchmarks/gpt_step.py's sizes; llama-small: 8 layers,
h 768, 12 heads in 4 key/value groups, SwiGLU 2048, untied vocabulary 32000: 99.5 M parameters, half of them
the embedding and the output layer) is saved with random weights to a temporary folder once. Every run
starts :class:`~lightning_megatron.models.gpt.module.GPTLightningModule` from that folder
(``from_pretrained``; dropout 0) in fresh spawned processes (``--tp`` ranks, TP = ``--tp``, one
``getrusage`` high-water mark per run) and trains ``warmup + steps`` steps of ``Trainer.fit`` on synthetic
full-length batches under the MegatronStrategy (the default code path; ``--cpu-tuning`` adds the opt-in CPU
tuning) with the module's default AdamW (fused, lr 3e-4, weight decay 0.1 except norms) and
``MegatronOptimizerCallback(OptimizerConfig())`` (fp32 main params for bf16, clipping at 1.0):

- ``full``: every parameter trains;
- ``lora r``: ``lora={"rank": r, "alpha": 2 r}`` on ``linear_qkv``, ``linear_proj``, ``linear_fc1`` and
  ``linear_fc2`` of every layer; the base is frozen.

fp32 = ``precision="32-true"`` (fp32 parameters); bf16 = bf16 parameters under ``precision="bf16-true"``
with fp32 main params. Measured per rank (rank 0; RSS the highest over ranks) after the last step:

- *trainable*: parameters with ``requires_grad``;
- *grad buffer*: bytes of the strategy's :class:`~lightning_megatron.grads.GradBuffer`
  (``trainer.strategy.grad_buffer.memory_bytes()``: every ``main_grad`` is a view of it);
- *main params*: fp32 copies the optimizer wrapper keeps beside the model params (none for fp32 ones);
- *Adam moments*: the inner AdamW's state tensors (``exp_avg``, ``exp_avg_sq``);
- *peak RSS*: ``getrusage``'s high-water mark of the process (interpreter, imports and reading the
  folder included), also as it was before the first step and the RSS left after the steps;
- *step*: median seconds of the steps after the first (data, forward, backward, optimizer, logging).

Checked in every run, and printed as PROBLEM when broken: no frozen parameter is in the grad buffer, has a
``main_grad`` or a ``.grad``, is in the optimizer's groups or has optimizer state; the buffer holds exactly
the trainable elements (no DP padding at DP=1), the main params (bf16) and each moment too.

Every process runs with ``OMP_WAIT_POLICY=PASSIVE`` (``--omp-spin`` keeps OpenMP's default) and *load* is the
1-minute load average after each run: times measured while other jobs share the machine are contended (compare
the ratios); the bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, replace
from typing import Any

from _common import TokenBatches, current_rss_bytes, launch, max_rss_bytes, median, set_threads
from gpt_step import SIZES, LlamaSize

__all__ = ["lora_rank", "save_llama_folder"]


def save_llama_folder(size: LlamaSize, path: str, seed: int = 0) -> str:
    """A random transformers Llama of ``size`` (grouped-query attention, SwiGLU, untied head) saved to ``path``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=size.vocab_size, hidden_size=size.hidden_size,
                                      intermediate_size=size.ffn_hidden_size, num_hidden_layers=size.num_layers,
                                      num_attention_heads=size.num_attention_heads,
                                      num_key_value_heads=size.num_query_groups,
                                      max_position_embeddings=size.seq_length, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(trainer: Any, module: Any) -> dict[str, Any]:
    """Trainable parameters, grad buffer, main params and Adam state of this rank, and the frozen-parameter checks."""
    import torch

    params = [p for chunk in module.model_chunks for p in chunk.parameters()]
    trainable = [p for p in params if p.requires_grad]
    frozen = {id(p) for p in params if not p.requires_grad}
    model_ids = {id(p) for p in params}
    buffer = trainer.strategy.grad_buffer
    [optimizer] = trainer.optimizers  # the MegatronOptimizerCallback's wrapper
    in_groups = optimizer.get_parameters()
    main = [p for p in in_groups if id(p) not in model_ids]  # fp32 copies of 16-bit params
    moments = [v for s in optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    trainable_numel = sum(p.numel() for p in trainable)
    return {
        "params": sum(p.numel() for p in params),
        "model_bytes": _tensor_bytes(params),
        "trainable": trainable_numel,
        "grad_buffer_bytes": buffer.memory_bytes(),
        "grad_buffer_numel": buffer.data.numel(),
        "main_params_bytes": _tensor_bytes(main),
        "adam_bytes": _tensor_bytes(moments),
        "adam_numel": sum(t.numel() for t in moments),
        "optimizer": type(optimizer).__name__,
        "checks": {
            "frozen_in_grad_buffer": sum(id(p) in frozen for p in buffer.params),
            "frozen_with_main_grad": sum(hasattr(p, "main_grad") for p in params if id(p) in frozen),
            "frozen_with_grad": sum(p.grad is not None for p in params if id(p) in frozen),
            "frozen_in_optimizer": sum(id(p) in frozen for p in in_groups),
            "frozen_with_state": sum(id(p) in frozen for p in optimizer.optimizer.state),
            "grad_buffer_numel_minus_trainable": buffer.data.numel() - trainable_numel,
            "main_numel_minus_trainable": (sum(p.numel() for p in main) - trainable_numel) if main else 0,
            "adam_numel_minus_2x_trainable": sum(t.numel() for t in moments) - 2 * trainable_numel,
        },
    }


def lora_rank(run: dict[str, Any]) -> dict[str, Any]:
    """One fine-tuning run on this (spawned) rank: ``run`` = folder, size, precision, lora (rank or None), tp,
    batch, seq, warmup, steps, cpu_tuning."""
    import warnings

    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer

    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.models.gpt.module import GPTLightningModule
    from lightning_megatron.optimizer import OptimizerConfig
    from lightning_megatron.strategy import MegatronStrategy

    world = dist.get_world_size()
    threads = set_threads(world)
    warnings.filterwarnings("ignore")
    size = LlamaSize(**run["size"])
    bf16, r = run["precision"] == "bf16", run["lora"]
    rss_imports = current_rss_bytes()

    class Probe(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.at_start: dict[str, int] = {}
            self.figures: dict[str, Any] = {}

        def on_train_start(self, trainer, pl_module) -> None:
            self.at_start = {"peak_rss_before_steps": max_rss_bytes(), "rss_before_steps": current_rss_bytes()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.stamps.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module) -> None:  # before teardown drops the grad buffer
            self.figures = _measure(trainer, pl_module)
            self.figures["rss_after_steps"] = current_rss_bytes()
            self.figures["loss"] = float(trainer.callback_metrics["loss"])

    module = GPTLightningModule.from_pretrained(
        run["folder"], lora=None if r is None else {"rank": r, "alpha": 2.0 * r},
        config={"hidden_dropout": 0.0, "attention_dropout": 0.0, "params_dtype": "bfloat16" if bf16 else "float32"})
    probe = Probe()
    n = run["warmup"] + run["steps"]
    trainer = Trainer(accelerator="cpu", devices=world, precision="bf16-true" if bf16 else "32-true",
                      strategy=MegatronStrategy(tensor_model_parallel_size=run["tp"], micro_batch_size=run["batch"],
                                                cpu_tuning=True if run["cpu_tuning"] else None),
                      max_steps=n, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      use_distributed_sampler=False, callbacks=[MegatronOptimizerCallback(OptimizerConfig()), probe])
    data = TokenBatches(n * run["batch"], run["seq"], size.vocab_size)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=run["batch"]))
    w = run["warmup"]
    return {**probe.figures, **probe.at_start, "rss_imports": rss_imports, "peak_rss": max_rss_bytes(),
            "step_s": [b - a for a, b in zip(probe.stamps[w - 1:], probe.stamps[w:])], "threads": threads}


def _name(lora: int | None) -> str:
    return "full" if lora is None else f"lora r{lora}"


def _row(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's bytes, the highest RSS over ranks, a step as long as its slowest rank."""
    row = dict(ranks[0])
    for key in ("peak_rss", "peak_rss_before_steps", "rss_after_steps"):
        row[key] = max(r[key] for r in ranks)
    row["step_s"] = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    return row


def markdown(report: dict[str, Any]) -> str:
    """The table of a report: one row per precision and configuration."""
    mib, gib = 2**20, 2**30
    lines = ["| precision | run | trainable params | grad buffer (MiB) | fp32 main params (MiB) | Adam moments (MiB) "
             "| optimizer state (MiB) | peak RSS (GiB) | peak RSS before step 1 (GiB) | RSS after steps (GiB) "
             "| step (s) | step / full | load |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for precision, runs in report["runs"].items():
        full = runs.get("full", {}).get("step_median_s")
        for name, r in runs.items():
            state = r["main_params_bytes"] + r["adam_bytes"]
            ratio = f"{r['step_median_s'] / full:.2f}" if full else "-"
            lines.append(f"| {precision} | {name} | {r['trainable']:,} ({100 * r['trainable'] / r['params']:.2f}%) | "
                         f"{r['grad_buffer_bytes'] / mib:.1f} | {r['main_params_bytes'] / mib:.1f} | "
                         f"{r['adam_bytes'] / mib:.1f} | {state / mib:.1f} | {r['peak_rss'] / gib:.2f} | "
                         f"{r['peak_rss_before_steps'] / gib:.2f} | {r['rss_after_steps'] / gib:.2f} | "
                         f"{r['step_median_s']:.2f} | {ratio} | {max(r['load_after']):.1f} |")
    return "\n".join(lines)


def problems(report: dict[str, Any]) -> list[str]:
    """Every broken check of every run: frozen parameters with a gradient, buffer space or optimizer state."""
    out = []
    for precision, runs in report["runs"].items():
        for name, r in runs.items():
            for check, value in r["checks"].items():
                if check == "main_numel_minus_trainable" and precision == "fp32":
                    continue
                if value:
                    out.append(f"{precision} {name}: {check} = {value}")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="sequence 128, batch 2, 1 + 3 steps (default: the size's sequence and batch, 1 + 5)")
    parser.add_argument("--size", default="llama-small", choices=sorted(SIZES))
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--lora-ranks", default="8,16", help="LoRA ranks to compare with full fine-tuning")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size = processes per run")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every run, alternating their order")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 3 with --quick, else 5)")
    parser.add_argument("--cpu-tuning", action="store_true", help="MegatronStrategy(cpu_tuning=True)")
    parser.add_argument("--omp-spin", action="store_true",
                        help="keep OpenMP's default spin-waiting (we set OMP_WAIT_POLICY=PASSIVE, as benchmarks/run.py)")
    parser.add_argument("--out", default=None, help="also write the report here (JSON)")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first step's end starts the clock)")
    if not args.omp_spin:  # spinning OpenMP threads of other jobs on this shared machine distort the times
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    size = SIZES[args.size]
    seq, batch = (128, 2) if args.quick else (size.seq_length, size.batch)
    size = replace(size, seq_length=seq, batch=batch)
    steps = args.steps or (3 if args.quick else 5)
    loras: list[int | None] = [None] + [int(r) for r in args.lora_ranks.split(",") if r]
    report: dict[str, Any] = {"size": asdict(size), "tp": args.tp, "warmup": args.warmup, "steps": steps,
                              "repeats": args.repeats, "cpu_tuning": args.cpu_tuning,
                              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default (spin)"),
                              "load_before": round(os.getloadavg()[0], 2), "runs": {}}
    t_start = time.perf_counter()
    folder = tempfile.mkdtemp(prefix="lora_memory_")
    try:
        save_llama_folder(size, folder)
        for precision in [p for p in args.precisions.split(",") if p]:
            rows: dict[str, list[dict[str, Any]]] = {_name(r): [] for r in loras}
            for i in range(args.repeats):
                for r in (loras if i % 2 == 0 else loras[::-1]):
                    run = {"folder": folder, "size": asdict(size), "precision": precision, "lora": r, "tp": args.tp,
                           "batch": batch, "seq": seq, "warmup": args.warmup, "steps": steps,
                           "cpu_tuning": args.cpu_tuning}
                    rows[_name(r)].append({**_row(launch(lora_rank, args.tp, run, timeout=900)),
                                           "load_after": round(os.getloadavg()[0], 2)})
                    row = rows[_name(r)][-1]
                    print(f"{precision} {_name(r)}: trainable {row['trainable']:,}, grad buffer "
                          f"{row['grad_buffer_bytes'] / 2**20:.1f} MiB, peak RSS {row['peak_rss'] / 2**30:.2f} GiB, "
                          f"step {median(row['step_s']):.2f} s", flush=True)
            report["runs"][precision] = {}
            for name, repeats in rows.items():
                last = dict(repeats[-1])  # the bytes are the same in every repeat
                last["step_s"] = [t for x in repeats for t in x["step_s"]]
                last["step_median_s"] = median(last["step_s"])
                last["peak_rss"] = median([x["peak_rss"] for x in repeats])
                last["load_after"] = [x["load_after"] for x in repeats]
                report["runs"][precision][name] = last
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report["wall_s"] = time.perf_counter() - t_start
    report["load_after"] = round(os.getloadavg()[0], 2)
    report["problems"] = problems(report)
    print(f"\n{size.name} (seq {seq}, batch {batch}, TP={args.tp}): {args.warmup} + {steps} steps, "
          f"per rank, rank 0's bytes\n")
    print(markdown(report))
    for problem in report["problems"]:
        print(f"PROBLEM: {problem}")
    print(json.dumps(report), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
