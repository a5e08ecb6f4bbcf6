"""Local ranks started early (lightning_megatron.launch): the waiting process Lightning's launcher hands a
rank to runs exactly the command, environment and folder Lightning gave; the others are ended at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from dist_utils import run_python

from lightning_megatron import launch


@pytest.fixture
def outside_any_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in launch._STARTED_ELSEWHERE:
        monkeypatch.delenv(name, raising=False)
    yield
    launch.release()


_HANDING = """
import json, os, subprocess, sys, types
from lightning_megatron import launch

script, tmp = sys.argv[1:]
launch.prewarm(["fit", "--trainer.devices", "4", "--model.class_path", "warm_probe.Probe"],  # local ranks 1, 2 and 3
               also=["warm_probe.Missing", "no_such_module.Class"])  # start importing now
waiting = {w.local_rank: w.proc for w in launch._waiting}
lightnings = types.SimpleNamespace(subprocess=subprocess)  # stands for Lightning's launcher module
with launch.hand_to_waiting(lightnings):
    env = dict(os.environ, EXTRA="from rank 0")
    script_rank = lightnings.subprocess.Popen([sys.executable, script, os.path.join(tmp, "out.json")],
                                              env=dict(env, LOCAL_RANK="1"), cwd=os.path.join(tmp, "work"))
    module_rank = lightnings.subprocess.Popen([sys.executable, "-m", "after_rank_1", os.path.join(tmp, "out.json"),
                                               os.path.join(tmp, "out2.json")], env=dict(env, LOCAL_RANK="2"))
    # `python -c` is no command a waiting rank runs: started as asked, and waiting rank 3 is released
    other = lightnings.subprocess.Popen([sys.executable, "-c", "pass"], env=dict(env, LOCAL_RANK="3"))
print(json.dumps({"waiting": sorted(waiting), "launcher module as it was": lightnings.subprocess is subprocess,
                  "unused rank ended at once": waiting[3].returncode is not None,  # not left to finish importing
                  "handed": [script_rank is waiting[1], module_rank is waiting[2], other is not waiting[3]],
                  "status": [p.wait(timeout=120) for p in (script_rank, module_rank, other)],
                  "still waiting": len(launch._waiting)}))
"""


@pytest.mark.parametrize("started", ["new interpreters", "forks"])
def test_waiting_ranks_run_lightnings_commands_and_the_rest_exit(tmp_path, started, outside_any_rank) -> None:
    """The command's waiting ranks as ``lightning-megatron`` starts them (new interpreters), and as the tests'
    forked CLI runs start them (tests/dist_utils.py: forks of the run)."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import json, os, sys\n"
        "import lightning.pytorch\n"
        "json.dump({'argv': sys.argv, 'local_rank': os.environ['LOCAL_RANK'], 'cwd': os.getcwd(),\n"
        "           'extra': os.environ.get('EXTRA'), 'prewarm': os.environ.get('" + launch.PREWARM_ENV + "'),\n"
        "           'name': __name__, 'path0': sys.path[0],\n"
        "           'warmed': [m in sys.modules for m in ('warm_probe', 'warm_probe_types')],\n"
        "           'rank_zero': lightning.pytorch.utilities.rank_zero_only.rank},\n"
        "          open(sys.argv[1] + '.part', 'w'))\n"
        "os.replace(sys.argv[1] + '.part', sys.argv[1])  # whole when it appears (rank 2 copies it then)\n")
    (tmp_path / "after_rank_1.py").write_text(  # runs while rank 1 starts: each rank holds its own order pipe only
        "import os, shutil, sys, time\n"
        "deadline = time.monotonic() + 60\n"
        "while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "shutil.copy(sys.argv[1], sys.argv[2])\n")
    _write_warm_probe(tmp_path)
    work = tmp_path / "work"
    work.mkdir()

    args = ["-c", _HANDING, str(script), str(tmp_path)]
    if started == "forks":
        proc = run_python(args, tmp_path, dict(os.environ), timeout=120)
    else:
        proc = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == {"waiting": [1, 2, 3], "launcher module as it was": True,
                                       "unused rank ended at once": True, "handed": [True, True, True],
                                       "status": [0, 0, 0], "still waiting": 0}
    got = json.loads((tmp_path / "out.json").read_text())
    assert got == {"argv": [str(script), str(tmp_path / "out.json")], "local_rank": "1", "cwd": str(work),
                   "extra": "from rank 0", "prewarm": None, "name": "__main__", "path0": str(tmp_path),
                   "rank_zero": 1, "warmed": [True, True]}  # the class the command names, and its annotations' types
    assert "Traceback" not in proc.stderr  # the class paths it could not import: left to the command's parse
    assert (tmp_path / "out2.json").read_text() == (tmp_path / "out.json").read_text()


def _write_warm_probe(folder) -> None:
    """A class whose argument's type is imported under ``TYPE_CHECKING`` only (as Lightning's ``WandbLogger``
    has ``wandb``'s): LightningCLI's parse imports that module when it reads the signature."""
    (folder / "warm_probe.py").write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from warm_probe_types import Size\n"
        "class Probe:\n"
        "    def __init__(self, size: Size | None = None) -> None:\n"
        "        self.size = size\n")
    (folder / "warm_probe_types.py").write_text("Size = int\n")


