"""Run folders and W&B runs for the ``lightning-megatron`` command.

- :class:`CSVLogger`: Lightning's, with ``save_dir`` optional (the CLI puts it in ``trainer.default_root_dir``);
- :class:`WandbLogger`: Lightning's, whose history is indexed by the trainer's step (a resumed run continues
  it instead of restarting W&B's ``_step`` at 0), an offline resume recorded as one, no ``anonymous``
  setting passed to ``wandb.init`` (deprecated there: it warned on every run), and ``wandb.init`` bounded
  in time (``init_timeout_s``), with one offline fallback, so that W&B never keeps the other ranks waiting;
- :class:`WandbRunIdCallback` and :func:`saved_wandb_run`: every checkpoint records the W&B run id of
  the run that wrote it, so that a resumed ``fit`` continues that run and ``validate``/``test`` of it are
  grouped with it (or join its history, when asked); the callback also puts :func:`run_config` (layout,
  schedule, optimizer) into the W&B config;
- :func:`wandb_credentials`: whether W&B has credentials (the CLI runs offline, loudly, without).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from lightning.pytorch import loggers
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from typing_extensions import override

from lightning_megatron.config_checks import init_timeout_problem

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
    - ``wandb.init`` (on rank 0: started in the background by :meth:`start_in_background` while the ranks meet,
      else when ``experiment`` is first used) takes at most ``init_timeout_s``, then falls back to one offline
      run (:meth:`_bounded_init`).

    ``history_step``: log every row at this step of the run's history instead (an evaluation of a checkpoint
    joining the training run's history: the checkpoint's global step; Lightning logs an evaluation at 0).
    ``init_timeout_s``: the bound on ``wandb.init``, the W&B service start included, in seconds: the first
    attempt gets three quarters of it; when it fails or is still running then, the run continues offline
    (same run id and folder, one warning saying how to upload it), within what is left; when that fails too,
    an error. It must be below the strategy's ``timeout`` (checked before launch by ``lightning-megatron``),
    else the other ranks' barrier fails first.
    """

    def __init__(self, *args: Any, history_step: int | None = None, init_timeout_s: float = 60.0,
                 **kwargs: Any) -> None:
        problem = init_timeout_problem(init_timeout_s)
        if problem:
            raise ValueError(problem)
        super().__init__(*args, **kwargs)
        self._starting: tuple[threading.Thread, dict[str, Any]] | None = None
        self._service_lost: str | None = None  # why W&B's service stopped answering (then nothing is sent)
        self.history_step = history_step
        self.init_timeout_s = float(init_timeout_s)
        for name in ("init_timeout", "x_service_wait"):  # wandb's own waits, kept when the user sets them
            value = _setting(self._wandb_init.get("settings"), name)
            if isinstance(value, (int, float)) and value > self.init_timeout_s:
                rank_zero_warn(f"WandbLogger: settings {name}={value:g} has no effect past "
                               f"init_timeout_s={self.init_timeout_s:g}, the bound on all of wandb.init; raise "
                               f"init_timeout_s to wait longer")
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
        offline = self._offline or os.environ.get("WANDB_MODE") in ("offline", "dryrun")
        if offline and self._wandb_init.get("resume") == "must" and self._wandb_init.get("settings") is None:
            import wandb

            self._wandb_init["settings"] = wandb.Settings(resumed=True)

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> Any:
        """Lightning's, with the run it starts started by :meth:`_bounded_init`."""
        import wandb

        if self._experiment is None and (self._starting is not None or self._may_start()):
            run = self._started_run() if self._starting is not None else self._bounded_init()
            if self._wandb_init.get("sync_tensorboard"):  # Lightning's x-axis for the runs it starts
                run.define_metric("*", step_metric="global_step")
            else:
                run.define_metric("trainer/global_step")
                run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
            self._experiment = run
        return super().experiment

    def _may_start(self) -> bool:
        """No run yet to attach to or reuse: this logger starts one (Lightning's condition)."""
        import wandb

        if self._experiment is not None or getattr(self, "_attach_id", None) is not None or wandb.run is not None:
            return False
        if self._offline:
            os.environ["WANDB_MODE"] = "dryrun"  # as Lightning's
        return True

    def start_in_background(self) -> None:
        """Start the run now, on a daemon thread (:meth:`_bounded_init`, within ``init_timeout_s``); the first use of
        :attr:`experiment` waits for it. ``MegatronStrategy`` calls this on global rank 0 once the ranks are known
        and before it waits for the other ranks at the rendezvous, so that W&B's start (its service, the run at the
        server: 1.5 s offline on 2 cores, seconds online) overlaps that wait instead of following it."""
        if self._starting is not None or not self._may_start():
            return
        outcome: dict[str, Any] = {}

        def start() -> None:
            try:
                outcome["run"] = self._bounded_init()
            except BaseException as error:  # noqa: BLE001 - raised where the run is first used
                outcome["error"] = error

        thread = threading.Thread(target=start, name="wandb-start", daemon=True)
        thread.start()
        self._starting = (thread, outcome)

    def _started_run(self) -> Any:
        """The run :meth:`start_in_background` started (waits: at most ``init_timeout_s`` from its start), or its error."""
        assert self._starting is not None
        thread, outcome = self._starting
        thread.join()  # bounded: _bounded_init returns or raises within init_timeout_s
        self._starting = None
        if "error" in outcome:
            raise outcome["error"]
        return outcome["run"]

    def _bounded_init(self) -> Any:
        """``wandb.init`` within ``init_timeout_s``; once offline when the first attempt fails or runs out.

        wandb's own waits (``x_service_wait``: the service start; ``init_timeout``: the run at the server) are set
        to half the bound each, under the user's ``settings``, so that wandb usually ends a slow start itself,
        with its error. They do not cover every step of ``wandb.init`` (the login, git, the run-start request,
        a service start that hangs before its wait), so the call runs in a daemon thread that is waited for at
        most three quarters of the bound: a thread still running then is left behind (Python cannot stop it;
        it does not keep the process alive; a run it still starts later is finished at once, unused, as is a
        late offline fallback's after the error). The offline fallback first tears W&B's library state down
        (``wandb.teardown()``, in the background): the call left behind holds its service lock, and a failed run
        keeps its id in use in the service. The fallback keeps the run id (named here when none is given) and
        folder, so that ``wandb sync`` uploads it as the same run, and has what is left of the bound.
        """
        import wandb

        bound = self.init_timeout_s
        deadline = time.monotonic() + bound
        init = dict(self._wandb_init)
        resumes = init.get("resume") == "must" or (init.get("resume") == "allow" and _has_segments(init))
        init["id"] = init.get("id") or uuid.uuid4().hex[:8]  # named now: the offline fallback continues it
        first = dict(init, settings=self._settings(bound / 2))
        try:  # a run the stuck call still starts later is finished at once: the logger has the fallback's
            return _call_within(lambda: wandb.init(**first), 0.75 * bound, late=lambda run: run.finish(exit_code=1))
        except Exception as error:  # noqa: BLE001 - any failure of W&B's start falls back to offline
            failed = _failure(error)

        teardown = threading.Thread(target=wandb.teardown, name="wandb-teardown", daemon=True)
        teardown.start()
        teardown.join((deadline - time.monotonic()) / 2)  # detaches the library state first, then waits
        left = deadline - time.monotonic()
        settings = self._settings(left)
        if resumes:  # as __init__ for an offline resume: W&B cannot ask its server
            settings.resumed = True
        offline = dict(init, mode="offline", settings=settings)
        try:
            run = _call_within(lambda: wandb.init(**offline), left, late=lambda run: run.finish(exit_code=1))
        except Exception as error:  # noqa: BLE001
            raise RuntimeError(
                f"W&B: wandb.init {failed}, and the offline run it fell back to {_failure(error)}, within "
                f"init_timeout_s={bound:g} (the bound on starting W&B, so that rank 0 does not keep the other "
                f"ranks waiting at the barrier). Run without W&B (WANDB_MODE=disabled, or no WandbLogger), or "
                f"give W&B longer: --trainer.logger.init_args.init_timeout_s N (WandbLogger(init_timeout_s=N)), "
                f"below the strategy timeout") from error
        rank_zero_warn(
            f"W&B: wandb.init {failed} (init_timeout_s={bound:g}: the bound on starting W&B, its service included, "
            f"so that rank 0 does not keep the other ranks waiting at the barrier); this run logs offline instead, "
            f"as run {init['id']} in {run.settings.sync_dir}. Upload it later with `wandb sync "
            f"{run.settings.sync_dir}`; to give W&B longer, --trainer.logger.init_args.init_timeout_s N "
            f"(WandbLogger(init_timeout_s=N)), below the strategy timeout; or set WANDB_MODE=offline to run "
            f"offline from the start")
        return run

    def _settings(self, seconds: float) -> Any:
        """``wandb.Settings`` with wandb's own waits at ``seconds`` each, under the user's ``settings`` (kept)."""
        import wandb

        settings = wandb.Settings(init_timeout=seconds, x_service_wait=seconds)
        given = self._wandb_init.get("settings")
        if isinstance(given, wandb.Settings):
            settings.update_from_settings(given)
        elif given:
            settings.update_from_dict(dict(given))
        return settings

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        step = self.history_step if self.history_step is not None else step
        if step is None or self._wandb_init.get("sync_tensorboard"):
            self._to_service(lambda: super(WandbLogger, self).log_metrics(metrics, step))
            return
        if self._prefix:  # as Lightning's logger names them
            metrics = {f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}": v for k, v in metrics.items()}
        self._to_service(lambda: self.experiment.log(dict(metrics, **{"trainer/global_step": step}), step=step))

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        self._to_service(lambda: super(WandbLogger, self).log_hyperparams(params))

    @override
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        # log_model: the checkpoints uploaded as artifacts
        self._to_service(lambda: super(WandbLogger, self).after_save_checkpoint(checkpoint_callback))

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        self._to_service(lambda: super(WandbLogger, self).finalize(status))

    def _to_service(self, call: Callable[[], Any]) -> None:
        """``call()``, a call to W&B's service; nothing once the service is lost (:meth:`_lose_service`)."""
        if self._service_lost is not None:
            return
        try:
            call()
        except ConnectionError as error:
            self._lose_service(error)

    def _lose_service(self, error: ConnectionError) -> None:
        """W&B's service process (``wandb-core``) is gone: the job's stop signal reached it too (SLURM's time limit
        and ``scancel`` signal every process of the job; Kubernetes ends the pod's processes), or it crashed. Every
        call to the run then raises ``ConnectionResetError``, and one from ``log_metrics`` ended the training step:
        the rank died before its stop checkpoint was saved. Said once; the run goes on without W&B (its CSV log and
        checkpoints do not depend on it), and W&B's library state is released so that its exit hook does not
        raise again and no later logger reuses the run."""
        import wandb

        self._service_lost = f"{type(error).__name__}: {error}"
        rank_zero_warn(f"W&B: the W&B service stopped answering ({self._service_lost}): the job's stop signal reached "
                       f"it too, or it crashed. This run logs no more to W&B and goes on (its CSV log and checkpoints "
                       f"do not depend on W&B); what W&B wrote until now is in {self.save_dir or 'wandb'}/")
        try:
            wandb.teardown()
        except Exception:  # noqa: BLE001 - the service is gone: its teardown fails the same way
            pass
        if wandb.run is self._experiment:  # no later logger reuses a run that cannot log (wandb.finish's own step)
            from wandb.sdk.lib import module

            module.unset_globals()


