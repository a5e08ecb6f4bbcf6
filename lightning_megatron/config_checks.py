"""Checks that need only the configuration, run before any process is launched.

A wrong recipe (heads not divisible by TP, a global batch that does not split into microbatches,
a sequence longer than the position table, ...) should fail in seconds with every problem listed,
not after a minute of process start-up on every rank. :func:`check_config` takes the
model, data, strategy, trainer and scheduler arguments as plain mappings (the ``init_args`` a
LightningCLI config holds) and returns the problems, each naming the value and the fix.
:func:`validate_config` raises one :class:`ConfigError` listing them all. The ``lightning-megatron``
CLI calls it right after parsing, before the Trainer is built; from Python::

    from lightning_megatron.config_checks import validate_config
    from lightning_megatron.models.gpt.module import GPTLightningModule
    validate_config(model_hparams={"config": {"num_attention_heads": 8, "num_query_groups": 2}},
                    strategy_args={"tensor_model_parallel_size": 2}, trainer_args={"devices": 2},
                    model_class=GPTLightningModule)  # the model's rules: its record, built at TP=2

The only files read are those the configuration names (:func:`~lightning_megatron.data_checks.data_files_problems`:
the ``.bin`` / ``.idx`` of each ``data_prefix`` exist, the dataset's ``.vocab.json`` matches the tokenizer the
datamodule will use; ``predict``'s prompts fit the model's positions; a fine-tuning section's labelled files; the
split a command reads holds a document; ``ckpt_path`` is a complete checkpoint). What this machine can run is
:mod:`~lightning_megatron.machine_checks`'.
A missing key skips the checks that need it (the defaults of the classes apply later); checks that
need the world size (``devices x num_nodes``) are skipped when it is not an integer (``"auto"``).
Each rule is written once, where the class that enforces it at set-up lives: this module builds the
records (``ParallelDims``, the model's config record through ``model_class.config_problems``,
``BatchSizes``, the schedule's rules) or calls their validators, and only moves the failure earlier.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_megatron.checkpoint_checks import ckpt_path_problem, evaluated_model_problem, resume_problems
from lightning_megatron.data_checks import (binary_head_problem, checkpoint_data_problems, data_arguments,
                                           data_files_problems)
from lightning_megatron.data_checks import int_or_none as _int
from lightning_megatron.machine_checks import accelerator_problem, cpu_memory_problem, runs_on_cpu
from lightning_megatron.module import MegatronLightningModule, context_parallel_problem, torch_class
from lightning_megatron.optimizer.config import gradient_clip_val_problem, none_problems
from lightning_megatron.optimizer.distrib_optimizer import distributed_optimizer_problem
from lightning_megatron.optimizer.scheduler import lr_problems, resume_problem, style_problems, warmup_problem
from lightning_megatron.parallel_dims import ParallelDims, parallel_dims_problems
from lightning_megatron.pipeline.layout import get_layer_range
from lightning_megatron.pipeline.registry import pipeline_schedule_problem
from lightning_megatron.saved_model import flat_hparams
from lightning_megatron.step import batch_size_problem
from lightning_megatron.trainer_checks import callback_class_problem, trainer_flag_problems
from lightning_megatron.transformer.context_parallel import sequence_length_problem

__all__ = ["ConfigError", "check_config", "validate_config", "config_from_cli", "normalize_precision", "timeout_problem",
           "init_timeout_problem", "ckpt_path_problem", "PRECISION_PARAMS_DTYPE", "grad_scaler_problem",
           "save_last_problem", "write_location_problems"]


class ConfigError(ValueError):
    """A configuration that cannot train correctly; ``problems`` lists each one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"{len(problems)} configuration problem(s), found before launching any process:\n"
                         + "\n".join(f"  - {p}" for p in problems))


PRECISION_PARAMS_DTYPE = {"32-true": "float32", "bf16-mixed": "float32", "16-mixed": "float32",
                          "bf16-true": "bfloat16", "16-true": "float16"}
"""Trainer precision -> the ``params_dtype`` it needs: mixed precision autocasts over fp32 parameters;
``*-true`` runs the parameters in that dtype (fp32 main copies live in MegatronOptimizerCallback)."""

