"""--optimizer / --lr_scheduler the LightningCLI way, built on the model's parameter groups."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "bert_tiny.yaml")


def _built(*extra: str, recipe: str = RECIPE) -> dict:
    from lightning_megatron.cli_lightning import lightning_cli

    try:
        cli = lightning_cli(run=False, args=["--config", recipe, "--trainer.accelerator", "cpu",
                                              "--trainer.logger", "false", "--model.config.vocab_size", "512", *extra])
    except SystemExit as e:
        return {"exit": str(e.code)}
    model = cli.model
    model.configure_model()
    out = model.configure_optimizers()
    opt, sched = (out["optimizer"], out["lr_scheduler"]) if isinstance(out, dict) else (out, None)
    names = {id(p): n for n, p in model.sharded_named_parameters()}
    groups = [{"weight_decay": g["weight_decay"], "lr": g["lr"],
               "names": sorted(names[id(p)] for p in g["params"])} for g in opt.param_groups]
    schedules = [c for c in cli.trainer.callbacks if type(c).__name__ == "OptimizerParamSchedulerCallback"]
    [schedule] = schedules or [None]
    return {"optimizer": type(opt).__name__, "schedule": schedule and schedule.kwargs, "defaults": dict(opt.defaults), "groups": groups,
            "scheduler": None if sched is None else (type(sched["scheduler"]).__name__, sched["interval"],
                                                     getattr(sched["scheduler"], "step_size", None)),
            "callbacks": sorted(type(c).__name__ for c in cli.trainer.callbacks)}


def _worker(no_schedule_recipe: str) -> list[dict]:
    return [
        _built("--optimizer", "torch.optim.SGD", "--optimizer.nesterov", "true", "--optimizer.momentum", "0.9",
               "--optimizer.dampening", "0.0"),
        _built(),
        _built("--lr_scheduler", "torch.optim.lr_scheduler.StepLR", "--lr_scheduler.step_size", "3",
               recipe=no_schedule_recipe),
        _built("--lr_scheduler", "torch.optim.lr_scheduler.StepLR", "--lr_scheduler.step_size", "3"),
        _built("--lr_schedule", "null", "--lr_scheduler", "torch.optim.lr_scheduler.StepLR",
               "--lr_scheduler.step_size", "3"),
        _built("--trainer.max_steps", "10", "--lr_schedule.max_lr", "0.5"),
        _built("--optimizer", "torch.optim.AdamW", "--optimizer.lr", "3e-4"),
        _built("--optimizer.lr=3e-4", recipe=no_schedule_recipe),
    ]


def test_optimizer_and_lr_scheduler_from_the_command_line(tmp_path):
    import yaml
    from dist_utils import run_distributed

    from lightning_megatron.recipes import read_recipe

    recipe = read_recipe(RECIPE)  # with its base: merged in
    del recipe["lr_schedule"]
    no_schedule = tmp_path / "no_schedule.yaml"
    no_schedule.write_text(yaml.safe_dump(recipe))
    [[sgd, default, stepped, both, dropped, overridden, lr, lr_unscheduled]] = run_distributed(
        _worker, 1, str(no_schedule), timeout=240)
    # --optimizer.lr: a message naming the option that sets it, not jsonargparse's "not accepted"
    assert "use --lr_schedule.max_lr 3e-4" in lr["exit"], lr
    assert "use --model.lr 3e-4" in lr_unscheduled["exit"], lr_unscheduled

    # SGD with nesterov on our two groups: decay on weights, none on biases and norm weights.
    assert sgd["optimizer"] == "SGD"
    assert sgd["defaults"]["nesterov"] is True and sgd["defaults"]["momentum"] == 0.9
    assert sgd["defaults"]["dampening"] == 0.0
    decay, no_decay = sgd["groups"]
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0  # model.weight_decay
    assert decay["lr"] == no_decay["lr"] == 1e-3  # model.lr (the lr_schedule callback drives it)
    assert all(n.endswith("weight") and "norm" not in n for n in decay["names"])
    assert any(n.endswith("bias") for n in no_decay["names"]) and any("norm" in n for n in no_decay["names"])
    assert {"MegatronOptimizerCallback", "OptimizerParamSchedulerCallback"} <= set(sgd["callbacks"])
    assert sgd["scheduler"] is None
    # The recipe's shorthand (optimizer: adamw) is unchanged, on the same groups.
    assert default["optimizer"] == "AdamW" and [g["names"] for g in default["groups"]] == [decay["names"],
                                                                                           no_decay["names"]]
    # A torch LR scheduler, stepped every optimizer step, with a recipe without the lr_schedule section
    # (then no schedule callback) or with --lr_schedule null; with the section too: refused.
    assert stepped["scheduler"] == dropped["scheduler"] == ("StepLR", "step", 3)
    assert "OptimizerParamSchedulerCallback" not in stepped["callbacks"] + dropped["callbacks"]
    assert "--lr_scheduler torch.optim.lr_scheduler.StepLR" in both["exit"] and "lr_schedule" in both["exit"]
    # The section's arguments reach the callback, overrides and the warm-up clamp included.
    assert default["schedule"]["max_lr"] == 1e-3 and default["schedule"]["lr_warmup_steps"] == 30
    # The recipe's 30 warm-up steps reach the callback as written; it shortens them at set-up for a
    # 10-step run (the one rule for every way in: tests/test_optimizer_scheduler.py).
    assert overridden["schedule"]["max_lr"] == 0.5 and overridden["schedule"]["lr_warmup_steps"] == 30


def _said(*args: str, recipe: str) -> list[str]:
    """What the command says (its warnings) building ``recipe`` with ``args``, nothing run."""
    import warnings

    from lightning_megatron.cli_lightning import lightning_cli

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lightning_cli(run=False, args=["--config", recipe, "--trainer.logger", "false", *args])
    return [str(w.message) for w in caught if "not used" in str(w.message) or "seed_everything" in str(w.message)]


def test_the_models_optimizer_arguments_and_a_typed_seed_everything_are_said_when_unused():
    """``--optimizer torch.optim.AdamW`` builds with torch's betas (0.9, 0.999): a decoder recipe's adam_beta2 0.95
    gave way, unsaid; ``--seed_everything 7`` changed none of the run's numbers (weights, dropout and samples follow
    seeds of their own): a replicate run was the same run. Both are said, with the flags that do what was meant."""
    gpt = str(ROOT / "recipes" / "gpt_tiny.yaml")
    assert _said("--optimizer", "torch.optim.AdamW", recipe=gpt) == [
        "model.adam_beta1=0.9, model.adam_beta2=0.95 not used: --optimizer torch.optim.AdamW builds with its own "
        "betas=(0.9, 0.999); to train with the model's: --optimizer.betas [0.9,0.95]"]
    assert _said("--optimizer", "torch.optim.AdamW", "--optimizer.betas", "[0.9,0.95]", recipe=gpt) == []
    assert _said("--optimizer", "torch.optim.SGD", recipe=gpt) == [  # the model's SGD: Megatron-LM's momentum 0.9
        "model.sgd_momentum=0.9 not used: --optimizer torch.optim.SGD builds with its own momentum=0.0; to train with "
        "the model's: --optimizer.momentum 0.9"]
    assert _said("--optimizer", "torch.optim.SGD", "--optimizer.momentum", "0", recipe=gpt) == []  # typed: meant
    assert _said("--seed_everything", "7", recipe=gpt) == [
        "seed_everything=7 does not change this run's numbers: the weights follow the model's init_seed, dropout the "
        "strategy's seed, the samples the data's seed; for another replicate set them: --model.init_args.init_seed 7 "
        "--trainer.strategy.init_args.seed 7 --data.init_args.seed 7"]
    assert _said("--seed_everything", "7", recipe=RECIPE)[0].endswith(
        "--model.init_seed 7 --trainer.strategy.init_args.seed 7 --data.seed 7")
    assert _said(recipe=RECIPE) == []  # the recipe's own seed_everything is not typed
    # the schedule's fields of a style it does not run (the recipe's: cosine decay, constant weight decay)
    assert _said("--lr_schedule.wsd_decay_steps", "2", "--lr_schedule.wd_incr_steps", "1", recipe=RECIPE) == [
        "lr_schedule.wsd_decay_steps=2 is not used under lr_decay_style='cosine' (WSD's)",
        "lr_schedule.wd_incr_steps=1 is not used under wd_incr_style='constant' (the weight decay start_wd throughout)"]
