"""Predicted vs measured memory per rank (``lightning_megatron.cost.memory`` against a check run).

For bert-tiny and bert-base (the recipes, with a small batch so it runs on a shared CPU machine),
runs ``check_layouts`` with ``measure_memory=True`` at TP=2, PP=2, DP=2 and DP=2 + ZeRO-1 next to
one process, and prints per layout and pipeline stage (its fullest rank): predicted / measured bytes of
parameters + gradients + optimizer state, and of the peak of the tensors saved for backward, with their ratios.
Targets: state within 10%, activations within 20%.

    python benchmarks/memory_estimate.py [--models bert-tiny,bert-base] [--layouts tp2,pp2,dp2,dp2zero1]
    python benchmarks/memory_estimate.py --models bert-tiny,bert-tiny-recompute --layouts tp2,tp2sp
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from lightning_megatron.parallel_dims import ParallelDims

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    # recipe, overrides of the recipe's data and model sections (kept small: 2 CPU cores shared)
    "bert-tiny": (ROOT / "recipes/bert_tiny.yaml", {"global_batch_size": 16, "micro_batch_size": 4}, {}),
    "bert-tiny-recompute": (ROOT / "recipes/bert_tiny.yaml", {"global_batch_size": 16, "micro_batch_size": 4},
                            {"config.recompute_granularity": "full", "config.recompute_method": "uniform",
                             "config.recompute_num_layers": 1}),
    "bert-base": (ROOT / "recipes/bert_base.yaml", {"global_batch_size": 4, "micro_batch_size": 2,
                                                   "max_seq_length": 128}, {}),
}


def run(name: str, layouts: list[str], steps: int) -> list[dict]:
    from lightning_megatron.check import check_layouts
    from lightning_megatron.check.cli import judged_against_truth
    from lightning_megatron.cost.memory import estimate_stage
    from lightning_megatron.check.memory_cli import model_shape
    from lightning_megatron.check.parity import Tolerances
    from lightning_megatron.check.recipe import factories, load_recipe
    from lightning_megatron.saved_model import flat_hparams

    path, data, model = MODELS[name]
    recipe = load_recipe(path, model)
    recipe.data.update(data)
    G, m = recipe.global_batch_size, recipe.micro_batch_size
    bf16 = str(flat_hparams(recipe.model).get("params_dtype")) in ("bfloat16", "float16")  # config.params_dtype
    t0 = time.perf_counter()
    report = check_layouts(**factories(recipe, steps, G), layouts=layouts, global_batch_size=G, micro_batch_size=m,
                           steps=steps, trainer_kwargs=recipe.trainer_kwargs(steps), measure_memory=True,
                           tolerances=Tolerances.bf16() if bf16 else None, timeout=1800)
    report = judged_against_truth(recipe, report, steps=steps, grad_steps=[1], timeout=1800)  # as `check` does
    print(f"{name}: check {'PASS' if report.passed else 'FAIL'} in {time.perf_counter() - t0:.0f} s")
    print(report.table())
    shape = model_shape(recipe)  # a check run takes the library's kernels, not the CPU tuning's
    rows = []
    for layout_name, lrun in report.runs.items():
        layout = ParallelDims.parse(layout_name)
        for stage in range(layout.pp):
            est = estimate_stage(shape, layout, stage)
            # the stage's fullest rank, as check --estimate-memory reports it: DP ranks hold other samples (the
            # masked tokens the LM head keeps differ), TP ranks their shard
            ranks = lrun.memory[stage * layout.tp * layout.dp:(stage + 1) * layout.tp * layout.dp]
            state = max(r["params"] + r["grads"] + r["optimizer"] for r in ranks)
            rows.append(dict(model=name, layout=layout_name, stage=stage, state_pred=est.state_bytes,
                             state_meas=state, act_pred=est.activation_bytes,
                             act_meas=max(r["activations_peak"] for r in ranks)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="bert-tiny,bert-base")
    p.add_argument("--layouts", default="tp2,pp2,dp2,dp2zero1")
    p.add_argument("--steps", type=int, default=1)
    a = p.parse_args()
    rows = []
    for name in a.models.split(","):
        rows += run(name, a.layouts.split(","), a.steps)
    mib = 2**20
    print("\n| model | layout | stage | params+grads+optimizer MiB, predicted / measured | ratio | "
          "saved activations MiB, predicted / measured | ratio |")
    print("|---|---|---|---|---|---|---|")
    worst_state = worst_act = 0.0
    for r in rows:
        rs, ra = r["state_pred"] / r["state_meas"], r["act_pred"] / r["act_meas"]
        worst_state, worst_act = max(worst_state, abs(rs - 1)), max(worst_act, abs(ra - 1))
        print(f"| {r['model']} | {r['layout']} | {r['stage']} | {r['state_pred'] / mib:.2f} / {r['state_meas'] / mib:.2f} "
              f"| {rs:.3f} | {r['act_pred'] / mib:.2f} / {r['act_meas'] / mib:.2f} | {ra:.3f} |")
    print(f"\nlargest error: state {worst_state:.1%} (target 10%), activations {worst_act:.1%} (target 20%)")


if __name__ == "__main__":
    main()