def test_the_classes_a_command_names_are_read_where_lightningcli_reads_class_paths(tmp_path) -> None:
    """Every ``class_path`` of the recipes (nested, in lists), and the command line's class-path options;
    values elsewhere are not imported, even when they look like one (a run folder named ``runs.Bert``)."""
    (tmp_path / "r.yaml").write_text(
        "model:\n  class_path: pkg.models.Model\n  init_args:\n    head: {class_path: pkg.heads.Head}\n"
        "trainer:\n  default_root_dir: runs.Bert\n  logger:\n    - class_path: lightning.pytorch.loggers.CSVLogger\n"
        "  callbacks:\n    - {class_path: pkg.callbacks.Early, init_args: {monitor: val.Loss}}\n")
    argv = ["fit", "--config", str(tmp_path / "r.yaml"), "--trainer.strategy", "pkg.strategy.Strategy",
            "--data.class_path=pkg.data.Data", "--optimizer", "torch.optim.SGD", "--trainer.callbacks+=pkg.cb.Other",
            "--trainer.default_root_dir", "runs.Other", "--model.init_args.head.class_path", "pkg.heads.Head"]
    assert launch.named_classes(argv) == [
        "pkg.models.Model", "pkg.heads.Head", "lightning.pytorch.loggers.CSVLogger", "pkg.callbacks.Early",
        "pkg.strategy.Strategy", "pkg.data.Data", "torch.optim.SGD", "pkg.cb.Other"]


