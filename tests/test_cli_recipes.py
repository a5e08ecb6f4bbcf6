"""Every recipe parses and builds; the default recipe trains through the real CLI; TP=1 equals TP=2."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dist_utils import ForkedPython, accelerator, run_python, start_python
from launch_lines import STRATEGY_SECTION, Launch, bash_block_text, doc_lines, environ, free_port, slurm_job_id

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if not p.name.startswith("_"))  # _*: bases


FINETUNE = [p for p in RECIPES if yaml.safe_load(p.read_text()).get("base") == "_bert_tiny_finetune.yaml"]
DECODER = [p for p in RECIPES if yaml.safe_load(p.read_text()).get("base") == "_gpt_pretraining.yaml"]  # test_gpt_recipes.py
PRETRAINING = [p for p in RECIPES if p not in FINETUNE and p not in DECODER]


def _build_worker(*recipes: str | tuple[str, list[str]]) -> list[dict]:
    """Build each recipe (or ``(recipe, extra command-line arguments)``) as the CLI does, without running."""
    from lightning_megatron.cli_lightning import finetune_cli, lightning_cli

    out = []
    for item in recipes:
        recipe, extra = (item, []) if isinstance(item, str) else item
        build = finetune_cli if Path(recipe) in FINETUNE else lightning_cli
        # CPU stand-ins for the cluster settings, everything else exactly as written (the recipe's
        # precision too: the config checks before launch compare it with model.config.params_dtype).
        cli = build([
            "--config", recipe, "--trainer.accelerator", accelerator(), "--trainer.num_nodes", "1",
            "--trainer.logger", "false", *extra], run=False)
        strategy = cli.trainer.strategy
        out.append({"model": type(cli.model).__name__, "data": type(cli.datamodule).__name__,
                    "tp": strategy.parallel_dims.tp, "pp": strategy.parallel_dims.pp,
                    "callbacks": sorted(type(c).__name__ for c in cli.trainer.callbacks),
                    "hidden": cli.model.config.hidden_size, "global_batch": cli.datamodule.global_batch_size,
                    "num_classes": cli.model.hparams.get("num_classes"),
                    "cpu_tuning": None if strategy.cpu_tuning is None else vars(strategy.cpu_tuning)})
    return out


def test_recipes_exist():
    assert {p.name for p in RECIPES} >= {"bert_tiny.yaml", "bert_base.yaml", "bert_large.yaml"}
    assert {p.stem for p in FINETUNE} == {"bert_tiny_finetune", "bert_tiny_sst2", "bert_tiny_cola", "bert_tiny_mnli",
                                          "bert_tiny_stsb"}


@pytest.mark.parametrize("recipe", PRETRAINING, ids=lambda p: p.stem)
def test_recipe_parses_and_builds(recipe):
    from dist_utils import run_distributed

    # the CPU recipe also with a CPU-tuning piece that is off by default, as docs/pipeline.md writes it
    per_step = (str(recipe), ["--trainer.strategy.cpu_tuning", "{weight_grads_per_step: true}"])
    [[built, *tuned]] = run_distributed(_build_worker, 1, str(recipe), *([per_step] if recipe.stem == "bert_tiny" else []),
                                        timeout=180)
    if tuned:
        assert built["cpu_tuning"]["weight_grads_per_step"] is False
        assert tuned[0]["cpu_tuning"] == {**built["cpu_tuning"], "weight_grads_per_step": True}
    assert built["model"] == "BertLightningModule" and built["data"] == "BertDataModule"
    assert "MegatronOptimizerCallback" in built["callbacks"]
    assert "OptimizerParamSchedulerCallback" in built["callbacks"]
    assert built["hidden"] == {"bert_tiny": 128, "bert_base": 768, "bert_large": 1024}[recipe.stem]


def test_finetune_recipes_parse_and_build():
    """Every fine-tuning recipe (one per GLUE task shape), in one process; the model's classes come
    from the data (names, ids, or 1 output for regression)."""
    from dist_utils import run_distributed

    [built] = run_distributed(_build_worker, 1, *map(str, FINETUNE), timeout=240)
    by_name = dict(zip((p.stem for p in FINETUNE), built))
    for b in built:
        assert b["model"] == "BertClassificationModule" and b["hidden"] == 128
        assert {"MegatronOptimizerCallback", "OptimizerParamSchedulerCallback"} <= set(b["callbacks"])
    assert by_name["bert_tiny_finetune"]["data"] == "StdlibDocstringDataModule"
    assert {k: v["num_classes"] for k, v in by_name.items()} == {
        "bert_tiny_finetune": 8, "bert_tiny_sst2": 2, "bert_tiny_cola": 2, "bert_tiny_mnli": 3, "bert_tiny_stsb": 1}
    assert {v["data"] for k, v in by_name.items() if k != "bert_tiny_finetune"} == {"LabelledTextDataModule"}



def test_a_config_record_field_it_lacks_is_one_line_naming_it(tmp_path):
    """A recipe giving the model's config record a field it does not have (megatron-core's expert bias, or a typo)
    printed LightningCLI's usage and a 70-line dump of the parse ending with "Option ... is not accepted". One line
    now, before anything is built, naming the field, a close match and the record; a base recipe's fields too."""
    from lightning_megatron.cli import main

    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"base: {ROOT / 'recipes' / 'moe_tiny.yaml'}\nmodel:\n  init_args:\n    config:\n"
                      f"      moe_router_enable_expert_bias: true\n      moe_router_topK: 2\n")
    with pytest.raises(SystemExit) as refused:
        main(["fit", "--config", str(recipe)])
    message = str(refused.value.code)
    assert message.startswith("lightning-megatron: the recipe's model.init_args.config.moe_router_enable_expert_bias; "
                              "model.init_args.config.moe_router_topK (did you mean moe_router_topk"), message
    assert "not a field of lightning_megatron.models.gpt.config.GPTConfig (the GPTLightningModule config " in message
    assert message.count("\n") == 0
    recipe.write_text("model:\n  config:\n    num_layer: 2\n")  # BERT's, the default class
    with pytest.raises(SystemExit) as refused:
        main(["fit", "--config", str(recipe)])
    assert "model.config.num_layer (did you mean num_layers or " in str(refused.value.code), refused.value.code
    # the same typo on the command line printed ~100 lines of usage and the parse; one line too
    for argv, said in ((["--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--model.config.num_layer", "3"],
                        "the command line's model.config.num_layer (did you mean num_layers or "),
                       (["--config", str(ROOT / "recipes" / "gpt_tiny.yaml"), "--model.init_args.config.num_layer=3"],
                        "the command line's model.init_args.config.num_layer (did you mean num_layers or ")):
        with pytest.raises(SystemExit) as refused:
            main(["fit", *argv])
        assert str(refused.value.code).startswith(f"lightning-megatron: {said}"), refused.value.code
    # judged against the record of the class the command builds: one a program passes (lightning_cli(args,
    # GPTLightningModule, ...)) as well as one a recipe names
    from lightning_megatron.models.gpt.module import GPTLightningModule
    from lightning_megatron.recipes import RecipeError, refuse_unknown_config_fields

    rope = ["fit", "--model.config.position_embedding_type", "rope"]
    refuse_unknown_config_fields(rope, GPTLightningModule)
    with pytest.raises(RecipeError, match="model.config.position_embedding_type: not a field of .*BertConfig"):
        refuse_unknown_config_fields(rope)  # the CLI's default class, BERT's


