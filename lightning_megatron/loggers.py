"""Run folders and W&B runs for the ``lightning-megatron`` command.

- :class:`CSVLogger`: Lightning's, with ``save_dir`` optional (the CLI puts it in ``trainer.default_root_dir``);
- :class:`WandbRunIdCallback` and :func:`saved_wandb_run_id`: every checkpoint records the W&B run id of
  the run that wrote it, so that ``validate``/``test``/``predict`` or a resumed ``fit`` of it continue
  that run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import loggers
from lightning.pytorch.callbacks import Callback

__all__ = ["CSVLogger", "WANDB_RUN_ID", "WandbRunIdCallback", "saved_wandb_run_id", "wandb_credentials"]

WANDB_RUN_ID = "wandb_run_id"
"""Checkpoint key holding the W&B run id of the run that wrote the checkpoint."""


class CSVLogger(loggers.CSVLogger):
    """Lightning's ``CSVLogger`` (``metrics.csv`` in ``save_dir/name/version_N``) with ``save_dir``
    optional, so that a recipe names its run folder once (``trainer.default_root_dir``): the
    ``lightning-megatron`` CLI fills a missing ``save_dir`` with it before the logger is built, as it
    does for a ``WandbLogger`` left at ``save_dir="."`` and a ``ModelCheckpoint`` without ``dirpath``.
    An explicit ``save_dir`` is used as given."""

    def __init__(self, save_dir: str | os.PathLike[str] | None = None, name: str | None = "csv",
                 version: int | str | None = None, prefix: str = "", flush_logs_every_n_steps: int = 100) -> None:
        if save_dir is None:
            raise ValueError("CSVLogger(save_dir=None): the folder is filled in from trainer.default_root_dir by the "
                             "lightning-megatron CLI only; pass save_dir=... when building the logger yourself")
        super().__init__(save_dir, name=name, version=version, prefix=prefix,
                         flush_logs_every_n_steps=flush_logs_every_n_steps)


class WandbRunIdCallback(Callback):
    """Writes the run id of the trainer's ``WandbLogger`` into every checkpoint (``checkpoint["wandb_run_id"]``)."""

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, loggers.WandbLogger) and logger.version:
                checkpoint[WANDB_RUN_ID] = str(logger.version)


def wandb_credentials() -> str | None:
    """Where W&B would take its credentials from, as ``wandb`` looks for them (without importing it):
    ``WANDB_API_KEY`` or ``WANDB_IDENTITY_TOKEN_FILE``, else the netrc entry of the W&B host that
    ``wandb login`` writes (``$NETRC``, ``~/.netrc`` or ``~/_netrc``; the host of ``WANDB_BASE_URL``,
    default ``api.wandb.ai``). None when there are none: a run would have to be offline."""
    import netrc
    from urllib.parse import urlparse

    for variable in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if os.environ.get(variable):
            return variable
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    candidates = ([os.environ["NETRC"]] if os.environ.get("NETRC")
                  else [os.path.expanduser("~/.netrc"), os.path.expanduser("~/_netrc")])
    for path in candidates:
        if not os.path.isfile(path):
            continue
        try:
            entry = netrc.netrc(path).authenticators(host)
        except (netrc.NetrcParseError, OSError):
            continue  # wandb reports an unreadable file itself
        if entry and entry[2]:
            return f"{path} ({host})"
    return None


def saved_wandb_run_id(ckpt_path: Any) -> str | None:
    """The W&B run id a checkpoint (a lightning_megatron directory: its ``extra.pt``; or a single-file
    Lightning checkpoint) was written under; None when it has none or is not a readable path (the
    checkpoint load then reports the problem)."""
    if not isinstance(ckpt_path, (str, os.PathLike)):
        return None
    path = Path(ckpt_path)
    path = path / "extra.pt" if path.is_dir() else path
    if not path.is_file():  # "last", "best" or a missing path
        return None
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    except Exception:  # noqa: BLE001 - an unreadable checkpoint is reported by the checkpoint load itself
        return None
    run_id = saved.get(WANDB_RUN_ID) if isinstance(saved, dict) else None
    return run_id if isinstance(run_id, str) else None