def test_warming_a_class_imports_its_annotations_and_says_nothing_of_the_classes_it_cannot(
        tmp_path, monkeypatch, capsys) -> None:
    _write_warm_probe(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    launch._warm(["no_such_module.Class", "warm_probe.Missing", "warm_probe.Probe", "warm_probe"])
    assert {"warm_probe", "warm_probe_types"} <= set(sys.modules)
    assert capsys.readouterr() == ("", "")
    for name in ("warm_probe", "warm_probe_types"):
        monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("argv, recipe, expected", [
    (["fit", "--trainer.devices", "2"], None, 2),
    (["fit", "--trainer.devices=3"], "trainer:\n  devices: 2\n", 3),  # the command line wins over the recipe
    (["fit"], "trainer:\n  devices: 2\n", 2),
    (["fit"], "trainer:\n  devices: auto\n", 1),  # not a number: no guess
    (["fit", "--trainer.devices", "[0, 1]"], None, 1),
    (["fit"], None, 1),
])
def test_local_processes_reads_a_number_of_devices_only(tmp_path, argv, recipe, expected) -> None:
    if recipe is not None:
        (tmp_path / "r.yaml").write_text(recipe)
        argv = [*argv, "--config", str(tmp_path / "r.yaml")]
    assert launch.local_processes(argv) == expected


def test_no_prewarming_inside_a_rank_or_for_help(monkeypatch, outside_any_rank) -> None:
    launch.prewarm(["fit", "--trainer.devices", "2", "--help"])
    monkeypatch.setenv("LOCAL_RANK", "1")
    launch.prewarm(["fit", "--trainer.devices", "2"])
    assert launch._waiting == []


_PREWARM_PROBE = """
import sys
from lightning_megatron import cli, launch

def prewarm(argv, also=()):  # what was imported when the command starts its other local ranks
    print([name for name in ("torch", "lightning") if name in sys.modules], flush=True)
    raise SystemExit(0)

launch.prewarm = prewarm
cli.main(sys.argv[1:])
print("never prewarmed")
"""


@pytest.mark.parametrize("command", [
    "fit --config recipes/bert_tiny.yaml",
    "finetune fit --config recipes/bert_tiny_sst2.yaml",  # a classifier
    "finetune predict --config recipes/gpt_tiny_lora.yaml",  # a decoder
])
def test_commands_start_their_ranks_before_importing_torch(command, outside_any_rank) -> None:
    """The waiting ranks import while rank 0 does: a command that imported torch and Lightning first (~10 s
    on 2 cores) would start them only after, and pay the imports twice, one after the other. A new
    interpreter (the tests' own has torch imported already)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _PREWARM_PROBE, *command.split()], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (0, "[]\n"), proc.stderr[-3000:]


def test_collection_pauses_only_when_the_command_paused_it() -> None:
    """``resume_collection`` without ``pause_collection`` (the library called from a user's program) changes
    nothing; after a pause, what exists is frozen out of later collections and collection is back on."""
    import gc

    frozen = gc.get_freeze_count()
    launch.resume_collection()
    assert (gc.isenabled(), gc.get_freeze_count()) == (True, frozen)
    launch.pause_collection()
    try:
        assert not gc.isenabled()
        made = [[] for _ in range(1000)]  # tracked objects made while paused
        launch.resume_collection()
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(made)
        launch.resume_collection()  # once only
        assert gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()  # this test process's objects back in the oldest generation, as before


_GC_PROBE = """
import gc, sys
from lightning_megatron import cli, launch

started = launch.prewarm
def prewarm(argv, also=()):  # the command's start-up: before its imports
    print("collecting while importing:", gc.isenabled(), flush=True)
    started(argv, also)

launch.prewarm = prewarm
try:
    cli.main()  # as the process's command: its arguments from sys.argv
except SystemExit:
    pass
print("after the imports:", gc.isenabled(), gc.get_freeze_count() > 100_000, flush=True)
"""


def test_the_command_does_not_collect_while_it_imports_and_freezes_what_it_imported(outside_any_rank) -> None:
    """CPython's full collections while ~3,900 modules import walk the growing heap again and again (~1 s of a
    rank's start-up on 2 cores); the command pauses them until its imports are done, then freezes what they made
    (never garbage: modules, classes, functions) out of every later collection. A new interpreter."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _GC_PROBE, "fit", "--config", "recipes/bert_tiny.yaml",
                           "--trainer.devices", "1", "--print_config"], cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("collecting", "after"))]
    assert lines == ["collecting while importing: False", "after the imports: True True"], proc.stdout[-3000:]


def test_main_given_its_arguments_leaves_the_collector_alone(tmp_path, monkeypatch) -> None:
    """``cli.main(argv)`` from a program (or a test), not as the process's command: freezing would keep whatever
    cyclic garbage exists then (a dropped model's tensors) for the rest of the process."""
    import gc

    from lightning_megatron import cli

    frozen = gc.get_freeze_count()
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])
    with pytest.raises(SystemExit):  # the recipe is refused before anything runs
        cli.main(["fit", "--config", str(tmp_path / "missing.yaml")])
    assert (gc.isenabled(), gc.get_freeze_count()) == (True, frozen)


_WANDB_AHEAD_PROBE = """
import sys
from lightning_megatron import cli, launch

ahead = launch.import_wandb_ahead
def probe(argv):  # what the command imported ahead, and whether torch was imported then
    ahead(argv)
    print(["wandb.sdk.launch.inputs.internal" in sys.modules, "torch" in sys.modules], flush=True)
    raise SystemExit(0)

launch.import_wandb_ahead = probe
cli.main(sys.argv[1:])
print("never imported ahead")
"""