def _has_segments(init: dict[str, Any]) -> bool:
    """Whether the W&B folder of ``wandb.init(**init)`` holds a segment of the run it names (``id``): a
    ``resume="allow"`` that falls back to offline is then a resume (the CLI passes it online when it continues
    a checkpoint's run), which only the server could have said."""
    run_id = init.get("id")
    folder = Path(init.get("dir") or os.environ.get("WANDB_DIR") or ".") / "wandb"
    stamp = "run-" + "[0-9]" * 8 + "_" + "[0-9]" * 6  # run-YYYYMMDD_HHMMSS-<id>[-N]: not another id ending in it
    return bool(run_id) and any(any(folder.glob(f"*{stamp}-{run_id}{tail}")) for tail in ("", "-[0-9]*"))


def _setting(settings: Any, name: str) -> Any:
    """A field of the user's ``settings`` (a ``wandb.Settings`` or a mapping) when they set it, else None."""
    if settings is None:
        return None
    if isinstance(settings, Mapping):
        return settings.get(name)
    import wandb

    given = isinstance(settings, wandb.Settings) and name in settings.model_fields_set
    return getattr(settings, name) if given else None


class _StillRunning(TimeoutError):
    """A call :func:`_call_within` stopped waiting for."""


def _call_within(fn: Callable[[], Any], seconds: float, late: Callable[[Any], Any] | None = None) -> Any:
    """``fn()`` in a daemon thread, waited for at most ``seconds``: its result, or the exception it raised;
    :class:`_StillRunning` when it is still running then (it is left running, and ``late`` is called on
    the result it returns after that)."""
    outcome: dict[str, Any] = {}
    lock = threading.Lock()

    def call() -> None:
        try:
            result = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            with lock:
                outcome["error"] = error
            return
        with lock:
            outcome["result"] = result
            too_late = outcome.get("gave_up", False)
        if too_late and late is not None:
            late(result)

    seconds = max(seconds, 0.0)
    thread = threading.Thread(target=call, name="wandb-init", daemon=True)
    thread.start()
    thread.join(seconds)
    with lock:
        if "result" not in outcome and "error" not in outcome:
            outcome["gave_up"] = True
            raise _StillRunning(f"did not finish within {seconds:.3g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _failure(error: BaseException) -> str:
    """What happened to an attempt, for the messages: how long it ran, else its error's first line."""
    if isinstance(error, _StillRunning):
        return str(error)
    lines = str(error).strip().splitlines()
    return f"failed ({type(error).__name__}: {lines[0]})" if lines else f"failed ({type(error).__name__})"


def run_config(trainer: Any, model: Any) -> dict[str, Any]:
    """Trainer, strategy, layout, precision, the lr schedule, clipping and loss scaling: what the W&B config
    shows next to the module's hyper-parameters (the optimizer's among them: Lightning logs them itself, at the
    top level) and the command's whole configuration (``recipe``, logged by the CLI). Logged at set-up and again
    when training starts, with what the run then uses: the micro batch read from the data, the lr schedule
    resolved for the run (and at a resume the checkpoint's)."""
    from lightning_megatron.callbacks import MegatronOptimizerCallback, OptimizerParamSchedulerCallback
    from lightning_megatron.strategy import MegatronStrategy

    strategy = trainer.strategy
    run = {"trainer": {"max_steps": trainer.max_steps, "precision": str(trainer.precision),
                       "devices": trainer.num_devices, "num_nodes": trainer.num_nodes,
                       "accelerator": type(trainer.accelerator).__name__},
           "strategy": type(strategy).__name__}
    if isinstance(strategy, MegatronStrategy):
        dims = strategy.parallel_dims  # Megatron's names, as the recipe writes them
        sizes = strategy.batch_sizes  # resolved in the strategy's set-up (after the callbacks' setup)
        run["layout"] = {"name": dims.name, **dims.strategy_kwargs(), "data_parallel_size": dims.dp,
                         "use_distributed_optimizer": dims.zero1,
                         "micro_batch_size": sizes.micro_batch_size if sizes else strategy.micro_batch_size}
    for callback in trainer.callbacks:  # the lr schedule, clipping and loss scaling: the settings each declares
        if isinstance(callback, OptimizerParamSchedulerCallback):
            run["lr_schedule"] = callback.used_settings()
        elif isinstance(callback, MegatronOptimizerCallback):
            run["megatron_optimizer"] = callback.run_settings()
    return run


def _wandb_loggers(trainer: Any) -> list[Any]:
    """The trainer's WandbLoggers that write a W&B run (not one started with ``mode="disabled"`` or under
    ``WANDB_MODE=disabled``: W&B's no-op run has an id of its own that names nothing)."""
    found = []
    for logger in trainer.loggers:
        if not isinstance(logger, loggers.WandbLogger):
            continue
        run = logger._experiment
        mode = (getattr(run.settings, "mode", None) if run is not None
                else logger._wandb_init.get("mode") or os.environ.get("WANDB_MODE"))
        if mode != "disabled":
            found.append(logger)
    return found


class WandbRunIdCallback(Callback):
    """Writes the run id of the trainer's ``WandbLogger`` into every checkpoint (``checkpoint["wandb_run_id"]``;
    none when W&B is disabled), and :func:`run_config` into its config at set-up (on rank 0, after the launch:
    the W&B run no longer starts in the launching process before the other ranks are started) and again when
    training starts (what the run then uses)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._log_run_config(trainer, pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._log_run_config(trainer, pl_module)  # after the strategy's set-up and the checkpoint's restore

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.state.fn != "fit":  # validate: after the strategy's set-up (the micro batch)
            self._log_run_config(trainer, pl_module)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._log_run_config(trainer, pl_module)

    @staticmethod
    def _log_run_config(trainer: Any, pl_module: Any) -> None:
        # not into a training run an evaluation joins (--log_to_training_run): its config stays the training's
        wandb = [lg for lg in trainer.loggers if isinstance(lg, loggers.WandbLogger)
                 and getattr(lg, "history_step", None) is None]
        if wandb:
            config = run_config(trainer, pl_module)
            for logger in wandb:
                logger.log_hyperparams(config)  # rank zero only; a value logged before is replaced

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        for logger in _wandb_loggers(trainer):
            if logger.version:
                checkpoint[WANDB_RUN_ID] = str(logger.version)


_FORGE_HOSTS = {"forge.coreweave.com": "api.wandb.ai", "qa.forge.coreweave.com": "api.qa.wandb.ai"}
"""wandb's CoreWeave Forge hosts and the W&B API host behind each (``wandb.sdk.lib.urls.FORGE_HOSTS``): a key
for either is the other's."""
_DEFAULT_HOSTS = ("api.forge.coreweave.com", "api.wandb.ai")
"""The server of ``wandb login`` without ``--host``: api.forge.coreweave.com since wandb 0.31, api.wandb.ai before."""


def _wandb_hosts() -> tuple[str, ...]:
    """The netrc machines wandb would read a key from: its server's host (with its port: ``localhost:8080``) from
    ``WANDB_BASE_URL``, else the ``base_url`` that ``wandb login --host`` keeps in W&B's settings file, else the
    default; a Forge proxy address (``https://forge.coreweave.com/api/wandb``) as wandb rewrites it, and for a
    Forge host the W&B API host behind it."""
    import configparser
    from urllib.parse import urlsplit

    url = os.environ.get("WANDB_BASE_URL")
    if not url:
        settings = configparser.ConfigParser()
        folder = os.environ.get("WANDB_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".config", "wandb")
        try:
            settings.read(os.path.join(folder, "settings"))
            url = settings.get("default", "base_url", fallback=None)
        except (configparser.Error, OSError, UnicodeDecodeError):
            url = None
    if not url:
        return _DEFAULT_HOSTS
    parts = urlsplit(url)
    machine = parts.netloc.rpartition("@")[2]
    if parts.hostname in _FORGE_HOSTS and parts.path.rstrip("/") == "/api/wandb":  # the proxy: its api. host
        machine = f"api.{parts.hostname}"
    host = machine.partition(":")[0]
    upstream = [api for forge, api in _FORGE_HOSTS.items() if host in (forge, f"api.{forge}", api)]
    return tuple(dict.fromkeys([machine, *upstream]))


def wandb_credentials() -> str | None:
    """Where W&B would take its credentials from, as ``wandb`` looks for them (without importing it):
    ``WANDB_API_KEY`` or ``WANDB_IDENTITY_TOKEN_FILE``, else the netrc entry (``$NETRC``, ``~/.netrc`` or
    ``~/_netrc``) of the W&B server that ``wandb login`` writes (:func:`_wandb_hosts`). None when there are
    none: a run would have to be offline."""
    import netrc

    for variable in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if os.environ.get(variable):
            return variable
    path = os.environ.get("NETRC") or next(  # the one file wandb reads
        (p for p in (os.path.expanduser("~/.netrc"), os.path.expanduser("~/_netrc")) if os.path.exists(p)), None)
    if path is None or not os.path.isfile(os.path.expanduser(path)):
        return None
    path = os.path.expanduser(path)
    try:
        entries = netrc.netrc(path)
    except (netrc.NetrcParseError, OSError):
        return None  # wandb reports an unreadable file itself
    for host in _wandb_hosts():
        entry = entries.authenticators(host)
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
