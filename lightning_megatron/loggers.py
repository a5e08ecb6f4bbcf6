"""Run folders and W&B runs for the ``lightning-megatron`` command.

- :class:`CSVLogger`: Lightning's, with ``save_dir`` optional (the CLI puts it in ``trainer.default_root_dir``);
- :class:`WandbLogger`: Lightning's, whose history is indexed by the trainer's step (a resumed run continues
  it instead of restarting W&B's ``_step`` at 0), an offline resume recorded as one, and no ``anonymous``
  setting passed to ``wandb.init`` (deprecated there: it warned on every run);
- :class:`WandbRunIdCallback` and :func:`saved_wandb_run`: every checkpoint records the W&B run id of
  the run that wrote it, so that a resumed ``fit`` continues that run and ``validate``/``test`` of it are
  grouped with it (or join its history, when asked); the callback also puts :func:`run_config` (layout,
  schedule, optimizer) into the W&B config;
- :func:`wandb_credentials`: whether W&B has credentials (the CLI runs offline, loudly, without).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from lightning.pytorch import loggers
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

__all__ = ["CSVLogger", "WANDB_RUN_ID", "WandbLogger", "WandbRunIdCallback", "run_config", "SavedWandbRun",
           "saved_wandb_run", "wandb_credentials"]

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


class WandbLogger(loggers.WandbLogger):
    """Lightning's ``WandbLogger`` (same arguments) for runs that stop and resume.

    - Each row goes to W&B at the step Lightning logs (``trainer/global_step``, the CSV's ``step``), passed as
      ``wandb.log(..., step=)``: W&B's own ``_step`` counts the rows of one process from 0, so a resumed run's
      rows would restart at 0 and a sync of its segments drop or mix them.
    - ``resume="must"`` (what the ``lightning-megatron`` CLI passes when it continues the W&B run a checkpoint
      names) in offline mode also records the segment as resumed (``wandb.Settings(resumed=True)``): offline,
      W&B cannot ask its server, and would record every segment as a new run.
    - ``anonymous=None`` (the default) is not passed on: ``wandb`` deprecated the setting and warns whenever it
      is given, even as None.

    ``history_step``: log every row at this step of the run's history instead (an evaluation of a checkpoint
    joining the training run's history: the checkpoint's global step; Lightning logs an evaluation at 0).
    """

    def __init__(self, *args: Any, history_step: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.history_step = history_step
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
        offline = self._offline or os.environ.get("WANDB_MODE") in ("offline", "dryrun")
        if offline and self._wandb_init.get("resume") == "must" and self._wandb_init.get("settings") is None:
            import wandb

            self._wandb_init["settings"] = wandb.Settings(resumed=True)

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        step = self.history_step if self.history_step is not None else step
        if step is None or self._wandb_init.get("sync_tensorboard"):
            super().log_metrics(metrics, step)
            return
        if self._prefix:  # as Lightning's logger names them
            metrics = {f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}": v for k, v in metrics.items()}
        self.experiment.log(dict(metrics, **{"trainer/global_step": step}), step=step)


_OPTIMIZER_HPARAMS = ("optimizer", "optimizer_class", "optimizer_kwargs", "lr", "weight_decay", "adam_beta1",
                      "adam_beta2", "adam_eps", "sgd_momentum", "lr_scheduler_class", "lr_scheduler_kwargs")
"""The module hyper-parameters that make the optimizer (BertLightningModule's), gathered under ``optimizer``."""


def run_config(trainer: Any, model: Any) -> dict[str, Any]:
    """Trainer, strategy, layout, precision, the lr schedule, clipping and the optimizer: what the W&B config
    shows next to the module's hyper-parameters (which Lightning logs itself)."""
    import dataclasses

    from lightning_megatron.callbacks import MegatronOptimizerCallback, OptimizerParamSchedulerCallback
    from lightning_megatron.strategy import MegatronStrategy

    strategy = trainer.strategy
    run = {"trainer": {"max_steps": trainer.max_steps, "precision": str(trainer.precision),
                       "devices": trainer.num_devices, "num_nodes": trainer.num_nodes,
                       "accelerator": type(trainer.accelerator).__name__},
           "strategy": type(strategy).__name__}
    if isinstance(strategy, MegatronStrategy):
        dims = strategy.parallel_dims  # Megatron's names, as the recipe writes them
        run["layout"] = {"name": dims.name, **dims.strategy_kwargs(), "data_parallel_size": dims.dp,
                         "use_distributed_optimizer": dims.zero1, "micro_batch_size": strategy.micro_batch_size}
    for callback in trainer.callbacks:  # the lr schedule, clipping and loss scaling
        if isinstance(callback, OptimizerParamSchedulerCallback):
            run["lr_schedule"] = dict(callback.kwargs)
        elif isinstance(callback, MegatronOptimizerCallback):
            run["megatron_optimizer"] = dataclasses.asdict(callback.config)
    hparams = dict(model.hparams)
    optimizer = {k: hparams[k] for k in _OPTIMIZER_HPARAMS if hparams.get(k) is not None}
    if optimizer:
        run["optimizer"] = optimizer
    return run



class WandbRunIdCallback(Callback):
    """Writes the run id of the trainer's ``WandbLogger`` into every checkpoint (``checkpoint["wandb_run_id"]``),
    and :func:`run_config` into its config at set-up (on rank 0, after the launch: the W&B run no longer
    starts in the launching process before the other ranks are started)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        wandb = [lg for lg in trainer.loggers if isinstance(lg, loggers.WandbLogger)]
        if wandb:
            config = run_config(trainer, pl_module)
            for logger in wandb:
                logger.log_hyperparams(config)  # rank zero only

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


class SavedWandbRun(NamedTuple):
    """What a checkpoint says about the W&B run that wrote it."""

    run_id: str
    """The W&B run id (``checkpoint["wandb_run_id"]``)."""
    global_step: int | None
    """The trainer's global step at the save (Lightning's ``checkpoint["global_step"]``)."""


def saved_wandb_run(ckpt_path: Any) -> SavedWandbRun | None:
    """The W&B run a checkpoint (a lightning_megatron directory: its ``extra.pt``; or a single-file
    Lightning checkpoint) was written under, and its step; None when it has no run id or is not a
    readable path (the checkpoint load then reports the problem)."""
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
    if not isinstance(run_id, str):
        return None
    step = saved.get("global_step")
    return SavedWandbRun(run_id, int(step) if isinstance(step, int) else None)
