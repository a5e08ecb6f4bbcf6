"""``lightning-megatron check``: layout parity of a recipe, and memory per rank.

    lightning-megatron check --config recipes/bert_tiny.yaml --layouts tp2,pp2,dp2,tp2pp2 [--steps 3]
        [--reference tp1] [--global-batch-size 16] [--micro-batch-size 4] [--model.NAME VALUE ...]
        [--data.NAME VALUE ...] [--fp32]
    lightning-megatron check --config recipes/bert_tiny.yaml --layouts tp2,dp2zero1 --estimate-memory
    lightning-megatron check --config recipes/bert_large.yaml --estimate-memory --estimate-time --gpus 64 \\
        --gpu-memory 80GB --device h100 [--data.global_batch_size 512]
    lightning-megatron check --config recipes/bert_tiny.yaml --layouts tp2,pp2vp2,dp2zero1 --estimate-time --device this

Exit status 1 when a layout differs from the reference beyond the tolerances (or, with ``--gpus``,
when no layout fits).
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?i?b?)\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 80GB or 24GiB")
    unit = m.group(2).rstrip("b")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    try:
        size = int(float(m.group(1)) * scale[unit])
    except ValueError:  # "1.2.3GB"
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 80GB or 24GiB")
    return size


def _checked(convert: Any, ok: Any, says: str) -> Any:
    """An argparse ``type``: ``convert(text)`` when ``ok`` of it, else the usage error "TEXT is not SAYS"."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text} is not {says}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text} is not {says}")
        return value

    return parse


_whole = _checked(int, lambda v: v >= 1, "a whole number >= 1")  # a count: steps, GPUs, batch sizes
_fraction = _checked(float, lambda v: 0.0 < v <= 1.0, "a fraction in (0, 1]")  # of a device's rate (0: never done)
_seconds = _checked(float, lambda v: v > 0, "a number of seconds > 0")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-megatron check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__,
                                allow_abbrev=False)  # a mistyped option is an error, not the one it begins
    p.add_argument("--config", required=True, help="a recipe YAML (model: and data: sections)")
    p.add_argument("--layouts", default="tp2,pp2,dp2",
                   help="comma-separated: tp2, pp2, vp2 (with pp), dp2, sp (with tp), zero1; e.g. tp2pp2,dp2zero1")
    p.add_argument("--reference", default="tp1", help="the layout the others are compared with (default: one process)")
    p.add_argument("--steps", type=_whole, default=3)
    p.add_argument("--global-batch-size", type=_whole, default=None, help="default: the recipe's")
    p.add_argument("--micro-batch-size", type=_whole, default=None, help="default: the recipe's")
    p.add_argument("--seq-length", type=_whole, default=None,
                   help="the data's sequence length (a decoder's data.seq_length, BERT's data.max_seq_length); "
                        "default: the recipe's")
    p.add_argument("--grad-steps", default="1", help="steps after which every gradient is compared (comma-separated)")
    p.add_argument("--timeout", type=_seconds, default=900.0, help="seconds per group of layouts of one world size")
    p.add_argument("--fp32", action="store_true",
                   help="check a 16-bit recipe's layouts in fp32 (config.params_dtype float32, precision 32-true) at "
                        "fp32's bounds: the layouts' math without 16-bit rounding (docs/check.md, '16-bit checks')")
    p.add_argument("--estimate-memory", action="store_true",
                   help="predicted bytes per rank (docs/memory.md); with --gpus: the layouts that fit, nothing run")
    p.add_argument("--estimate-time", action="store_true",
                   help="predicted step time, tokens/s and MFU per layout on --device (docs/check.md); "
                   "runs nothing by itself")
    p.add_argument("--device", default="h100", help="with --estimate-time: a100, h100, h200 (datasheet rates x the "
                   "efficiencies below) or 'this' (this machine, measured now)")
    p.add_argument("--devices-per-node", type=_whole, default=None,
                   help="with --estimate-time: GPUs per node (default 8)")
    p.add_argument("--gemm-efficiency", type=_fraction, default=None,
                   help="achievable fraction of the dense peak (0.7)")
    p.add_argument("--memory-efficiency", type=_fraction, default=None,
                   help="achievable fraction of HBM bandwidth (0.8)")
    p.add_argument("--link-efficiency", type=_fraction, default=None,
                   help="achievable fraction of NVLink/IB bandwidth (0.8)")
    p.add_argument("--overlap-grad-reduce", choices=("on", "off"), default=None,
                   help="with --estimate-time: DP reduction overlapped with the backward (default: the strategy's "
                        "default, on; off for --device this, whose CPU tuning reduces synchronously)")
    p.add_argument("--host-op-us", type=float, default=None,
                   help="with --estimate-time on a GPU: host microseconds per op the step dispatches (default 30, "
                        "measured on one H200 host; 0: the device's time alone)")
    p.add_argument("--overlap-param-gather", choices=("on", "off"), default="off",
                   help="with --estimate-time: the ZeRO-1 parameter all-gather hidden behind the next forward "
                        "(MegatronStrategy(overlap_param_gather=True); default off, as the strategy's)")
    p.add_argument("--gpus", type=_whole, default=None,
                   help="with --estimate-memory / --estimate-time: every layout of this many GPUs")
    p.add_argument("--gpu-memory", type=_bytes, default=None, help="with --gpus: memory per GPU, e.g. 80GB")
    p.add_argument("--top", type=int, default=0, help="with --gpus: list the N first layouts only (and the recipe's "
                   "own); 0, the default, lists every one")
    return p