def test_old_datamodule_class_paths_are_refused_naming_the_new_one(tmp_path, capsys):
    """The LightningDataModules left lightning_megatron.data (which imports no Lightning) for
    lightning_megatron.datamodules: a recipe or command line naming an old class path stops before
    anything is built, in one line naming the new path (never rewritten behind the user's back); the
    new path is that class, the old module is gone."""
    from lightning_megatron.recipes import import_class
    from lightning_megatron.cli import main
    from lightning_megatron.recipes import MOVED_CLASS_PATHS

    assert "lightning_megatron.data.gpt_datamodule.GPTDataModule" in MOVED_CLASS_PATHS
    for old, new in MOVED_CLASS_PATHS.items():
        assert import_class(new).__name__ == old.rsplit(".", 1)[1]
        with pytest.raises(ValueError, match="cannot be imported"):
            import_class(old)
        recipe = tmp_path / "mine.yaml"  # a user's recipe on top of ours, as written before the move
        recipe.write_text(f"base: {ROOT / 'recipes' / 'gpt_tiny.yaml'}\ndata:\n  class_path: {old}\n")
        command = ["finetune", "fit"] if "Finetune" in new or "LabelledText" in new else ["fit"]
        for where, argv in ((f"recipe '{recipe}' (data.class_path)", ["--config", str(recipe)]),
                            ("the command line", ["--data", old]), ("the command line", [f"--data.class_path={old}"])):
            with pytest.raises(SystemExit) as refused:
                main([*command, *argv])
            assert str(refused.value.code) == (f"lightning-megatron: {where} names {old}, which has moved: use class_path "
                                               f"{new} (the LightningDataModules left lightning_megatron.data for "
                                               f"lightning_megatron.datamodules)")
    # check reads recipes too: the same line, as its usage error
    recipe.write_text("data:\n  class_path: lightning_megatron.data.datamodule.BertDataModule\n")
    with pytest.raises(SystemExit):
        main(["check", "--config", str(recipe)])
    err = capsys.readouterr().err
    assert f"recipe '{recipe}' (data.class_path) names lightning_megatron.data.datamodule.BertDataModule, which has " \
           "moved: use class_path lightning_megatron.datamodules.pretraining.BertDataModule " in err, err

