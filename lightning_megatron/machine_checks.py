"""What this machine can run, checked before launch (:func:`lightning_megatron.config_checks.check_config` calls
these): the accelerator the Trainer names, and a CPU run's ranks of a host against the memory it has free.

Both would otherwise end after launch: Lightning raises in the Trainer with a traceback ("No supported gpu backend
found!"), and the kernel kills a rank of a model too large for the host ("terminated with code -9"). Device-neutral:
the accelerator is asked through ``torch.accelerator``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lightning_megatron.parallel_dims import ParallelDims

__all__ = ["MEMORY_FIX", "accelerator_problem", "cpu_memory_problem", "host_memory_available", "runs_on_cpu"]


def host_memory_available() -> int | None:
    """Bytes this machine can give new processes without swapping (Linux's ``MemAvailable``, else the free
    physical pages); None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _torch_accelerator(name: str) -> bool:
    """Whether Lightning's ``accelerator`` name asks for a torch accelerator: ``gpu`` (any), or a torch device
    type other than the CPU (``mps``, ``xpu``, ...); a name torch does not know (``tpu``, a plugin's) is not
    judged here."""
    if name == "gpu":
        return True
    try:
        torch.device(name)
    except RuntimeError:
        return False
    return name != "cpu"


def runs_on_cpu(accelerator: Any) -> bool:
    """Whether the Trainer's ``accelerator`` puts the ranks on the CPU ("auto": where torch finds no accelerator)."""
    name = accelerator.lower() if isinstance(accelerator, str) else None
    return name == "cpu" or (name == "auto" and not torch.accelerator.is_available())


def accelerator_problem(accelerator: Any, devices: int | None) -> str | None:
    """A run on a machine without the accelerators it asks for (Lightning would raise in the Trainer, with a
    traceback): none of the kind ``accelerator`` (the Trainer's) names, or fewer than ``devices`` (per node; None:
    not a count); None otherwise."""
    if not isinstance(accelerator, str) or not _torch_accelerator(accelerator.lower()):
        return None
    found = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if found is None or accelerator.lower() not in ("gpu", found.type):
        has = f"only {found.type}" if found is not None else "none"
        return (f"trainer.accelerator={accelerator!r}: this machine has no such device torch can use ({has}); run "
                f"on a node that has it, or try the recipe on this CPU with --trainer.accelerator cpu (gloo; a "
                f"model sized for GPUs may not fit this machine's memory)")
    count = torch.accelerator.device_count()
    if devices is not None and devices > count:
        return (f"trainer.devices={devices} with trainer.accelerator={accelerator!r}: this machine has {count} "
                f"({found.type}); set --trainer.devices {count} (the layout's sizes must then fit {count} per node) "
                f"or run on nodes with {devices}")
    return None


def cpu_memory_problem(model_class: Any, model_hparams: dict[str, Any], data_hparams: dict[str, Any],
                       dims: ParallelDims, ranks_per_node: int, *, micro_batch_size: int | None,
                       global_batch_size: int | None) -> str | None:
    """A CPU run whose ranks on one host need more memory together than this machine has free (the memory estimate
    of the module's declared sizes, :func:`~lightning_megatron.cost.memory.node_bytes`: a lower bound), which the
    kernel would end by killing a rank; None when it fits or the module declares no sizes."""
    from lightning_megatron.cost import EstimatesCost, node_bytes

    if not isinstance(model_class, EstimatesCost) or not dims.resolved or not micro_batch_size or \
            not global_batch_size:
        return None
    try:
        m = model_class.estimate_shape(model_hparams, data_hparams, micro_batch_size=micro_batch_size,
                                       global_batch_size=global_batch_size)
        needed = node_bytes(m, dims, ranks_per_node)
    except (ValueError, TypeError, KeyError):
        return None  # sizes left to the data (its tokenizer's vocabulary) or said wrong (refused on their own)
    free = host_memory_available()
    if free is None or needed <= free:
        return None
    g = 2**30
    return (f"on this machine's CPU the {ranks_per_node} rank(s) of {dims.name} on a host need at least "
            f"{needed / g:.2f} GiB together (the memory estimate: parameters, gradients, optimizer state, "
            f"activations), more than the {free / g:.2f} GiB it has free: the kernel would kill a rank; "
            f"{MEMORY_FIX}")


MEMORY_FIX = ("train a smaller shape or micro batch (--model.config.num_layers, --data.micro_batch_size), fewer ranks "
              "(--trainer.devices), or on GPUs")
"""How :func:`cpu_memory_problem`'s refusal ends (``check`` adds its own way on when it sees it)."""
