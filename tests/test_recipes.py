"""Recipes share what they share: ``base:`` and its merge rules (lightning_megatron/recipes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_megatron.recipes import (
    MOVED_CLASS_PATHS,
    RecipeError,
    merge_recipes,
    read_recipe,
    refuse_moved_class_paths,
    resolve_config_arguments,
)

ROOT = Path(__file__).resolve().parents[1]
PRETRAINING = ["bert_tiny", "bert_base", "bert_large"]


def test_merge_rules():
    base = {"trainer": {"devices": 2, "strategy": {"class_path": "S", "init_args": {"tp": 1, "pp": 1}},
                        "callbacks": [{"class_path": "A", "init_args": {"x": 1, "y": 2}},
                                      {"class_path": "B", "init_args": {"z": 3}}],
                        "plugins": [1, 2]},
            "lr_schedule": {"max_lr": 1.0}, "model": {"lr": 0.1}}
    recipe = {"trainer": {"strategy": {"class_path": "S", "init_args": {"tp": 2}},
                          "callbacks": [{"class_path": "B", "init_args": {"z": 4}}, {"class_path": "C"}],
                          "plugins": [3]},
              "lr_schedule": None, "model": {"class_path": "Other", "init_args": {"h": 1}}}
    merged = merge_recipes(base, recipe)
    assert merged["trainer"]["devices"] == 2  # kept from the base
    assert merged["trainer"]["strategy"] == {"class_path": "S", "init_args": {"tp": 2, "pp": 1}}  # merged deep
    assert merged["trainer"]["callbacks"] == [{"class_path": "A", "init_args": {"x": 1, "y": 2}},
                                              {"class_path": "B", "init_args": {"z": 4}},  # merged on class_path
                                              {"class_path": "C"}]  # appended
    assert merged["trainer"]["plugins"] == [3]  # other lists are replaced
    assert merged["lr_schedule"] is None  # null replaces (drops the section)
    assert merged["model"] == {"class_path": "Other", "init_args": {"h": 1}}  # another class: replaced whole
    assert base["trainer"]["callbacks"][1]["init_args"] == {"z": 3}  # inputs untouched


def test_merge_rules_match_a_class_however_written_and_never_guess_which_entry_is_which():
    """A class written as jsonargparse takes it (a bare name, another module path) is the base's class: merged, not
    appended or replaced (``class_path: MegatronStrategy`` dropped the base's cpu_tuning; a bare ``ModelCheckpoint``
    was a second one, keeping 1 checkpoint). A bare string entry of a callbacks list is an entry (it made the whole
    list replace the base's). A class the recipe or its base lists twice is not merged entry by entry (two
    ModelCheckpoints, "best" and "periodic", became one with both's settings): the recipe's entries of that class
    replace the base's."""
    ckpt = "lightning.pytorch.callbacks.ModelCheckpoint"
    base = {"trainer": {"strategy": {"class_path": "lightning_megatron.strategy.MegatronStrategy",
                                     "init_args": {"tensor_model_parallel_size": 2, "cpu_tuning": True}},
                        "callbacks": [{"class_path": ckpt, "init_args": {"save_top_k": -1, "save_last": True}},
                                      {"class_path": "lightning_megatron.callbacks.ThroughputCallback"}]}}
    short = merge_recipes(base, {"trainer": {
        "strategy": {"class_path": "MegatronStrategy", "init_args": {"tensor_model_parallel_size": 1}},
        "callbacks": [{"class_path": "ModelCheckpoint", "init_args": {"every_n_train_steps": 2}},
                      "lightning.pytorch.callbacks.LearningRateMonitor"]}})
    assert short["trainer"]["strategy"]["init_args"] == {"tensor_model_parallel_size": 1, "cpu_tuning": True}
    assert short["trainer"]["callbacks"] == [
        {"class_path": "ModelCheckpoint", "init_args": {"save_top_k": -1, "save_last": True, "every_n_train_steps": 2}},
        {"class_path": "lightning_megatron.callbacks.ThroughputCallback"},
        {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"}]
    module_path = merge_recipes(base, {"trainer": {"callbacks": [
        {"class_path": "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint",
         "init_args": {"verbose": True}}]}})
    assert len(module_path["trainer"]["callbacks"]) == 2
    assert module_path["trainer"]["callbacks"][0]["init_args"] == {"save_top_k": -1, "save_last": True, "verbose": True}
    two = merge_recipes(base, {"trainer": {"callbacks": [
        {"class_path": ckpt, "init_args": {"monitor": "val_loss", "save_top_k": 1, "filename": "best"}},
        {"class_path": ckpt, "init_args": {"every_n_train_steps": 100, "filename": "periodic"}}]}})
    assert two["trainer"]["callbacks"] == [
        {"class_path": ckpt, "init_args": {"monitor": "val_loss", "save_top_k": 1, "filename": "best"}},
        {"class_path": ckpt, "init_args": {"every_n_train_steps": 100, "filename": "periodic"}},
        {"class_path": "lightning_megatron.callbacks.ThroughputCallback"}]
    # a recipe's flat arguments over a base's class_path section are its init_args, as the command line's
    # --data.labels is (they ended in jsonargparse's "Not a valid subclass" dump)
    section = {"class_path": "X", "init_args": {"a": 1, "labels": ["x", "y"]}}
    assert merge_recipes({"data": section}, {"data": {"labels": ["neg", "pos"], "b": 2}}) == {
        "data": {"class_path": "X", "init_args": {"a": 1, "labels": ["neg", "pos"], "b": 2}}}
    # a list of plain strings elsewhere (class names of a dataset, LoRA's targets) is a value: replaced
    assert merge_recipes({"data": {"labels": ["a", "b"]}}, {"data": {"labels": ["b", "a"]}}) == {
        "data": {"labels": ["b", "a"]}}


def test_bases_relative_in_order_and_errors_name_the_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.yaml").write_text("x: 1\ny: {p: 1, q: 1}\n")
    (tmp_path / "sub" / "b.yaml").write_text("base: a.yaml\ny: {q: 2}\n")  # relative to sub/
    (tmp_path / "c.yaml").write_text("z: 0\ny: {q: 3, r: 3}\n")
    (tmp_path / "r.yaml").write_text("base: [sub/b.yaml, c.yaml]\nx: 5\n")
    assert read_recipe(tmp_path / "r.yaml") == {"x": 5, "y": {"p": 1, "q": 3, "r": 3}, "z": 0}

    (tmp_path / "loop1.yaml").write_text("base: loop2.yaml\n")
    (tmp_path / "loop2.yaml").write_text("base: loop1.yaml\n")
    with pytest.raises(RecipeError, match="cycle: .*loop1.yaml -> .*loop2.yaml -> .*loop1.yaml"):
        read_recipe(tmp_path / "loop1.yaml")
    (tmp_path / "missing.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(RecipeError, match=r"nowhere.yaml' \(the base of .*missing.yaml'\) is not a file"):
        read_recipe(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("base: {a: 1}\n")
    with pytest.raises(RecipeError, match="base: must be a file name or a list"):
        read_recipe(tmp_path / "bad.yaml")
    # A !!python/object tag in a base: one line naming the file (was yaml's ConstructorError traceback),
    # and nothing constructed.
    (tmp_path / "evil.yaml").write_text("model:\n  x: !!python/object/apply:os.system ['touch PWNED']\n")
    (tmp_path / "uses_evil.yaml").write_text("base: evil.yaml\n")
    with pytest.raises(RecipeError) as info:
        read_recipe(tmp_path / "uses_evil.yaml")
    message = str(info.value)
    assert f"recipe '{tmp_path / 'evil.yaml'}' (the base of '{tmp_path / 'uses_evil.yaml'}') is not plain YAML " \
           f"at line 2: could not determine a constructor" in message and "\n" not in message, message
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


def test_config_arguments_get_the_merged_recipe(tmp_path):
    recipe = ROOT / "recipes" / "bert_tiny.yaml"
    plain = tmp_path / "plain.yaml"
    plain.write_text("trainer: {max_steps: 3}\n")
    args = resolve_config_arguments(["fit", "--config", str(recipe), "-c", str(plain), "--trainer.max_steps", "5"])
    assert args[0] == "fit" and args[3:] == ["-c", str(plain), "--trainer.max_steps", "5"]  # no base: as given
    assert yaml.safe_load(args[2]) == read_recipe(recipe) and "base" not in yaml.safe_load(args[2])
    [joined] = resolve_config_arguments([f"--config={recipe}"])
    assert yaml.safe_load(joined[len("--config="):]) == read_recipe(recipe)
    # The ranks Lightning starts run this process's (merged) sys.argv again: text passes unchanged,
    # even longer than a file name may be.
    assert resolve_config_arguments(args) == args
    long_text = "model:\n" + "".join(f"  k{i}: {i}\n" for i in range(400))
    assert resolve_config_arguments(["--config", long_text]) == ["--config", long_text]
    assert resolve_config_arguments(["--config", "x" * 5000]) == ["--config", "x" * 5000]  # ENAMETOOLONG
    # what a command records of itself (the run folder's lock: "another run is training ... (its command)") names the
    # recipe file, not the merged text (it showed "--config seed_everything: 1234\ntrainer:\n  strategy: ...")
    from lightning_megatron.run_lock import command_line

    assert command_line(args) == f"lightning-megatron fit --config {recipe} -c {plain} --trainer.max_steps 5"
    assert command_line(["fit", "--config", long_text]) == "lightning-megatron fit --config '<recipe text>'"


def test_moved_class_paths_are_refused_where_they_stand(tmp_path):
    """An old class path as a recipe's value (any section, the short ``data: X`` form too) or a command-line
    value is refused naming where it stands and the new path; our recipes name none; a mere mention in
    another value is not a class path."""
    old, new = "lightning_megatron.data.gpt_datamodule.GPTDataModule", "lightning_megatron.datamodules.gpt.GPTDataModule"
    assert MOVED_CLASS_PATHS[old] == new
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        refuse_moved_class_paths(read_recipe(recipe), str(recipe))
    with pytest.raises(RecipeError, match=rf"^mine.yaml \(data\) names {old}, which has moved: use class_path {new} "):
        refuse_moved_class_paths({"data": old}, "mine.yaml")
    refuse_moved_class_paths({"data": {"init_args": {"note": f"was {old}"}}}, "mine.yaml")
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"base: {ROOT / 'recipes' / 'gpt_tiny.yaml'}\ndata:\n  class_path: {old}\n")
    with pytest.raises(RecipeError, match=rf"^recipe '{mine}' \(data.class_path\) names {old}, "):
        refuse_moved_class_paths(["fit", "--config", str(mine)])
    with pytest.raises(RecipeError, match=rf"^the command line names {old}, "):
        refuse_moved_class_paths(["fit", "--config", str(ROOT / "recipes" / "gpt_tiny.yaml"), f"--data={old}"])
    refuse_moved_class_paths(["fit", "--config", str(ROOT / "recipes" / "gpt_tiny.yaml"), "--data", new])

@pytest.mark.parametrize("name", PRETRAINING)
def test_pretraining_recipes_start_from_the_shared_one_and_do_not_repeat_it(name):
    raw = yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())
    assert raw["base"] == "_bert_pretraining.yaml"
    shared = yaml.safe_load((ROOT / "recipes" / "_bert_pretraining.yaml").read_text())

    def repeated(own, base, path=""):  # leaves the recipe sets to the value the base already has
        if isinstance(own, dict) and isinstance(base, dict):
            return [r for k, v in own.items() if k != "class_path" and k in base
                    for r in repeated(v, base[k], f"{path}.{k}")]
        if isinstance(own, list) and isinstance(base, list):
            by_class = {e.get("class_path"): e for e in base if isinstance(e, dict)}
            return [r for e in own if isinstance(e, dict) and e.get("class_path") in by_class
                    for r in repeated(e, by_class[e["class_path"]], f"{path}[{e['class_path']}]")]
        return [path] if own == base else []

    assert repeated(raw, shared) == [], f"{name}.yaml repeats what _bert_pretraining.yaml says"
    merged = read_recipe(ROOT / "recipes" / f"{name}.yaml")
    assert "base" not in merged and merged["trainer"]["strategy"]["init_args"]["seed"] == 1234
    assert merged["trainer"]["default_root_dir"] == f"runs/{name}"  # each names its own run folder


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "recipes").glob("*.yaml") if not p.name.startswith("_")),
                         ids=lambda p: p.stem)