def grad_scaler_problem(precision: str) -> str:
    """Why Lightning's fp16 autocast (``16-mixed``) cannot train under the strategy, and the fix."""
    return (f"precision={precision!r} scales the loss with torch's GradScaler in Lightning's backward, which the "
            f"strategy's microbatch schedule replaces (the gradients would be unscaled without ever being scaled; on "
            f"a CPU Lightning runs bf16-mixed instead). Use precision='bf16-mixed' (autocast, no scaling), or "
            f"params_dtype='float16' with precision='16-true' and MegatronOptimizerCallback (dynamic loss scaling)")


_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "torch.float32": "float32",
                  "torch.bfloat16": "bfloat16", "torch.float16": "float16"}
_PRECISION_FOR_DTYPE = {"float32": "'32-true' (or 'bf16-mixed' for autocast)", "bfloat16": "'bf16-true'",
                        "float16": "'16-true'"}


def normalize_precision(precision: Any) -> str:
    """Lightning's precision spellings (32, "32", "bf16", "16", None) -> "32-true", "bf16-mixed", ..."""
    if precision is None:
        return "32-true"  # Lightning's default
    p = str(precision)
    return _PRECISION_ALIASES.get(p, p)


def _dtype_name(value: Any) -> str:
    s = str(value)
    return _DTYPE_ALIASES.get(s, s)


def timeout_problem(timeout: Any) -> str | None:
    """What is wrong with a strategy ``timeout`` (seconds or a timedelta), or None."""
    import datetime

    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and not seconds > 0:
        return (f"strategy timeout={timeout!r} must be more than 0 seconds: every collective waits at most this "
                f"long, and 0 fails the first rendezvous ('socket timed out after 0ms'); leave the default "
                f"(1800 s) or give e.g. 600")
    return None


def init_timeout_problem(init_timeout_s: Any, timeout: Any = None) -> str | None:
    """What is wrong with a WandbLogger's ``init_timeout_s`` (:class:`lightning_megatron.loggers.WandbLogger`:
    the bound on ``wandb.init`` on rank 0, the W&B service start and the offline fallback included), or None.

    It must be a finite number of seconds above 0, and below the strategy ``timeout`` (seconds or a timedelta;
    None: not compared): the other ranks wait for rank 0 at the next barrier, which fails after ``timeout``,
    so a longer bound would let the barrier fail first."""
    import datetime
    import math

    if isinstance(init_timeout_s, bool) or not isinstance(init_timeout_s, (int, float)) or \
            not (math.isfinite(init_timeout_s) and init_timeout_s > 0):
        return (f"WandbLogger init_timeout_s={init_timeout_s!r} must be a number of seconds above 0: it bounds "
                f"wandb.init (the W&B service start included) on rank 0 while the other ranks wait at the barrier; "
                f"leave the default (60) or give e.g. --trainer.logger.init_args.init_timeout_s 120")
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds > 0 \
            and not init_timeout_s < seconds:
        return (f"WandbLogger init_timeout_s={init_timeout_s:g} is not below the strategy timeout={seconds:g} s: the "
                f"other ranks wait for rank 0's wandb.init at the barrier, which would fail first; give "
                f"init_timeout_s below {seconds:g} (--trainer.logger.init_args.init_timeout_s N) or a longer strategy "
                f"timeout")
    return None


def _init_timeout_problems(logger: Any, timeout: Any) -> list[str]:
    """:func:`init_timeout_problem` of each ``trainer.logger`` entry (``class_path``/``init_args``) that has an
    ``init_timeout_s``."""
    entries = logger if isinstance(logger, list) else [logger]
    args = [entry.get("init_args") or {} for entry in entries if isinstance(entry, Mapping)]
    problems = [init_timeout_problem(a["init_timeout_s"], timeout) for a in args if "init_timeout_s" in a]
    return [p for p in problems if p]


def _world_size(trainer_args: Mapping[str, Any]) -> int | None:
    devices = trainer_args.get("devices", "auto")
    if isinstance(devices, (list, tuple)):
        n = len(devices)
    elif isinstance(devices, str) and "," in devices:
        n = len([d for d in devices.split(",") if d.strip()])
    else:
        n = _int(devices)
        if n is None or n < 1:
            return None  # "auto" / -1: known only once the accelerator is chosen
    nodes = _int(trainer_args.get("num_nodes", 1))
    return None if nodes is None or nodes < 1 else n * nodes


