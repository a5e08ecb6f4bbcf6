"""One run folder (trainer.default_root_dir) for CSV, W&B and checkpoints; validate/test of a checkpoint
continue the W&B run that wrote it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from dist_utils import run_python

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "bert_tiny.yaml")


def _build_worker(*extras: list[str]) -> list[dict]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_megatron.cli_lightning import lightning_cli

    built = []
    for extra in extras:
        cli = lightning_cli(run=False, args=["--config", RECIPE, "--trainer.accelerator", "cpu", *extra])
        loggers = {type(lg).__name__: os.path.abspath(lg.save_dir) for lg in cli.trainer.loggers}
        [csv] = [lg for lg in cli.trainer.loggers if type(lg).__name__ == "CSVLogger"]
        [ckpt] = [c for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint)]
        [wandb] = [lg for lg in cli.trainer.loggers if type(lg).__name__ == "WandbLogger"]
        built.append({"loggers": loggers, "csv_log_dir": os.path.abspath(csv.log_dir),
                      "checkpoints": os.path.abspath(ckpt.dirpath), "wandb_name": wandb._wandb_init.get("name")})
    return built


def _login_worker(home: str, *extras: list[str]) -> tuple[list[dict], list[tuple]]:
    """The W&B mode the CLI chooses after `wandb login` (a ~/.netrc entry, no WANDB_API_KEY) and without
    it, then :func:`_build_worker` of ``extras``."""
    import warnings

    from lightning_megatron.cli_lightning import lightning_cli

    os.environ["HOME"] = home
    for variable in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE"):
        os.environ.pop(variable, None)
    modes = []
    for logged_in in (True, False):
        netrc = Path(home) / ".netrc"
        if logged_in:
            netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")
            netrc.chmod(0o600)
        else:
            netrc.unlink()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lightning_cli(run=False, args=["--config", RECIPE, "--trainer.accelerator", "cpu"])
        modes.append((os.environ.pop("WANDB_MODE", None), " ".join(str(w.message) for w in caught)))
    return _build_worker(*extras), modes


def test_default_root_dir_moves_logs_and_checkpoints(tmp_path):
    from dist_utils import run_distributed

    for recipe in (ROOT / "recipes").glob("[!_]*.yaml"):  # each recipe names its run folder once (_*: bases)
        assert len(re.findall(r"\bruns/\w+\b(?!/checkpoints/last)", recipe.read_text())) == 1, recipe.name
    root = str(tmp_path / "x")
    explicit = str(tmp_path / "elsewhere")
    home = tmp_path / "home"
    home.mkdir()
    [([moved, kept], modes)] = run_distributed(_login_worker, 1, str(home), ["--trainer.default_root_dir", root], [
        "--trainer.default_root_dir", root, "--trainer.logger",
        '[{"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"save_dir": "%s"}},'
        ' {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "%s"}}]'
        % (explicit, explicit)], timeout=180)
    # after `wandb login` (its ~/.netrc entry) W&B stays online; without credentials: offline, said loudly
    (online, online_warnings), (offline, offline_warnings) = modes
    assert online is None and "W&B" not in online_warnings, modes
    assert offline == "offline" and "W&B: no credentials" in offline_warnings and "wandb sync" in offline_warnings
    assert moved["loggers"] == {"CSVLogger": root, "WandbLogger": root}
    assert moved["csv_log_dir"].startswith(os.path.join(root, "csv", "version_"))
    assert moved["checkpoints"] == os.path.join(root, "checkpoints")
    assert moved["wandb_name"] == "x"  # the W&B run is named after the run folder
    assert kept["loggers"] == {"CSVLogger": explicit, "WandbLogger": explicit}  # explicit values win


def _cli(tmp: Path, command: str, *args: str, root: str = "run", status: int = 0, columns: int | None = None,
         fresh: bool = False) -> subprocess.CompletedProcess:
    """``lightning-megatron COMMAND`` of a 1-layer bert_tiny on one process in ``tmp/root``, which must
    exit with ``status``; ``tests/`` is on the PYTHONPATH (the faults of ``cli_faults``). Its output is
    not a terminal (a pipe, as under nohup or SLURM), or with ``columns`` a terminal of that width (a
    pseudo-terminal: Rich draws the live bar). It runs from the forkserver (``run_python``), or with ``fresh``
    or ``columns`` as the installed ``lightning-megatron`` (a new interpreter, which prints what importing torch
    and Lightning prints)."""
    installed = os.path.join(os.path.dirname(sys.executable), "lightning-megatron")  # the console script
    cmd = [sys.executable, "-m", "lightning_megatron.cli"] if columns is None and not fresh else [installed]
    cmd += [command, "--config", RECIPE,
           "--trainer.devices", "1", "--trainer.strategy.tensor_model_parallel_size", "1",
           "--trainer.strategy.cpu_tuning", "false", "--trainer.default_root_dir", str(tmp / root),
           "--trainer.enable_progress_bar", "false", "--model.config.num_layers", "1",
           "--model.config.hidden_size", "32", "--model.config.num_attention_heads", "2",
           "--model.config.ffn_hidden_size", "64", "--data.global_batch_size", "2", "--data.micro_batch_size", "2",
           "--data.max_seq_length", "32", "--model.config.max_sequence_length", "32", *args]
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=path)
    if columns is None and not fresh:
        proc = run_python(cmd[1:], tmp, env, timeout=600)
    elif columns is None:
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    else:
        proc = _in_terminal(cmd, tmp, dict(env, COLUMNS=str(columns), LINES="24", TERM="xterm"))
    assert proc.returncode == status, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _in_terminal(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``cmd`` with its stdout on a pseudo-terminal (read as it comes), its stderr on a pipe."""
    import pty
    import threading

    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the other end closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    stderr = proc.stderr.read().decode(errors="replace")
    proc.wait(timeout=600)
    reader.join()
    os.close(master)
    return subprocess.CompletedProcess(cmd, proc.returncode, b"".join(chunks).decode(errors="replace"), stderr)


