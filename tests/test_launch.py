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
launch.prewarm(["fit", "--trainer.devices", "4"])  # local ranks 1, 2 and 3 start importing now
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
        "           'rank_zero': lightning.pytorch.utilities.rank_zero_only.rank},\n"
        "          open(sys.argv[1] + '.part', 'w'))\n"
        "os.replace(sys.argv[1] + '.part', sys.argv[1])  # whole when it appears (rank 2 copies it then)\n")
    (tmp_path / "after_rank_1.py").write_text(  # runs while rank 1 starts: each rank holds its own order pipe only
        "import os, shutil, sys, time\n"
        "deadline = time.monotonic() + 60\n"
        "while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "shutil.copy(sys.argv[1], sys.argv[2])\n")
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
                   "rank_zero": 1}
    assert (tmp_path / "out2.json").read_text() == (tmp_path / "out.json").read_text()


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

def prewarm(argv):  # what was imported when the command starts its other local ranks
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
