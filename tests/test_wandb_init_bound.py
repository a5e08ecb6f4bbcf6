"""``WandbLogger(init_timeout_s=...)``: a ``wandb.init`` that hangs or fails on rank 0 never keeps the other ranks
waiting at the barrier past the bound. Each test starts a real W&B run in ``tmp_path`` (``WANDB_SILENT``) and
makes its start hang or fail by a real means: the W&B service start wedged once (its launch blocks, as a
wandb-core that never writes its port file), or a W&B server that accepts connections and never answers. The
run continues offline within the bound, as the same run, with one warning naming the bound and the fix; a
fallback that hangs too is an error within the bound; a bound the strategy's barrier would outlast is refused
before launch.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import wandb
from wandb.sdk.lib.service import service_process

from lightning_megatron.cli import main
from lightning_megatron.loggers import WandbLogger
from wandb_records import offline_runs

ROOT = Path(__file__).resolve().parents[1]
SLACK_S = 2.0
"""Past the bound: the thread switches and the warning of a loaded 2-core machine."""


@pytest.fixture
def wandb_env(tmp_path, monkeypatch) -> Path:
    """A W&B run folder in ``tmp_path``, W&B quiet; the library torn down before the test (a fresh service) and
    after it, once the W&B starts the test left behind have ended (a late one would otherwise start its run in
    a later test)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for variable in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_SERVICE"):
        monkeypatch.delenv(variable, raising=False)
    wandb.teardown()  # a service an earlier test of this process left running would start no new one
    yield tmp_path
    _join_wandb_threads()
    wandb.teardown()


def _join_wandb_threads(seconds: float = 60.0) -> None:
    """Waits for the threads WandbLogger starts (``wandb-start``, ``wandb-init``, ``wandb-teardown``)."""
    deadline = time.monotonic() + seconds
    for thread in threading.enumerate():
        if thread.name in ("wandb-start", "wandb-init", "wandb-teardown"):
            thread.join(max(deadline - time.monotonic(), 0.0))


class Wedge:
    """The W&B service launch blocks the first ``times`` times; :meth:`release` ends the blocked ones: they fail,
    or launch as usual when ``launch_when_released``."""

    def __init__(self) -> None:
        self.times, self.launch_when_released = 1, False
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()


@pytest.fixture
def wedged_service_start(monkeypatch):
    """A :class:`Wedge` on the W&B service launch (as a wandb-core that never reports its port); released after
    the test at the latest."""
    launch = service_process._launch_server
    wedge = Wedge()

    def blocking_launch(*args, **kwargs):
        if wedge.times > 0:
            wedge.times -= 1
            wedge._released.wait(600)
            if not wedge.launch_when_released:
                raise OSError("the wedged service start was released by the test")
        return launch(*args, **kwargs)

    monkeypatch.setattr(service_process, "_launch_server", blocking_launch)
    yield wedge
    wedge.release()  # their wandb.init ends (with the error) before the library is torn down (wandb_env)


def _experiment_timed(logger: WandbLogger):
    start = time.monotonic()
    run = logger.experiment
    return run, time.monotonic() - start


def test_wedged_service_start_continues_offline_within_the_bound(wandb_env, wedged_service_start):
    # 20 s: the offline fallback gets the last quarter, 5 s, to start a second W&B service (over 2 s on a loaded
    # 2-core machine)
    logger = WandbLogger(project="bound", save_dir=str(wandb_env), init_timeout_s=20)
    with pytest.warns(UserWarning, match=r"init_timeout_s=20\b") as caught:
        run, seconds = _experiment_timed(logger)
    assert seconds < 20 + SLACK_S, seconds
    [warning] = [str(w.message) for w in caught if "init_timeout_s" in str(w.message)]
    folder = run.settings.sync_dir
    assert run.settings.mode == "offline" and Path(folder).parent == wandb_env / "wandb", folder
    assert "did not finish within 15 s" in warning, warning  # the first attempt's three quarters
    for text in (f"run {run.id} in {folder}", f"`wandb sync {folder}`", "--trainer.logger.init_args.init_timeout_s N",
                 "WANDB_MODE=offline"):
        assert text in warning, warning
    assert logger.version == run.id  # the run the checkpoints name

    logger.log_metrics({"loss": 2.5}, step=3)  # the run logs as a started one does
    run.finish()
    runs = {r.folder: r for r in offline_runs(wandb_env / "wandb")}
    saved = runs.pop(Path(folder))  # the folder the warning names holds the run; the stuck attempt's, nothing
    assert saved.run_id == run.id and saved.steps == [3] and saved.history[0]["loss"] == 2.5
    assert not saved.resumed  # a new run (no earlier segment of its id here): synced as one
    assert all(not r.run_id and not r.history for r in runs.values()), runs