def _seq_length_argument(data_class: str) -> str:
    """The data argument ``--seq-length`` sets: the sequence length the datamodule ``data_class`` takes (a decoder's
    ``seq_length``, BERT's ``max_seq_length``)."""
    import inspect

    from lightning_megatron.recipes import import_class

    taken = inspect.signature(import_class(data_class)).parameters
    for name in ("seq_length", "max_seq_length"):
        if name in taken:
            return name
    raise ValueError(f"--seq-length: {data_class} takes neither seq_length nor max_seq_length; set its own "
                     f"argument with --data.NAME VALUE")


def _in_fp32(recipe) -> str | None:
    """``--fp32``: the recipe's model with fp32 parameters (its config record's ``params_dtype``, or the module's own
    argument) and the Trainer at 32-true; why not, when the recipe already trains in fp32."""
    config = recipe.model.get("config")
    holder = config if isinstance(config, dict) else recipe.model
    dtype = str(holder.get("params_dtype", "float32")).removeprefix("torch.")
    if dtype in ("float32", "fp32") and recipe.precision in (None, "32-true", "32"):  # not autocast's 16-bit math
        return (f"--fp32: {recipe.model_class} already trains in fp32 (params_dtype {dtype}, precision "
                f"{recipe.precision or 'the Trainer default'}): its check is in fp32 without the flag")
    holder["params_dtype"] = "float32"
    recipe.precision = "32-true"
    return None


def tolerances(recipe):
    """The recipe's :class:`~lightning_megatron.check.parity.Tolerances`: 16-bit math (16-bit parameters, or fp32 ones
    under autocast's ``bf16-mixed``, whose matmuls round to 16 bits) at ``Tolerances.bf16()``."""
    from lightning_megatron.check.parity import Tolerances

    return Tolerances.bf16() if _sixteen_bit(recipe)[1] else Tolerances()


def _sixteen_bit(recipe) -> tuple[str | None, bool]:
    """(the recipe's 16-bit parameter dtype, ``"bfloat16"`` or ``"float16"``, else None; whether its math is 16-bit:
    16-bit parameters or autocast's ``bf16-mixed`` / ``16-mixed``)."""
    from lightning_megatron.saved_model import flat_hparams

    dtype = str(flat_hparams(recipe.model).get("params_dtype", "float32")).removeprefix("torch.")  # config.params_dtype
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
    params = dtype if dtype in ("bfloat16", "float16") else None
    return params, params is not None or str(recipe.precision) in ("bf16-mixed", "16-mixed")