@pytest.mark.parametrize("command, env, imported", [
    ("fit --config recipes/bert_tiny.yaml", {}, True),  # the recipe's WandbLogger
    ("fit --config recipes/bert_tiny.yaml", {"WANDB_MODE": "disabled"}, False),  # no W&B run will start
    ("fit --config recipes/bert_tiny.yaml", {"LOCAL_RANK": "1"}, False),  # a rank the command started
    ("finetune fit --config recipes/bert_tiny_sst2.yaml", {}, False),  # a CSVLogger only
    ("finetune fit --config recipes/bert_tiny_sst2.yaml --trainer.logger+=lightning_megatron.loggers.WandbLogger",
     {}, True),
], ids=["wandb", "disabled", "in-a-rank", "csv", "finetune-wandb"])
def test_the_command_imports_what_wandb_init_imports_last_before_torch(command, env, imported, outside_any_rank):
    """``wandb.init`` imports W&B Launch's inputs once the run is ready, whose pydantic models scan ``sys.modules``
    per stack frame: ~0.13 s before torch and Lightning are imported, 0.35-0.7 s after, on rank 0's W&B thread
    (docs/benchmarks.md, "Start-up"). The command that starts W&B imports it ahead; nothing else does. A new
    interpreter."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environ = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    proc = subprocess.run([sys.executable, "-c", _WANDB_AHEAD_PROBE, *command.split()], cwd=root,
                          capture_output=True, text=True, timeout=120, env={**environ, **env})
    assert (proc.returncode, proc.stdout) == (0, f"[{imported}, False]\n"), proc.stderr[-3000:]


_ORPHAN = """import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(120)
"""

_WATCHED = """import ctypes
from lightning_megatron.launch import exit_when_parent_dies
with exit_when_parent_dies("local rank 1", "connecting to the other ranks"):
    print("watching", flush=True)
    ctypes.PyDLL(None).sleep(120)  # a C call that keeps the GIL, as torch's TCPStore constructor does
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_whose_launcher_died_during_the_rendezvous_exits_at_once() -> None:
    """Killed (or ``scancel``-ed) while its rank 0 started W&B, before rank 0 hosted the rendezvous store, the command's
    launcher left local rank 1 in the TCPStore connect for the whole timeout, about 30-60 minutes at the default
    (retried once), saying only that a client socket timed out; a thread watching the parent cannot run there (the
    connect keeps the GIL). While the rank connects, the kernel ends it when its parent dies."""
    import signal
    import time

    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN, _WATCHED], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "watching"  # the child's stdout is the parent's
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    killed = time.monotonic()
    while not _gone(child) and time.monotonic() - killed < 30:
        time.sleep(0.05)
    assert _gone(child), "the orphaned rank is still waiting"
    assert time.monotonic() - killed < 5


def test_a_rank_started_by_rank_0_leaves_ctrl_c_to_it_until_its_stop_handler_is_in_place(monkeypatch) -> None:
    """Rank 0 started it (``CHILD_ENV``): from the package's first import Ctrl-C does nothing there (Ctrl-C reaches
    every process of the job; in the start-up rank 0 alone ends the command, lightning_megatron.launch). A program it
    starts is not a rank: the variable leaves the environment, and the program begins with Ctrl-C's default action
    (SIG_IGN, which exec keeps, left the programs a rank started running after a Ctrl-C). Its stop handler takes SIGINT
    over and, leaving, gives Python's default back."""
    import signal

    from lightning_megatron.preemption import PreemptionHandler

    probe = ("import os, signal, subprocess, sys, lightning_megatron; from lightning_megatron import launch; "
             "child = subprocess.run([sys.executable, '-c', 'import signal; print(signal.getsignal(signal.SIGINT) is "
             "signal.default_int_handler)'], capture_output=True, text=True).stdout.strip(); "
             "print(signal.getsignal(signal.SIGINT).__name__, launch.started_by_rank_0(), launch.CHILD_ENV in "
             "os.environ, child)")
    for env, expected in (({launch.CHILD_ENV: "1"}, "_ctrl_c_during_start_up True False True"),
                          ({}, "default_int_handler False False True")):
        started = {k: v for k, v in os.environ.items() if k != launch.CHILD_ENV}
        proc = subprocess.run([sys.executable, "-c", probe], env={**started, **env}, timeout=60,
                              capture_output=True, text=True)  # a new interpreter: the package's first import
        assert proc.stdout.strip() == expected, (env, proc.stdout, proc.stderr[-2000:])
    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setenv(launch.CHILD_ENV, "1")
    monkeypatch.setattr(launch, "_started_by_rank_0", False)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        launch.leave_ctrl_c_to_rank_0()
        assert launch.started_by_rank_0() and launch.CHILD_ENV not in os.environ
        assert signal.getsignal(signal.SIGINT) is launch._ctrl_c_during_start_up
        handler = PreemptionHandler()
        handler.install()
        assert signal.getsignal(signal.SIGINT) == handler._handle
        handler.uninstall()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