def test_unanswered_server_continues_offline_as_the_same_run(wandb_env, monkeypatch):
    """Online, a server that never answers: wandb's own init timeout (the user's 2 s, kept under the bound) ends
    the attempt with its error, well inside the first attempt's 9 s even on a loaded machine (the W&B service
    start comes before it: at half the bound, 6 s, it lost that race on a loaded CI runner), and the run
    continues offline with the id it was given and the user's settings, as a resume of that id's earlier
    segment."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)  # connections are accepted by the kernel, and never answered
    earlier = WandbLogger(project="bound", save_dir=str(wandb_env), id="boundrun1")  # the run's first segment
    earlier.log_metrics({"loss": 3.0}, step=1)
    earlier.experiment.finish()
    wandb.teardown()  # W&B reads WANDB_MODE once, at its set-up
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    logger = WandbLogger(project="bound", save_dir=str(wandb_env), id="boundrun1", init_timeout_s=12,
                         settings={"console": "off", "init_timeout": 2})
    try:
        with pytest.warns(UserWarning, match=r"init_timeout_s=12\b") as caught:
            run, seconds = _experiment_timed(logger)
    finally:
        server.close()
    assert seconds < 12 + SLACK_S, seconds
    [warning] = [str(w.message) for w in caught if "init_timeout_s" in str(w.message)]
    assert "wandb.init failed (CommError: " in warning and "deadline exceeded" in warning, warning  # wandb's own
    assert run.id == "boundrun1" and run.settings.mode == "offline" and run.settings.console == "off"
    run.finish()
    # the run had a segment here (the CLI passes resume="allow" online when it continues a checkpoint's run): the
    # fallback records a resume too, else a sync would take the offline segment for a new run of that id
    first, fallback = [r for r in offline_runs(wandb_env / "wandb") if r.run_id]
    assert (first.run_id, first.resumed, first.steps) == ("boundrun1", False, [1]), first
    assert (fallback.run_id, fallback.resume, fallback.resumed) == ("boundrun1", True, True), fallback


def test_fallback_that_hangs_too_is_an_error_within_the_bound(wandb_env, wedged_service_start):
    """Both starts hang: an error within the bound. When they end after it, each run they still start is finished
    at once, so that no run of theirs is left as the process's ``wandb.run``."""
    wedged_service_start.times = 2  # the offline start hangs as well
    logger = WandbLogger(project="bound", save_dir=str(wandb_env), init_timeout_s=2)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        logger.experiment
    assert time.monotonic() - start < 2 + SLACK_S
    message = str(error.value)
    for text in ("wandb.init did not finish within 1.5 s", "the offline run it fell back to did not finish",
                 "init_timeout_s=2", "WANDB_MODE=disabled", "--trainer.logger.init_args.init_timeout_s N"):
        assert text in message, message

    wedged_service_start.launch_when_released = True
    wedged_service_start.release()  # both starts go on now, late
    _join_wandb_threads()
    late = [r for r in offline_runs(wandb_env / "wandb") if r.run_id]
    assert late and all(r.exited for r in late) and wandb.run is None, (late, wandb.run)  # started late, finished


def test_user_settings_are_kept_under_the_bound(wandb_env):
    with pytest.warns(UserWarning, match="settings x_service_wait=90 has no effect past init_timeout_s=30"):
        logger = WandbLogger(project="bound", save_dir=str(wandb_env), init_timeout_s=30,
                             settings=wandb.Settings(init_timeout=20, x_service_wait=90, console="off"))
    run = logger.experiment
    assert (run.settings.init_timeout, run.settings.x_service_wait, run.settings.console) == (20, 90, "off")
    run.finish()
    run = WandbLogger(project="bound", save_dir=str(wandb_env), init_timeout_s=30).experiment
    assert (run.settings.init_timeout, run.settings.x_service_wait) == (15, 15)  # half the bound each
    run.finish()


@pytest.mark.parametrize("bound", [0, -5, float("nan"), float("inf")], ids=["zero", "negative", "nan", "inf"])
def test_bound_that_is_not_a_positive_number_is_refused(bound):
    with pytest.raises(ValueError, match=rf"WandbLogger init_timeout_s={bound!r} must be a number of seconds above 0"):
        WandbLogger(project="bound", init_timeout_s=bound)