def judged_against_truth(recipe, report, *, steps: int, grad_steps: list[int], timeout: float = 900.0):
    """``report`` of a 16-bit ``recipe``'s check with its gradients beyond the bounds judged against the fp32 truth:
    its reference layout run once more with the recipe made fp32 (:func:`_in_fp32`) from the same weights rounded to
    the recipe's 16 bits (:func:`~lightning_megatron.check.parity.judge_against_truth`); ``report`` itself when the
    recipe's math is fp32 or no gradient is beyond the bounds."""
    from lightning_megatron.check.parity import check_layouts, judge_against_truth
    from lightning_megatron.check.recipe import factories

    params, sixteen_bit_math = _sixteen_bit(recipe)
    if not sixteen_bit_math or not any(f.startswith("step ") and ": gradient of " in f
                                       for r in report.results for f in r.failures):
        return report
    reference = report.reference.layout
    print(f"  16-bit gradients beyond the bounds: judged against the fp32 truth, {reference} in fp32 from the same "
          f"weights (docs/check.md, '16-bit checks')", flush=True)
    exact = copy.deepcopy(recipe)
    _in_fp32(exact)
    G, m = exact.global_batch_size, exact.micro_batch_size
    truth = check_layouts(**factories(exact, steps, G), layouts=[], reference=reference, global_batch_size=G,
                          micro_batch_size=m, steps=steps, trainer_kwargs=exact.trainer_kwargs(steps),
                          grad_steps=grad_steps, round_params_to=params, timeout=timeout).reference
    return judge_against_truth(report, truth)


def notes(recipe, steps: int, fp32: bool) -> list[str]:
    """What a check of ``recipe`` over ``steps`` steps cannot see, said before it runs: a schedule that starts at lr 0
    (step 1 updates nothing: step 2's loss and gradients are the same weights'; a layout that doubled its update
    passed a check of 2 steps), and a 16-bit recipe's loose bounds (a layout 3% off passed them)."""
    out = []
    schedule = next((a for name, a in recipe.callbacks if name == "OptimizerParamSchedulerCallback"), None)
    warmup = int((schedule or {}).get("lr_warmup_steps") or 0)
    if schedule is not None and not float(schedule.get("init_lr") or 0.0) and warmup > 0:
        out.append(f"the recipe's lr schedule starts at lr 0 (init_lr 0, lr_warmup_steps {warmup}): step 1 updates "
                   f"nothing, the updates are compared from step 3 on"
                   + (f"; this check runs {steps}: add --steps 3" if steps < 3 else ""))
    if _sixteen_bit(recipe)[1] and not fp32:
        out.append("16-bit bounds are loose (a layout's error of a few percent passes them): --fp32 checks the "
                   "layouts' math at fp32's")
    return out


def _tuned(recipe) -> dict:
    """The MegatronStrategy arguments a check run takes from the recipe: its ``cpu_tuning`` (a check runs on this
    machine's CPU, where ``fit`` of the recipe runs the tuning's collectives and kernels: those are checked)."""
    return {} if recipe.cpu_tuning is None else {"cpu_tuning": recipe.cpu_tuning}