def check_config(model_hparams: Mapping[str, Any] | None = None, data_hparams: Mapping[str, Any] | None = None,
                 strategy_args: Mapping[str, Any] | None = None, trainer_args: Mapping[str, Any] | None = None,
                 scheduler_args: Mapping[str, Any] | None = None, *,
                 has_optimizer_callback: bool | None = None, use_distributed_optimizer: bool = False,
                 data_class: type | None = None, predicting: bool = False, ckpt_path: Any = None,
                 running: bool = True, model_class: type | None = None, split: str | None = None,
                 fitting: bool = True, optimizer_class: str | None = None,
                 optimizer_config: Mapping[str, Any] | None = None) -> list[str]:
    """Every problem of this configuration, each with the offending values and the fix; [] when none.

    ``has_optimizer_callback``: whether a MegatronOptimizerCallback is configured (None: unknown,
    skip the 16-bit-parameters check); ``use_distributed_optimizer``: its ZeRO-1 setting.
    ``model_class``: the LightningModule the model section builds: its records are built here
    (:meth:`~lightning_megatron.module.MegatronLightningModule.config_problems`: heads, FFN and grouped-query
    groups against the TP size, ...; every rule where the module enforces it). ``data_class``: the
    datamodule the data section builds (its packaged tokenizer; a fine-tuning
    section's files are read); ``predicting``: ``predict``'s inputs are checked too (the prompts against
    the positions); ``ckpt_path``: the checkpoint to load must exist; ``running=False`` (the CLI only builds
    its objects, ``run=False``): the fine-tuning files, read by a run only, are not. ``split``: the split of a
    pretraining corpus the command reads whole (``validate``: ``"valid"``; ``test``, ``predict``: ``"test"``), which
    must hold a document. ``fitting``: the command trains (a ``ckpt_path`` it resumes from is checked against the
    optimizer class, ``optimizer_class`` (the CLI's ``--optimizer``) else the module's
    :meth:`~lightning_megatron.module.MegatronLightningModule.default_optimizer_class`, and the lr schedule of
    ``scheduler_args``, as the ranks check them at set-up). A WandbLogger in
    ``trainer_args["logger"]`` has its ``init_timeout_s`` checked against the strategy's ``timeout``
    (:func:`init_timeout_problem`). ``optimizer_config``: the ``megatron_optimizer`` section (its nulls for numbers).
    """
    m, d = flat_hparams(dict(model_hparams or {})), dict(data_hparams or {})  # config.<field> at the top level
    spelled = "model.config." if isinstance((model_hparams or {}).get("config"), Mapping) else "model."
    s, t, sch = dict(strategy_args or {}), dict(trainer_args or {}), dict(scheduler_args or {})
    problems: list[str] = []
    world = _world_size(t)

    # --- layout: the strategy's record, built as the strategy builds it (every rule once, in parallel_dims)
    given = ParallelDims.fields_of_strategy_kwargs(s)
    sizes = {**{k: v if _int(v) is None else _int(v) for k, v in given.items()},
             "sequence_parallel": bool(given["sequence_parallel"]), "schedule": given["schedule"],
             "zero1": bool(has_optimizer_callback and use_distributed_optimizer)}
    layout_problems = parallel_dims_problems(**sizes, world_size=world)
    # The sizes as the strategy takes them (before the world is known): the model's rules use these even
    # when the world does not fit them, so that every problem is listed at once.
    nominal = ParallelDims(**sizes) if not parallel_dims_problems(**sizes) else None
    dims = None
    if not layout_problems:
        dims = ParallelDims(**sizes)
        layout_problems = dims.unsupported()
        if world is not None:
            dims = dims.for_world_size(world)
    problems += layout_problems
    if dims is not None:  # a registered name (imported by now: the parsed class paths)
        problems += [p for p in [pipeline_schedule_problem(dims.schedule, dims.pp, dims.vp)] if p]
    problems += [p for p in [timeout_problem(s.get("timeout"))] if p]
    problems += _init_timeout_problems(t.get("logger"), s.get("timeout"))  # W&B's start against the barrier
    tp = dims.tp if dims is not None else (_int(sizes["tp"]) or 1)
    pp = dims.pp if dims is not None else (_int(sizes["pp"]) or 1)
    vp = dims.vp if dims is not None else _int(sizes["vp"])
    dp = dims.dp if dims is not None else None

    # --- the model's records at this layout (heads, FFN, grouped-query groups against TP: the module's rules)
    if isinstance(model_class, type) and issubclass(model_class, MegatronLightningModule):
        problems += model_class.config_problems(dict(model_hparams or {}), nominal)
        if fitting and (model_hparams or {}).get("compile") and hasattr(model_class, "config_class"):
            problems += [f"model.{p}" for p in [_compile_problem(model_class, model_hparams)] if p]
    cp = _int(sizes["cp"]) or 1
    if cp > 1 and model_class is not None:  # the module takes context parallelism, on a sequence it can split
        problems += [p for p in [context_parallel_problem(model_class, cp)] if p]
        record = getattr(model_class, "config_class", None)
        try:
            config = record.coerce((model_hparams or {}).get("config")) if record is not None else None
        except (TypeError, ValueError):
            config = None  # its own problems are listed above
        if fitting and getattr(config, "cp_comm_type", None) == "p2p" and (config.attention_dropout or 0) > 0:
            problems.append(f"model.config: cp_comm_type='p2p' (ring attention) has no attention dropout, and "
                            f"attention_dropout={config.attention_dropout} trains with it: set "
                            f"--model.config.attention_dropout 0.0, or use cp_comm_type='all_gather' or 'a2a'")
        seq_length = _int(d.get("seq_length", d.get("max_seq_length")))
        problems += [p for p in [sequence_length_problem(seq_length, cp) if seq_length else None] if p]
    seq = _int(d.get("seq_length", d.get("max_seq_length")))
    if sizes["sequence_parallel"] and tp > 1 and seq and seq % cp == 0 and (seq // cp) % tp:  # (CP's own: above)
        # every rank raised "dimension 0 of size=127 is not divisible by tensor_model_parallel_size=2" at its first
        # step (a BERT or a decoder, pretraining or fine-tuning)
        problems.append(f"data sequence length {seq} is not divisible by tensor_model_parallel_size={tp}"
                        + (f" x context_parallel_size={cp}" if cp > 1 else "") + ": sequence parallelism splits each "
                        f"sequence over the TP ranks; use a multiple of {tp * cp} (data.seq_length / "
                        f"data.max_seq_length), or sequence_parallel=false")
    # --- the model against the pipeline
    layers = _int(m.get("num_layers"))
    chunks = pp * (vp or 1)
    if layers is not None and chunks > layers:
        problems.append(f"num_layers={layers} cannot fill pipeline_model_parallel_size={pp} x "
                        f"virtual_pipeline_model_parallel_size={vp or 1} = {chunks} model chunks (each needs a "
                        f"layer); use at least {chunks} layers or fewer stages/chunks")
    first, last = _int(m.get("num_layers_in_first_pipeline_stage")), _int(m.get("num_layers_in_last_pipeline_stage"))
    if layers is not None and chunks <= layers and (first is not None or last is not None):
        try:  # the layout's own rule (pipeline/layout.py), as configure_model applies it
            get_layer_range(layers, pp, 0, vp, 0, num_layers_in_first_pipeline_stage=first,
                            num_layers_in_last_pipeline_stage=last)
        except ValueError as e:
            problems.append(str(e))

    if m.get("defer_embedding_wgrad_compute") is True and pp == 1:
        problems.append("defer_embedding_wgrad_compute=True needs pipeline parallelism (pipeline_model_parallel_size >= 2): "
                        "the output layer's weight gradient is deferred to the last stage's pipeline flush, and with "
                        "one stage there is none; set it to false")

    # --- batch sizes
    gb = _int(d.get("global_batch_size"))
    s_micro, d_micro = _int(s.get("micro_batch_size")), _int(d.get("micro_batch_size"))
    micro = s_micro or d_micro  # the strategy's, else the data's (as setup_checks.resolve_batch_sizes)
    if s_micro is not None and d_micro is not None and s_micro != d_micro:
        problems.append(f"strategy micro_batch_size={s_micro} disagrees with data micro_batch_size={d_micro}; "
                        f"set it in one place (the data's, with the strategy's left null)")
    if gb is not None and micro is not None:  # the rules BatchSizes and the schedules apply at set-up
        problem = batch_size_problem(micro, gb, dp or 1)
        if problem is None and dims is not None and dims.resolved and \
                pipeline_schedule_problem(dims.schedule, pp, vp) is None:
            problem = pipeline_schedule_problem(dims.schedule, pp, vp, gb // (micro * dp))
        problems += [problem] if problem else []

    # --- sequence length
    seq, positions = _int(d.get("max_seq_length")), _int(m.get("max_sequence_length"))
    if seq is not None and positions is not None and seq > positions:
        problems.append(f"data max_seq_length={seq} exceeds the model's max_sequence_length={positions} (learned "
                        f"positions); set data.max_seq_length <= {positions} or {spelled}max_sequence_length >= {seq}")
    seq = _int(d.get("seq_length"))  # a decoder's samples (GPTDataModule)
    if seq is not None and positions is not None and seq > positions:
        problems.append(f"data seq_length={seq} exceeds the model's max_sequence_length={positions} (the positions "
                        f"it has); set data.seq_length <= {positions} or {spelled}max_sequence_length >= {seq}")
    problems += _generation_problems(m)

    problems += data_files_problems(d, m, data_class=data_class, predicting=predicting, running=running, split=split)
    if running and not fitting:
        command = "predict" if predicting else "validate" if split == "valid" else "test"
        problems += [p for p in [evaluated_model_problem(command, ckpt_path, m.get("init_from"), model_class,
                                                          m.get("lora"))] if p]
    checkpoint_problem = ckpt_path_problem(ckpt_path)
    problems += [checkpoint_problem] if checkpoint_problem else []
    problems += checkpoint_data_problems(d, m, data_class=data_class,
                                         ckpt_path=None if checkpoint_problem else ckpt_path)
    if fitting and ckpt_path is not None and not checkpoint_problem:
        problems += resume_problems(str(ckpt_path), dict(model_hparams or {}), model_class, optimizer_class, sch,
                                     _int(t.get("max_steps")), data=d, data_class=data_class)

    if fitting:  # what the samples are trained on (evaluation reads the split, predict its texts)
        problems += [p for p in [binary_head_problem(data_arguments(data_class, d), m, model_class)] if p]
    prob = d.get("masked_lm_prob")
    if isinstance(prob, (int, float)) and not 0.0 < prob < 1.0:
        problems.append(f"data masked_lm_prob={prob} must be in (0, 1) (BERT masks 0.15 of the tokens)")
    lr = m.get("lr")
    if isinstance(lr, (int, float)) and not lr > 0:
        problems.append(f"model lr={lr} must be > 0")

    # --- precision
    precision = normalize_precision(t.get("precision"))
    params_dtype = _dtype_name(m["params_dtype"]) if m.get("params_dtype") is not None else None
    if precision == "16-mixed":
        problems.append(grad_scaler_problem(precision))
    elif precision not in PRECISION_PARAMS_DTYPE:
        problems.append(f"precision={t.get('precision')!r} is not supported by MegatronStrategy; use one of "
                        f"{sorted(p for p in PRECISION_PARAMS_DTYPE if p != '16-mixed')}")  # 16-mixed: refused too
    elif params_dtype is not None and PRECISION_PARAMS_DTYPE[precision] != params_dtype:
        problems.append(f"precision={precision!r} needs params_dtype={PRECISION_PARAMS_DTYPE[precision]!r} but the "
                        f"model has params_dtype={params_dtype!r}; set trainer.precision="
                        f"{_PRECISION_FOR_DTYPE.get(params_dtype, '?')} or {spelled}params_dtype="
                        f"{PRECISION_PARAMS_DTYPE[precision]!r}")
    if params_dtype in ("bfloat16", "float16") and has_optimizer_callback is False:
        problems.append(f"params_dtype={params_dtype!r} without MegatronOptimizerCallback updates 16-bit weights "
                        f"directly (fp16 diverges, bf16 loses small updates); add the callback "
                        f"lightning_megatron.callbacks.MegatronOptimizerCallback (fp32 main params, loss scaling)")

    # --- trainer options the strategy replaces
    acc = _int(t.get("accumulate_grad_batches", 1))
    if acc is not None and acc != 1:
        problems.append(f"accumulate_grad_batches={acc}: accumulation is the microbatch schedule; set it to 1 and "
                        f"raise global_batch_size (= micro_batch_size x num_microbatches x data-parallel size)")
    clip_problem = gradient_clip_val_problem(t.get("gradient_clip_val"))
    if clip_problem is not None:
        problems.append(clip_problem)
    problems += trainer_flag_problems(t, data_class)
    for cb in t.get("callbacks") or []:
        save_last = (cb.get("init_args") or {}).get("save_last") if isinstance(cb, Mapping) else None
        unsupported = callback_class_problem(cb.get("class_path")) if isinstance(cb, Mapping) else None
        problems += [p for p in [save_last_problem(save_last), unsupported] if p]
    if fitting and running:  # where the run writes: found at its first save (steps later) or a rank's traceback
        problems += write_location_problems(t)
    if use_distributed_optimizer and isinstance(m.get("optimizer_class"), str):  # ZeRO-1 over a named optimizer
        try:
            optimizer_class = torch_class(m["optimizer_class"], torch.optim, torch.optim.Optimizer, "optimizer_class",
                                          "optimizer", "torch.optim.SGD, torch.optim.NAdam")
        except ValueError as e:
            problems.append(str(e))
        else:
            problems += [p for p in [distributed_optimizer_problem(
                optimizer_class, f"model.optimizer_class={m['optimizer_class']!r}")] if p]

    problems += none_problems(optimizer_config or {})  # the megatron_optimizer section's nulls

    # --- schedule
    if sch:
        fast_dev_run = t.get("fast_dev_run")  # Lightning runs that many steps (True: 1) and sets max_steps to it
        problems += _check_schedule(sch, _int(t.get("max_steps")), fast_dev_run=bool(fast_dev_run))

    # --- this machine (a run): the GPUs the trainer asks for; a CPU run's ranks of a node against its memory
    if running:
        gpus = accelerator_problem(t.get("accelerator", "auto"), _int(t.get("devices")))
        problems += [gpus] if gpus else []
        if gpus is None and dims is not None and world is not None and runs_on_cpu(t.get("accelerator", "auto")):
            data = data_arguments(data_class, d)
            memory = cpu_memory_problem(model_class, dict(model_hparams or {}), data, dims,
                                        world // (_int(t.get("num_nodes", 1)) or 1),
                                        micro_batch_size=micro or _int(data.get("micro_batch_size")),
                                        global_batch_size=gb or _int(data.get("global_batch_size")))
            problems += [memory] if memory else []
    return problems


def _generation_problems(m: dict[str, Any]) -> list[str]:
    """A decoder's ``predict_*`` settings (:func:`lightning_megatron.generation.generation_problems`, the rule
    ``generate`` applies): the sampling ones only when they are used (``predict_greedy`` false)."""
    if "predict_max_new_tokens" not in m:
        return []
    from lightning_megatron.generation import generation_problems

    sampling = {} if m.get("predict_greedy", True) else {
        k: m[f"predict_{k}"] for k in ("temperature", "top_k", "top_p") if f"predict_{k}" in m}
    problems = generation_problems(max_new_tokens=m["predict_max_new_tokens"], **sampling, prefix="--model.predict_")
    seed = m.get("predict_seed", 0)
    if not m.get("predict_greedy", True) and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        problems.append(f"--model.predict_seed={seed!r} must be an integer >= 0 (each prompt's draws are seeded from "
                        f"it and the prompt's index)")
    return [p.replace("greedy decoding takes the argmax", "--model.predict_greedy true takes the argmax")
            for p in problems]


def write_location_problems(trainer_args: Mapping[str, Any]) -> list[str]:
    """The run folder (``default_root_dir``: logs, W&B, checkpoints) and each ModelCheckpoint ``dirpath``: a file
    there, or a folder this process cannot make or write in (a read-only mount), failed at the run's first save,
    after the steps before it, or after launch with a rank's traceback. Probed with a file made and removed in the
    folder, or in the nearest existing folder above it (nothing is created for good)."""
    import os
    import tempfile

    root = trainer_args.get("default_root_dir")
    places = [("--trainer.default_root_dir", os.fspath(root))] if root else []
    places += [("the checkpoint folder", os.fspath(cb["init_args"]["dirpath"]))
               for cb in trainer_args.get("callbacks") or []
               if isinstance(cb, Mapping) and isinstance(cb.get("init_args"), Mapping)
               and cb["init_args"].get("dirpath")]
    problems = []
    for what, path in dict.fromkeys(places):
        if "://" in path:  # an object store (s3://, gs://): the file system's to say
            continue
        if os.path.exists(path) and not os.path.isdir(path):
            problems.append(f"{what} {path} is a file, not a folder: the run writes its logs and checkpoints there; "
                            f"pass a folder")
            continue
        existing = os.path.abspath(path)
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            problems.append(f"{what} {path} cannot be made: {existing} is a file, not a folder")
            continue
        try:
            fd, probe = tempfile.mkstemp(prefix=".lightning-megatron-probe-", dir=existing)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            problems.append(f"{what} {path} cannot be written ({existing}: {e.strerror or e}): the run would fail at "
                            f"its first save; pass a folder it can write")
    return problems


def save_last_problem(save_last: Any) -> str | None:
    """``ModelCheckpoint(save_last="link")`` refused: Lightning makes that link on rank 0 outside the strategy's
    atomic save (a crash between its remove and its link leaves no ``last``; it replaces another run's)."""
    if save_last != "link":
        return None
    return ("ModelCheckpoint(save_last='link') is not supported by MegatronStrategy: Lightning links last.ckpt on rank "
            "0 outside the atomic, run-guarded save (a crash while it replaces the link leaves no last checkpoint, and "
            "it replaces another run's); set save_last: true (last.ckpt saved as a checkpoint of its own)")


_SCHEDULE_NUMBERS = {"init_lr": 0.0, "max_lr": 1e-4, "min_lr": 0.0, "lr_warmup_steps": 0, "start_wd": 0.01,
                     "end_wd": 0.01}
"""The schedule's arguments that take a number only, and their defaults (OptimizerParamSchedulerCallback's)."""


def _compile_problem(model_class: type, model_hparams: Mapping[str, Any]) -> str | None:
    """A training run's :func:`~lightning_megatron.language.module.compile_problem` (its own record's problems are
    the module's, listed before)."""
    from lightning_megatron.language.module import compile_problem

    try:
        config = model_class.config_class.coerce(model_hparams.get("config"))
    except (TypeError, ValueError):
        return None
    return compile_problem(config, model_hparams.get("compile"))


def _check_schedule(sch: dict[str, Any], max_steps: int | None, *, fast_dev_run: bool = False) -> list[str]:
    problems = [f"lr_schedule.{key}=None: the schedule needs a number (leave the key out for the default, {default})"
                for key, default in _SCHEDULE_NUMBERS.items() if key in sch and sch[key] is None]
    decay = _int(sch.get("lr_decay_steps"))
    warmup = _int(sch.get("lr_warmup_steps", 0)) or 0
    if sch.get("lr_decay_steps") is None and fast_dev_run:
        pass  # the scheduler callback takes the horizon past the warm-up for the few steps of the check run
    elif sch.get("lr_decay_steps") is None:
        if max_steps is None or max_steps <= 0:
            problems.append(f"lr_decay_steps=null means trainer.max_steps, but max_steps={max_steps}; set "
                            f"trainer.max_steps or lr_decay_steps")
        # else a warm-up as long as the run is shortened at set-up (scheduler.warmup_for_run), with a warning
    elif decay is not None:
        problems += [p for p in [warmup_problem(warmup, decay)] if p]  # the scheduler's own rule
    if sch.get("wd_incr_steps") is None and sch.get("wd_incr_style", "constant") != "constant" and not fast_dev_run \
            and (max_steps is None or max_steps <= 0):
        problems.append(f"wd_incr_steps=null means trainer.max_steps, but max_steps={max_steps}; set trainer.max_steps "
                        f"or lr_schedule.wd_incr_steps")
    numbers = [v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
               for v in (sch.get("init_lr"), sch.get("max_lr"), sch.get("min_lr"))]
    problems += lr_problems(*numbers)  # the scheduler's own rules
    styles = ("lr_decay_style", "lr_wsd_decay_style", "wd_incr_style", "wsd_decay_steps", "start_wd", "end_wd")
    problems += [f"lr_schedule.{p}" for p in style_problems(**{k: sch[k] for k in styles if k in sch},
                                                            lr_decay_steps=decay)]
    problems += [p for p in [resume_problem(bool(sch.get("use_checkpoint_opt_param_scheduler")),
                                            bool(sch.get("override_opt_param_scheduler")))] if p]
    return problems


def validate_config(*args: Any, **kwargs: Any) -> None:
    """:func:`check_config` (the same arguments), raising one :class:`ConfigError` (a ValueError) that lists
    every problem."""
    problems = check_config(*args, **kwargs)
    if problems:
        raise ConfigError(problems)


def _plain(value: Any) -> Any:
    as_dict = getattr(value, "as_dict", None)
    return as_dict() if callable(as_dict) else value


def _init_args(section: Any) -> dict[str, Any]:
    """A model/data section's arguments: plain, or the ``init_args`` of a class named by ``class_path``."""
    section = dict(section or {})
    return dict(section.get("init_args") or {}) if "class_path" in section else section


def config_from_cli(config: Mapping[str, Any], fitting: bool = True, *, predicting: bool = False,
                    data_class: type | None = None, model_class: type | None = None,
                    running: bool = True, split: str | None = None) -> dict[str, Any]:
    """The keyword arguments of :func:`check_config` from a parsed LightningCLI config (one subcommand's).

    Only a MegatronStrategy configuration is checked: with another strategy this returns ``{}``.
    ``fitting=False`` (validate/test/predict) skips the checks that only matter for training;
    ``predicting`` adds ``predict``'s. ``data_class`` / ``model_class``: the datamodule / LightningModule when
    the section names none by ``class_path`` (the CLI's default one); ``running=False``: no command runs (see :func:`check_config`).
    """
    c = _plain(config)
    trainer = dict(c.get("trainer") or {})
    strategy = trainer.get("strategy")
    if isinstance(strategy, Mapping):
        if not str(strategy.get("class_path", "")).endswith("MegatronStrategy"):
            return {}
        strategy_args = dict(strategy.get("init_args") or {})
    elif strategy == "megatron":
        strategy_args = {}
    else:
        return {}
    scheduler_args: dict[str, Any] = {}
    optimizer_config: dict[str, Any] = {}
    has_optimizer_callback = zero1 = False
    for cb in trainer.get("callbacks") or []:
        if not isinstance(cb, Mapping):
            continue
        path = str(cb.get("class_path", ""))
        if path.endswith("OptimizerParamSchedulerCallback"):
            scheduler_args = dict(cb.get("init_args") or {})
        elif path.endswith("MegatronOptimizerCallback"):
            has_optimizer_callback = True
            optimizer_config = (cb.get("init_args") or {}).get("config")  # where the CLI's section has moved
            zero1 = isinstance(optimizer_config, Mapping) and bool(optimizer_config.get("use_distributed_optimizer"))
    # The CLI's named callback groups (``lr_schedule:``, ``megatron_optimizer:``; None when absent).
    if isinstance(c.get("lr_schedule"), Mapping):
        scheduler_args = dict(c["lr_schedule"])
    if isinstance(c.get("megatron_optimizer"), Mapping):
        optimizer_config = dict(c["megatron_optimizer"])
        has_optimizer_callback = True
        zero1 = bool(c["megatron_optimizer"].get("use_distributed_optimizer"))
    data = c.get("data")
    if isinstance(data, Mapping) and data.get("class_path"):
        data_class = _imported_class(str(data["class_path"]))
    model = c.get("model")
    if isinstance(model, Mapping) and model.get("class_path"):
        model_class = _imported_class(str(model["class_path"]))
    return dict(model_hparams=_init_args(c.get("model")), data_hparams=_init_args(data),
                strategy_args=strategy_args, trainer_args=trainer, scheduler_args=scheduler_args if fitting else {},
                has_optimizer_callback=has_optimizer_callback if fitting else None,
                use_distributed_optimizer=zero1 and fitting, data_class=data_class, model_class=model_class,
                predicting=predicting, ckpt_path=c.get("ckpt_path"), running=running, split=split,
                fitting=fitting, optimizer_class=_optimizer_class_path(c.get("optimizer")),
                optimizer_config=optimizer_config if fitting else {})


def _optimizer_class_path(section: Any) -> str | None:
    """The class path of the CLI's ``--optimizer`` section (a class path, or ``{class_path, init_args}``)."""
    if isinstance(section, Mapping):
        section = section.get("class_path")
    return section if isinstance(section, str) else None


def _imported_class(class_path: str) -> type | None:
    """The class a parsed ``class_path`` names (imported by the parser already), or None."""
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) else None