_NOISE = ("anonymous setting", "💡 Tip", "LeafSpec", "args parameter")
"""What dependencies printed on every run, asking nothing of the user (issue 34)."""


def test_resume_continues_the_wandb_history_and_validate_logs_beside_it(tmp_path):
    """fit writes its W&B run id into the checkpoint; a resumed fit continues that run: the same id, recorded
    as resumed, its history at the trainer's steps (not from 0 again); validate of the checkpoint logs into
    a W&B run of its own grouped with it and into csv/validate/, not into the training run. Each logs the
    trainer, strategy, layout and precision into the W&B config. Output redirected, fit prints a plain line
    per logged step; on an 80-column terminal the resumed fit's bar stays within 2 lines. The checkpoint is
    left as a crash between the two renames of a file system without an exchange rename leaves it
    (last.ckpt.tmp-<id>, no last.ckpt), with its checksums removed: ``--ckpt_path last
    --allow-unverified-checkpoint`` finds it and loads it, saying so."""
    import json
    import re

    import torch
    from wandb_records import offline_runs

    first = _cli(tmp_path, "fit", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0",
                 "--lr_schedule.lr_warmup_steps", "0", "--trainer.log_every_n_steps", "1",
                 "--trainer.enable_progress_bar", "true", "--ckpt_path", "last", fresh=True)
    # `last` with no checkpoint yet (a job script that always passes it): a new run, said in our words (Lightning's
    # hint was to set ModelCheckpoint(save_last=True), which the recipe does)
    assert (f"lightning-megatron: --ckpt_path last: no last checkpoint in {tmp_path / 'run' / 'checkpoints'} yet: "
            f"a new run from step 0\n") in first.stdout and "save_last" not in first.stderr, first.stderr[-3000:]
    # Not a terminal: a plain line per logged step, with the step, loss, lr, throughput and MFU
    lines = [line for line in first.stdout.splitlines() if line.startswith("Step ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"], first.stdout[-3000:]
    assert re.fullmatch(r"Step 2/2 loss \d+\.\d{4} lr \S+ tok/s \S+ mfu [\d.]+%!? \d:\d\d:\d\d elapsed, "
                        r"0:00:00 left", lines[-1]), lines
    assert not [n for n in _NOISE if n in first.stderr], first.stderr[-3000:]
    # the configuration the run saved holds the run folder's paths as given (derived from default_root_dir), so
    # that it runs again elsewhere with --trainer.default_root_dir moving all three (it held the derived paths:
    # the metrics and W&B of the new run went into this run's folder, its checkpoints refused as this run's)
    # Its lr_schedule and megatron_optimizer sections are kept as sections, so that the overrides the recipes page
    # shows apply to it (they were saved inside trainer.callbacks, the sections null: a second schedule callback
    # failed Lightning's set-up, a second optimizer config every rank's)
    saved, other = tmp_path / "run" / "csv" / "version_0" / "config.yaml", tmp_path / "other"
    import yaml

    def schedule(path):
        section = yaml.safe_load(path.read_text())["lr_schedule"]
        return section["init_args"]  # the callback's arguments under its class_path

    written = yaml.safe_load(saved.read_text())
    assert schedule(saved)["lr_warmup_steps"] == 0 and written["megatron_optimizer"]["clip_grad"] == 1.0
    assert not [c for c in written["trainer"]["callbacks"] if "Optimizer" in c["class_path"]], written
    _cli(tmp_path, "fit", "--config", str(saved), "--trainer.default_root_dir", str(other), "--trainer.max_steps",
         "1", "--trainer.limit_val_batches", "0", "--lr_schedule.max_lr", "3e-3", "--megatron_optimizer.clip_grad",
         "0.5", root="other")
    assert schedule(other / "csv" / "version_0" / "config.yaml")["max_lr"] == 3e-3
    assert (other / "csv" / "version_0" / "metrics.csv").is_file() and (other / "checkpoints" / "last.ckpt").is_dir()
    assert [p.name for p in (other / "wandb").glob("offline-run-*")] and not (tmp_path / "run" / "csv" /
                                                                               "version_1").exists()
    import shutil

    step2 = tmp_path / "run" / "checkpoints" / "step2.ckpt"  # an earlier checkpoint of the run, to roll back to
    shutil.copytree(tmp_path / "run" / "checkpoints" / "last.ckpt", step2)
    # A resume whose model the checkpoint does not fit (another depth) is refused before any rank starts, in one
    # line naming the value and the fix (it was refused in every rank after they started, a traceback each)
    wrong = _cli(tmp_path, "fit", "--trainer.max_steps", "3", "--trainer.devices", "2", "--data.micro_batch_size",
                 "1", "--model.config.num_layers", "2", "--ckpt_path", "last", status=1)
    said = wrong.stdout + wrong.stderr
    assert "Initializing distributed" not in said and "Traceback" not in said, said[-3000:]
    last_ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert _last_line(wrong) == (
        f"lightning-megatron: checkpoint {str(last_ckpt)!r} does not fit this model (saved at layout {{'cp': 1, "
        f"'dp': 1, 'ep': 1, 'etp': None, 'pp': 1, 'schedule': 'auto', 'sequence_parallel': False, 'tp': 1, 'vp': None, "
        f"'world_size': 1, 'zero1': False}}): config.num_layers: checkpoint 1, model 2. Build the model with the "
        f"checkpoint's values (the first of each pair) to load it, e.g. with the run's own configuration: --config "
        f"{tmp_path / 'run' / 'csv' / 'version_0' / 'config.yaml'}"), said[-3000:]
    # the random shuffle goes on mid-epoch from the samples consumed (4), which another global batch must divide:
    # refused before launch (each rank raised the sampler's ValueError once started)
    shuffled = _cli(tmp_path, "fit", "--trainer.max_steps", "3", "--data.shuffle", "random", "--data.global_batch_size",
                    "8", "--data.micro_batch_size", "8", "--ckpt_path", "last", status=1)
    assert "Initializing distributed" not in shuffled.stdout + shuffled.stderr, shuffled.stderr[-3000:]
    assert (f"data.shuffle='random' goes on from sample 4 of the checkpoint {str(last_ckpt)!r}, mid-epoch, which "
            f"global_batch_size=8 does not divide: resume with a global batch that divides 4 (the run's was 2), or "
            f"with data.shuffle='sequential'") in shuffled.stderr, shuffled.stderr[-3000:]
    # `--ckpt_path last` (Lightning's name for the newest last.ckpt) continues the run as the path does
    resumed = _cli(tmp_path, "fit", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0",
                   "--lr_schedule.lr_warmup_steps", "0", "--ckpt_path", "last", "--trainer.enable_progress_bar", "true",
                   "--trainer.log_every_n_steps", "1", columns=80)
    # The bar counts optimizer steps of the whole run: not "Epoch 0/-2", not "3/1" after the resume; it shows
    # loss, tok/s and mfu (not the W&B version) and on 80 columns takes at most 2 lines
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", resumed.stdout).replace("\r", "")
    frames = [chunk for chunk in screen.split("Step ")[1:] if chunk.startswith("3/3")]
    assert frames and "Epoch 0/-2" not in screen and "3/1 " not in screen, screen[-3000:]
    last = frames[-1].split("lightning-megatron: run summary")[0].rstrip("\n ").split("\n")
    assert len(last) <= 2 and all(len(line) <= 80 for line in last), last
    assert "loss:" in last[0] and "tok/s:" in frames[-1] and "mfu:" in frames[-1] and "v_num" not in screen, last
    # resuming into its own folder (the only fit the CLI lets into a folder holding checkpoints): Lightning's
    # "Checkpoint directory ... exists and is not empty" tells the user nothing
    assert not [n for n in (*_NOISE, "exists and is not empty") if n in resumed.stderr], resumed.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt.tmp-1a2b3c4d"
    (tmp_path / "run" / "checkpoints" / "last.ckpt").rename(ckpt)
    marker = json.loads((ckpt / "lightning_megatron.json").read_text())
    del marker["sha256"]
    (ckpt / "lightning_megatron.json").write_text(json.dumps(marker))
    run_id = torch.load(ckpt / "extra.pt", weights_only=True)["wandb_run_id"]
    proc = _cli(tmp_path, "validate", "--trainer.limit_val_batches", "1", "--ckpt_path", "last",
                "--allow-unverified-checkpoint")
    assert "is loaded UNVERIFIED: its lightning_megatron.json has no sha256 checksums" in proc.stderr, proc.stderr
    assert "is missing, but the interrupted save" in proc.stderr and "tmp-1a2b3c4d" in proc.stderr, proc.stderr
    training, second, evaluation = offline_runs(tmp_path / "run" / "wandb")
    assert (training.run_id, second.run_id) == (run_id, run_id) and evaluation.run_id != run_id
    assert (second.resume, second.resumed) == (True, True)  # offline, recorded as the resume it is
    assert training.steps == [0, 1] and second.steps == [2], (training.steps, second.steps)  # the trainer's steps
    assert (evaluation.group, evaluation.job_type) == (run_id, "validate") and "val_loss" in evaluation.history[0]
    for run in (training, second, evaluation):
        assert all(k in run.config for k in (b"tensor_model_parallel_size", b"MegatronStrategy", b"precision")), run
        # the lr schedule, clipping and the optimizer are in the run config too
        assert all(k in run.config for k in (b"lr_schedule", b"lr_warmup_steps", b"megatron_optimizer", b"clip_grad",
                                             b"adam_beta2")), run
    # what the run used, not what was asked: lr_decay_steps=null is max_steps (2), kept at the resume to 3 (the
    # checkpoint's schedule); the micro batch the strategy read from the data; the whole configuration, as its
    # config.yaml (seed, trainer, strategy options, class paths); no module setting replacing a group of ours
    for run, decay in ((training, 2), (second, 2)):
        assert run.settings["lr_schedule"]["lr_decay_steps"] == decay, run.settings.get("lr_schedule")
        assert run.settings["layout"]["micro_batch_size"] == 2, run.settings.get("layout")
        recipe = run.settings["recipe"]
        assert recipe["trainer"]["strategy"]["init_args"]["cpu_tuning"] is False and "seed_everything" in recipe
        assert recipe["model"]["config"]["num_layers"] == 1 and recipe["data"]["micro_batch_size"] == 2, recipe
        assert all(isinstance(run.settings[k], dict) for k in ("trainer", "layout", "lr_schedule",
                                                                "megatron_optimizer", "recipe")), run.settings
    assert training.settings["recipe"]["trainer"]["max_steps"] == 2 and second.settings["recipe"]["trainer"][
        "max_steps"] == 3
    assert evaluation.settings["layout"]["micro_batch_size"] == 2, evaluation.settings["layout"]  # validate's too
    # the CSV: a version per start of the training run, the validate's beside them
    csv_dir = tmp_path / "run" / "csv"
    assert sorted(p.relative_to(csv_dir).as_posix() for p in csv_dir.rglob("metrics.csv")) == [
        "validate/version_0/metrics.csv", "version_0/metrics.csv", "version_1/metrics.csv"]
    # a fit from an earlier checkpoint of the run (step 2, the run went on to 3): W&B keeps a run's steps in order
    # and drops rows below the last it holds, so continuing run_id would have lost the new step 2: a new W&B run
    # in its group, said
    rolled = _cli(tmp_path, "fit", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0",
                  "--lr_schedule.lr_warmup_steps", "0", "--trainer.log_every_n_steps", "1", "--ckpt_path", str(step2))
    assert (f"lightning-megatron: {step2} is step 2 of W&B run {run_id}, which went on to step 3 "
            f"(last.ckpt.tmp-1a2b3c4d): W&B keeps a run's steps in order") in rolled.stdout, rolled.stdout[-3000:]
    [rollback] = [r for r in offline_runs(tmp_path / "run" / "wandb") if r not in (training, second, evaluation)]
    assert rollback.run_id != run_id and rollback.group == run_id and rollback.steps == [2], rollback


def _sums(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (checkpoint directories included), by relative path."""
    from lightning_megatron.checkpoint import file_sha256

    return {str(p.relative_to(folder)): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.strip().splitlines()[-1]


def test_one_run_per_checkpoint_folder_last_is_this_runs_and_nan_stops_a_plain_optimizer(tmp_path):
    """Issue 34's data loss, through the CLI. A run's checkpoint folder takes no second run, `last` is
    the newest state of one run, and no save replaces another run's checkpoint: the case of the issue
    (run A's last.ckpt and a later run B's last-v1.ckpt in one folder; `--ckpt_path last` took B's, and
    a SIGTERM then saved over A's last.ckpt) ends with A's checkpoints byte for byte as they were.
    On the way, fp32 with a plain torch optimizer (no megatron_optimizer group) stops at an injected
    NaN gradient with one line naming the step and the parameter, its last.ckpt untouched."""
    from lightning_megatron.checkpoint import checkpoint_identity

    plain = ["--megatron_optimizer", "null", "--trainer.limit_val_batches", "0", "--lr_schedule.lr_warmup_steps", "0"]
    folder = tmp_path / "run" / "checkpoints"
    _cli(tmp_path, "fit", *plain, "--trainer.max_steps", "3")  # run A
    run_a, step = checkpoint_identity(folder / "last.ckpt")
    assert run_a and step == 3
    sums_a = _sums(folder)

    # a new run into A's folder: refused before launch, naming the folder, A's checkpoint and the two ways on
    new = _cli(tmp_path, "fit", *plain, "--trainer.max_steps", "2", status=1)
    message = _last_line(new)
    assert message.startswith(f"lightning-megatron: {folder} already holds checkpoints (last.ckpt (run {run_a}, "
                              f"step 3)): a new run there would mix"), message
    assert "Resume that run with --ckpt_path last" in message and "--trainer.default_root_dir" in message, message
    assert "Initializing distributed" not in new.stdout + new.stderr  # nothing launched

    # fp32, a plain AdamW: a NaN in one weight's gradient in step 4 of A resumed (`last`: A's only). Its last.ckpt
    # under a step checkpoint's name (the `last` save failed, on a full disk): `last` is the run's newest complete
    # checkpoint, said once (it said "a new run from step 0", which the rule above then refused)
    (folder / "last.ckpt").rename(folder / "epoch=0-step=3.ckpt")
    nan = _cli(tmp_path, "fit", *plain, "--trainer.max_steps", "6", "--ckpt_path", "last",
               "--trainer.callbacks+=cli_faults.NaNGradientAt", "--trainer.callbacks.step=4",
               "--trainer.callbacks.name=encoder.layers.0.mlp.linear_fc1.weight", status=1)
    assert (nan.stderr.count("resuming from this run's newest complete checkpoint") == 1
            and f"{folder / 'epoch=0-step=3.ckpt'}' (step 3)" in nan.stderr), nan.stderr[-3000:]
    (folder / "epoch=0-step=3.ckpt").rename(folder / "last.ckpt")
    assert _last_line(nan).startswith(
        "lightning-megatron: at step 4 (the state at global_step=4 is the last good one) the gradient is not finite "
        "(nan); first parameter with a non-finite gradient on rank 0: encoder.layers.0.mlp.linear_fc1.weight. The "
        "run stops before the optimizer step"), nan.stderr[-3000:]
    assert "Traceback" not in nan.stderr and "PlainOptimizer" not in nan.stderr
    assert _sums(folder) == sums_a  # no checkpoint of the NaN state (the end-of-fit save never ran)

    # run B, started (as before this rule) into the same folder: its last checkpoint lands beside A's
    # as last-v1.ckpt, written after A's
    _cli(tmp_path, "fit", *plain, "--trainer.max_steps", "2", root="other")
    (tmp_path / "other" / "checkpoints" / "last.ckpt").rename(folder / "last-v1.ckpt")
    run_b = checkpoint_identity(folder / "last-v1.ckpt")[0]
    assert run_b and run_b != run_a

    # `--ckpt_path last` there is ambiguous: refused, each last checkpoint named with its run and step
    last = _cli(tmp_path, "fit", *plain, "--trainer.max_steps", "50", "--ckpt_path", "last", status=1)
    assert _last_line(last).startswith(
        f"lightning-megatron: --ckpt_path last is ambiguous: {folder} holds the last checkpoints of 2 runs: "
        f"last-v1.ckpt (run {run_b}, step 2), last.ckpt (run {run_a}, step 3)"), last.stderr[-3000:]

    # B resumed by its path and stopped by SIGTERM: saved as B's own last (last-v1.ckpt), exit 143
    stopped = _cli(tmp_path, "fit", *plain, "--trainer.max_steps", "50", "--ckpt_path", str(folder / "last-v1.ckpt"),
                   "--trainer.callbacks+=cli_faults.SignalAt", "--trainer.callbacks.step=3", status=143)
    assert f"SIGTERM at step 3: saved {folder / 'last-v1.ckpt'}" in stopped.stdout + stopped.stderr
    assert "holds checkpoints of other runs besides last-v1.ckpt" in stopped.stderr  # said once, as a warning
    assert checkpoint_identity(folder / "last-v1.ckpt") == (run_b, 3)
    assert {k: v for k, v in _sums(folder).items() if not k.startswith("last-v1.ckpt/")} == sums_a  # A untouched


def test_a_fit_from_another_folders_checkpoint_that_run_went_past_starts_a_new_wandb_run(tmp_path, capsys):
    """``--ckpt_path`` naming a checkpoint in another run's folder, at step 5 of W&B run ``be5f77a9``, which went
    on to step 19 there: continuing ``be5f77a9`` from step 5 would rewrite its history (W&B drops the rows
    below the last it holds). As for a rewind in the run's own folder: a new W&B run in its group, said."""
    import json

    import torch
    from jsonargparse import Namespace

    from lightning_megatron.cli_config import _continue_wandb_run

    source = tmp_path / "runC" / "checkpoints"
    for step in (5, 19):
        ckpt = source / f"epoch=0-step={step}.ckpt"
        ckpt.mkdir(parents=True)
        (ckpt / "lightning_megatron.json").write_text(json.dumps({"run_id": "be5f77a9", "global_step": step}))
        torch.save({"wandb_run_id": "be5f77a9", "global_step": step}, ckpt / "extra.pt")
    logger = Namespace(class_path="lightning_megatron.loggers.WandbLogger", init_args=Namespace(name="runE"))
    checkpoints = Namespace(class_path="lightning.pytorch.callbacks.ModelCheckpoint",
                            init_args=Namespace(dirpath=str(tmp_path / "runE" / "checkpoints")))
    ckpt_path = str(source / "epoch=0-step=5.ckpt")
    config = Namespace(trainer=Namespace(logger=[logger], callbacks=[checkpoints]), ckpt_path=ckpt_path)
    _continue_wandb_run(config, "fit")
    assert logger.init_args.get("id") is None and logger.init_args.group == "be5f77a9", logger
    assert (f"{ckpt_path} is step 5 of W&B run be5f77a9, which went on to step 19 (epoch=0-step=19.ckpt)"
            in capsys.readouterr().out)
    # the run went no further than the checkpoint: continued, in the new folder
    other = source / "epoch=0-step=19.ckpt"  # now another run's
    (other / "lightning_megatron.json").write_text(json.dumps({"run_id": "x", "global_step": 19}))
    torch.save({"global_step": 19}, other / "extra.pt")
    logger.init_args = Namespace(name="runE")
    _continue_wandb_run(config, "fit")
    assert logger.init_args.id == "be5f77a9" and logger.init_args.get("group") is None, logger


def test_a_fit_started_by_slurm_into_a_run_folder_in_use_is_refused_by_every_rank(tmp_path):
    """The run folder's lock was taken only where the command starts every rank itself: a job submitted twice (two
    ``sbatch`` of one script, two torchrun jobs into one folder) trained both runs into one folder, the second's
    checkpoints replacing the first's (``last`` among them). Started by a launcher (here two SLURM tasks), the
    process of global rank 0 takes the lock once the ranks are connected, and every rank refuses, before the model
    is built and before anything of this job is written there (its W&B run), when another run holds it."""
    import fcntl
    import json as jsonlib

    from dist_utils import start_python
    from launch_lines import free_port, slurm_job_id

    run = tmp_path / "run"
    run.mkdir()
    holder = os.open(run / ".lightning-megatron.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the first job's rank 0 (another open file: it conflicts)
    os.write(holder, jsonlib.dumps({"pid": 4242, "host": "node-a", "started": "2026-12-07 10:00:00",
                                    "command": "lightning-megatron fit --config a.yaml"}).encode())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "MASTER_PORT": str(free_port()),
           "SLURM_JOB_ID": slurm_job_id(), "SLURM_JOB_NAME": "bert", "SLURM_NNODES": "1", "SLURM_NTASKS": "2",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}
    args = ["-m", "lightning_megatron.cli", "fit", "--config", RECIPE, "--trainer.devices", "2",
            "--trainer.default_root_dir", str(run), "--trainer.max_steps", "2",
            "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
            "--trainer.strategy.init_args.timeout", "120", "--model.config.num_layers", "1",
            "--data.global_batch_size", "8", "--data.micro_batch_size", "4"]
    try:
        ranks = [start_python(args, tmp_path, {**env, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)})
                 for i in (0, 1)]
        done = [rank.wait(timeout=300) for rank in ranks]
    finally:
        os.close(holder)
    out = [d.stdout + d.stderr for d in done]
    assert [d.returncode for d in done] == [1, 1], out
    assert (f"lightning-megatron: another run is training in {run} now (pid 4242 on node-a, started 2026-12-07 "
            f"10:00:00: lightning-megatron fit --config a.yaml)") in out[0], out[0][-3000:]
    assert "another run is training" not in out[1] and "Traceback" not in out[0] + out[1], out[1][-3000:]
    assert not (run / "checkpoints").exists() and "MegatronStrategy: world 2" not in out[0], out[0][-3000:]
    # nothing of this job in the other run's folder: rank 0 started its W&B run there while the ranks met, before
    # the lock was checked (its wandb/latest-run then named the refused job's run)
    assert sorted(p.name for p in run.iterdir()) == [".lightning-megatron.lock"], list(run.iterdir())