def _layout_problems(recipe, layouts: list, runs: bool = True) -> list[str]:
    """What ``fit`` would refuse before launch for each layout (:func:`lightning_megatron.config_checks.check_config`
    on the recipe's model and data, its precision, the layout's sizes and world size; where the check ``runs`` the
    layouts, on this machine's CPU: the layout's ranks together against its free memory)."""
    from lightning_megatron.check.recipe import fill_vocab_size
    from lightning_megatron.config_checks import check_config
    from lightning_megatron.pipeline.layout import STAGE_SIZES
    from lightning_megatron.recipes import import_class

    sized = copy.deepcopy(recipe)  # the vocabulary the data's tokenizer has, where the recipe leaves it to the data
    try:
        fill_vocab_size(sized)
    except (ValueError, OSError, ImportError):
        pass  # the data cannot tell it here: the memory this machine needs for the run is then not predicted
    data = dict(sized.data)  # the run's: batch sizes, sequence length, vocabulary (the memory estimate's)
    trainer = {"precision": recipe.precision} if recipe.precision is not None else {}
    trainer["accelerator"] = "cpu"  # a check runs every layout's ranks on this machine's CPU
    trainer.update(recipe.trainer_options, max_steps=recipe.max_steps or 1)  # a check run always has max_steps
    schedule = next((args for name, args in recipe.callbacks if name == "OptimizerParamSchedulerCallback"), {})
    recipe = sized
    found_by_layout = []
    one_stage = copy.deepcopy(recipe.model)  # the one-stage layouts' (the reference's): every layer on the stage
    for name in STAGE_SIZES:
        (one_stage.get("config") or {}).pop(name, None)
    for dims in layouts:
        model = recipe.model if dims.pp > 1 else one_stage
        found = check_config(model_hparams=model, data_hparams=data, strategy_args=dims.strategy_kwargs(),
                             trainer_args={**trainer, "devices": dims.world_size}, scheduler_args=schedule,
                             optimizer_class=recipe.optimizer[0] if recipe.optimizer else None,
                             has_optimizer_callback=True if dims.zero1 else None, use_distributed_optimizer=dims.zero1,
                             model_class=import_class(recipe.model_class), running=runs,
                             data_class=import_class(recipe.data_class))
        found_by_layout.append((dims, found))
    # a problem every layout has is the recipe's (a data file missing): said once, before the layouts' own
    everywhere = [p for p in found_by_layout[0][1] if all(p in found for _, found in found_by_layout)] \
        if len(found_by_layout) > 1 else []
    return everywhere + [f"layout {dims}: {p}" for dims, found in found_by_layout for p in found if p not in everywhere]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    from lightning_megatron.parallel_dims import ParallelDims
    from lightning_megatron.check.recipe import factories, load_recipe, parse_overrides

    try:  # argument errors: a usage message, not a traceback
        overrides = parse_overrides(rest, ("model", "data", "megatron_optimizer", "trainer"))
        recipe = load_recipe(args.config, overrides["model"], overrides["data"], overrides["megatron_optimizer"],
                             overrides["trainer"])
        layouts, reference = ParallelDims.parse_list(args.layouts), ParallelDims.parse(args.reference)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    if not layouts:
        parser.error(f"--layouts {args.layouts!r} names no layout; write e.g. --layouts tp2,pp2,dp2")
    twice = sorted({x.name for x in layouts if layouts.count(x) > 1})
    if twice:
        parser.error(f"--layouts {args.layouts!r} names {', '.join(twice)} twice; name each layout once")
    if args.fp32:
        refused = _in_fp32(recipe)
        if refused:
            parser.error(refused)
    if args.global_batch_size is not None:
        recipe.data["global_batch_size"] = args.global_batch_size
    if args.micro_batch_size is not None:
        recipe.data["micro_batch_size"] = args.micro_batch_size
    if args.seq_length is not None:
        try:
            recipe.data[_seq_length_argument(recipe.data_class)] = args.seq_length
        except ValueError as e:
            parser.error(str(e))
    if args.gpus is not None and not (args.estimate_memory or args.estimate_time):
        parser.error("--gpus lists layouts for --estimate-memory and/or --estimate-time; add one of them")
    if args.top and args.gpus is None:
        parser.error(f"--top {args.top} shortens the list of layouts of --gpus N; add --gpus (and --estimate-memory "
                     f"and/or --estimate-time)")
    if args.top < 0:
        parser.error(f"--top {args.top}: a number of layouts, >= 0 (0 lists every one)")
    if args.gpus is None:  # the layouts named: refused as `fit` refuses them, before any process starts
        runs = args.estimate_memory or not args.estimate_time  # --estimate-time alone runs nothing
        problems = _layout_problems(recipe, [reference] + [x for x in layouts if x != reference], runs)
        source = recipe.model.get("init_from")
        if source and not Path(source).exists() and runs:
            problems.append(f"model.init_from={str(source)!r} does not exist: a check run builds the model from it; "
                            f"make it first (the recipe's comments say how) or set --model.init_from to a "
                            f"checkpoint or a Hugging Face folder")
        from lightning_megatron.machine_checks import MEMORY_FIX

        if any(p.endswith(MEMORY_FIX) for p in problems):  # runs larger than this machine: the estimate runs nothing
            gpus = recipe.layout.world_size if recipe.layout is not None else "N"
            problems.append(f"estimate the recipe's GPUs instead, without running anything: --estimate-memory "
                            f"--estimate-time --gpus {gpus} --gpu-memory 80GB")
        if problems:
            parser.exit(2, f"lightning-megatron check: {len(problems)} problem(s), found before starting "
                           f"any process:\n" + "".join(f"  - {p}\n" for p in problems))
    if args.estimate_memory or args.estimate_time:
        from lightning_megatron.check.memory_cli import model_shape
        from lightning_megatron.check.recipe import fill_vocab_size

        try:  # the vocabulary the data's tokenizer has, where the recipe leaves it to the data (as `fit` does)
            fill_vocab_size(recipe)
        except (ValueError, OSError, ImportError):
            pass  # the data cannot tell it here (its files elsewhere): the estimate names what to set
        try:  # the module's class declares its sizes (protocols.EstimatesCost), or the estimate is refused
            model_shape(recipe)
        except ValueError as e:
            parser.error(str(e))
    timing = None
    if args.estimate_time:
        from lightning_megatron.check.time_cli import timing_inputs

        try:
            timing = timing_inputs(recipe, args)
        except ValueError as e:
            parser.error(str(e))
    if (args.estimate_memory or args.estimate_time) and args.gpus is not None:
        from lightning_megatron.check.memory_cli import fitting_layouts

        return fitting_layouts(recipe, args.gpus, args.gpu_memory, timing, top=args.top)
    if args.estimate_time and not args.estimate_memory:
        from lightning_megatron.check.time_cli import time_table

        print(time_table(recipe, [reference] + [x for x in layouts if x != reference], timing), flush=True)
        return 0
    from lightning_megatron.check.parity import check_layouts

    tol = tolerances(recipe)
    G, m = recipe.global_batch_size, recipe.micro_batch_size
    in_fp32 = (" in fp32 (--fp32: config.params_dtype float32, precision 32-true)" if args.fp32
               else f" in {recipe.precision}" if recipe.precision is not None else "")
    print(f"lightning-megatron check: {args.config}{in_fp32}, layouts {', '.join(map(str, layouts))} against "
          f"{reference}, {args.steps} step{'s' if args.steps != 1 else ''}, global batch {G}, micro batch {m}, "
          f"dropout off{', layers compiled (model.compile)' if recipe.model.get('compile') else ''}", flush=True)
    if recipe.skipped_callbacks:
        print(f"  recipe callbacks not used by the check: {', '.join(recipe.skipped_callbacks)}", flush=True)
    if recipe.cpu_tuning is not None:  # what `fit` of the recipe runs on a CPU: its collectives, kernels, schedule
        print(f"  the recipe's cpu_tuning on every layout: {recipe.cpu_tuning}", flush=True)
    for name, section in (("optimizer", recipe.optimizer), ("lr_scheduler", recipe.lr_scheduler)):
        if section is not None:
            print(f"  the recipe's {name}: {section[0]} {section[1] or ''}".rstrip(), flush=True)
    for note in notes(recipe, args.steps, args.fp32):
        print(f"  {note}", flush=True)
    report_steps = [int(s) for s in args.grad_steps.split(",") if s.strip()]
    report = check_layouts(**factories(recipe, args.steps, G), layouts=layouts, reference=reference,
                           global_batch_size=G, micro_batch_size=m, steps=args.steps, tolerances=tol,
                           trainer_kwargs=recipe.trainer_kwargs(args.steps), grad_steps=report_steps,
                           measure_memory=args.estimate_memory, measure_traffic=timing is not None,
                           timeout=args.timeout, strategy_kwargs=_tuned(recipe))
    report = judged_against_truth(recipe, report, steps=args.steps, grad_steps=report_steps, timeout=args.timeout)
    print(report.table(), flush=True)
    if not report.passed and _sixteen_bit(recipe)[1]:
        print("  the layouts' math at fp32's bounds: add --fp32", flush=True)
    if args.estimate_memory:
        from lightning_megatron.check.memory_cli import memory_table

        print(memory_table(recipe, [reference] + [x for x in layouts if x != reference], report), flush=True)
    if timing is not None:
        from lightning_megatron.check.time_cli import time_table

        from lightning_megatron.check.traffic import traffic_table

        shown = [reference] + [x for x in layouts if x != reference]
        print(time_table(recipe, shown, timing), flush=True)
        print(traffic_table(recipe, shown, report, timing[2]), flush=True)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
