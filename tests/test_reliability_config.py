"""Config-only checks (lightning_megatron.config_checks): every problem named with its value, before launch."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from dist_utils import run_python

from lightning_megatron.config_checks import ConfigError, check_config, config_from_cli, validate_config
from lightning_megatron.models.bert.module import BertLightningModule
from lightning_megatron.models.gpt.module import GPTLightningModule

REPO = Path(__file__).resolve().parents[1]
GOOD = dict(
    model_hparams=dict(config=dict(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512,
                                   max_sequence_length=128, params_dtype="float32")),
    model_class=BertLightningModule,
    data_hparams=dict(max_seq_length=128, global_batch_size=16, micro_batch_size=4),
    strategy_args=dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1),
    trainer_args=dict(devices=4, num_nodes=1, precision="32-true", max_steps=100),
    scheduler_args=dict(init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=10, lr_decay_steps=None),
    has_optimizer_callback=True,
)


MODULE_ARGUMENTS = ("lr", "predict_max_new_tokens", "predict_greedy", "predict_temperature", "predict_top_p",
                    "predict_top_k")
"""The module's own arguments; the other model keys of a row are fields of its config record."""


def _with(**changes: dict) -> dict:
    kwargs = {k: (dict(v) if isinstance(v, dict) else v) for k, v in GOOD.items()}
    kwargs["model_hparams"]["config"] = dict(GOOD["model_hparams"]["config"])
    for group, values in changes.items():
        if group == "model_hparams":
            for key, value in values.items():
                (kwargs[group] if key in MODULE_ARGUMENTS else kwargs[group]["config"])[key] = value
        elif isinstance(values, dict):
            kwargs[group].update(values)
        else:
            kwargs[group] = values
    return kwargs


def test_good_config_has_no_problems():
    assert check_config(**GOOD) == []
    validate_config(**GOOD)
    assert check_config() == []  # nothing known, nothing checked