def test_a_recipe_s_weight_decay_is_the_one_its_schedule_sets(path):
    """Where a recipe has the ``lr_schedule`` section, the schedule sets the weight decay every step (``start_wd`` to
    ``end_wd``): a ``model.weight_decay`` of another value is not used (the CLI says so). The LoRA recipes' 0.0 sat
    under the pretraining schedule's 0.1, and the adapters decayed at 0.1."""
    import inspect

    from lightning_megatron.callbacks import OptimizerParamSchedulerCallback

    merged = read_recipe(path)
    schedule, model = merged.get("lr_schedule"), merged.get("model") or {}
    decay = (model.get("init_args") or model).get("weight_decay")
    if schedule and decay is not None:
        defaults = inspect.signature(OptimizerParamSchedulerCallback).parameters  # what a recipe leaves out
        wd = [schedule.get(k, defaults[k].default) for k in ("start_wd", "end_wd")]
        assert decay in wd, (path.name, decay, wd)


def test_a_recipe_that_expands_without_end_is_refused_at_once(tmp_path):
    """Nine levels of ten YAML aliases (a billion values) hung `fit` past 150 s in its parser, before anything was
    said; a recipe that is not UTF-8 or nests past the parser's depth was a traceback. One line each, at once."""
    import time

    from lightning_megatron.cli import main

    bomb = tmp_path / "bomb.yaml"
    lines = ['a0: &a0 ["lol"]'] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    bomb.write_text("\n".join(lines + ["model:\n  lr: *a9"]) + "\n")
    deep = tmp_path / "deep.yaml"
    deep.write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"model:\n  lr: caf\xe9\n")
    for recipe, said in ((bomb, "expands to more than 100,000 values"), (deep, "nests too deeply"),
                         (latin, "is not UTF-8 text (invalid continuation byte at byte 16)")):
        start = time.monotonic()
        with pytest.raises(SystemExit) as refused:
            main(["fit", "--config", str(recipe)])
        assert time.monotonic() - start < 30
        assert str(refused.value.code) == f"lightning-megatron: recipe {str(recipe)!r} {said}" or \
            said in str(refused.value.code), refused.value.code