def _start(launches: list[Launch], cwd: Path, env: dict, **popen) -> list[subprocess.Popen]:
    return [subprocess.Popen(launch.argv(), cwd=cwd, env=dict(env, **launch.env), text=True, **popen)
            for launch in launches]


def _launch(launches: list[Launch], cwd: Path, env: dict) -> list[subprocess.CompletedProcess]:
    """Start every launch (a torchrun line once per simulated node, a SLURM loop once per task) and
    wait for all of them. ``lightning-megatron`` starts from the forkserver (``start_python``), torchrun's
    agent (which starts its workers as new interpreters) as a new interpreter."""
    procs = [start_python(launch.argv()[1:], cwd, dict(env, **launch.env)) if launch.program == "lightning-megatron"
             else _start([launch], cwd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)[0] for launch in launches]
    try:
        return [p.wait(timeout=600) if isinstance(p, ForkedPython)
                else subprocess.CompletedProcess(p.args, p.wait(timeout=600), *p.communicate()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _test_config(tmp: Path, name: str, run_dir: Path) -> Path:
    """recipes/bert_tiny.yaml (with its base) checkpointing every 6 steps into the run folder."""
    from lightning_megatron.recipes import read_recipe

    recipe = read_recipe(ROOT / "recipes/bert_tiny.yaml")
    for cb in recipe["trainer"]["callbacks"]:
        if cb["class_path"].endswith("ModelCheckpoint"):
            cb["init_args"].update(dirpath=str(run_dir / "ckpt"), every_n_train_steps=6, save_top_k=-1,
                                   filename="{step}")
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump(recipe))
    return config


# A small model for the tests, appended to the documented lines (the later value of an option wins).
_SMALL = ["--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false", "--model.config.hidden_dropout",
          "0.0", "--model.config.attention_dropout", "0.0", "--model.config.num_layers", "1", "--data.global_batch_size", "8",
          "--data.micro_batch_size", "4", "--data.max_seq_length", "64", "--model.config.max_sequence_length", "64"]


def _fit(tmp: Path, name: str, wandb: bool, launches: list[Launch] | None = None) -> tuple[list[float], str, str]:
    """``fit`` for 12 steps of a 1-layer bert_tiny: ``launches`` (documented lines, ``--config`` replaced
    here), or one process at TP=1 through Lightning's launcher. Returns the logged losses, the
    summary's whole-model parameter count and the processes' output."""
    run_dir = tmp / name
    loggers = ('[{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "%s", "name": "csv"}}'
               % run_dir)
    if wandb:
        loggers += (', {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": '
                    '{"project": "lm-test", "save_dir": "%s", "offline": true}}' % run_dir)
    loggers += "]"
    config = _test_config(tmp, name, run_dir)
    if launches is None:
        launches = [Launch("lightning-megatron", ["fit", "--config", str(config), "--trainer.devices", "1",
                                                  "--trainer.strategy.tensor_model_parallel_size", "1"])]
    args = ["--trainer.max_steps", "12", "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(run_dir),
            "--trainer.logger", loggers, *_SMALL,
            "--megatron_optimizer.clip_grad", "0.5"]  # a Megatron callback's argument from the command line
    launches = [launch.replace({"--config": str(config)}) for launch in launches]
    launches = [Launch(launch.program, launch.args + args, launch.env) for launch in launches]
    procs = _launch(launches, tmp, environ(WANDB_MODE="offline", WANDB_SILENT="true"))
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    stderr = "".join(proc.stderr for proc in procs)  # rank 0 runs under either torchrun agent
    assert "lr_warmup_steps=30 is not below" in stderr and "args parameter" not in stderr
    stdout = "".join(proc.stdout for proc in procs)
    # The model summary counts the whole model (every TP shard), the run summary the throughput
    [whole] = re.findall(r"Whole model: ([\d.]+ [KMB]) parameters", stdout + stderr)
    assert "Total FLOPs: 0" not in stdout + stderr
    assert re.search(r"mfu +median over steps", stdout) and re.search(r"tokens_per_sec +median", stdout), stdout[-3000:]
    [metrics] = list(run_dir.rglob("metrics.csv"))
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("train_lm_loss")]
    assert (run_dir / "ckpt").exists() and any((run_dir / "ckpt").iterdir()), "a checkpoint must be saved"
    if wandb:
        assert list(run_dir.rglob("*.wandb")), "W&B offline run files must exist"
        records = b"".join(p.read_bytes() for p in run_dir.rglob("*.wandb"))
        assert all(k in records for k in (b"tensor_model_parallel_size", b"MegatronStrategy", b"precision"))
    return [float(r["train_lm_loss"]) for r in rows], whole, stdout + stderr