@pytest.mark.parametrize("changes, expected", [
    (dict(strategy_args=dict(tensor_model_parallel_size=3)), "tensor_model_parallel_size=3"),
    (dict(model_hparams=dict(num_attention_heads=3, hidden_size=96)), "num_attention_heads=3"),
    (dict(model_hparams=dict(hidden_size=130)), "hidden_size=130 is not divisible by num_attention_heads=4"),
    (dict(model_hparams=dict(ffn_hidden_size=501)), "ffn_hidden_size=501"),
    # the grouped-query rules, from the decoder's record built at the strategy's TP size (issue 35)
    (dict(model_class=GPTLightningModule, model_hparams=dict(num_attention_heads=8, num_query_groups=3)),
     "num_query_groups=3 must be a number that divides num_attention_heads=8"),
    (dict(model_class=GPTLightningModule, model_hparams=dict(num_attention_heads=6, num_query_groups=3, hidden_size=96),
          strategy_args=dict(tensor_model_parallel_size=2)),
     "num_query_groups=3 must be a multiple or a divisor of tensor_model_parallel_size=2"),
    (dict(model_class=GPTLightningModule, model_hparams=dict(num_attention_heads=8, num_query_groups=2),
          strategy_args=dict(tensor_model_parallel_size=4)), None),  # t/g ranks share one group, as megatron-core
    (dict(model_hparams=dict(ffn_hidden_size=None, hidden_size=132, num_attention_heads=4),
          strategy_args=dict(tensor_model_parallel_size=4), trainer_args=dict(devices=4)), None),
    (dict(model_hparams=dict(num_layers=3), strategy_args=dict(tensor_model_parallel_size=1,
          pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)), "num_layers=3"),
    (dict(strategy_args=dict(tensor_model_parallel_size=1, virtual_pipeline_model_parallel_size=2)),
     "virtual_pipeline_model_parallel_size=2"),
    (dict(model_hparams=dict(num_layers_in_last_pipeline_stage=4), strategy_args=dict(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=2)), "num_layers=4 does not fit"),
    (dict(model_hparams=dict(num_layers_in_last_pipeline_stage=2), strategy_args=dict(tensor_model_parallel_size=4)),
     "num_layers_in_last_pipeline_stage=2 needs pipeline_model_parallel_size >= 2"),
    (dict(strategy_args=dict(tensor_model_parallel_size=1, sequence_parallel=True)), "sequence_parallel=True"),
    (dict(model_hparams=dict(defer_embedding_wgrad_compute=True)),
     "defer_embedding_wgrad_compute=True needs pipeline parallelism"),
    (dict(model_hparams=dict(defer_embedding_wgrad_compute=True), strategy_args=dict(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=2)), None),
    # one rule for the layout, read by the strategy, ParallelDims and this check alike (vp=1 with pp=1 too)
    (dict(strategy_args=dict(tensor_model_parallel_size=1, virtual_pipeline_model_parallel_size=1)),
     "virtual_pipeline_model_parallel_size=1 needs pipeline_model_parallel_size >= 2"),
    (dict(strategy_args=dict(micro_batch_size=2)), "strategy micro_batch_size=2 disagrees with data micro_batch_size=4"),
    (dict(data_hparams=dict(global_batch_size=12)), "global_batch_size=12 is not divisible by micro_batch_size=4 "
                                                     "x data-parallel size=2"),
    (dict(data_hparams=dict(global_batch_size=10)), "global_batch_size=10 is not divisible by micro_batch_size=4"),
    (dict(strategy_args=dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                             virtual_pipeline_model_parallel_size=2), data_hparams=dict(global_batch_size=24)),
     "num_microbatches=3"),
    (dict(data_hparams=dict(max_seq_length=256)), "max_seq_length=256 exceeds the model's max_sequence_length=128"),
    (dict(trainer_args=dict(precision="32-true"), model_hparams=dict(params_dtype="bfloat16")),
     "precision='32-true' needs params_dtype='float32' but the model has params_dtype='bfloat16'"),
    (dict(trainer_args=dict(precision="bf16-mixed"), model_hparams=dict(params_dtype="bfloat16")),
     "precision='bf16-mixed' needs params_dtype='float32'"),
    (dict(trainer_args=dict(precision="bf16-true")), "precision='bf16-true' needs params_dtype='bfloat16'"),
    (dict(trainer_args=dict(precision="64-true")), "precision='64-true' is not supported"),
    # fp16 autocast: on a GPU torch's GradScaler, which the schedule's backward never scales; on a CPU Lightning
    # runs bf16-mixed instead, warning once (the run was not what was asked for)
    (dict(trainer_args=dict(precision="16-mixed")), "precision='16-mixed' scales the loss with torch's GradScaler"),
    (dict(trainer_args=dict(precision=16)), "precision='16-mixed' scales the loss with torch's GradScaler"),
    (dict(trainer_args=dict(precision="16-true"), model_hparams=dict(params_dtype="float16"),
          has_optimizer_callback=False), "params_dtype='float16' without MegatronOptimizerCallback"),
    (dict(trainer_args=dict(accumulate_grad_batches=4)), "accumulate_grad_batches=4"),
    (dict(data_hparams=dict(masked_lm_prob=1.5)), "masked_lm_prob=1.5"),
    (dict(model_hparams=dict(lr=-1.0)), "lr=-1.0 must be > 0"),
    (dict(trainer_args=dict(gradient_clip_val=1.0)), "gradient_clip_val=1.0"),
    # lr_decay_steps=null: a warm-up as long as the run is shortened at set-up with a warning (one rule,
    # scheduler.warmup_for_run; tests/test_optimizer_scheduler.py), not a problem.
    (dict(scheduler_args=dict(lr_warmup_steps=100)), None),
    (dict(scheduler_args=dict(lr_warmup_steps=50, lr_decay_steps=20)), "lr_warmup_steps=50 must be < "
                                                                       "lr_decay_steps=20"),
    (dict(trainer_args=dict(max_steps=-1)), "max_steps=-1"),
    (dict(scheduler_args=dict(max_lr=1e-6, min_lr=1e-5)), "max_lr=1e-06 must be >= min_lr=1e-05"),
    (dict(scheduler_args=dict(init_lr=1.0)), "init_lr=1.0 must be <= max_lr=0.001"),
    (dict(scheduler_args=dict(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True)),
     "contradict"),
    (dict(strategy_args=dict(timeout=0)), "strategy timeout=0 must be more than 0 seconds"),
    # a decoder's samples and generation settings (GPTDataModule.seq_length, the module's predict_*)
    (dict(data_hparams=dict(seq_length=256)), "data seq_length=256 exceeds the model's max_sequence_length=128"),
    (dict(model_hparams=dict(predict_max_new_tokens=-1)), "--model.predict_max_new_tokens=-1 must be an integer >= 0"),
    (dict(model_hparams=dict(predict_max_new_tokens=8, predict_greedy=False, predict_temperature=0.0)),
     "--model.predict_temperature=0.0 must be > 0 (it divides the logits; --model.predict_greedy true takes"),
    (dict(model_hparams=dict(predict_max_new_tokens=8, predict_greedy=False, predict_top_p=1.5)),
     "--model.predict_top_p=1.5 must be in (0, 1]"),
    (dict(model_hparams=dict(predict_max_new_tokens=8, predict_greedy=False, predict_top_k=-2)),
     "--model.predict_top_k=-2 must be an integer >= 0"),
    (dict(model_hparams=dict(predict_max_new_tokens=8, predict_greedy=True, predict_temperature=0.0)), None),
    (dict(model_hparams=dict(predict_max_new_tokens=8, predict_greedy=False, predict_seed=-1)),
     "--model.predict_seed=-1 must be an integer >= 0"),
    (dict(ckpt_path="/nonexistent/last.ckpt"), "ckpt_path='/nonexistent/last.ckpt' does not exist"),
    (dict(ckpt_path="last"), None),
])
def test_each_problem_names_its_value(changes, expected):
    kwargs = _with(**changes)
    problems = check_config(**kwargs)
    if expected is None:  # ffn None -> 4 x hidden = 528, divisible by 4: fine
        assert problems == [], problems
        return
    assert any(expected in p for p in problems), problems
    with pytest.raises(ValueError, match="configuration problem") as info:
        validate_config(**kwargs)
    assert isinstance(info.value, ConfigError) and expected in str(info.value)


