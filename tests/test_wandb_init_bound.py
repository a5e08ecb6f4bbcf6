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
    after it (its runs finished)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for variable in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_SERVICE"):
        monkeypatch.delenv(variable, raising=False)
    wandb.teardown()  # a service an earlier test of this process left running would start no new one
    yield tmp_path
    wandb.teardown()


@pytest.fixture
def wedged_service_start(monkeypatch):
    """The W&B service launch blocks (as a wandb-core that never reports its port) the first ``wedged[0]``
    times (1 unless the test says more), then launches as usual; the blocked ones are released (and fail)
    after the test."""
    launch = service_process._launch_server
    release = threading.Event()
    wedged, stuck = [1], []

    def blocking_launch(*args, **kwargs):
        if wedged[0] > 0:
            wedged[0] -= 1
            stuck.append(threading.current_thread())
            release.wait(600)
            raise OSError("the wedged service start was released by the test")
        return launch(*args, **kwargs)

    monkeypatch.setattr(service_process, "_launch_server", blocking_launch)
    yield wedged
    release.set()
    for thread in stuck:  # their wandb.init ends (with the error) before the library is torn down
        thread.join(30)


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
    assert all(not r.run_id and not r.history for r in runs.values()), runs


def test_unanswered_server_continues_offline_as_the_same_run(wandb_env, monkeypatch):
    """Online, a server that never answers: wandb's own init timeout (half the bound, passed in its settings
    under the user's) ends the attempt with its error, and the run continues offline with the id it was given
    (in the other half: 6 s)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)  # connections are accepted by the kernel, and never answered
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    logger = WandbLogger(project="bound", save_dir=str(wandb_env), id="boundrun1", init_timeout_s=12,
                         settings={"console": "off"})
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


def test_fallback_that_hangs_too_is_an_error_within_the_bound(wandb_env, wedged_service_start):
    wedged_service_start[0] = 2  # the offline start hangs as well
    logger = WandbLogger(project="bound", save_dir=str(wandb_env), init_timeout_s=2)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        logger.experiment
    assert time.monotonic() - start < 2 + SLACK_S
    message = str(error.value)
    for text in ("wandb.init did not finish within 1.5 s", "the offline run it fell back to did not finish",
                 "init_timeout_s=2", "WANDB_MODE=disabled", "--trainer.logger.init_args.init_timeout_s N"):
        assert text in message, message


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