def _documented(kind: str) -> list[Launch]:
    """The documented launch line of ``kind``: "c10d" / "static" torchrun, or the "slurm" loop."""
    lines = doc_lines()
    pick = {"c10d": lambda c: c[0].program == "torchrun" and "--rdzv-endpoint" in c[0].args,
            "static": lambda c: c[0].program == "torchrun" and "--master-port" in c[0].args,
            "slurm": lambda c: "SLURM_PROCID" in c[0].env}[kind]
    [line] = [c for c in lines if pick(c)]
    return line


def test_documented_launch_lines_agree():
    """docs/recipes.md shows the same torchrun and SLURM lines as docs/strategy.md (which the tests run)."""
    [recipes_block] = bash_block_text(ROOT / "docs" / "recipes.md", "## On several nodes")
    strategy_blocks = bash_block_text(*STRATEGY_SECTION)
    assert recipes_block == strategy_blocks[0] + strategy_blocks[1]
    assert {len(_documented(k)) for k in ("c10d", "static")} == {1} and len(_documented("slurm")) == 2


def test_cli_fit_tp1_equals_tp2(tmp_path):
    """`lightning-megatron fit --config recipes/bert_tiny.yaml` (few steps) started by the documented
    torchrun line (c10d rendezvous) on two simulated nodes of two processes, TP=2 x DP=2 with each TP
    group within a node, logs the one-process losses (fp32, dropout off) within 1e-5; its step-6
    checkpoint, resumed on one node at TP=1 x DP=2 by the documented SLURM line (Lightning's
    SLURMEnvironment starts no process: the two ranks exist only if it read them), continues the
    one-process run; test and export read the two-node checkpoint on one process."""
    c10d = _documented("c10d")[0].replace({"--rdzv-endpoint": f"127.0.0.1:{free_port()}"})
    tp2, whole_tp2, out = _fit(tmp_path, "tp2", True, [c10d] * int(c10d.option("--nnodes")))  # once per node
    assert "world 4 = TP 2 x PP 1 x DP 2" in out, out[-3000:]
    assert "nodes: 2 (node 0: ranks [0, 1], node 1: ranks [2, 3]), every TP group within one node: yes" in out
    tp1, whole_tp1, _ = _fit(tmp_path, "tp1", False)
    assert whole_tp2 == whole_tp1, "the summary counts every TP shard"
    assert len(tp1) == len(tp2) == 12
    for a, b in zip(tp1, tp2):
        assert abs(a - b) <= 1e-5 * abs(a), (tp1, tp2)
    job = {"SLURM_JOB_ID": slurm_job_id()}  # one job: every task the same id
    step6 = str(tmp_path / "tp2/ckpt/step=6.ckpt")
    slurm = [launch.replace({"--ckpt_path": step6}, job) for launch in _documented("slurm")]
    resumed, _, out = _fit(tmp_path, "resumed", False, slurm)
    assert "world 2 = TP 1 x PP 1 x DP 2" in out and "SLURM auto-requeueing enabled" in out, out[-3000:]
    assert len(resumed) == 6
    for a, b in zip(tp1[6:], resumed):
        assert abs(a - b) <= 1e-5 * abs(a), (tp1, resumed)
    ckpt = tmp_path / "tp2" / "ckpt" / "step=12.ckpt"
    assert ckpt.is_dir()
    test = run_python(["-m", "lightning_megatron.cli", "test", "--config", str(tmp_path / "tp2.yaml"),
                       "--trainer.devices", "1", "--trainer.strategy.tensor_model_parallel_size", "1",
                       "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                       "--model.config.num_layers", "1", "--data.global_batch_size", "8", "--data.micro_batch_size", "4",
                       "--data.max_seq_length", "64", "--model.config.max_sequence_length", "64",
                       "--trainer.limit_test_batches", "2", "--ckpt_path", str(ckpt)],
                      tmp_path, dict(os.environ), timeout=600)
    assert test.returncode == 0 and "test_lm_loss" in test.stdout, test.stdout[-3000:] + test.stderr[-3000:]
    from lightning_megatron.cli import main

    main(["export", "hf", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "hf")])  # the CLI's entry, in-process
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["MegatronBertForPreTraining"]
    _predict_from_cli_checkpoint(tmp_path, ckpt)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_killing_one_node_ends_the_other(tmp_path):
    """Two nodes started by the documented static-rendezvous torchrun line (one process each, TP=2
    across them): once training runs, node 1's agent and its worker are killed (SIGKILL, a node that
    dies); node 0's worker fails in its next collective and node 0's agent exits non-zero instead of
    waiting for the 30-minute collective timeout (the wait below is a hang guard, not a timing)."""
    import signal
    import time

    run_dir = tmp_path / "run"
    config = _test_config(tmp_path, "kill", run_dir)
    static = _documented("static")[0].replace({"--nproc-per-node": "1", "--master-port": str(free_port()),
                                               "--config": str(config), "--trainer.devices": "1"})
    args = ["--trainer.max_steps", "100000", "--trainer.default_root_dir", str(run_dir), "--trainer.logger", "false",
            *_SMALL]
    nodes = [Launch(static.program, static.replace({"--node-rank": str(r)}).args + args) for r in (0, 1)]
    logs = [(tmp_path / f"node{r}.out").open("w+") for r in (0, 1)]
    procs = [_start([node], tmp_path, environ(), stdout=log, stderr=subprocess.STDOUT)[0]
             for node, log in zip(nodes, logs)]
    try:
        deadline = time.monotonic() + 600
        while "MegatronStrategy: world 2" not in (tmp_path / "node0.out").read_text():  # both ranks set up
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, [
                (tmp_path / f"node{r}.out").read_text()[-3000:] for r in (0, 1)]
            time.sleep(0.2)
        time.sleep(1.0)  # into the steps
        worker = _children(procs[1].pid)
        assert worker, "node 1's worker must be running"
        for pid in [procs[1].pid, *worker]:
            os.kill(pid, signal.SIGKILL)
        procs[1].wait(timeout=60)
        killed = time.monotonic()
        code = procs[0].wait(timeout=300)  # a hang fails here
        ended_after = time.monotonic() - killed
        out = (tmp_path / "node0.out").read_text()
        assert code != 0, out[-4000:]
        # TP=2 over 2 nodes x 1 process: the start-up message says so, and the strategy warns.
        assert "every TP group within one node: no, [0, 1] span nodes" in out and "TP groups [[0, 1]] span nodes" in out
        assert "ChildFailedError" in out or "failed" in out.lower(), out[-4000:]
        print(f"node 0's agent exited {code} {ended_after:.1f} s after node 1 was killed")
    finally:
        for p in procs:
            for pid in [p.pid, *_children(p.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=60)
        for log in logs:
            log.close()


def _own_filesystem_at(folder: Path) -> list[str]:
    """A command prefix that runs a program seeing an empty filesystem of its own at ``folder`` (a mount
    namespace with a tmpfs there: a node whose disk is its own); [] where this host allows none."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs none '{folder}'"], capture_output=True)
    return ["unshare", "-m", "sh", "-c", f"mount -t tmpfs none '{folder}' && exec \"$@\"", "sh"] if (
        probe.returncode == 0) else []


def test_a_checkpoint_folder_one_node_cannot_see_is_refused_before_the_first_step(tmp_path):
    """Two nodes started by the documented static torchrun line, node 1 with a disk of its own at the run folder
    (a folder on a node's /tmp or local NVMe): each node would keep only its own shards of every checkpoint.
    The run trained to its first save and died there ("Parent directory ... does not exist"), its steps lost. It is
    refused at set-up, before the first step, naming the folder, the node that cannot see it and the fix."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    own = _own_filesystem_at(run_dir)
    if not own:
        pytest.skip("this host allows no mount namespace (unshare -m), which gives a node a disk of its own")
    config = _test_config(tmp_path, "local", run_dir)
    static = _documented("static")[0].replace({"--nproc-per-node": "1", "--master-port": str(free_port()),
                                               "--config": str(config), "--trainer.devices": "1"})
    args = ["--trainer.max_steps", "12", "--trainer.default_root_dir", str(run_dir), "--trainer.logger", "false",
            *_SMALL]
    nodes = [static.replace({"--node-rank": str(r)}).args + args for r in (0, 1)]
    with (tmp_path / "node0.out").open("w+") as log0, (tmp_path / "node1.out").open("w+") as log1:
        procs = [subprocess.Popen([*prefix, *Launch(static.program, node).argv()], cwd=tmp_path, env=environ(),
                                  stdout=log, stderr=subprocess.STDOUT)
                 for prefix, node, log in (([], nodes[0], log0), (own, nodes[1], log1))]
        codes = [p.wait(timeout=600) for p in procs]
    out = (tmp_path / "node0.out").read_text()
    assert codes[0] != 0 and codes[1] != 0, out[-4000:]
    refusal = [line for line in out.splitlines() if line.startswith("lightning-megatron: ")]
    assert len(refusal) == 1 and f"the checkpoint folder '{run_dir / 'ckpt'}' is not shared by every node" in \
        refusal[0] and "node 1 (ranks [1])" in refusal[0] and "every node mounts" in refusal[0], out[-4000:]
    assert "Step " not in out and "saving checkpoint" not in out, out[-4000:]
    assert not list((run_dir / "ckpt").iterdir())  # the probe removed, nothing saved


def _predict_from_cli_checkpoint(tmp_path: Path, ckpt: Path) -> None:
    """On the TP=2 checkpoint the CLI wrote: `predict` through the CLI at TP=2 on a JSONL file of 11 texts
    (one full global batch of 8 and a short one, top 3), `load_from_checkpoint`, the default test split
    through the PredictionWriter (pooled), and `export hf`'s refusals."""
    import pytest
    import torch

    from lightning_megatron.cli import main
    from lightning_megatron.models.bert.module import BertLightningModule

    texts = [f"sentence number {i} says the [MASK] is {'blue' if i % 2 else '[MASK]'} today" for i in range(11)]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    predict = run_python(
        ["-m", "lightning_megatron.cli", "predict", "--config", str(tmp_path / "tp2.yaml"),
         "--trainer.devices", "2", "--trainer.strategy.tensor_model_parallel_size", "2", "--trainer.logger", "false",
         "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "pred"),
         "--model.config.num_layers", "1", "--data.global_batch_size", "8", "--data.micro_batch_size", "4",
         "--data.max_seq_length", "64", "--model.config.max_sequence_length", "64", "--data.predict_file",
         str(tmp_path / "texts.jsonl"), "--data.predict_json_key", "body", "--ckpt_path", str(ckpt),
         "--model.predict_top_k", "3"],  # not the checkpoint's 5: a setting that may differ
        tmp_path, dict(os.environ, WANDB_MODE="offline"), timeout=600)
    assert predict.returncode == 0, predict.stdout[-3000:] + predict.stderr[-6000:]
    assert "custom batch sampler" not in predict.stderr, predict.stderr[-3000:]  # Lightning's doubt: filtered by the CLI
    records = [json.loads(line) for line in (tmp_path / "pred" / "predictions" / "predictions.jsonl").open()]
    assert [r["index"] for r in records] == list(range(11))  # every text once, the padding dropped
    # The reference: one process, the checkpoint the CLI wrote (LightningCLI's _instantiator and
    # vocab_size: null in its hyper-parameters), softmax over the real vocabulary.
    module = BertLightningModule.load_from_checkpoint(ckpt)
    from lightning_megatron.data.predict import TextPredictionDataset
    from lightning_megatron.data.tokenizer import BertTokenizer

    tokenizer = BertTokenizer()
    dataset = TextPredictionDataset(tmp_path / "texts.jsonl", tokenizer, 64, json_key="body")
    for record in records:
        sample = dataset[record["index"]]
        with torch.no_grad():
            logits, _ = module.model_chunks[0](sample["tokens"][None], sample["attention_mask"][None])
        probs = logits[0, :, :module.vocab_size].softmax(-1)
        positions = (sample["tokens"] == tokenizer.mask_id).nonzero().flatten().tolist()
        assert [m["position"] for m in record["masked"]] == positions and positions
        for m in record["masked"]:
            want_p, want_ids = probs[m["position"]].topk(3)
            assert m["ids"] == want_ids.tolist() and m["tokens"] == tokenizer.convert_ids_to_tokens(m["ids"])
            torch.testing.assert_close(torch.tensor(m["probs"]), want_p, rtol=1e-5, atol=1e-7)
    # The default predict split (the test split, 10 samples: a full batch and a padded one) through the
    # PredictionWriter, pooled: pooled.npy equals the pooler on each sample, in index order.
    import lightning as L
    import numpy as np

    from lightning_megatron.callbacks import PredictionWriter
    from lightning_megatron.datamodules.pretraining import BertDataModule

    pooled_module = BertLightningModule.load_from_checkpoint(ckpt, predict_output="pooled")
    dm = BertDataModule(max_seq_length=64, global_batch_size=8, micro_batch_size=4, eval_samples=10, num_workers=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        default_root_dir=tmp_path / "pooled", callbacks=[PredictionWriter()])
    folder = tmp_path / "pooled" / "predictions"
    folder.mkdir(parents=True)  # an earlier predict's files (masked_lm at DP=2), and a file of the user's
    for name in ("predictions.dp0.jsonl", "predictions.dp1.jsonl", "hidden.npy", "notes.txt"):
        (folder / name).write_text("earlier")
    trainer.predict(pooled_module, datamodule=dm, return_predictions=False)
    # the folder holds this predict's output (before, the earlier files stayed beside it), and the user's file
    assert sorted(p.name for p in folder.iterdir()) == ["index.npy", "notes.txt", "pooled.npy"]
    assert np.load(folder / "index.npy").tolist() == list(range(10))
    pooled = np.load(folder / "pooled.npy")
    batch = {k: torch.stack([dm.test_dataset[i][k] for i in range(10)]) for k in ("tokens", "attention_mask",
                                                                                 "token_types")}
    with torch.no_grad():
        hidden = module.model_chunks[0](batch["tokens"], batch["attention_mask"], batch["token_types"],
                                        return_hidden_states=True)
        want = module.model_chunks[0].pooler(hidden)
    torch.testing.assert_close(torch.from_numpy(pooled), want, rtol=0, atol=1e-5)
    # init_from of this checkpoint reads its architecture from the saved hyper-parameters.
    assert {k: BertLightningModule.read_architecture(ckpt)[k] for k in ("num_layers", "hidden_size", "max_sequence_length")} == {
        "num_layers": 1, "hidden_size": 128, "max_sequence_length": 64}
    # export hf: a non-empty target is refused unless --overwrite, which replaces it whole.
    (tmp_path / "hf" / "stale.bin").write_text("x")
    with pytest.raises(SystemExit) as refused:
        main(["export", "hf", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "hf")])
    assert refused.value.code == 1 and (tmp_path / "hf" / "stale.bin").is_file()
    main(["export", "hf", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "hf"), "--overwrite"])
    assert not (tmp_path / "hf" / "stale.bin").exists() and (tmp_path / "hf" / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]  # no temporary folder left


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    import pytest

    from lightning_megatron.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["export", "hf", "--ckpt_path", str(tmp_path / "nope.ckpt"), "--output", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert exited.value.code == 1 and err.count("\n") == 1 and str(tmp_path / "nope.ckpt") in err, err
    assert not (tmp_path / "hf").exists()


def test_help_lists_every_command():
    proc = subprocess.run([sys.executable, "-m", "lightning_megatron.cli", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    for command in ("fit", "validate", "test", "predict", "preprocess", "train-tokenizer", "plot", "export"):
        assert f"  {command} " in proc.stdout, proc.stdout


def test_every_recipe_named_in_the_help_the_docs_and_the_recipes_exists():
    """The help's ``finetune`` line named recipes/llama_tiny_lora.yaml, which never existed (gpt_tiny_lora.yaml)."""
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "recipes").glob("*.yaml"),
             *(ROOT / "lightning_megatron").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    named = {(m, t.relative_to(ROOT)) for t in texts for m in re.findall(r"recipes/[\w.-]+?\.yaml", t.read_text())}
    assert len({m for m, _ in named}) > 10
    missing = sorted(f"{where} names {m}" for m, where in named if not (ROOT / m).is_file())
    assert not missing, missing


def test_preprocess_and_plot_commands(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes("The first document has two sentences. Here is the second one.\n\n"
                       "Another document follows.\n\n\n".encode() + b"bad bytes \xff\xfe here.\n")
    proc = subprocess.run([sys.executable, "-m", "lightning_megatron.cli", "preprocess", "--input", str(corpus),
                           "--output-prefix", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out.bin").is_file() and (tmp_path / "out.idx").is_file()
    assert "documents" in proc.stdout
    missing = subprocess.run([sys.executable, "-m", "lightning_megatron.cli", "preprocess", "--input",
                              str(tmp_path / "nope.txt"), "--output-prefix", str(tmp_path / "x")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "nope.txt" in missing.stderr

    from lightning_megatron.cli import plot_runs

    for run, scale in (("run_a", 1.0), ("run_b", 0.9)):
        d = tmp_path / run / "csv" / "version_0"
        d.mkdir(parents=True)
        with (d / "metrics.csv").open("w") as fh:
            fh.write("step,train_lm_loss,val_lm_loss\n")
            for step in range(10):
                fh.write(f"{step},{scale * (10 - step * 0.3)},\n")
    out = plot_runs([tmp_path / "run_a", tmp_path / "run_b"], tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no metrics.csv"):
        plot_runs([tmp_path / "empty"], tmp_path / "x.png")