def test_every_problem_in_one_error():
    kwargs = _with(strategy_args=dict(tensor_model_parallel_size=3), trainer_args=dict(devices=3),
                   data_hparams=dict(max_seq_length=512), scheduler_args=dict(lr_warmup_steps=500,
                                                                               lr_decay_steps=200))
    with pytest.raises(ConfigError) as info:
        validate_config(**kwargs)
    msg = str(info.value)
    for part in ("num_attention_heads=4", "ffn_hidden_size=512", "max_seq_length=512", "lr_warmup_steps=500"):
        assert part in msg, msg
    assert len(info.value.problems) == 4


def test_unknown_world_size_skips_layout_checks():
    kwargs = _with(trainer_args=dict(devices="auto"), data_hparams=dict(global_batch_size=12))
    assert check_config(**kwargs) == []


def test_config_from_cli_only_checks_megatron_strategy():
    config = {"trainer": {"strategy": "ddp", "devices": 2},
              "model": {"class_path": "lightning_megatron.models.bert.module.BertLightningModule",
                        "init_args": {"config": {"num_attention_heads": 3}}}}
    assert config_from_cli(config) == {}
    config["trainer"]["strategy"] = {"class_path": "lightning_megatron.strategy.MegatronStrategy",
                                     "init_args": {"tensor_model_parallel_size": 2}}
    config["trainer"]["callbacks"] = [{"class_path": "lightning_megatron.callbacks.MegatronOptimizerCallback"}]
    kwargs = config_from_cli(config)
    assert kwargs["has_optimizer_callback"] is True
    assert any("num_attention_heads=3" in p for p in check_config(**kwargs))
    # validate/test: the training-only checks (16-bit params without the callback, schedule) are skipped
    config["trainer"]["callbacks"] = []
    config["model"]["init_args"]["config"]["params_dtype"] = "bfloat16"
    config["trainer"]["precision"] = "bf16-true"
    assert config_from_cli(config)["has_optimizer_callback"] is False
    assert any("without MegatronOptimizerCallback" in p for p in check_config(**config_from_cli(config)))
    assert not any("without MegatronOptimizerCallback" in p
                   for p in check_config(**config_from_cli(config, fitting=False)))