def test_bound_the_barrier_would_outlast_is_refused_before_launch(tmp_path, monkeypatch):
    """The recipes' WandbLogger (default bound 60 s) against a 30-second strategy timeout, through the CLI."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--trainer.default_root_dir", str(run),
              "--trainer.strategy.init_args.timeout", "30"])
    message = str(exited.value.code)
    assert "1 configuration problem(s), found before launching any process" in message, message
    assert ("WandbLogger init_timeout_s=60 is not below the strategy timeout=30 s" in message
            and "--trainer.logger.init_args.init_timeout_s N" in message), message
    assert not dist.is_initialized() and not run.exists()  # nothing launched, nothing written


def test_rank_zero_starts_wandb_while_the_ranks_meet(wandb_env):
    """MegatronStrategy starts rank 0's W&B run in the background as soon as the ranks are known, before the
    rendezvous waits for the other ranks; the run Lightning's set-up hook then gets is that one. Another rank
    starts nothing."""
    from lightning.pytorch import Trainer

    from lightning_megatron.models.bert import BertConfig
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy
    from megatron_testing import TINY_CONFIG, TINY_OPTIONS

    def trainer_with_logger() -> tuple[MegatronStrategy, WandbLogger]:
        logger = WandbLogger(project="bound", save_dir=str(wandb_env), init_timeout_s=20)
        strategy = MegatronStrategy()
        trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=logger, enable_progress_bar=False)
        module = BertLightningModule(BertConfig(**TINY_CONFIG), **TINY_OPTIONS)
        module.trainer = trainer
        strategy.connect(module)
        return strategy, logger

    strategy, logger = trainer_with_logger()
    with pytest.MonkeyPatch.context() as rank_one:
        rank_one.setattr(MegatronStrategy, "global_rank", property(lambda self: 1))
        strategy.set_world_ranks()
    assert logger._starting is None and wandb.run is None  # not rank 0: nothing started

    strategy, logger = trainer_with_logger()
    strategy.set_world_ranks()  # rank 0: started, and set_world_ranks returned without waiting for it
    assert logger._starting is not None and logger._starting[0].name == "wandb-start"
    run = logger.experiment  # what Lightning's set-up hook does first: waits for the run started above
    assert logger._starting is None and run is wandb.run and logger.version == run.id
    assert run.settings.mode == "offline" and Path(run.settings.sync_dir).parent == wandb_env / "wandb"
    logger.log_metrics({"loss": 1.5}, step=2)
    run.finish()
    [saved] = [r for r in offline_runs(wandb_env / "wandb") if r.run_id]
    assert saved.run_id == run.id and saved.steps == [2]


@pytest.mark.parametrize("machine, base_url, settings_url, found", [
    ("api.forge.coreweave.com", None, None, True),  # `wandb login` since wandb 0.31: its default server
    ("api.wandb.ai", None, None, True),  # `wandb login` before it
    ("wandb.example.com", None, None, False),  # another server's key: not W&B's
    ("wandb.example.com", "https://wandb.example.com", None, True),  # WANDB_BASE_URL
    ("api.wandb.ai", "https://wandb.example.com", None, False),
    ("wandb.example.com", None, "https://wandb.example.com", True),  # `wandb login --host`: its settings file
    ("api.forge.coreweave.com", "https://forge.coreweave.com/api/wandb", None, True),  # the Forge proxy address
    ("localhost:8080", "http://localhost:8080", None, True),  # a server of your own, on a port
], ids=["forge", "wandb-ai", "other-host", "base-url", "base-url-elsewhere", "login-host", "forge-proxy", "port"])
def test_credentials_are_found_where_wandb_finds_them(tmp_path, monkeypatch, machine, base_url, settings_url, found):
    """The CLI runs W&B offline (and says so) when it finds no credentials: it must find the ones wandb uses, else
    a user who ran `wandb login` never uploads. wandb 0.31 logs in to api.forge.coreweave.com by default and
    reads its key from the netrc under that host or the api.wandb.ai behind it; `wandb login --host` keeps the
    server in W&B's settings file. Each case against wandb's own reading of the same files."""
    from wandb.sdk.lib import urls
    from wandb.sdk.lib.wbauth import wbnetrc

    from lightning_megatron.loggers import wandb_credentials

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    for variable in ("NETRC", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(variable, raising=False)
    if base_url:
        monkeypatch.setenv("WANDB_BASE_URL", base_url)
    if settings_url:
        (tmp_path / "wandb-config").mkdir()
        (tmp_path / "wandb-config" / "settings").write_text(f"[default]\nbase_url = {settings_url}\n")
    netrc = tmp_path / ".netrc"
    netrc.write_text(f"machine {machine}\n  login user\n  password {'0' * 40}\n")
    netrc.chmod(0o600)
    server = urls.normalize_forge_base_url(base_url or settings_url or urls.DEFAULT_BASE_URL)  # as wandb reads it
    assert (wbnetrc.read_netrc_auth(host=server) is not None) == found, (machine, server)  # wandb's own reading
    ours = wandb_credentials()
    assert (ours is not None) == found, (ours, machine, server)
    if found:
        assert ours == f"{netrc} ({machine})", ours


def test_a_run_with_wandb_disabled_names_no_wandb_run_in_its_checkpoints(wandb_env, monkeypatch):
    """WANDB_MODE=disabled (or mode="disabled") starts no W&B run: its checkpoints name none, so that a resume
    with W&B on starts a run of its own instead of "continuing" one that never existed, from the middle."""
    from types import SimpleNamespace

    from lightning_megatron.loggers import WANDB_RUN_ID, WandbRunIdCallback

    for mode, given in (("offline", {"mode": "disabled"}), ("disabled", {}), ("offline", {})):
        monkeypatch.setenv("WANDB_MODE", mode)
        wandb.teardown()  # W&B reads WANDB_MODE once, at its set-up
        logger = WandbLogger(project="bound", save_dir=str(wandb_env), **given)
        run = logger.experiment  # started, as Lightning does at set-up
        checkpoint: dict = {}
        WandbRunIdCallback().on_save_checkpoint(SimpleNamespace(loggers=[logger]), None, checkpoint)
        disabled = "disabled" in (mode, given.get("mode"))
        assert checkpoint.get(WANDB_RUN_ID) == (None if disabled else run.id), (mode, given, checkpoint)
        run.finish()


def test_an_evaluation_joining_the_training_run_leaves_its_config(wandb_env):
    """``validate --log_to_training_run true`` logs into the training run's history (``history_step``): its own
    configuration (another command's layout, schedule) must not replace the training run's config."""
    from types import SimpleNamespace

    from lightning_megatron.loggers import WandbRunIdCallback

    logged = []
    joined, own = (WandbLogger(project="bound", save_dir=str(wandb_env), history_step=step) for step in (7, None))
    for logger in (joined, own):
        logger.log_hyperparams = lambda params, logger=logger: logged.append((logger, params))
    trainer = SimpleNamespace(loggers=[joined, own], strategy=None, callbacks=[], max_steps=5, precision="32-true",
                              num_devices=1, num_nodes=1, accelerator=None)
    WandbRunIdCallback().setup(trainer, None, "validate")
    assert [logger for logger, _ in logged] == [own], logged


def test_a_wandb_service_gone_ends_wandb_not_the_run(wandb_env):
    """W&B's service process (``wandb-core``) ended by the job's stop signal (SLURM signals every process of the job)
    or a crash: every call to the run raised ``ConnectionResetError``, from ``log_metrics`` (the next step), from a
    ``ModelCheckpoint`` save's ``after_save_checkpoint`` (``log_model="all"`` uploads each checkpoint) and from
    ``finalize``. Said once; the run goes on without W&B. (A 2-rank run killed this way saves and exits 143:
    tests/test_reliability_sigterm.py.)"""
    import os
    import signal
    import warnings

    import psutil
    from lightning.pytorch.callbacks import ModelCheckpoint

    logger = WandbLogger(project="bound", save_dir=str(wandb_env), log_model="all")
    logger.experiment  # started
    logger.log_metrics({"loss": 1.0}, step=1)
    services = [p for p in psutil.Process().children(recursive=True) if "wandb-core" in " ".join(p.cmdline())]
    for service in services:  # this test's, and any an earlier test of this process left running
        service.send_signal(signal.SIGTERM)
        service.wait(30)
    assert services
    checkpoint = ModelCheckpoint(dirpath=wandb_env / "ckpt")
    (wandb_env / "ckpt").mkdir()
    checkpoint.last_model_path = str(wandb_env / "ckpt" / "last.ckpt")
    (wandb_env / "ckpt" / "last.ckpt").write_bytes(b"a checkpoint")
    with pytest.warns(UserWarning, match=r"W&B: the W&B service stopped answering \(ConnectionResetError"):
        logger.after_save_checkpoint(checkpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        logger.log_metrics({"loss": 0.5}, step=2)
        logger.log_hyperparams({"lr": 1e-3})
        logger.finalize("success")
    assert os.path.isdir(wandb_env / "wandb")
