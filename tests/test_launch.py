"""Local ranks started early (lightning_megatron.launch): the waiting process Lightning's launcher hands a
rank to runs exactly the command, environment and folder Lightning gave; the others are ended at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from lightning_megatron import launch


@pytest.fixture
def outside_any_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in launch._STARTED_ELSEWHERE:
        monkeypatch.delenv(name, raising=False)
    yield
    launch.release()


def test_waiting_ranks_run_lightnings_commands_and_the_rest_exit(tmp_path, outside_any_rank) -> None:
    script = tmp_path / "rank.py"
    script.write_text(
        "import json, os, sys\n"
        "import lightning.pytorch\n"
        "json.dump({'argv': sys.argv, 'local_rank': os.environ['LOCAL_RANK'], 'cwd': os.getcwd(),\n"
        "           'extra': os.environ.get('EXTRA'), 'prewarm': os.environ.get('" + launch.PREWARM_ENV + "'),\n"
        "           'name': __name__, 'rank_zero': lightning.pytorch.utilities.rank_zero_only.rank},\n"
        "          open(sys.argv[1], 'w'))\n")
    (tmp_path / "in.json").write_text('{"b": 1}')
    work = tmp_path / "work"
    work.mkdir()

    launch.prewarm(["fit", "--trainer.devices", "4"])  # local ranks 1, 2 and 3 start importing now
    waiting = {w.local_rank: w.proc for w in launch._waiting}
    assert sorted(waiting) == [1, 2, 3]

    lightnings = types.SimpleNamespace(subprocess=subprocess)  # stands for Lightning's launcher module
    with launch.hand_to_waiting(lightnings):
        env = dict(os.environ, EXTRA="from rank 0")
        script_rank = lightnings.subprocess.Popen([sys.executable, str(script), str(tmp_path / "out.json")],
                                                  env=dict(env, LOCAL_RANK="1"), cwd=str(work))
        module_rank = lightnings.subprocess.Popen([sys.executable, "-m", "json.tool", str(tmp_path / "in.json"),
                                                   str(tmp_path / "out2.json")], env=dict(env, LOCAL_RANK="2"))
        # `python -c` is no command a waiting rank runs: started as asked, and waiting rank 3 is released
        other = lightnings.subprocess.Popen([sys.executable, "-c", "pass"], env=dict(env, LOCAL_RANK="3"))
    assert lightnings.subprocess is subprocess  # the launcher module is left as it was
    assert waiting[3].returncode is not None  # the rank no launcher took is ended and reaped on the spot,
    # not left to finish its imports

    assert script_rank is waiting[1] and module_rank is waiting[2] and other is not waiting[3]
    assert [p.wait(timeout=120) for p in (script_rank, module_rank, other)] == [0, 0, 0]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got == {"argv": [str(script), str(tmp_path / "out.json")], "local_rank": "1", "cwd": str(work),
                   "extra": "from rank 0", "prewarm": None, "name": "__main__", "rank_zero": 1}
    assert json.loads((tmp_path / "out2.json").read_text()) == {"b": 1}
    assert launch._waiting == []


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