def test_cli_bad_recipe_fails_before_the_trainer_is_built(tmp_path):
    """A wrong recipe exits non-zero with every problem, before the Trainer exists or any process starts."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "lightning_megatron.cli", "fit", "--config", str(REPO / "recipes/bert_tiny.yaml"),
           "--trainer.strategy.init_args.tensor_model_parallel_size", "4", "--trainer.devices", "2",
           "--model.config.num_attention_heads", "6", "--model.config.hidden_size", "96", "--model.config.max_sequence_length", "64",
           "--trainer.default_root_dir", str(tmp_path), "--trainer.strategy.init_args.timeout", "0"]
    out = run_python(cmd[1:], tmp_path, env, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "configuration problem(s), found before launching any process" in text, text
    assert "tensor_model_parallel_size=4" in text and "num_attention_heads=6" in text, text
    assert "max_seq_length=128 exceeds the model's max_sequence_length=64" in text, text
    assert "strategy timeout=0 must be more than 0 seconds" in text, text  # torch: "socket timed out after 0ms"
    # Trainer construction prints the accelerator summary; launching prints "Initializing distributed".
    assert "GPU available" not in text and "Initializing distributed" not in text, text
    assert not (tmp_path / "runs").exists()


def test_strategy_refuses_a_zero_timeout_before_launch():
    import datetime

    from lightning_megatron.strategy import MegatronStrategy

    for timeout in (0, -5, datetime.timedelta(0)):
        with pytest.raises(ValueError, match=r"MegatronStrategy: strategy timeout=.* must be more than 0 seconds"):
            MegatronStrategy(timeout=timeout)
    assert MegatronStrategy(timeout=60)._timeout == datetime.timedelta(seconds=60)


def test_lightning_callbacks_the_strategy_cannot_honour_are_refused_at_set_up():
    """GradientAccumulationScheduler set accumulate_grad_batches at the first epoch, after the strategy's check:
    the step kept the last batch's gradient of each 2 (grad norm 4.534609, the second batch's alone) and read twice
    the data, unsaid; the tuner's finders, SWA and the fine-tuning callbacks failed on the ranks or did nothing.
    Refused at set-up, naming the fix; a subclass too, and the stock callbacks that work pass."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import (BackboneFinetuning, EarlyStopping, GradientAccumulationScheduler,
                                             LearningRateFinder, LearningRateMonitor, StochasticWeightAveraging)

    from lightning_megatron.setup_checks import check_trainer

    class MyScheduler(GradientAccumulationScheduler):
        pass

    refused = {GradientAccumulationScheduler({0: 2}): "raise data global_batch_size instead",
               MyScheduler({0: 2}): "callback MyScheduler is not supported by MegatronStrategy: it accumulates",
               StochasticWeightAveraging(swa_lrs=1e-3): "outside the strategy's fp32 main params",
               LearningRateFinder(): "choose lr_schedule.max_lr", BackboneFinetuning(): "freeze parameters"}
    for callback, fix in refused.items():
        trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, callbacks=[callback])
        with pytest.raises(ValueError, match=re.escape(fix)):
            check_trainer(trainer)
    check_trainer(Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          callbacks=[EarlyStopping("val_loss"), LearningRateMonitor()]))


def test_a_linked_last_checkpoint_is_refused_from_python_too():
    """``ModelCheckpoint(save_last="link")`` built in Python (no recipe for the pre-launch check to read): the
    strategy refuses it at set-up, before any save (Lightning links last.ckpt on rank 0 outside the atomic save)."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_megatron.setup_checks import check_trainer

    for save_last, refused in ((True, False), ("link", True)):
        trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          callbacks=[ModelCheckpoint(save_last=save_last)])
        if refused:
            with pytest.raises(ValueError, match=r"save_last='link'\) is not supported .*set save_last: true"):
                check_trainer(trainer)
        else:
            check_trainer(trainer)
